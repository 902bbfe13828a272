"""The static-cache backend computes what the transformers model computes (HF backend).

Tiny random models (2 layers, hidden 64) of every supported family are built from
transformers configs, with weights large enough that the distributions are far from
uniform; sliding windows (4 positions) are shorter than the contexts replayed.
"""

from __future__ import annotations

import copy
import os
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.backends.hf import HFBackend
from trace_replay.engines.builtin.backends.packed_linear import packed_linears_available
from trace_replay.engines.builtin.backends.static import StaticCacheBackend, supports
from trace_replay.runs.replay import replay

PROMPTS = [[50, 35, 28, 46], [1], [95, 30, 21], [50, 35]]
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"sliding_window": 4}),
    "gemma3": (
        "Gemma3TextConfig",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


@pytest.fixture(scope="module")
def tiny_model(make_tiny_lm):
    """``tiny_model(arch)``: a new seeded random float32 model of ``arch`` (conftest's tiny
    sizes, with the architecture's own options)."""

    def build(arch: str) -> torch.nn.Module:
        name, extra = ARCHITECTURES[arch]
        # transformers' sdpa path drops Gemma-2's attention soft-capping; eager applies it
        attn = "eager" if arch == "gemma2" else "sdpa"
        return make_tiny_lm(name, attn_implementation=attn, **extra)

    return build


def requests(vocab: int = 128) -> list[ReplayRequest]:
    """Five traces of uneven prompt and trace lengths (left padding, a smaller second wave)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, (prompt_len, trace_len) in enumerate([(4, 9), (1, 12), (3, 5), (6, 1), (2, 10)]):
        ids = torch.randint(3, vocab, (prompt_len + trace_len,), generator=gen).tolist()
        out.append(ReplayRequest(str(i), tuple(ids[:prompt_len]), tuple(ids[prompt_len:])))
    return out


def run(lm, backend: str, method: str | None = None, **options):
    """Replay ``requests()`` in four slots; returns (engine, results)."""
    speculative = None if method is None else {"method": method, "num_tokens": 3}
    engine = make_engine(
        "torch", lm, batch_size=4, backend=backend, speculative=speculative, **options
    )
    return engine, engine.run(requests(lm.config.vocab_size))


def assert_same_results(ours, theirs, atol=1e-4):
    """Same tokens; logprobs and top-k logprobs within ``atol``; ranks equal up to ±1."""
    for a, b in zip(ours, theirs):
        assert a.trace_id == b.trace_id
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprob, b.logprob, atol=atol)
        np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=atol)
        np.testing.assert_allclose(a.entropy, b.entropy, atol=atol)
        assert (np.abs(a.rank - b.rank) <= 1).all()


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def tiny(request, tiny_model):
    """(architecture, model, the HF backend's step-by-step replay of ``requests()``)."""
    lm = tiny_model(request.param)
    return request.param, lm, run(lm, "hf")[1]


def test_supports_families(tiny):
    """Every family listed is supported; other model types are not."""
    _, lm, _ = tiny
    assert supports(lm)
    assert not supports(torch.nn.Linear(2, 2))
    other = SimpleNamespace(
        config=SimpleNamespace(model_type="gpt2", sub_configs={}), model=lm.model
    )
    assert not supports(other)


def test_replay_equals_hf(tiny):
    """Step-by-step replay (left padding, two waves in four slots) matches the HF backend."""
    _, lm, hf = tiny
    engine, ours = run(lm, "static")
    assert engine.backend.name.startswith("static")
    assert_same_results(ours, hf)


def test_verify_equals_step_by_step(tiny):
    """Verify with trace drafts (k = 3) gives what step-by-step replay gives."""
    _, lm, hf = tiny
    assert_same_results(run(lm, "static", "trace")[1], hf)


def test_ngram_verify_equals_hf(tiny_model):
    """N-gram drafts (some rejected, dropped by ``keep``) match the HF backend's verify path."""
    lm = tiny_model("qwen3")
    ours_engine, ours = run(lm, "static", "ngram")
    theirs_engine, theirs = run(lm, "hf", "ngram")
    assert_same_results(ours, theirs)
    assert ours_engine.stats()["acceptance_rate"] == theirs_engine.stats()["acceptance_rate"]


def test_model_left_unmodified(tiny_model):
    """The backend runs a view of the model: the model's own config and layers are untouched."""
    lm = tiny_model("llama")
    before = (lm.config._attn_implementation, [type(m).forward for m in lm.model.layers])
    run(lm, "static")
    assert lm.config._attn_implementation == before[0]
    assert "forward" not in vars(lm.model.layers[0])
    assert isinstance(HFBackend(lm, 0).prefill(PROMPTS, 4), torch.Tensor)


def test_float32_matmul_is_checked(tiny_model):
    with pytest.raises(ValueError, match="float32_matmul"):
        StaticCacheBackend(tiny_model("llama"), 0, float32_matmul="tf32")
    assert "+3xtf32" not in StaticCacheBackend(tiny_model("llama"), 0).name  # CPU: F.linear


KEEP = torch.tensor(
    [[True, False, False], [True, True, True], [True, False, True], [False, False, False]]
)


def _decode_keep_decode(backend):
    """Prefill, decode 3 drafts per row, keep ``KEEP`` of them, decode 2 more tokens per row."""
    lens = torch.tensor([len(p) for p in PROMPTS])
    drafts = torch.tensor([[11, 12, 13]] * len(PROMPTS))
    with torch.inference_mode():
        first = backend.prefill(PROMPTS, max_new_tokens=8).clone()
        backend.decode(drafts, lens[:, None] + torch.arange(3))
        backend.keep(KEEP)
        last = backend.decode(drafts[:, :2] + 5, (lens + KEEP.sum(1))[:, None] + torch.arange(2))
    return first, last.clone()


def test_keep_then_decode_equals_hf(tiny_model):
    """After ``keep`` drops drafts (some trailing, one in the middle), logits match HF's."""
    lm = tiny_model("llama")
    ours = StaticCacheBackend(lm, 0, max_query_len=3)
    for a, b in zip(_decode_keep_decode(ours), _decode_keep_decode(HFBackend(lm, 0))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # trailing drops are given back: cursor = prompt + slots up to the last kept one (the
    # CPU writes each prompt unpadded from slot 0; left-padded, the prompts' width)
    starts = [len(p) for p in PROMPTS] if ours.unpadded_prefill else [4] * 4
    assert ours.cache.cursor.tolist() == [s + n + 2 for s, n in zip(starts, [1, 3, 3, 0])]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_unpadded_prefill_equals_the_left_padded_batch(arch, tiny_model):
    """The CPU's prefill (each prompt its own forward from slot 0 of its row) gives the
    left-padded batch's logits, then and after drafts are decoded, dropped and decoded
    again (Mistral: a sliding window of 4 positions); only the cursors differ."""
    lm = tiny_model(arch)
    unpadded = StaticCacheBackend(lm, 0, max_query_len=3)
    padded = StaticCacheBackend(lm, 0, max_query_len=3)
    padded.unpadded_prefill = False
    for a, b in zip(_decode_keep_decode(unpadded), _decode_keep_decode(padded)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert unpadded.cache.cursor.tolist() != padded.cache.cursor.tolist()


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_keep_with_sliding_window_equals_plain_forward(arch, tiny_model):
    """With sliding windows (4 positions), a row that kept a prefix of its drafts sees exactly
    that context: logits equal the model's own unpadded forward over prompt + kept + new
    tokens. Windows count positions, so dropped drafts never narrow them (the HF backend's
    windows count its masked slots too, and differ here)."""
    lm = tiny_model(arch)
    _, last = _decode_keep_decode(StaticCacheBackend(lm, 0, max_query_len=3))
    with torch.inference_mode():
        for row in (0, 1, 3):  # row 2 dropped a middle draft: no plain sequence matches it
            prompt = PROMPTS[row]
            kept = [t for t, k in zip([11, 12, 13], KEEP[row].tolist()) if k]
            ids = torch.tensor([prompt + kept + [16, 17]])
            expected = lm(input_ids=ids).logits[0, -2:]
            torch.testing.assert_close(last[row], expected, atol=1e-4, rtol=0)


def test_smaller_wave_reuses_cache(tiny_model):
    """A wave with fewer rows in the same length bucket reuses the cache; padding rows are
    inert (eager, not computed: the rows after the wave's keep their keys)."""
    lm = tiny_model("llama")
    ours, theirs = StaticCacheBackend(lm, 0), HFBackend(lm, 0)
    with torch.inference_mode():
        ours.prefill(PROMPTS, max_new_tokens=4)
        cache = ours.cache
        small = PROMPTS[1:3]
        rest = cache.keys[0][len(small) :].clone()
        a = ours.prefill(small, max_new_tokens=5)
        b = theirs.prefill(small, max_new_tokens=5)
        assert ours.cache is cache
        positions = torch.tensor([[len(p)] for p in small])
        a2 = ours.decode(a.argmax(-1)[:, None], positions).clone()
        b2 = theirs.decode(b.argmax(-1)[:, None], positions)
    assert a2.shape == b2.shape
    assert torch.equal(cache.keys[0][len(small) :], rest)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    torch.testing.assert_close(a2, b2, atol=1e-4, rtol=0)


def test_backend_choice(tiny_model):
    """``auto`` on CPU is static for a float32 model where torch packs its linears for
    oneDNN; ``static`` runs without graphs on CPU, a float32 model's linears through oneDNN
    where torch has it; unknown names raise."""
    lm = tiny_model("llama")
    packed = "+onednn" if packed_linears_available(torch.float32) else ""
    auto = "static+onednn" if packed else "hf"
    assert make_engine("torch", lm, backend="auto").backend.name == auto
    assert make_engine("torch", lm, backend="static").backend.name == "static" + packed
    with pytest.raises(ValueError, match="backend"):
        make_engine("torch", lm, backend="bogus")
    with pytest.raises(ValueError, match="cuda_graphs"):
        StaticCacheBackend(lm, 0, cuda_graphs=True)


@pytest.mark.slow
def test_embedded_model_replay_equals_hf(lm, real_traces, assert_matches_reference):
    """The embedded SmolLM2 replays real traces through the static backend as through HF,
    within 2e-3 of float64 per token (ranks equal up to near-ties)."""
    ours = replay(
        real_traces, engine=make_engine("torch", lm, batch_size=4, backend="static"), progress=False
    )
    assert_matches_reference(ours)
    theirs = replay(
        real_traces, engine=make_engine("torch", lm, batch_size=4, backend="hf"), progress=False
    )
    assert ours.attrs["engine_path"].startswith("torch-decode[static")
    assert ours["token_id"].tolist() == theirs["token_id"].tolist()
    np.testing.assert_allclose(ours["logprob"], theirs["logprob"], atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    "method, float32_matmul", [(None, "3xtf32"), ("trace", "3xtf32"), (None, "ieee")]
)
def test_compiled_graphs_equal_hf(tiny, method, float32_matmul):
    """On CUDA, the compiled, captured backend replays what the HF backend replays, with its
    float32 products on tensor cores (3xTF32) or not."""
    arch, lm, _ = tiny
    gpu = copy.deepcopy(lm).to("cuda")
    engine, ours = run(gpu, "auto", method, float32_matmul=float32_matmul)
    suffix = "+3xtf32" if float32_matmul == "3xtf32" else ""
    assert engine.backend.name == "static+compiled" + suffix
    assert_same_results(ours, run(gpu, "hf")[1], atol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_captured_prefill_is_replayed_for_later_waves(tiny_model, monkeypatch):
    """On CUDA a prefill is captured once per padded width and replayed with the next
    wave's prompts (widths 4 and 3 share a bucket, 20 does not); past
    PREFILL_GRAPH_TOKENS it runs compiled without a graph. Every prefill's logits are
    the HF backend's, within float32 rounding of differently fused kernels."""
    from trace_replay.engines.builtin.backends import static as static_backend

    lm = copy.deepcopy(tiny_model("llama")).to("cuda")
    ours, theirs = StaticCacheBackend(lm, 0), HFBackend(lm, 0)
    long_prompts = [list(range(3, 23)), [7, 8]]
    # 150 new tokens: every wave's cache is 256 slots long, so captures are kept
    with torch.inference_mode():
        for prompts in (PROMPTS, [[5, 6, 7], [9], [40, 41]], long_prompts):
            torch.testing.assert_close(
                ours.prefill(prompts, max_new_tokens=150),
                theirs.prefill(prompts, max_new_tokens=150),
                atol=2e-4,
                rtol=0,
            )
        assert sorted(ours._prefills) == [16, 32]  # both buckets captured
        monkeypatch.setattr(static_backend, "PREFILL_GRAPH_TOKENS", 8)
        torch.testing.assert_close(
            ours.prefill(long_prompts, max_new_tokens=150),
            theirs.prefill(long_prompts, max_new_tokens=150),
            atol=2e-4,
            rtol=0,
        )
        assert ours._prefill_shapes == {(4, 32)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_half_precision_at_one_row_runs_the_gemv(arch, dtype, tiny_model, monkeypatch):
    """At batch 1 a bfloat16 or float16 model's captured step multiplies with the one-row
    GEMV: q/k/v grouped (a launch of 3 weights) with the layer's input norm inside it, the
    MLP's norm, gate, up and activation in one gated launch, and (Llama, Qwen2: the add
    follows the projection directly) the residual adds inside the o and down GEMVs. Its
    logprobs are as close to the float32 model's as the HF backend's in the same dtype
    (cuBLAS): within twice that largest difference plus two roundings of the largest
    logprob in the dtype (a logit of 12 moves by 0.06 when bfloat16 rounds it the other
    way)."""
    from trace_replay.kernels import gated_gemv as gated_module
    from trace_replay.kernels import gemv as gemv_module

    members, gated = [], []
    launch, gated_launch = gemv_module.launch, gated_module.launch

    def counted(x, weights, *args, residual=None, norm=None, **kwargs):
        members.append((len(weights), residual is not None, norm is not None))
        return launch(x, weights, *args, residual=residual, norm=norm, **kwargs)

    def counted_gated(*args, norm=None, **kwargs):
        gated.append((args[-1], norm is not None))
        return gated_launch(*args, norm=norm, **kwargs)

    monkeypatch.setattr(gemv_module, "launch", counted)
    monkeypatch.setattr(gated_module, "launch", counted_gated)
    lm = copy.deepcopy(tiny_model(arch)).to("cuda")

    def logprobs(model, backend):
        engine = make_engine("torch", model, batch_size=1, backend=backend)
        results = engine.run(requests(model.config.vocab_size))
        return engine, np.concatenate([r.logprob for r in results])

    exact = logprobs(lm, "hf")[1]
    half = lm.to(dtype)
    cublas = logprobs(half, "hf")[1]
    assert not members and not gated  # the HF backend multiplies with cuBLAS
    engine, ours = logprobs(half, "auto")
    assert engine.backend.name == "static+compiled"
    assert (3, False, True) in members and not any(m[0] == 2 for m in members)
    assert set(gated) == {("gelu_tanh" if arch == "gemma2" else "silu", True)}
    # Gemma-2 norms the projections' outputs before the residual add: nothing to fold
    assert ((1, True, False) in members) == (arch != "gemma2")
    ours_error, cublas_error = np.abs(ours - exact).max(), np.abs(cublas - exact).max()
    slack = 2 * torch.finfo(dtype).eps * np.abs(exact).max()
    assert ours_error <= 2 * cublas_error + slack, (ours_error, cublas_error, slack)


def test_fusions_off_where_they_change_nothing_are_not_recorded(tiny_model):
    """On CPU the batch-1 fusions never run, so turning them off leaves the settings (and
    with them a checkpoint's key) as they were."""
    lm = tiny_model("llama")
    on = make_engine("torch", lm, batch_size=1, backend="static")
    off = make_engine("torch", lm, batch_size=1, backend="static", batch1_fusions=False)
    assert off.backend.batch1_fusions is False
    assert off.settings() == on.settings() and "batch1_fusions" not in off.settings()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fusions_off_reach_the_view_and_the_settings(tiny_model):
    """A bfloat16 engine built with ``batch1_fusions=False`` has a view without the fused
    modules and says so in its settings (the fusions change numbers); by default the view
    has them and the settings do not name them."""
    lm = copy.deepcopy(tiny_model("llama")).to("cuda", torch.bfloat16)
    engines = {
        fusions: make_engine("torch", lm, batch_size=1, backend="static", batch1_fusions=fusions)
        for fusions in (True, False)
    }
    kinds = {
        fusions: {type(m).__name__ for m in engine.backend.view.modules()}
        for fusions, engine in engines.items()
    }
    assert "GatedMLP" in kinds[True] and "GatedMLP" not in kinds[False]
    assert "batch1_fusions" not in engines[True].settings()
    assert engines[False].settings()["batch1_fusions"] is False


def _process_state() -> tuple:
    """The process-wide settings an engine could change: environment, dynamo, inductor,
    warning filters."""
    return (
        dict(os.environ),
        torch._dynamo.config.get_config_copy(),
        torch._inductor.config.get_config_copy(),
        list(warnings.filters),
    )


def test_an_engine_leaves_the_process_as_it_was(tiny_model, device):
    """Building the torch engine (on CUDA compiled and graph-captured, with the compiled
    scorer), replaying and closing it leaves the environment, dynamo's and inductor's
    configuration and the warning filters as they were, a recompile limit lower than the
    package's too."""
    lm = copy.deepcopy(tiny_model("llama")).to(device)
    with torch._dynamo.config.patch(recompile_limit=8):
        before = _process_state()
        engine, results = run(lm, "auto")
        engine.close()
        assert _process_state() == before
    assert len(results) == len(requests())
