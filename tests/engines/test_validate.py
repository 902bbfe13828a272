"""trace_replay.engines.validate: the one definition of an impossible score, and replay()
refusing an engine's impossible output whatever the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest, TraceResult
from trace_replay.engines.validate import ROUNDING, ImpossibleResult, check_results, impossible
from trace_replay.runs.replay import replay

REQUEST = ReplayRequest("t", (1, 2), (7, 8, 9))


def result(**change) -> TraceResult:
    """A possible 3-step result of REQUEST (top_k=2), with ``change`` applied to step 1."""
    fields = {
        "logprob": np.array([-0.5, -1.0, -math.inf]),
        "rank": np.array([1, 2, 40]),
        "top_logprobs": np.array([[-0.5, -1.5], [-0.5, -1.0], [-0.1, -3.0]]),
        "top_token_ids": np.array([[7, 100], [100, 8], [100, 101]]),
        "entropy": np.array([1.0, 0.5, np.nan]),
    }
    for name, value in change.items():
        fields[name] = fields[name].astype(np.asarray(value).dtype, copy=True)
        fields[name][1] = value
    return TraceResult(trace_id="t", prompt_len=2, token_ids=np.array([7, 8, 9]), **fields)


def with_tail(step1_tail: float) -> TraceResult:
    """``result()`` with its tail masses recorded (1 - sum of its top-k), step 1's replaced."""
    base = result()
    tail = np.log1p(-np.exp(base.top_logprobs).sum(axis=1))
    tail[1] = step1_tail
    base.tail_logmass = tail
    return base


def test_a_consistent_tail_passes():
    """A tail mass that makes the top-k sum to 1 passes, and NaN (not recorded) passes."""
    good = with_tail(np.log1p(-np.exp([-0.5, -1.0]).sum()))
    check_results([REQUEST], [good], top_k=2, vocab_size=49152)
    check_results([REQUEST], [with_tail(np.nan)], top_k=2, vocab_size=49152)


@pytest.mark.parametrize("tail", [0.01, np.log(0.5)])  # > 0; 0.97 + 0.5 != 1
def test_an_impossible_tail_is_named(tail):
    """A tail above probability 1, or one whose mass and the top-k's do not sum to 1, is an
    ImpossibleResult naming the step and the field tail_logmass."""
    with pytest.raises(ImpossibleResult, match=r"trace 't', step 1: .*tail_logmass") as error:
        check_results([REQUEST], [with_tail(tail)], top_k=2, vocab_size=49152)
    assert (error.value.step, error.value.field) == (1, "tail_logmass")


def test_possible_scores_pass():
    """Possible scores pass: -inf logprob (probability 0) with a rank past the top-k, NaN
    entropy (not computed), a rank shared by a tie, and rounding within ROUNDING."""
    check_results([REQUEST], [result()], top_k=2, vocab_size=49152)
    check_results([REQUEST], [result(top_logprobs=[-1.0, -1.0])], top_k=2)  # tie: rank 2
    check_results(
        [REQUEST],
        [
            result(
                logprob=ROUNDING / 2,
                rank=1,
                top_token_ids=[8, 100],
                top_logprobs=[ROUNDING / 2, -20.0],
            )
        ],
        top_k=2,
    )


