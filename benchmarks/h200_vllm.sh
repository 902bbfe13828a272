#!/usr/bin/env bash
# vLLM 0.32 on the H200: the GPU tests and the native/forcing-vs-greedy benchmark, run with
# the bundle of ../shared/tools/vllm-h200 (make_bundle.sh into .vw/, carried part by part and
# assembled in /tmp/vw as its assemble.sh says). Logs go to $OUT (or ./out).
#   bash benchmarks/h200_vllm.sh smoke    # forcing on Model Runner V2, native, one replay each
#   bash benchmarks/h200_vllm.sh tests    # tests/gpu/test_vllm_gpu.py
#   bash benchmarks/h200_vllm.sh bench SHAPE [BATCHES] [ROUNDS]   # smollm2-135m | llama-3.1-8b
set -u
w=/tmp/vw
out=${OUT:-out}; mkdir -p "$out"
export LD_PRELOAD=$w/p00/shim/libncclshim.so PYTHONPATH=$PWD:$w/site PYTHONUNBUFFERED=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case $1 in
smoke)
  timeout 300 python3 - <<'PY' 2>&1 | tee "$out/smoke.txt"
import tempfile, torch, transformers
from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest
config = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=512, initializer_range=0.3)
folder = tempfile.mkdtemp(); transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
args = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 256,
        "gpu_memory_utilization": 0.1}
for native in (False, None):
    engine = make_engine("vllm", folder, dtype="bfloat16", batch_size=4, engine_args=args, native=native)
    (r,) = engine.run([ReplayRequest("t", (1, 2, 3), tuple(range(5, 45)))])
    print("SMOKE", native, engine.settings()["engine_path"], engine.settings()["model_runner"],
          r.token_ids.tolist() == list(range(5, 45)), r.rank[:8].tolist())
    engine.close()
PY
  ;;
tests)
  timeout 540 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_vllm_gpu.py 2>&1 \
    | tee "$out/tests.txt"
  ;;
bench)
  timeout 560 python3 benchmarks/bench_vllm_gpu.py --shape "$2" --batches "${3:-1,16,64,256}" \
    --rounds "${4:-5}" 2>&1 | grep -v -i "warn" | tee "$out/bench_$2.txt"
  ;;
esac
