"""The batch-invariant Llama forward (trace_replay.engines.builtin.backends.deterministic_model) on a tiny random
Llama: the model's own numbers, a row's bits independent of the other rows of its call, and
the models it refuses named with the reason."""

from __future__ import annotations

import pytest
import torch

import trace_replay.kernels._triton
from trace_replay.engines.builtin.backends.deterministic_model import (
    DeterministicLlama,
    unsupported_reason,
)
from trace_replay.engines.builtin.backends.deterministic_ops import score_rows
from trace_replay.kernels.deterministic_attention import BLOCK_N

SEQUENCES = [[50, 35, 28, 46, 7], [1], [95, 30, 21], [9, 9, 9, 9, 9, 9, 9]]


@pytest.fixture(scope="module")
def model(tiny_llama) -> DeterministicLlama:
    return DeterministicLlama(tiny_llama)


def logits_of(
    model: DeterministicLlama, sequences: list[list[int]], slots: int = 64, runs: bool = False
):
    """Logits at every token of ``sequences``, each in its own cache row, all in one call
    (``runs``: the forward is told the sequences' lengths, as a prefill tells it)."""
    cache = model.new_cache(len(sequences), slots)
    for row, sequence in enumerate(sequences):
        cache.valid[row, : len(sequence)] = True
    tokens = torch.tensor([t for s in sequences for t in s])
    cache_row = torch.cat([torch.full((len(s),), row) for row, s in enumerate(sequences)])
    slot = torch.cat([torch.arange(len(s)) for s in sequences])
    lengths = [len(s) for s in sequences] if runs else None
    with torch.inference_mode():
        return model.lm_head(model.forward(cache, tokens, cache_row, slot, slot, runs=lengths))


def test_forward_is_the_models_own(model, tiny_llama):
    """Every sequence's logits agree with the transformers model run on it alone, within
    float32 rounding."""
    ours = logits_of(model, SEQUENCES).split([len(s) for s in SEQUENCES])
    with torch.inference_mode():
        for sequence, logits in zip(SEQUENCES, ours):
            theirs = tiny_llama(input_ids=torch.tensor([sequence])).logits[0]
            torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=0)


def test_row_bits_ignore_the_other_rows(model):
    """A sequence's logits are the same bits alone, among other sequences (at another row
    offset, in another cache row), and with a larger cache (a longer rotary table)."""
    alone = logits_of(model, SEQUENCES[:1])
    crowd = logits_of(model, SEQUENCES[1:] + SEQUENCES[:1])
    start = sum(len(s) for s in SEQUENCES[1:])
    assert torch.equal(alone, crowd[start:])
    assert torch.equal(alone, logits_of(model, SEQUENCES[:1], slots=4 * BLOCK_N * 2))


def test_new_cache_has_a_scratch_row(model, tiny_llama):
    """A cache of R rows has one more, the scratch row R, for padding rows; nothing in
    context yet."""
    cache = model.new_cache(3, 2 * BLOCK_N)
    config = tiny_llama.config
    assert cache.k.shape == (
        config.num_hidden_layers,
        4,
        config.num_key_value_heads,
        2 * BLOCK_N,
        config.head_dim,
    )
    assert cache.scratch == 3 and not cache.valid.any()


def test_describe_names_the_arithmetic(model):
    """On CPU without Triton: torch linear, norms and attention in fixed row blocks, the
    attention key block, and no row padding."""
    described = model.describe()
    assert described["linear"].startswith("torch, [")
    assert described["norm"].startswith("torch") and described["attention"].startswith("torch")
    assert described["key_block"] == BLOCK_N and described["row_multiple"] == 1


# tiny_llama lives on the CPU: its Triton kernels run only in the interpreter (on CUDA the
# 3xTF32 path is checked by tests/kernels/test_deterministic_kernels.py and, end to end and
# bitwise, by benchmarks/bench_determinism.py)
needs_kernels = pytest.mark.skipif(
    not trace_replay.kernels._triton.interpreting(),
    reason="CPU tensors run Triton kernels only with TRITON_INTERPRET=1 set before the first import",
)


@needs_kernels
def test_3xtf32_linears_are_the_models_own(tiny_llama):
    """With linear='3xtf32' (the CUDA float32 default: one launch per layer, the
    configuration fixed by the weight's shape) the forward still agrees with the
    transformers model; settings name the arithmetic and rows need no padding."""
    model = DeterministicLlama(tiny_llama, triton=True, linear="3xtf32")
    described = model.describe()
    assert described["linear"].startswith("triton 3xtf32") and described["row_multiple"] == 1
    ours = logits_of(model, SEQUENCES).split([len(s) for s in SEQUENCES])
    with torch.inference_mode():
        for sequence, logits in zip(SEQUENCES, ours):
            theirs = tiny_llama(input_ids=torch.tensor([sequence])).logits[0]
            torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=0)


@needs_kernels
def test_tiled_attention_is_the_models_own(tiny_llama):
    """attention='tiles' (a prefill's queries a tile of one trace at a time) still gives
    the transformers model's logits, for sequences of several tiles and of one token."""
    model = DeterministicLlama(tiny_llama, triton=True, attention="tiles")
    assert model.describe()["attention"].startswith("triton, tiles of")
    sequences = [*SEQUENCES, list(range(3, 40))]
    logits = logits_of(model, sequences, runs=True)
    with torch.inference_mode():
        for sequence, ours in zip(sequences, logits.split([len(s) for s in sequences])):
            theirs = tiny_llama(input_ids=torch.tensor([sequence])).logits[0]
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="attention='blocks'; choose one of tiles, rows"):
        DeterministicLlama(tiny_llama, attention="blocks")
    cache = model.new_cache(1, 64)
    with pytest.raises(ValueError, match="runs cover 3 rows; the forward has 2"):
        model.forward(
            cache,
            torch.tensor([5, 6]),
            torch.tensor([0, 0]),
            torch.tensor([0, 1]),
            torch.tensor([0, 1]),
            runs=[3],
        )