@pytest.mark.parametrize(
    "change, field",
    [
        ({"logprob": 1e-3}, "logprob"),
        ({"logprob": np.nan}, "logprob"),
        ({"rank": 0}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"rank": 49153}, "rank"),  # beyond the vocabulary
        ({"rank": 1}, "rank"),  # -0.5 is listed above the token's -1.0
        ({"logprob": -0.1, "rank": 3}, "rank"),  # ranked past the top 2, yet above both
        ({"top_logprobs": [-1.0, -0.5]}, "top_logprobs"),  # not best first
        ({"top_logprobs": [np.nan, -1.0]}, "top_logprobs"),
        ({"top_logprobs": [0.5, -1.0]}, "top_logprobs"),
        ({"entropy": -0.1}, "entropy"),
        ({"entropy": 10.9}, "entropy"),  # above log(49152) = 10.80, the uniform distribution's
        ({"entropy": np.inf}, "entropy"),
        (
            {"logprob": -0.1, "rank": 1, "top_token_ids": [8, 100], "top_logprobs": [-0.1, -0.1]},
            "top_logprobs",
        ),  # 0.90 + 0.90 > 1
        (
            {
                "logprob": -1.2,
                "rank": 3,
                "top_token_ids": [100, 101],
                "top_logprobs": [-0.05, -0.1],
            },
            "top_logprobs",
        ),  # the token ranked past two listed ones: 0.95 + 0.90 + 0.30 > 1
        (
            {"top_token_ids": [8, 100], "top_logprobs": [-0.5, -1.0]},
            "top_logprobs",
        ),  # token 8 listed first at -0.5, its own logprob -1.0
        ({"top_token_ids": [100, 100]}, "top_token_ids"),  # a token listed twice
        ({"top_token_ids": [-5, 8]}, "top_token_ids"),
        ({"top_token_ids": [49152, 8]}, "top_token_ids"),  # beyond the vocabulary
        ({"top_token_ids": [np.nan, 8]}, "top_token_ids"),  # no id
        ({"top_token_ids": [100.5, 8]}, "top_token_ids"),
    ],
)
def test_impossible_scores_are_named(change, field):
    """Each impossible value is an ImpossibleResult naming the trace, the step, the field and
    the value."""
    with pytest.raises(
        ImpossibleResult, match=r"^trace 't', step 1: the engine returned "
    ) as error:
        check_results([REQUEST], [result(**change)], top_k=2, vocab_size=49152)
    assert (error.value.trace_id, error.value.step, error.value.field) == ("t", 1, field)
    assert f"{field} = {np.asarray(change[field]).tolist()!r}" in str(error.value)


@pytest.mark.parametrize(
    "change, vocab_size",
    [
        (
            {
                "logprob": -20.0,
                "rank": 1,
                "top_token_ids": [8, 100],
                "top_logprobs": [-20.0, -21.0],
            },
            49152,
        ),  # a server's rank-1 logprob below -log(49152) = -10.80
        (
            {
                "logprob": -math.inf,
                "rank": 1,
                "top_token_ids": [8, 100],
                "top_logprobs": [-math.inf, -math.inf],
            },
            None,
        ),  # -9999 from a server: any vocabulary
        # past the top-k list, where the other rules see nothing wrong (the top 2 and the
        # token sum to 0.97 and 0.96): 5 tokens of p >= 0.27, 10 of p >= 0.135
        (
            {"logprob": -1.3, "rank": 5, "top_token_ids": [100, 101], "top_logprobs": [-1.0, -1.1]},
            None,
        ),
        (
            {
                "logprob": -2.0,
                "rank": 10,
                "top_token_ids": [100, 101],
                "top_logprobs": [-0.5, -1.5],
            },
            None,
        ),
    ],
)
def test_a_rank_bounds_its_logprob(change, vocab_size):
    """r tokens are at least as likely as a token at rank r, so its logprob is at most
    -log(r); the most likely of V tokens has probability at least 1/V, so rank 1 has a logprob
    of at least -log(V) and never -inf. A logprob beyond either bound is an error naming the
    trace, the step, the rank and the logprob."""
    with pytest.raises(
        ImpossibleResult,
        match=r"^trace 't', step 1: the engine returned "
        rf"rank = {change['rank']} with logprob {change['logprob']}, which is "
        "impossible: .*rank",
    ) as error:
        check_results([REQUEST], [result(**change)], top_k=2, vocab_size=vocab_size)
    assert (error.value.trace_id, error.value.step, error.value.field) == ("t", 1, "rank")


def test_the_first_top_k_logprob_is_at_least_minus_log_v():
    """The first top-k logprob is the most likely token's: below -log(V), or -inf, it is
    impossible even when the scored token ranks past the list."""
    for top, vocab_size in (([-11.0, -12.0], 49152), ([-math.inf, -math.inf], None)):
        change = {
            "logprob": -math.inf,
            "rank": 40,
            "top_token_ids": [100, 101],
            "top_logprobs": top,
        }
        with pytest.raises(
            ImpossibleResult,
            match=r"step 1: .*top_logprobs = .*the most "
            "likely token's",
        ) as error:
            check_results([REQUEST], [result(**change)], top_k=2, vocab_size=vocab_size)
        assert error.value.field == "top_logprobs"


def test_a_uniform_distribution_is_possible():
    """The bounds are tight, not off by one: a uniform distribution over V tokens gives rank
    1 the logprob -log(V) exactly (rounded in float32), and r tokens tied at 1/r give rank r
    the logprob -log(r)."""
    uniform = float(np.float32(-np.log(np.float32(49152))))
    check_results(
        [REQUEST],
        [result(logprob=uniform, rank=1, top_token_ids=[8, 100], top_logprobs=[uniform, uniform])],
        top_k=2,
        vocab_size=49152,
    )
    half = float(np.float32(-np.log(2)))
    check_results([REQUEST], [result(logprob=half, rank=2, top_logprobs=[half, half])], top_k=2)


