"""From a vLLM server's JSON answers to per-step arrays (trace_replay.engines.server.responses),
on answers shaped as vLLM writes them (/v1/completions with token ids, the token endpoint
/inference/v1/generate), including the odd cases a real server produces."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from trace_replay.engines.server.responses import (
    RANK_DEPTH,
    completion_steps,
    emitted_ids,
    generate_steps,
)
from trace_replay.engines.validate import ImpossibleResult

# /v1/completions with return_tokens_as_token_ids: the emitted token's logprob and a map of
# the best alternatives, the emitted one among them (vLLM adds it when it is not in the top)
COMPLETION = json.loads("""{
  "id": "cmpl-1", "object": "text_completion", "model": "m",
  "choices": [{"index": 0, "text": " Paris.", "token_ids": [7042, 30],
    "logprobs": {"text_offset": [0, 6], "tokens": ["token_id:7042", "token_id:30"],
      "token_logprobs": [-0.25, -2.5],
      "top_logprobs": [{"token_id:7042": -0.25, "token_id:11": -1.75, "token_id:13": -3.0},
                       {"token_id:30": -2.5, "token_id:11": -0.5, "token_id:2": -1.0,
                        "token_id:13": -2.5}]}}]}""")

# /inference/v1/generate with output_mode tokens: exact ranks; the sampled token first, then
# the best alternatives in rank order
GENERATE = json.loads("""{
  "request_id": "r", "choices": [{"index": 0, "token_ids": [7042, 30],
    "logprobs": {"content": [
      {"token_id": 7042, "logprob": -0.25, "rank": 1, "top_logprobs": [
        {"token_id": 7042, "logprob": -0.25, "rank": 1},
        {"token_id": 11, "logprob": -1.75, "rank": 2},
        {"token_id": 13, "logprob": -3.0, "rank": 3}]},
      {"token_id": 30, "logprob": -6.5, "rank": 7, "top_logprobs": [
        {"token_id": 30, "logprob": -6.5, "rank": 7},
        {"token_id": 11, "logprob": -0.5, "rank": 1},
        {"token_id": 2, "logprob": -1.0, "rank": 2}]}]}}]}""")


def test_completion_steps_rank_the_emitted_token_among_the_alternatives():
    """Rank is 1 + the alternatives with a strictly higher logprob (a tie shares the rank);
    top-k is the best alternatives, best first; ranks are exact when a listed alternative is
    no more likely than the emitted token (every likelier one is then listed)."""
    logprob, rank, top_ids, top_lps, exact = completion_steps(
        COMPLETION["choices"][0]["logprobs"], top_k=2, token_ids=[7042, 30]
    )
    np.testing.assert_array_equal(logprob, [-0.25, -2.5])
    np.testing.assert_array_equal(rank, [1, 3])  # -0.5 and -1.0 beat -2.5; -2.5 ties
    np.testing.assert_array_equal(top_ids, [[7042, 11], [11, 2]])
    np.testing.assert_array_equal(top_lps, [[-0.25, -1.75], [-0.5, -1.0]])
    assert exact.tolist() == [True, True]


def test_completion_rank_is_a_lower_bound_past_the_depth():
    """When every one of the RANK_DEPTH alternatives beats the emitted token, its rank is
    the lower bound RANK_DEPTH + 1, marked inexact."""
    alternatives = {f"token_id:{100 + i}": -0.1 * (i + 1) for i in range(RANK_DEPTH)}
    logprobs = {"token_logprobs": [-9.0], "top_logprobs": [{**alternatives, "token_id:5": -9.0}]}
    _, rank, top_ids, _, exact = completion_steps(logprobs, top_k=3, token_ids=[5])
    assert rank.tolist() == [RANK_DEPTH + 1] and exact.tolist() == [False]
    assert top_ids.tolist() == [[100, 101, 102]]


def test_a_rank_past_fewer_alternatives_than_asked_is_a_lower_bound():
    """A server answering 5 alternatives where 20 were asked, all likelier than the emitted
    token: the token may lie anywhere past them, so its rank 6 is a lower bound (it was
    recorded as exact), and the top-k leaves the token out (its place in it is unknown)."""
    alternatives = {f"token_id:{100 + i}": -0.5 * (i + 1) for i in range(5)}
    logprobs = {"token_logprobs": [-4.0], "top_logprobs": [{**alternatives, "token_id:7": -4.0}]}
    _, rank, top_ids, _, exact = completion_steps(logprobs, top_k=5, token_ids=[7])
    assert rank.tolist() == [6] and exact.tolist() == [False]
    assert top_ids.tolist() == [[100, 101, 102, 103, 104]]


@pytest.mark.parametrize("listed, top_k", [(3, 5), (0, 0)])
def test_too_few_alternatives_for_the_top_k_are_an_error(listed, top_k):
    """Fewer alternatives than top_k likelier than the emitted token (or none at all), so the
    top-k list cannot be filled, nor the token ranked: an error naming the step and the
    count, where NaN-padded lists went on to a puzzling impossible-score error."""
    alternatives = {f"token_id:{100 + i}": -0.5 * (i + 1) for i in range(listed)}
    logprobs = {
        "token_logprobs": [-0.1, -4.0],
        "top_logprobs": [
            {
                "token_id:7": -0.1,
                "token_id:100": -3.0,
                **{f"token_id:{200 + i}": -5.0 - i for i in range(5)},
            },
            {**alternatives, "token_id:7": -4.0},
        ],
    }
    with pytest.raises(
        ValueError,
        match=rf"step 1: the server listed {listed} alternatives "
        "to the emitted token, too few",
    ):
        completion_steps(logprobs, top_k=top_k, token_ids=[7, 7])


def test_floor_logprobs_are_minus_infinity():
    """vLLM writes -inf as -9999.0 in JSON; both answer kinds read it back as -inf (a token
    at -inf shares the rank of the others there)."""
    logprobs = {
        "token_logprobs": [-9999.0],
        "top_logprobs": [
            {"token_id:1": -0.01, "token_id:2": -5.0, "token_id:3": -9999.0, "token_id:4": -9999.0}
        ],
    }
    logprob, rank, _, top_lps, exact = completion_steps(logprobs, top_k=3, token_ids=[4])
    assert logprob[0] == -math.inf and top_lps[0, 2] == -math.inf and rank[0] == 3
    assert exact.tolist() == [True]
    content = [
        {
            "token_id": 4,
            "logprob": -9999.0,
            "rank": 9,
            "top_logprobs": [{"token_id": 4, "logprob": -9999.0, "rank": 9}],
        }
    ]
    assert generate_steps(content, top_k=1)[0][0] == -math.inf


def test_generate_steps_keep_the_servers_exact_ranks():
    """The token endpoint's ranks are taken as they are (always exact); top-k is ordered by
    rank, so a sampled token outside the top k is left out of it."""
    content = GENERATE["choices"][0]["logprobs"]["content"]
    logprob, rank, top_ids, top_lps, exact = generate_steps(content, top_k=2)
    np.testing.assert_array_equal(logprob, [-0.25, -6.5])
    np.testing.assert_array_equal(rank, [1, 7])
    np.testing.assert_array_equal(top_ids, [[7042, 11], [11, 2]])
    np.testing.assert_array_equal(top_lps, [[-0.25, -1.75], [-0.5, -1.0]])
    assert exact.all()


def test_generate_steps_pad_missing_alternatives():
    """Alternatives without a rank are skipped; top-k slots left empty are id 0, NaN."""
    content = [
        {
            "token_id": 9,
            "logprob": -0.5,
            "rank": 1,
            "top_logprobs": [
                {"token_id": 9, "logprob": -0.5, "rank": 1},
                {"token_id": 3, "logprob": -0.7, "rank": None},
            ],
        }
    ]
    _, _, top_ids, top_lps, _ = generate_steps(content, top_k=3)
    assert top_ids.tolist() == [[9, 0, 0]]
    assert top_lps[0, 0] == -0.5 and np.isnan(top_lps[0, 1:]).all()


@pytest.mark.parametrize(
    "choice, ids",
    [
        (COMPLETION["choices"][0], [7042, 30]),
        ({**COMPLETION["choices"][0], "token_ids": None}, [7042, 30]),  # older servers: none
        (GENERATE["choices"][0], [7042, 30]),
        ({"index": 0, "text": "", "logprobs": None}, []),
    ],
)
def test_emitted_ids_from_token_ids_else_logprob_tokens(choice, ids):
    """The emitted ids are the choice's token_ids, else its ``token_id:N`` logprob tokens,
    else none."""
    assert emitted_ids(choice) == ids


def test_text_tokens_are_refused():
    """A server that ignored return_tokens_as_token_ids (tokens as text) is an error, not a
    misread."""
    choice = {"token_ids": None, "logprobs": {"tokens": [" Paris"]}}
    with pytest.raises(
        ValueError, match="logprobs.tokens holds text .* Paris.*return_tokens_as_token_ids"
    ):
        emitted_ids(choice)


@pytest.mark.parametrize(
    "read, problem",
    [
        (
            lambda: completion_steps(
                COMPLETION["choices"][0]["logprobs"], top_k=2, steps=3, token_ids=[7042, 30]
            ),
            "logprobs.token_logprobs lists 2 steps where 3 were expected",
        ),
        (
            lambda: completion_steps(
                {**COMPLETION["choices"][0]["logprobs"], "top_logprobs": [{"token_id:1": -0.1}]},
                top_k=2,
                token_ids=[7042, 30],
            ),
            "logprobs.top_logprobs lists 1 step where 2 were expected",
        ),
        (
            lambda: generate_steps(GENERATE["choices"][0]["logprobs"]["content"], top_k=2, steps=3),
            "logprobs.content lists 2 steps where 3 were expected",
        ),
        (
            lambda: generate_steps(
                [{**GENERATE["choices"][0]["logprobs"]["content"][0], "rank": float("nan")}],
                top_k=2,
            ),
            "step 0: rank nan is not an integer",
        ),
    ],
)
def test_lists_of_the_wrong_length_say_both_counts(read, problem):
    """A logprob list of another length than the trace, or a rank that is not an integer,
    is an error saying what was expected and what came (the engine adds the trace)."""
    with pytest.raises(ValueError, match=problem):
        read()


def test_a_nan_alternative_is_an_impossible_answer():
    """20 alternatives, the least likely one NaN, the emitted token below the other 19: an
    ImpossibleResult naming the step, the alternative and the rule (it was recorded as rank
    20, exact, as if the NaN were not there)."""
    alternatives = {f"token_id:{100 + i}": -0.1 * (i + 1) for i in range(RANK_DEPTH - 1)}
    logprobs = json.loads(
        json.dumps(
            {
                "token_logprobs": [-0.5, -9.0],
                "top_logprobs": [
                    {"token_id:7": -0.5, "token_id:8": -1.0},
                    {**alternatives, "token_id:199": math.nan, "token_id:5": -9.0},
                ],
            }
        )
    )
    with pytest.raises(
        ImpossibleResult,
        match=r"^step 1: the server answered alternative "
        r"'token_id:199' logprob = nan, which is "
        r"impossible: a logprob is a number <= 0$",
    ) as error:
        completion_steps(logprobs, top_k=1, token_ids=[7, 5])
    assert (error.value.step, error.value.field) == (1, "top_logprobs")


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.5])
def test_an_impossible_logprob_anywhere_in_a_generate_answer(value):
    """A NaN, +inf or positive logprob of the token or of any alternative listed by the
    generate endpoint is an ImpossibleResult naming the step (a NaN alternative past the
    top-k kept was accepted); -inf (probability 0) is possible."""
    for where in ("token", "alternative"):
        content = json.loads(json.dumps(GENERATE["choices"][0]["logprobs"]["content"]))
        if where == "token":
            content[1]["logprob"] = value
        else:
            content[1]["top_logprobs"][2]["logprob"] = value
        with pytest.raises(ImpossibleResult, match=r"^step 1: the server answered") as error:
            generate_steps(content, top_k=1)
        assert error.value.field == ("logprob" if where == "token" else "top_logprobs")
    content = json.loads(json.dumps(GENERATE["choices"][0]["logprobs"]["content"]))
    content[1]["top_logprobs"][2]["logprob"] = -math.inf
    assert generate_steps(content, top_k=1)[3][1].tolist() == [-0.5]
