"""Where vLLM's float32 differs from the built-in engine's (issue 30): one random 4-layer Llama of
SmolLM2-135M's widths (init 0.3, as tests/gpu/test_vllm_gpu.py), 16 prompts, 24-token traces from
the built-in engine's IEEE float32 greedy; vLLM native replay of them in float32; max |Δ logprob|."""
import os
import sys

import numpy as np
import torch
import transformers

def main():
    mode = sys.argv[1]
    folder = "/tmp/fp32-llama"
    if not os.path.exists(folder + "/config.json"):
        config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            max_position_embeddings=2048, initializer_range=0.3, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    from trace_replay.engines import make_engine
    from trace_replay.engines.base import ReplayRequest
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (16,), generator=gen).tolist() for _ in range(16)]
    ref = make_engine("torch", folder, dtype="float32", device="cuda", batch_size=16, float32_matmul="ieee")
    traces = [ids for ids, _ in ref.generate(prompts, max_tokens=24)]
    reqs = [ReplayRequest(str(i), tuple(p), tuple(t)) for i, (p, t) in enumerate(zip(prompts, traces))]
    base = np.concatenate([r.logprob for r in ref.run(reqs)])
    ref.close()
    args = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 512,
            "gpu_memory_utilization": 0.12}
    args["attention_backend"] = "FLEX_ATTENTION" if mode == "flex" else None
    eng = make_engine("vllm", folder, dtype="float32", batch_size=16, top_k=5, engine_args=args, verbose=True)
    lp = np.concatenate([r.logprob for r in eng.run(reqs)])
    print(f"PROBE mode={mode} TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT')} "
          f"path={eng.settings()['engine_path']} max|d|={np.abs(lp - base).max():.3g} "
          f"median|d|={np.median(np.abs(lp - base)):.3g} n={lp.size}", flush=True)
    eng.close()

if __name__ == "__main__":
    main()
