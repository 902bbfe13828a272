#!/usr/bin/env bash
# The H200 runs behind benchmarks/RESULTS.md's performance sections (one call each part).
#   bash benchmarks/h200_perf.sh torch    # 135M float32 / bfloat16, Llama-3.1-8B shape
#   bash benchmarks/h200_perf.sh big      # Qwen2.5-7B shape
#   bash benchmarks/h200_perf.sh tests    # the GPU tests (run these first on new code)
#   bash benchmarks/h200_perf.sh determinism   # deterministic mode's cost and bits, both attentions
#   python3 benchmarks/bench_fp32_linear.py [--sweep]      # float32 linears: cuBLAS vs 3xTF32
#   bash benchmarks/h200_perf.sh vllm W   # vLLM 0.26 forcing vs greedy; W = the assembled
#       bundle of ../shared/tools/vllm-h200 (carry .vllm-bundle/p0..p3 into W in four calls
#       back to back, the machine idles out after 30 s; then `bash W/p3/assemble.sh W`)
# Output goes to $OUT (or ./out) as one text file per benchmark.
set -u
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
bench() { name=$1; shift; timeout "$LIMIT" python3 benchmarks/bench_replay.py --device cuda \
  --new-tokens 128 --backends static "$@" 2>&1 | grep -v -i warn | tee "$out/$name.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
case $1 in
torch)
  LIMIT=200 bench smol_fp32 --shape smollm2-135m --dtype float32 --batch 64 --k 8 --repeats 5 \
    --fidelity --host-profile
  LIMIT=100 bench smol_bf16 --shape smollm2-135m --dtype bfloat16 --batch 256 --k 0 --skip-hf --repeats 7
  LIMIT=100 bench smol_bf16_verify --shape smollm2-135m --dtype bfloat16 --batch 64 --k 8 --skip-hf --repeats 5
  LIMIT=240 bench llama8b --shape llama-3.1-8b --dtype bfloat16 --batch 1,16,64 --k 0 --repeats 2 --profile
  ;;
fp32)
  # the 3xTF32 tensor-core default beside float32 FMAs (cuBLAS), one run
  LIMIT=200 bench smol_fp32 --shape smollm2-135m --dtype float32 --batch 64 --k 8 --fidelity --profile \
    --backends static,static:ieee
  ;;
determinism)
  # float32, 135M shape, batch 64: cost against the default path and the bitwise checks,
  # with the per-row and the tiled Triton attention (RESULTS, Deterministic mode)
  for attention in rows tiles; do
    LIMIT=240 timeout 240 python3 benchmarks/bench_determinism.py --device cuda --batch 64 \
      --new-tokens 128 --model random --repeats 5 --profile --attention $attention 2>&1 \
      | grep -v -i warn | tee "$out/determinism_$attention.txt"
  done
  ;;
big)
  LIMIT=400 bench qwen7b --shape qwen2.5-7b --dtype bfloat16 --batch 1,16,64 --k 0 --repeats 2
  ;;
tests)
  # the GPU paths: captured steps (both backends, forced steps), CUDA scoring and top-k, the kernels
  timeout 400 python3 -m pytest -v -p no:cacheprovider -m gpu tests/engines/builtin/backends/test_captured_step.py \
    tests/engines/builtin/test_decode.py tests/engines/builtin/backends/test_static_backend.py tests/engines/builtin/test_scoring.py tests/kernels/test_kernels.py tests/engines/test_replay_state.py \
    tests/engines/builtin/test_prefill.py -k "${TESTS:-.}" 2>&1 | grep -E "PASS|FAIL|Error|error|passed|failed" | tee "$out/gpu_tests.txt"
  # the kernels' and the state's CUDA cases are not gpu-marked (a device parameter instead)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_top_k.py tests/kernels/test_kernels.py tests/engines/test_replay_state.py tests/kernels/test_cache_attention.py tests/kernels/test_fp32_linear.py tests/engines/builtin/passes/test_linear_groups.py \
    tests/kernels/test_gemv.py tests/kernels/test_gated_gemv.py tests/engines/builtin/passes/test_residual_adds.py tests/engines/builtin/passes/test_norm_folds.py \
    tests/engines/builtin/backends/test_deterministic_ops.py tests/kernels/test_deterministic_kernels.py -k cuda 2>&1 | tail -5 | tee -a "$out/gpu_tests.txt"
  # deterministic mode's CUDA kernels (their device is the module's, not a parameter) and its
  # bitwise promises end to end with the CUDA arithmetic
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_deterministic_kernels.py \
    tests/kernels/test_deterministic_epilogues.py tests/kernels/test_deterministic_score.py tests/gpu/test_determinism_gpu.py 2>&1 | tail -5 \
    | tee -a "$out/gpu_tests.txt"
  ;;
vllm)
  # paired ratios over 11 rounds of 256-token traces (~6 min: a call of its own); PROFILE=1
  # runs the engine-core profile instead (no --vanilla there: vLLM will not capture a second
  # in-process LLM's CUDA graphs)
  export PYTHONPATH=$2/site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  [ "${PROFILE:-0}" = 1 ] || { timeout 500 python3 benchmarks/bench_vllm_forcing.py \
    --batches 64,256 --new-tokens 256 --repeats 11 --vanilla 2>&1 \
    | grep -E "^  batch|^\||^20|^Ratios|Error" | tee "$out/vllm_forcing.txt"; exit; }
  timeout 200 python3 benchmarks/bench_vllm_forcing.py --batches 64,256 --repeats 3 \
    --profile "$out/prof" 2>&1 | grep -E "^  batch|^\||^20|^Ratios|^    |Error" \
    | tee "$out/vllm_profile.txt"
  rm -rf "$out/prof"
  ;;
esac
