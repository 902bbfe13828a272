"""Random-weight models of published shapes, built without a hub, and their HBM bound.

Speed does not depend on weight values, so a model of Llama-3.1-8B's shape with random
bfloat16 weights decodes as fast as the real one. Shapes are the published ``config.json``
values (hidden size, layers, heads, vocabulary, RoPE).
"""

from __future__ import annotations

import torch

__all__ = [
    "SHAPES",
    "hbm_bound_seconds",
    "kv_bytes_per_token",
    "random_model",
    "saved_random_model",
]

SHAPES = {
    "smollm2-135m": (
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.1-8b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "llama-3.1-70b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
    ),
    # a forward that costs next to nothing: what is left of a step is the host's work
    "tiny": (
        "LlamaConfig",
        dict(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
}


def random_model(
    shape: str, dtype: torch.dtype, device: torch.device, layers: int | None = None
) -> torch.nn.Module:
    """A causal LM of ``shape`` with seeded random weights, initialized on ``device``;
    ``layers`` replaces the shape's layer count (a model of its widths that fits)."""
    import transformers

    name, values = SHAPES[shape]
    if layers is not None:
        values = {**values, "num_hidden_layers": layers}
    config = getattr(transformers, name)(**values, pad_token_id=0)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            lm = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    return lm.eval()


def saved_random_model(shape: str, device: str) -> tuple[str, int]:
    """A :func:`random_model` of ``shape`` saved in a new temporary folder, in bfloat16 on
    CUDA and float32 elsewhere: ``(folder, vocabulary size)``."""
    import tempfile

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    folder = tempfile.mkdtemp()
    lm = random_model(shape, dtype, torch.device(device))
    lm.save_pretrained(folder)
    vocab = lm.config.vocab_size
    del lm
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder, vocab


def kv_bytes_per_token(lm: torch.nn.Module) -> int:
    """Bytes of keys and values one context token holds across all layers."""
    config = lm.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(lm.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def hbm_bound_seconds(
    lm: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, bandwidth: float = 4.8e12
) -> float:
    """Least time of ``new_tokens`` decode steps: every weight and every row's context
    (keys and values) read once per step, at ``bandwidth`` bytes/s.

    An input embedding table that is not also the output head is not read whole by a
    step, only one row per token: it counts as ``batch`` rows (Llama-3.1-8B: 1.05 of its
    16.06 GB are that table; until 2026-12-01's sixth session the bound counted all of it,
    which made every 8B fraction ~7% too high)."""
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    table = lm.get_input_embeddings().weight
    head = lm.get_output_embeddings()
    if head is None or head.weight is not table:
        weights += (batch - table.shape[0]) * table.shape[1] * table.element_size()
    mean_context = prompt_len + (new_tokens - 1) / 2
    per_step = weights + batch * mean_context * kv_bytes_per_token(lm)
    return new_tokens * per_step / bandwidth
