"""vLLM on a CUDA GPU: native trace replay, forcing on Model Runner V2, and the built-in engine.

Run by hand on a GPU machine with vLLM >= 0.29 (``benchmarks/h200_vllm.sh tests``); CI has
no GPU and skips the module. The model is random (a 4-layer Llama of SmolLM2-135M's widths,
weights at init 0.3 so its distributions are far from uniform), token-id prompts, no
tokenizer. Engines run eager (no CUDA graphs): several live in this one process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[gpu]')")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from trace_replay.engines import make_engine  # noqa: E402
from trace_replay.engines.base import ReplayRequest  # noqa: E402
from trace_replay.traces.trace import TraceError  # noqa: E402

EOS = 2
MAX_MODEL_LEN = 512
STEPS = 48


@pytest.fixture(scope="module")
def folder(save_smol_llama):
    return save_smol_llama("random-llama", eos_token_id=EOS)


def _engine(folder, dtype, **options):
    args = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "gpu_memory_utilization": 0.12,
    }
    return make_engine(
        "vllm", folder, dtype=dtype, batch_size=16, top_k=5, engine_args=args, **options
    )


@pytest.fixture(scope="module")
def native(folder):
    engine = _engine(folder, "bfloat16")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def forcing(folder):
    engine = _engine(folder, "bfloat16", native=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (16,), generator=gen).tolist() for _ in range(12)]


@pytest.fixture(scope="module")
def greedy(native, prompts):
    """vLLM's own greedy decoding (same engine instance, same batch): ids, logprobs, top 5."""
    params = SamplingParams(
        temperature=0.0, max_tokens=STEPS, logprobs=5, ignore_eos=True, detokenize=False
    )
    outs = native.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [o.outputs[0] for o in outs]


def _requests(prompts, traces, prefix="t"):
    return [
        ReplayRequest(f"{prefix}{i}", tuple(p), tuple(t))
        for i, (p, t) in enumerate(zip(prompts, traces))
    ]


def _top_ids(entries) -> list[int]:
    return [tid for tid, e in sorted(entries.items(), key=lambda kv: kv[1].rank) if e.rank <= 5]


def test_native_path_is_chosen_on_cuda(native):
    """On CUDA with vLLM's trace replay, the native path runs on Model Runner V2 and says so."""
    settings = native.settings()
    assert settings["engine_path"] == "vllm-native-trace-replay"
    assert settings["model_runner"] == "v2"
    assert "native_unavailable" not in settings


def test_native_equals_vllm_greedy_on_policy(native, prompts, greedy):
    """Replaying vLLM's own greedy output: logprob, rank and top-5 equal greedy's (bf16,
    same engine, same batch: the same arithmetic)."""
    traces = [list(g.token_ids) for g in greedy]
    results = native.run(_requests(prompts, traces))
    for result, g in zip(results, greedy):
        want = np.array([lp[t].logprob for t, lp in zip(g.token_ids, g.logprobs)])
        assert np.abs(result.logprob - want).max() <= 1e-6
        assert result.rank.tolist() == [lp[t].rank for t, lp in zip(g.token_ids, g.logprobs)]
        assert result.top_token_ids.tolist() == [_top_ids(lp) for lp in g.logprobs]


def test_forcing_runs_on_model_runner_v2(forcing, prompts, greedy):
    """native=False works on the default GPU runner (it failed at start before): the
    forcing processor is MRV2's, and on-policy traces give greedy's ranks (all 1) and
    logprobs within bf16 noise of another engine instance."""
    assert forcing.settings()["engine_path"] == "vllm-logits-processor-forcing"
    assert forcing.settings()["model_runner"] == "v2"
    traces = [list(g.token_ids) for g in greedy]
    results = forcing.run(_requests(prompts, traces))
    deltas = np.concatenate(
        [
            r.logprob - [lp[t].logprob for t, lp in zip(g.token_ids, g.logprobs)]
            for r, g in zip(results, greedy)
        ]
    )
    assert np.median(np.abs(deltas)) < 0.05
    assert np.mean(np.concatenate([r.rank for r in results]) == 1) > 0.95


@pytest.mark.parametrize("path", ["native", "forcing"])
def test_off_policy_traces_are_followed_with_their_ranks(path, request, native, prompts, greedy):
    """Every 7th token replaced by a random one: the trace is emitted exactly, and each
    replaced token's rank is the one the native engine gives it."""
    engine = request.getfixturevalue(path)
    gen = torch.Generator().manual_seed(1)
    traces = [list(g.token_ids) for g in greedy]
    for trace in traces:
        for step in range(3, len(trace), 7):
            trace[step] = int(torch.randint(3, 49152, (1,), generator=gen))
    results = engine.run(_requests(prompts, traces, "off"))
    replaced = [r.rank[3::7] for r in results]
    assert all(r.token_ids.tolist() == t for r, t in zip(results, traces))
    assert np.median(np.concatenate(replaced)) > 100
    if path == "forcing":  # same model, another instance: ranks of random tokens agree
        again = native.run(_requests(prompts, traces, "off"))
        agree = np.mean(
            np.concatenate([a.rank[3::7] == b.rank[3::7] for a, b in zip(again, results)])
        )
        assert agree > 0.9


@pytest.mark.parametrize("path", ["native", "forcing"])
def test_eos_inside_a_trace_does_not_stop_it(path, request, prompts):
    """An EOS token in the middle of a trace is replayed and the trace goes on to its end;
    a 300-token trace is not cut by vLLM's default max_tokens (16, bug #56730)."""
    engine = request.getfixturevalue(path)
    trace = [5 + i % 100 for i in range(300)]
    trace[10] = EOS
    (result,) = engine.run(_requests(prompts[:1], [trace], "eos"))
    assert result.token_ids.tolist() == trace


