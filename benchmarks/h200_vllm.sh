#!/usr/bin/env bash
# vLLM 0.32 on the H200: the GPU tests and the native/forcing-vs-greedy benchmark, run with
# the bundle of ../shared/tools/vllm-h200 (make_bundle.sh into .vw/, carried part by part and
# assembled in /tmp/vw as its assemble.sh says). Logs go to $OUT (or ./out).
#   bash benchmarks/h200_vllm.sh smoke    # forcing on Model Runner V2, native, one replay each
#   bash benchmarks/h200_vllm.sh tests    # tests/gpu/test_vllm_gpu.py
#   bash benchmarks/h200_vllm.sh server-tests   # tests/gpu/test_vllm_server_gpu.py (issue 53)
#   bash benchmarks/h200_vllm.sh routing-tests  # tests/gpu/test_routing_gpu.py (issue 54: routed experts)
#   bash benchmarks/h200_vllm.sh served SHAPE [BATCHES] [ROUNDS]   # stock server vs offline
#       # both in one 600 s call: server-tests (<= 280 s), then served smollm2-135m 1,16,64 5
#   bash benchmarks/h200_vllm.sh bench SHAPE [BATCHES] [ROUNDS] [PARTS] [SECONDS]
#       # SHAPE: smollm2-135m | llama-3.1-8b; PARTS: speed, or speed,in-process;
#       # SECONDS: add rounds per batch until its timed calls reach this (short calls)
# Two GPUs (nvidia-h200-x2, issue 33; tensor parallelism, TP=2):
#   bash benchmarks/h200_vllm.sh tp-tests                         # tests/gpu/test_vllm_tp_gpu.py
#   bash benchmarks/h200_vllm.sh tp SHAPE PARTS [LAYERS] [BATCHES] [ROUNDS]
#     e.g. tp llama-3.1-8b speed '' 1,16,64,256 5;  tp llama-3.1-8b agreement,served
#          tp llama-3.1-70b speed 40 1,16,64 3;     tp llama-3.1-70b agreement,served 40
#     (the model is saved once in /tmp/m-SHAPE-LAYERS and reused while the machine is warm)
#
# NCCL on two GPUs. The bundle's LD_PRELOAD shim (ncclshim.c) defines eight NCCL 2.29 entry
# points that torch 2.13 links and the image's NCCL 2.28.9 lacks; it does not shadow the
# collectives a TP run calls (ncclAllReduce, ncclAllGather, ncclSend... come from 2.28.9). But
# vLLM's own NCCL wrapper (pynccl) looks its functions up in libnccl.so.2 itself (ctypes; a
# preloaded symbol is not found through that handle, checked with ctypes here) and on CUDA
# requires ncclCommSuspend/ncclCommResume (NCCL >= 2.29.7): with 2.28.9 it disables itself
# without a word and vLLM falls back to torch.distributed, a path TP runs do not normally take.
# So a TP run drops the shim and preloads the real NCCL 2.29.7 that torch 2.13 was built with
# instead (those eight symbols are then real ones). Steps:
#   here:  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#            --platform manylinux_2_17_x86_64 --platform manylinux_2_18_x86_64 \
#            --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
#            -d .vw/nccl nvidia-nccl-cu13==2.29.7
#          (cd .vw/nccl && split -b 62m -d -a 2 nvidia_nccl_cu13-*.whl part. && rm *.whl)
#          then carry the parts, one `run` call each with the bundle's (.vw in .git/info/exclude),
#          each command starting:  mkdir -p /tmp/vw/nccl && cp .vw/nccl/part.* /tmp/vw/nccl/
#   there: this script unpacks them into /tmp/vw/nccl/libnccl.so.2 on its first tp call and
#          checks torch.cuda.nccl.version() is (2, 29, 7) before anything starts.
# NVLink multicast stays off (the x2 machine's rule): NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are exported below, and the
# package sets them for its engines and servers where they are unset; VLLM_ALLREDUCE_USE_SYMM_MEM=0
# keeps vLLM off PyTorch symmetric memory (it would disable itself without multicast anyway).
set -u
w=/tmp/vw
out=${OUT:-out}; mkdir -p "$out"
export LD_PRELOAD=$w/p00/shim/libncclshim.so PYTHONPATH=$PWD:$w/site PYTHONUNBUFFERED=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0
case $1 in
tp|tp-tests)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    VLLM_ALLREDUCE_USE_SYMM_MEM=0
  nccl=$w/nccl/libnccl.so.2
  if [ ! -f "$nccl" ]; then
    ls "$w"/nccl/part.* >/dev/null 2>&1 || { echo "no NCCL 2.29.7 parts in $w/nccl: see the steps above"; exit 1; }
    cat $(ls "$w"/nccl/part.* | sort) > "$w/nccl/nccl.whl" && python3 -c "import sys, zipfile