@pytest.mark.parametrize(
    "broken, problem",
    [
        (lambda r: [], "returned 0 results for 1 traces"),
        (
            lambda r: [TraceResult(**{**vars(r), "prompt_len": 3})],
            "trace 't': the engine returned prompt_len 3 for a prompt of 2 tokens",
        ),
        (
            lambda r: [TraceResult(**{**vars(r), "logprob": r.logprob[:2]})],
            "trace 't': the engine returned 2 logprob for a trace of 3 tokens",
        ),
        (
            lambda r: [TraceResult(**{**vars(r), "token_ids": np.array([7, 5, 9])})],
            "trace 't', step 1: the engine scored token 5 where the trace has 8",
        ),
        (
            lambda r: [TraceResult(**{**vars(r), "top_logprobs": r.top_logprobs[:, :1]})],
            r"top_logprobs of shape \(3, 1\) for top_k 2",
        ),
    ],
)
def test_results_that_do_not_fit_the_requests_are_named(broken, problem):
    """One result per request, its prompt length, a step per trace token, the trace's own
    tokens, top_k wide."""
    with pytest.raises(ImpossibleResult, match=problem):
        check_results([REQUEST], broken(result()), top_k=2)


def test_a_batch_names_its_first_impossible_trace_and_step():
    """Many results checked together (all steps at once) name the same first impossible
    trace, step and field as checking them one by one; possible ones pass."""
    from dataclasses import replace

    requests = [replace(REQUEST, trace_id=t) for t in ("a", "b", "c")]
    good = [replace(result(), trace_id=t) for t in ("a", "b", "c")]
    check_results(requests, good, top_k=2, vocab_size=49152)
    bad = [
        good[0],
        replace(result(rank=0), trace_id="b"),
        replace(result(logprob=np.nan), trace_id="c"),
    ]
    with pytest.raises(ImpossibleResult, match="trace 'b', step 1") as caught:
        check_results(requests, bad, top_k=2, vocab_size=49152)
    assert (caught.value.trace_id, caught.value.step, caught.value.field) == ("b", 1, "rank")
    ragged = [
        good[0],
        replace(
            good[1],
            top_logprobs=good[1].top_logprobs[:, :1],
            top_token_ids=good[1].top_token_ids[:, :1],
        ),
    ]
    check_results(requests[:2], ragged)  # widths differ, top_k unchecked: one by one


def test_an_infinite_logprob_excuses_nothing_else():
    """A -inf logprob (probability 0) is possible, but its slack is that of 0: a positive
    top-k logprob beside it is still impossible."""
    rules = impossible(
        np.array([-math.inf]), np.array([40]), np.array([[0.5, -1.0]]), np.array([1.0])
    )
    assert {(field, tuple(rows)) for field, _, rows in rules if rows.any()} == {
        ("top_logprobs", (True,))
    }


def test_rules_are_masks_over_rows():
    """impossible() gives each rule's rows, so a frame of many traces is checked at once
    (checkpoint parts are read back with it)."""
    rules = impossible(
        np.array([-1.0, 0.5]), np.array([1, 1]), np.array([[-1.0], [0.5]]), np.array([0.0, 0.0])
    )
    broken = {(field, tuple(rows)) for field, _, rows in rules if rows.any()}
    assert broken == {("logprob", (False, True)), ("top_logprobs", (False, True))}


def test_a_model_giving_nan_is_an_error_not_rank_1(make_tiny_lm, tokenizer):
    """A model whose logits are NaN (one NaN weight) makes replay raise naming the trace and
    the NaN logprob, instead of returning NaN with rank 1."""
    lm = make_tiny_lm()
    with torch.no_grad():
        lm.model.norm.weight[0] = float("nan")
    engine = make_engine("torch", lm, top_k=2, device="cpu")
    engine.tokenizer = tokenizer
    traces = [{"id": "nan-model", "prompt_token_ids": [5, 6], "trace_token_ids": [7, 8]}]
    with pytest.raises(ImpossibleResult, match=r"trace 'nan-model', step 0: .*logprob = nan"):
        replay(traces, engine=engine, progress=False)