@pytest.mark.parametrize("path", ["native", "forcing"])
def test_a_trace_past_max_model_len_is_refused_naming_it(path, request, prompts):
    """prompt + trace > max_model_len: a clear error naming the trace (upstream would cut a
    native trace silently in _normalize_trace_replay_params)."""
    engine = request.getfixturevalue(path)
    trace = [7] * (MAX_MODEL_LEN - 16 + 1)
    with pytest.raises(TraceError, match="'too-long'.*max_model_len"):
        engine.run([ReplayRequest("too-long", tuple(prompts[0]), tuple(trace))])


def test_native_forcing_and_builtin_agree_bf16(native, forcing, folder, prompts, greedy):
    """bf16: native, forcing and the built-in torch engine give the same ranks almost
    everywhere and logprobs within bf16 noise (median |Δ| < 0.05)."""
    traces = [list(g.token_ids) for g in greedy]
    requests = _requests(prompts, traces)
    torch_engine = make_engine("torch", folder, dtype="bfloat16", device="cuda", batch_size=16)
    try:
        frames = [e.run(requests) for e in (native, forcing, torch_engine)]
    finally:
        torch_engine.close()
    lp = [np.concatenate([r.logprob for r in f]) for f in frames]
    ranks = [np.concatenate([r.rank for r in f]) for f in frames]
    for other in (1, 2):
        assert np.median(np.abs(lp[0] - lp[other])) < 0.05
        assert np.mean(ranks[0] == ranks[other]) > 0.9


def test_float32_agrees_with_the_builtin_engine(folder, prompts):
    """float32 on CUDA starts vLLM on FlexAttention (settings say so), whose products are IEEE
    float32: native = forcing to 1e-4 and both = the built-in engine's IEEE float32 to float32
    rounding. vLLM's default float32 backend, TRITON_ATTN, multiplies in TF32 (Triton's tl.dot
    default): 0.21 max |Δ| against the built-in engine on this model, FlexAttention 1.7e-4 max,
    1e-5 median (2026-12-03, H200). Skipped, with vLLM's reason, where vLLM refuses float32."""
    try:
        native32 = _engine(folder, "float32")
    except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the finding
        pytest.skip(f"vLLM does not run float32 here: {type(exc).__name__}: {exc}")
    try:
        assert native32.settings()["attention_backend"] == "FLEX_ATTENTION"
        gen = native32.generate(prompts, max_tokens=24)
        requests = _requests(prompts, [ids for ids, _ in gen])
        results = [native32.run(requests)]
    finally:
        native32.close()
    forcing32 = _engine(folder, "float32", native=False)
    try:
        results.append(forcing32.run(requests))
    finally:
        forcing32.close()
    torch_engine = make_engine(
        "torch", folder, dtype="float32", device="cuda", batch_size=16, float32_matmul="ieee"
    )
    try:
        results.append(torch_engine.run(requests))
    finally:
        torch_engine.close()
    lp = [np.concatenate([r.logprob for r in f]) for f in results]
    print(
        "float32 max |Δ| native-forcing",
        np.abs(lp[0] - lp[1]).max(),
        "native-builtin",
        np.abs(lp[0] - lp[2]).max(),
        "median",
        np.median(np.abs(lp[0] - lp[2])),
    )
    assert np.abs(lp[0] - lp[1]).max() <= 1e-4
    assert np.median(np.abs(lp[0] - lp[2])) <= 1e-4
    assert np.abs(lp[0] - lp[2]).max() <= 1e-3


def test_deterministic_is_batch_invariant(folder, prompts, greedy):
    """deterministic=True: vLLM's batch-invariant mode on; a batch of 8 replays to the same
    bits as each trace alone."""
    engine = _engine(folder, "bfloat16", deterministic=True)
    try:
        assert engine.settings()["deterministic_active"] is True
        requests = _requests(prompts[:8], [list(g.token_ids) for g in greedy[:8]])
        batched = engine.run(requests)
        alone = [engine.run([r])[0] for r in requests]
    finally:
        engine.close()
    for a, b in zip(batched, alone):
        assert np.array_equal(a.logprob, b.logprob) and np.array_equal(a.rank, b.rank)


def test_fp8_replays_the_trace_and_says_it_is_quantized(folder, native, prompts, greedy):
    """quantization="fp8" (vLLM's dynamic FP8 on the H200): settings say fp8, the bf16
    greedy traces are replayed exactly, with finite logprobs that are not bf16's (the
    quantized arithmetic ran). How far they move depends on the weights (random ones here:
    no bound is asserted; benchmarks/quantized_replay.py measures it on real weights)."""
    engine = make_engine(
        "vllm",
        folder,
        dtype="bfloat16",
        batch_size=16,
        top_k=5,
        engine_args={
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "max_model_len": MAX_MODEL_LEN,
            "gpu_memory_utilization": 0.12,
            "quantization": "fp8",
        },
    )
    try:
        assert engine.settings()["quantization"] == "fp8"
        assert native.settings()["quantization"] == "none"
        traces = [list(g.token_ids) for g in greedy]
        requests = _requests(prompts, traces, "fp8")
        fp8, bf16 = engine.run(requests), native.run(requests)
    finally:
        engine.close()
    assert all(r.token_ids.tolist() == t for r, t in zip(fp8, traces))
    delta = np.abs(np.concatenate([a.logprob - b.logprob for a, b in zip(fp8, bf16)]))
    print("fp8 vs bf16 |Δ logprob| median", np.median(delta), "max", delta.max())
    assert np.isfinite(delta).all() and delta.max() > 0