z = zipfile.ZipFile(sys.argv[1]); name = next(n for n in z.namelist() if n.endswith('/libnccl.so.2'))
open(sys.argv[2], 'wb').write(z.read(name))" \
      "$w/nccl/nccl.whl" "$nccl" && rm "$w/nccl/nccl.whl" "$w"/nccl/part.*
  fi
  export LD_PRELOAD=$nccl VLLM_NCCL_SO_PATH=$nccl
  python3 -c "import torch, sys; v = torch.cuda.nccl.version(); print('NCCL', v, 'GPUs', torch.cuda.device_count())
sys.exit(v < (2, 29, 7) or torch.cuda.device_count() < 2)" || { echo "TP needs NCCL >= 2.29.7 and 2 GPUs"; exit 1; }
  ;;
esac
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case $1 in
server-tests|served)
  # `vllm serve` imports three pure-Python packages the bundle (made for offline LLM) lacks
  # (H100, 2026-12-07: "No module named 'model_hosting_container_standards'"). Here:
  #   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  #     --platform any -d .vw/whl model_hosting_container_standards==0.1.16 jmespath==1.1.0 \
  #     supervisor==4.3.0
  # and carry .vw/whl with any bundle part.
  [ -d "$w/site/model_hosting_container_standards" ] || {
    ls .vw/whl/*.whl >/dev/null 2>&1 || { echo "carry .vw/whl (see above)"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$w/site" .vw/whl/*.whl; }
  ;;
esac
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
    --rounds "${4:-5}" --parts "${5:-speed}" --seconds "${6:-0}" 2>&1 | grep -v -i "warn" | tee "$out/bench_$2.txt"
  ;;
routing-tests)
  timeout 400 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_routing_gpu.py 2>&1 \
    | tee "$out/routing_tests.txt"
  ;;
server-tests)
  timeout 280 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu/test_vllm_server_gpu.py \
    2>&1 | tee "$out/server_tests.txt"
  ;;
served)
  timeout 300 python3 benchmarks/bench_vllm_served.py --shape "${2:-smollm2-135m}" \
    --batches "${3:-1,16,64}" --rounds "${4:-5}" 2>&1 | grep -v -i "warn" \
    | tee "$out/served_${2:-smollm2-135m}.txt"
  ;;
tp-tests)
  timeout 540 python3 -m pytest -q -s -ra -p no:cacheprovider tests/gpu/test_vllm_tp_gpu.py 2>&1 \
    | tee "$out/tp_tests.txt"
  ;;
tp)
  layers=${4:-}; dir=/tmp/m-$2-${layers:-all}
  timeout 560 python3 benchmarks/bench_vllm_gpu.py --tp 2 --shape "$2" --parts "$3" \
    ${layers:+--layers "$layers"} --model-dir "$dir" --batches "${5:-1,16,64,256}" \
    --rounds "${6:-5}" --memory 0.3 2>&1 | grep -v -i "warn" | tee "$out/tp_$2_$3.txt"
  ;;
esac