@needs_kernels
def test_triton_scoring_is_the_blocked_scorings_rule(tiny_llama):
    """With the Triton kernels, scoring runs one program per row (any row count, top_k up
    to 32) and gives the torch row blocks' numbers within float32 rounding (top ids may
    order tied logits otherwise; their logprobs are level); above 32 it is the row blocks
    themselves."""
    model = DeterministicLlama(tiny_llama, triton=True)
    assert model.describe()["score"].startswith("triton (top_k <= 32")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-40, 40, (11, 128), generator=generator) / 8  # exact ties, no near ones
    tokens = torch.randint(0, 128, (11,), generator=generator)
    for top_k in (0, 5, 40):
        got, want = model.score(logits, tokens, top_k), score_rows(logits, tokens, top_k, 8)
        assert torch.equal(got.rank, want.rank)
        torch.testing.assert_close(got.logprob, want.logprob, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got.entropy, want.entropy, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=2e-5, rtol=1e-5)


def test_linear_choice_is_checked(tiny_llama):
    """An unknown linear, or '3xtf32' without the Triton kernels or on a bfloat16 model, is
    refused by name."""
    with pytest.raises(ValueError, match="choose '3xtf32' or 'blocks'"):
        DeterministicLlama(tiny_llama, linear="cublas")
    with pytest.raises(ValueError, match="needs a float32 model and the Triton kernels"):
        DeterministicLlama(tiny_llama, triton=False, linear="3xtf32")


@pytest.mark.parametrize(
    "config_name, overrides, reason",
    [
        ("MistralConfig", {"sliding_window": 4}, "sliding-window attention"),
        ("Qwen3Config", {}, "model type 'qwen3' is not Llama-family (llama, mistral, qwen2)"),
        ("LlamaConfig", {"hidden_act": "gelu"}, "activation 'gelu' (only silu)"),
        (
            "LlamaConfig",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
            "position-dependent RoPE scaling",
        ),
    ],
)
def test_unsupported_models_are_named(make_tiny_lm, config_name, overrides, reason):
    """Models whose arithmetic the invariant forward does not reproduce are refused with the
    reason, before anything runs."""
    lm = make_tiny_lm(config_name, **overrides)
    assert unsupported_reason(lm) == reason
    with pytest.raises(ValueError, match=f"does not support {type(lm).__name__}: "):
        DeterministicLlama(lm)


def test_llama_family_is_supported(tiny_llama, make_tiny_lm):
    """Llama, Qwen2 and Mistral without a sliding window are supported."""
    assert unsupported_reason(tiny_llama) is None
    assert unsupported_reason(make_tiny_lm("Qwen2Config")) is None
    assert unsupported_reason(make_tiny_lm("MistralConfig", sliding_window=None)) is None


class _Sites:
    """A RowObserver that keeps every site's values."""

    def __init__(self):
        self.values = {}

    def begin(self, cache_row, positions):
        self.values.clear()

    def site(self, layer, name, values):
        self.values[layer, name] = values.clone()


@needs_kernels
def test_fused_layers_show_the_observer_their_own_numbers(tiny_llama):
    """With the Triton kernels (linears' partials summed inside the next kernel) an observer
    still sees the numbers the forward used: each layer's residual stream is, bitwise, the
    previous one plus the attention and MLP outputs it was shown, and the final norm is the
    forward's result; observing changes no bit of it."""
    model = DeterministicLlama(tiny_llama, triton=True, linear="3xtf32")
    plain = logits_of(model, SEQUENCES)
    sites = _Sites()
    model.observer = sites
    try:
        observed = logits_of(model, SEQUENCES)
    finally:
        model.observer = None
    assert torch.equal(plain, observed)
    stream = sites.values[-1, "embeddings"]
    for layer in range(model.num_layers):
        stream = (stream + sites.values[layer, "attention"]) + sites.values[layer, "mlp"]
        assert torch.equal(stream, sites.values[layer, "residual"])
    with torch.inference_mode():
        assert torch.equal(model.lm_head(sites.values[model.num_layers, "final_norm"]), plain)


@needs_kernels
@pytest.mark.parametrize("linear", ["3xtf32", "blocks"])
def test_fused_layers_add_every_bias(make_tiny_lm, linear):
    """Biases on every projection (Llama's attention_bias and mlp_bias; Qwen2 has q/k/v's)
    reach the logits through the fused kernels as the transformers model adds them, with
    the linears' partials (3xtf32) or their finished outputs (blocks)."""
    lm = make_tiny_lm("LlamaConfig", attention_bias=True, mlp_bias=True)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in lm.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.3)
    model = DeterministicLlama(lm, triton=True, linear=linear)
    ours = logits_of(model, SEQUENCES).split([len(s) for s in SEQUENCES])
    with torch.inference_mode():
        for sequence, logits in zip(SEQUENCES, ours):
            theirs = lm(input_ids=torch.tensor([sequence])).logits[0]
            torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=0)
