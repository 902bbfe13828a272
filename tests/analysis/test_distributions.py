"""trace_replay.analysis.distributions: a paired replay reduces two engines' full
distributions step by step, and its numbers are those of a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trace_replay as tr
from trace_replay.analysis.distribution_bounds import distribution_bounds
from trace_replay.analysis.distributions import METRICS, replay_pair, step_divergences
from trace_replay.engines.distributions import StepLogits


def reference(la: np.ndarray, lb: np.ndarray) -> dict[str, np.ndarray]:
    """KL both ways, TV, JS and max |Δ logprob| of float64 logits rows, in numpy."""
    la = la - np.logaddexp.reduce(la, axis=1, keepdims=True)
    lb = lb - np.logaddexp.reduce(lb, axis=1, keepdims=True)
    pa, pb = np.exp(la), np.exp(lb)
    lm = np.logaddexp(la, lb) - np.log(2)
    return {
        "kl_ab": (pa * (la - lb)).sum(1),
        "kl_ba": (pb * (lb - la)).sum(1),
        "tv": 0.5 * np.abs(pa - pb).sum(1),
        "js": 0.5 * ((pa * (la - lm)).sum(1) + (pb * (lb - lm)).sum(1)),
        "max_abs_dlogprob": np.abs(la - lb).max(1),
    }


def test_step_divergences_match_numpy_float64():
    """On random logits, each metric equals numpy's float64 value within 1e-9 relative, and
    top-k overlap counts shared top tokens."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 300, generator=g) * 4
    b = a + 0.05 * torch.randn(16, 300, generator=g)
    got = step_divergences(a, b, torch.arange(16), 5).numpy()
    want = reference(a.double().numpy(), b.double().numpy())
    for j, name in enumerate(METRICS):
        np.testing.assert_allclose(got[:, 2 + j], want[name], rtol=1e-9, err_msg=name)
    top_a, top_b = a.topk(5).indices, b.topk(5).indices
    shared = [len(set(x.tolist()) & set(y.tolist())) / 5 for x, y in zip(top_a, top_b)]
    np.testing.assert_array_equal(got[:, -1], shared)


def test_a_token_of_probability_zero_on_one_side_gives_infinite_kl():
    """A logit of -inf on side b only makes KL(a||b) and max |Δ logprob| infinite and leaves
    KL(b||a), TV and JS finite; on both sides it adds nothing."""
    a = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, -torch.inf]])
    b = torch.tensor([[0.0, -torch.inf, 2.0], [0.0, 1.0, -torch.inf]])
    got = step_divergences(a, b, torch.tensor([1, 0]), 2).numpy()
    assert np.isinf(got[0, 2]) and np.isinf(got[0, 6]) and np.isfinite(got[0, 3:6]).all()
    assert got[0, 1] == -np.inf
    np.testing.assert_allclose(got[1, 2:7], 0.0, atol=1e-12)


@pytest.fixture(scope="module")
def engines():
    """The built-in decode engine and the prefill engine, each in float32 and bfloat16."""
    made = [
        tr.make_engine("torch", dtype="float32", batch_size=4),
        tr.make_engine("torch", dtype="bfloat16", batch_size=4),
        tr.make_engine("prefill", dtype="float32", batch_size=8),
        tr.make_engine("prefill", dtype="bfloat16", batch_size=8),
    ]
    yield made
    for engine in made:
        engine.close()


TRACES = [
    {
        "id": "capital",
        "prompt": "The capital of France is",
        "completion": " Paris. It is also the largest city",
    },
    {"id": "count", "prompt": "One, two, three,", "completion": " four"},
]


@pytest.mark.slow
def test_paired_replay_equals_a_float64_reference(engines):
    """Exact KL/TV/JS of a paired replay (float32 vs bfloat16 decode) equal a float64
    reference computed from each engine's full logits within 1e-6 relative; its token
    logprobs are those the engines' own replays give."""
    fp32, bf16, _, _ = engines
    assert isinstance(fp32, StepLogits) and isinstance(bf16, StepLogits)
    df = replay_pair(TRACES, fp32, bf16)
    assert df.attrs["distribution_form"] == "exact" and set(df["form"]) == {"exact"}
    from trace_replay.runs.replay import prepare_run
    from trace_replay.traces.sets import load_traces

    _, requests, _ = prepare_run(
        load_traces(TRACES),
        tokenizer=fp32.tokenizer,
        vocab_size=fp32.vocab_size,
        max_model_len=None,
        top_k=5,
        truncate=False,
    )
    full = [
        torch.cat([x.double().clone() for x in engine.step_logits(requests)])
        for engine in (fp32, bf16)
    ]  # step-major rows
    want = reference(full[0].numpy(), full[1].numpy())
    lengths = np.array([r.trace_len for r in requests])
    order = np.lexsort(
        (
            np.concatenate([np.full((lengths > s).sum(), s) for s in range(lengths.max())]),
            np.concatenate([np.flatnonzero(lengths > s) for s in range(lengths.max())]),
        )
    )
    for name in ("kl_ab", "kl_ba", "tv", "js", "max_abs_dlogprob"):
        np.testing.assert_allclose(df[name], want[name][order], rtol=1e-6, err_msg=name)
    assert (df["kl_ab"] > 0).all()  # bfloat16 moves every distribution a little
    own = tr.replay(TRACES, engine=fp32, progress=False)
    np.testing.assert_allclose(df["logprob_a"], own["logprob"], atol=1e-4)


@pytest.mark.slow
def test_bounds_contain_the_exact_values_on_bundled_tokens(engines):
    """On every token of the first trace of each bundled file (both datasets, both sources),
    the bounds from two result frames (the teacher-forced prefill in float32 and in
    bfloat16) contain the exact values a paired replay of the same engines gives. Not every
    bundled trace: bfloat16 matmuls on a CPU without native bfloat16 take ~80 ms a token
    here (measured 2026-12-07), so the whole bundle would take ~20 minutes."""
    _, _, fp32, bf16 = engines
    traces = tr.datasets.load(limit=1)
    exact = replay_pair(traces, fp32, bf16)
    bounds = distribution_bounds(
        tr.replay(traces, engine=fp32, progress=False),
        tr.replay(traces, engine=bf16, progress=False),
    )
    both = exact.merge(bounds, on=["trace_id", "step"], validate="one_to_one")
    assert len(both) == len(exact) == len(bounds) > 200
    for name in METRICS:
        inside = (both[f"{name}_lower"] <= both[name]) & (both[name] <= both[f"{name}_upper"])
        assert inside.all(), (name, both.loc[~inside, [name, f"{name}_lower"]].head())


@pytest.mark.slow
def test_an_engine_without_step_logits_gets_the_bounded_form(engines):
    """A pair with an engine lacking full logits (here: the run method alone) is replayed
    the usual way and bounded; attrs say which engine and why."""
    fp32, _, prefill, _ = engines

    class RunOnly:  # the Engine protocol's members, by delegation, without step_logits
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name == "step_logits":
                raise AttributeError(name)
            return getattr(self._inner, name)

    df = replay_pair(TRACES, RunOnly(prefill), fp32)
    assert df.attrs["distribution_form"] == "bounded" and set(df["form"]) == {"bounded"}
    assert "no step_logits" in df.attrs["distribution_reason"]
    assert (df["kl_ab_lower"] <= df["kl_ab_upper"]).all()
