"""Full-distribution divergence from result files alone: bounds that contain the exact value.

Two replays made on two machines keep, per token, their top-k logprobs, the trace token's
logprob and ``tail_logmass`` (the mass outside the top-k). :func:`distribution_bounds`
turns those into a lower and an upper bound of each divergence of
:mod:`~trace_replay.analysis.distributions`.

Why the bounds hold. Per token write P, Q for the two distributions over the vocabulary V.
P is known exactly on ``A_P`` (its top-k and the trace token); outside it P has mass
``r_P = tail_P - p_token`` (the token counted in the tail when ranked past the top-k), and
every unknown ``p_v`` is at most ``m_P``, the smallest listed top-k probability (else that
token would be listed). Likewise Q. Let ``C = A_P ∩ A_Q`` (both known), ``D_P = A_P \\ A_Q``
(p known, q not), ``D_Q = A_Q \\ A_P``, and ``G = V \\ C`` with masses
``P(G) = sum_{D_P} p + r_P`` and ``Q(G) = sum_{D_Q} q + r_Q``.

Every metric but ``max_abs_dlogprob`` is an f-divergence ``sum_v F(p_v, q_v)`` with F
jointly convex and 1-homogeneous (KL: ``p log(p/q)``; TV: ``|p - q| / 2``; JS:
``(p log(2p/(p+q)) + q log(2q/(p+q))) / 2``), so it can only shrink when tokens are merged
into groups (the data-processing inequality: ``F(p1 + p2, q1 + q2) <= F(p1, q1) + F(p2,
q2)``, which is convexity plus homogeneity).

* Lower. Merge ``G`` into the two groups ``D_P`` and ``V \\ A_P``: P's masses there are known
  (``a_P = sum_{D_P} p`` and ``r_P``); Q's are ``x`` and ``Q(G) - x`` for the unknown
  ``x = Q(D_P)``, which lies in ``[0, min(|D_P| m_Q, r_Q, Q(G))]`` (each q there is an
  unknown entry of Q). So ``sum_C F + min_x [F(a_P, x) + F(r_P, Q(G) - x)]`` is below the
  exact value. The bracket is convex in x with its unconstrained minimum at the
  proportional split ``x* = Q(G) a_P / (a_P + r_P)`` (there it equals ``F(P(G), Q(G))``,
  the merged value, which the inequality says is the least), so the constrained minimum
  is at ``x*`` clipped to the interval. The same with the roles of P and Q swapped is a
  second lower bound; the larger of the two is taken.
* Upper. ``F(p, q) <= F(p, 0) + F(0, q)`` (convexity again), so
  ``sum_C F + sum_G [F(p, 0) + F(0, q)]``: TV ``<= sum_C + (P(G) + Q(G)) / 2``, JS ``<=
  sum_C + (P(G) + Q(G)) log(2) / 2``; KL(P||Q) is unbounded once ``P(G) > 0`` (an
  unknown q may be as small as it likes), so its upper bound is ``inf``. TV and JS are also
  at most 1 and log 2.
* ``max_abs_dlogprob``. Lower: the largest ``|log p - log q|`` over ``C``; for v in ``D_P``,
  ``log p_v - log min(m_Q, r_Q)`` (q_v is at most that); the same for ``D_Q``; and ``|log
  P(G) - log Q(G)|`` (were every ratio in G within ``e^c``, so would the ratio of the sums
  be). Upper: ``inf`` unless ``P(G) = Q(G) = 0``.
* ``topk_overlap`` is the share of a's listed top-k in b's: exact from the lists.

Rounding: listed logprobs are float32 (off by a few 1e-6 where logits are ~20), and a tail
from top-k logprobs alone (vLLM, a server) loses masses below ~1e-7. So the lower bounds are
lowered and the upper bounds raised by :data:`SLACK`, relative and absolute; ``m`` is
raised by it, and the unknown masses ``r`` that cap an entry are taken at least
:data:`FLOOR`: a bound never excludes the exact value by a rounding.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trace_replay.runs.frame import check_frame

__all__ = ["FLOOR", "SLACK", "bound_arrays", "distribution_bounds", "value_or_bound"]

SLACK = 1e-5
FLOOR = 1e-6
_METRICS = ("kl_ab", "kl_ba", "tv", "js", "max_abs_dlogprob")
_KEY = ["trace_id", "step"]


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = p * (np.log(p) - np.log(q))
    return np.where(p > 0, np.where(q > 0, out, np.inf), 0.0)


def _tv(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return 0.5 * np.abs(p - q)


def _js(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    m = 0.5 * (p + q)
    return 0.5 * (_kl(p, m) + _kl(q, m))


_TERMS = {"kl_ab": _kl, "kl_ba": lambda p, q: _kl(q, p), "tv": _tv, "js": _js}


def distribution_bounds(
    a: pd.DataFrame, b: pd.DataFrame, *, labels: tuple[str, str] | None = None
) -> pd.DataFrame:
    """Lower and upper bounds of each per-token divergence of two replay frames.

    Parameters
    ----------
    a, b
        Replay frames of the same traces (a: rollout, b: trainer) with ``top_token_ids``,
        ``top_logprobs`` and ``tail_logmass`` (frames written before the tail was recorded
        have none: refused, naming the frame).
    labels
        Names of the two sides (default: from the frames' attrs).

    Returns
    -------
    DataFrame
        One row per (trace_id, step): ``token_id``, ``logprob_a``, ``logprob_b``, for each
        of ``kl_ab, kl_ba, tv, js, max_abs_dlogprob`` a ``<name>_lower`` and
        ``<name>_upper`` (the exact value lies between; see the module docstring),
        ``topk_overlap`` (exact, from the lists) and ``form`` (``"bounded"``);
        ``attrs["distribution_form"]`` is ``"bounded"``, with ``labels``, ``attrs_a``,
        ``attrs_b``.

    Raises
    ------
    ValueError
        When a frame lacks the columns, the traces or tokens differ, or a tail is NaN.
    """
    from trace_replay.analysis.metrics import compare

    for frame, name in ((a, "a"), (b, "b")):
        check_frame(frame, name)
        missing = [
            c for c in ("top_token_ids", "top_logprobs", "tail_logmass") if c not in frame.columns
        ]
        if missing:
            raise ValueError(
                f"{name} lacks {missing}: bounds need each step's top-k and the "
                "tail mass outside it (replay it again with this version)"
            )
    cmp = compare(a, b, labels=labels)
    tails = [_side(frame, cmp) for frame in (a, b)]
    for tail, name in zip(tails, ("a", "b")):
        if np.isnan(tail).any():
            row = cmp.iloc[int(np.argmax(np.isnan(tail)))]
            raise ValueError(
                f"{name}: trace {row.trace_id!r} step {row.step} has no tail mass "
                "(its engine records none): no bounds"
            )
    ids_a, lp_a = _known(cmp, "a")
    ids_b, lp_b = _known(cmp, "b")
    top_a = np.stack(cmp["top_token_ids_a"].map(np.asarray).to_numpy()).reshape(len(cmp), -1)
    top_b = np.stack(cmp["top_token_ids_b"].map(np.asarray).to_numpy()).reshape(len(cmp), -1)
    bounds = bound_arrays(ids_a, lp_a, tails[0], ids_b, lp_b, tails[1])
    out = cmp[[*_KEY, "token_id", "logprob_a", "logprob_b"]].copy()
    for name in _METRICS:
        out[f"{name}_lower"], out[f"{name}_upper"] = bounds[name]
    k = top_a.shape[1]
    out["topk_overlap"] = (
        (top_a[:, :, None] == top_b[:, None, :]).any(axis=2).sum(axis=1) / k if k else np.nan
    )
    out["form"] = "bounded"
    out.attrs = {
        "distribution_form": "bounded",
        "labels": cmp.attrs["labels"],
        "attrs_a": dict(a.attrs),
        "attrs_b": dict(b.attrs),
        "metrics": "each metric's _lower <= exact <= _upper, from stored top-k, "
        "token logprob and tail mass; kl upper bounds are inf",
    }
    return out


def value_or_bound(df: pd.DataFrame, metric: str) -> pd.Series:
    """``df[metric]`` of an exact frame, else its ``<metric>_lower`` (a bounded frame's
    guaranteed part), for plots and summaries that take either form."""
    return df[metric] if metric in df.columns else df[f"{metric}_lower"]


def _side(frame: pd.DataFrame, cmp: pd.DataFrame) -> np.ndarray:
    """``frame``'s tail masses in ``cmp``'s row order."""
    keyed = frame.set_index(_KEY)["tail_logmass"]
    return keyed.reindex(pd.MultiIndex.from_frame(cmp[_KEY])).to_numpy(dtype=np.float64)


def _known(cmp: pd.DataFrame, side: str) -> tuple[np.ndarray, np.ndarray]:
    """``[N, k + 1]`` ids and logprobs a side knows: its top-k, then the token (id -1 where
    the token is listed already, so that no id counts twice); last column is the token."""
    ids = np.stack(cmp[f"top_token_ids_{side}"].map(np.asarray).to_numpy()).reshape(len(cmp), -1)
    lps = np.stack(cmp[f"top_logprobs_{side}"].map(np.asarray).to_numpy()).reshape(len(cmp), -1)
    token = cmp["token_id"].to_numpy(np.int64)
    listed = (ids == token[:, None]).any(axis=1)
    return (
        np.column_stack([ids.astype(np.int64), np.where(listed, -1, token)]),
        np.column_stack([lps.astype(np.float64), cmp[f"logprob_{side}"].to_numpy(np.float64)]),
    )


def bound_arrays(
    ids_p: np.ndarray,
    lp_p: np.ndarray,
    tail_p: np.ndarray,
    ids_q: np.ndarray,
    lp_q: np.ndarray,
    tail_q: np.ndarray,
) -> dict[str, tuple[np.ndarray, ...]]:
    """``{metric: (lower, upper)}`` from what two runs know (see the module docstring).

    ``ids_*`` ``[N, k + 1]``: the top-k ids then the token's (-1: listed already);
    ``lp_*`` their logprobs; ``tail_*`` ``[N]`` the log mass outside the top-k.
    """
    p, q = np.exp(lp_p), np.exp(lp_q)
    valid_p, valid_q = ids_p >= 0, ids_q >= 0
    p, q = np.where(valid_p, p, 0.0), np.where(valid_q, q, 0.0)
    same = (ids_p[:, :, None] == ids_q[:, None, :]) & valid_p[:, :, None] & valid_q[:, None, :]
    in_c_p, in_c_q = same.any(axis=2), same.any(axis=1)
    q_at_p = (same * q[:, None, :]).sum(axis=2)  # q of P's known entries that are in C
    k = ids_p.shape[1] - 1
    # mass outside what each side knows: the tail less the token when it is in the tail
    r_p = np.clip(np.exp(tail_p) - np.where(valid_p[:, -1], p[:, -1], 0.0), 0.0, 1.0)
    r_q = np.clip(np.exp(tail_q) - np.where(valid_q[:, -1], q[:, -1], 0.0), 0.0, 1.0)
    m_p = (np.exp(lp_p[:, :k].min(axis=1)) if k else np.ones(len(p))) * (1 + SLACK)
    m_q = (np.exp(lp_q[:, :k].min(axis=1)) if k else np.ones(len(q))) * (1 + SLACK)
    d_p, d_q = valid_p & ~in_c_p, valid_q & ~in_c_q
    a_p, a_q = (p * d_p).sum(axis=1), (q * d_q).sum(axis=1)
    g_p, g_q = a_p + r_p, a_q + r_q
    # what an unknown mass may be at most, rounding allowed for
    cap_r_p, cap_r_q = r_p * (1 + SLACK) + FLOOR, r_q * (1 + SLACK) + FLOOR
    x_max = np.minimum(np.minimum(d_p.sum(axis=1) * m_q, cap_r_q), g_q)  # Q(D_P) at most
    y_max = np.minimum(np.minimum(d_q.sum(axis=1) * m_p, cap_r_p), g_p)  # P(D_Q) at most
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.clip(np.nan_to_num(g_q * a_p / g_p), 0.0, x_max)
        y = np.clip(np.nan_to_num(g_p * a_q / g_q), 0.0, y_max)
    out = {}
    for name, term in _TERMS.items():
        shared = np.where(in_c_p, term(p, q_at_p), 0.0).sum(axis=1)
        by_p = term(a_p, x) + term(r_p, g_q - x)  # P's groups D_P and V \ A_P
        by_q = term(y, a_q) + term(g_p - y, r_q)  # Q's groups D_Q and V \ A_Q
        lower = shared + np.maximum(by_p, by_q)
        upper = shared + term(g_p, 0.0 * g_p) + term(0.0 * g_q, g_q)
        if name == "tv":
            upper = np.minimum(upper, 1.0)
        if name == "js":
            upper = np.minimum(upper, np.log(2.0))
        out[name] = (np.maximum(lower * (1 - SLACK) - SLACK, 0.0), upper * (1 + SLACK) + SLACK)
    out["max_abs_dlogprob"] = _max_dlogprob(
        lp_p, lp_q, in_c_p, same, d_p, d_q, m_p, m_q, cap_r_p, cap_r_q, g_p, g_q
    )
    return out


def _max_dlogprob(lp_p, lp_q, in_c_p, same, d_p, d_q, m_p, m_q, r_p, r_q, g_p, g_q):
    """Bounds of ``max_v |log p_v - log q_v|`` (module docstring)."""
    lq_at_p = np.where(same, lp_q[:, None, :], -np.inf).max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        shared = np.where(in_c_p, np.abs(lp_p - lq_at_p), -np.inf).max(axis=1)
        cap_q, cap_p = np.log(np.minimum(m_q, r_q)), np.log(np.minimum(m_p, r_p))
        past_q = np.where(d_p, lp_p - cap_q[:, None], -np.inf).max(axis=1)
        past_p = np.where(d_q, lp_q - cap_p[:, None], -np.inf).max(axis=1)
        merged = np.where((g_p > 0) & (g_q > 0), np.abs(np.log(g_p) - np.log(g_q)), -np.inf)
    lower = np.nan_to_num(
        np.maximum.reduce([shared, past_q, past_p, merged, np.zeros(len(g_p))]), nan=0.0
    )
    upper = np.where((g_p > 0) | (g_q > 0), np.inf, shared)
    return (np.maximum(lower * (1 - SLACK) - SLACK, 0.0), upper * (1 + SLACK) + SLACK)
