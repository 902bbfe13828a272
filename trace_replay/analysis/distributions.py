"""Full-distribution divergence between two runs, per token: exact from a paired replay.

Equal sampled-token logprobs do not show that two distributions match. Per token this module
gives, between run a (rollout) and run b (trainer):

* ``kl_ab`` = KL(a || b) = sum_v p_a log(p_a / p_b), ``kl_ba`` = KL(b || a), in nats;
* ``tv`` = (1/2) sum_v |p_a - p_b|, total variation, in [0, 1];
* ``js`` = (1/2) KL(a || m) + (1/2) KL(b || m) with m = (p_a + p_b) / 2, in [0, log 2];
* ``max_abs_dlogprob`` = max_v |log p_a - log p_b|;
* ``topk_overlap``: the share of a's top-k tokens that are in b's top-k.

:func:`replay_pair` gets them exactly: both engines (in this process, each with the
:class:`~trace_replay.engines.distributions.StepLogits` capability) are fed the same batch,
and each step's two ``[n, V]`` logits are reduced on the device (float64) before the next
step is asked for, so the host never holds ``[tokens, V]`` and the device no more than each
engine's step logits take (one step's for the decode engine, one scoring chunk's for the
prefill engine, which runs its head on several steps at once). When either engine cannot give full logits (a server, vLLM), it replays
both the usual way and returns the bounds of
:func:`~trace_replay.analysis.distribution_bounds.distribution_bounds`, saying so in attrs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from trace_replay.engines.base import Engine, ReplayRequest, engine_identity
from trace_replay.engines.distributions import StepLogits
from trace_replay.engines.threads import intra_op_threads
from trace_replay.runs.replay import prepare_run
from trace_replay.traces.sets import load_traces

__all__ = ["METRICS", "replay_pair", "step_divergences"]

# the per-token divergences, in column order (topk_overlap after them)
METRICS = ("kl_ab", "kl_ba", "tv", "js", "max_abs_dlogprob")
_COLUMNS = ("logprob_a", "logprob_b", *METRICS, "topk_overlap")
_LOG_ZERO = -1e300  # log of a probability 0 (-inf) is clamped here, so 0 * log 0 is 0
_INFINITE = 1e299  # a KL term or |Δ logprob| from _LOG_ZERO: infinite


def step_divergences(
    logits_a: torch.Tensor, logits_b: torch.Tensor, token_ids: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Per row, the divergences of the two distributions, on the logits' device.

    Parameters
    ----------
    logits_a, logits_b
        ``[n, V]`` logits of the same n positions (any float dtype; reduced in float64).
    token_ids
        ``[n]``: the trace tokens, whose logprobs come first.
    top_k
        k of ``topk_overlap`` (0: NaN).

    Returns
    -------
    torch.Tensor
        ``[n, 8]`` float64: ``logprob_a, logprob_b``, then :data:`METRICS`, then
        ``topk_overlap``. A token of probability 0 under one side only makes its KL
        term and ``max_abs_dlogprob`` infinite; 0 under both adds nothing.

    Examples
    --------
    >>> a = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> b = torch.log(torch.tensor([[0.25, 0.75]]))
    >>> out = step_divergences(a, b, torch.tensor([0]), 1)[0]
    >>> round(out[4].item(), 4)  # tv
    0.25
    """
    if logits_a.shape != logits_b.shape:
        raise ValueError(
            f"the two engines' step logits differ in shape: "
            f"{tuple(logits_a.shape)} and {tuple(logits_b.shape)}"
        )
    # few full-vocabulary passes, all float64: log-softmax in place, then dot products
    (la, pa), (lb, pb) = _log_softmax(logits_a), _log_softmax(logits_b)
    diff = la - lb
    kl_ab = _dot(pa, diff)
    kl_ba = -_dot(pb, diff)
    tv = 0.5 * torch.linalg.vector_norm(pa - pb, ord=1, dim=-1)
    # JS = H(m) - (H(a) + H(b)) / 2, m the mixture: no log of the mixture per pair of terms
    mix = (pa + pb).mul_(0.5)
    entropy_mix = -torch.special.xlogy(mix, mix).sum(dim=-1)
    js = entropy_mix + 0.5 * (_dot(pa, la) + _dot(pb, lb))
    low, high = torch.aminmax(diff, dim=-1)
    biggest = torch.maximum(high, -low)
    ids = token_ids.long().to(la.device)[:, None]
    token_lps = [side.gather(1, ids).squeeze(1) for side in (la, lb)]
    # a token one side gives probability 0 and the other not: infinite KL and |Δ logprob|
    columns = [
        *(torch.where(lp <= _LOG_ZERO, -torch.inf, lp) for lp in token_lps),
        *(torch.where(c > _INFINITE, torch.inf, c) for c in (kl_ab, kl_ba)),
        tv,
        js,
        torch.where(biggest > _INFINITE, torch.inf, biggest),
    ]
    if top_k > 0:
        top_a = logits_a.topk(top_k, dim=-1).indices
        top_b = logits_b.topk(top_k, dim=-1).indices
        shared = (top_a[:, :, None] == top_b[:, None, :]).any(dim=2).sum(dim=1)
        columns.append(shared.double() / top_k)
    else:
        columns.append(torch.full_like(tv, float("nan")))
    return torch.stack(columns, dim=1)


def _log_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 log-probabilities (clamped at ``_LOG_ZERO``: 0 * log 0 is then 0, not NaN) and
    probabilities of ``[n, V]`` logits, in six passes and two buffers."""
    logs = logits.double()
    logs -= logs.amax(dim=-1, keepdim=True)
    probs = logs.exp()
    total = probs.sum(dim=-1, keepdim=True)
    probs /= total
    logs -= total.log()
    return logs.clamp_(min=_LOG_ZERO), probs


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products of ``[n, V]`` float64 tensors (one BLAS call)."""
    return torch.bmm(x[:, None, :], y[:, :, None]).reshape(-1)


def replay_pair(
    traces: Any,
    engine_a: Engine,
    engine_b: Engine,
    *,
    top_k: int = 5,
    labels: tuple[str, str] | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Replay ``traces`` through two engines and compare their full distributions per token.

    Parameters
    ----------
    traces
        Anything :func:`~trace_replay.runs.replay` takes (records, a frame, a path, a
        :class:`~trace_replay.traces.sets.TraceSet`).
    engine_a, engine_b
        Engines of one vocabulary: a is the behaviour side (rollout), b the target
        (trainer). Both with :class:`~trace_replay.engines.distributions.StepLogits`
        (the built-in ``torch`` and ``prefill`` engines) give the exact form; otherwise
        both are replayed as usual and the bounded form is returned.
    top_k
        k of ``topk_overlap`` (exact form; the bounded form uses the runs' own top-k).
    labels
        Names of the two sides (default: from the engines' settings).
    batch_size
        Traces fed to both engines at once (default: the smaller of their batch sizes).
    progress
        A progress bar for the bounded form's two replays.

    Returns
    -------
    DataFrame
        Exact form: one row per (trace_id, step) with ``token_id``, ``logprob_a``,
        ``logprob_b``, ``kl_ab``, ``kl_ba``, ``tv``, ``js``, ``max_abs_dlogprob``,
        ``topk_overlap`` and ``form`` (``"exact"``); ``attrs["distribution_form"]`` is
        ``"exact"``, with ``labels``, ``attrs_a``, ``attrs_b`` (the engines' settings) and
        ``top_k``. Bounded form: see
        :func:`~trace_replay.analysis.distribution_bounds.distribution_bounds`, with
        ``attrs["distribution_reason"]`` naming the engine without full logits.

    Raises
    ------
    ValueError
        When the engines' vocabularies differ.
    """
    lacking = [e for e in (engine_a, engine_b) if not isinstance(e, StepLogits)]
    if lacking:
        return _bounded_pair(traces, engine_a, engine_b, lacking, labels, progress)
    if engine_a.vocab_size != engine_b.vocab_size:
        raise ValueError(
            f"the engines' vocabularies differ ({engine_a.vocab_size} and "
            f"{engine_b.vocab_size} logits per step): no per-token distance"
        )
    settings = [engine_identity(engine_a), engine_identity(engine_b)]
    _, requests, _ = prepare_run(
        load_traces(traces),
        tokenizer=engine_a.tokenizer,
        vocab_size=engine_a.vocab_size,
        max_model_len=_shorter(engine_a, engine_b),
        top_k=top_k,
        truncate=False,
    )
    batch = batch_size or min(engine_a.batch_size, engine_b.batch_size)
    # one thread setting for both engines' steps and the reductions between them
    with intra_op_threads(getattr(engine_a, "threads", None)):
        frames = [
            _pair_batch(requests[i : i + batch], engine_a, engine_b, top_k)
            for i in range(0, len(requests), batch)
        ]
    df = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["trace_id", "step", "token_id", *_COLUMNS, "form"])
    )
    if labels is None:
        from trace_replay.analysis.metrics import run_labels

        labels = tuple(run_labels(settings))
    df.attrs = {
        "distribution_form": "exact",
        "labels": tuple(labels),
        "attrs_a": settings[0],
        "attrs_b": settings[1],
        "top_k": top_k,
        "metrics": "kl_ab = KL(a||b), kl_ba = KL(b||a), nats; tv; js; "
        "max_abs_dlogprob over the vocabulary; from full logits, float64",
    }
    return df


def _pair_batch(
    group: Sequence[ReplayRequest], engine_a: StepLogits, engine_b: StepLogits, top_k: int
) -> pd.DataFrame:
    """One batch through both engines in lockstep: each step's two logits reduced at once."""
    lengths = np.array([r.trace_len for r in group])
    values = []
    for step, (xa, xb) in enumerate(zip(engine_a.step_logits(group), engine_b.step_logits(group))):
        live = np.flatnonzero(lengths > step)
        tokens = torch.tensor([group[i].trace_token_ids[step] for i in live])
        if len(xa) != len(live) or len(xb) != len(live):
            raise RuntimeError(
                f"step {step}: the engines gave {len(xa)} and {len(xb)} rows "
                f"of logits for {len(live)} traces"
            )
        values.append(step_divergences(xa, xb, tokens, top_k))
    host = torch.cat(values).cpu().numpy()  # one transfer per batch: [tokens, 8]
    steps = np.concatenate([np.full(int((lengths > s).sum()), s) for s in range(lengths.max())])
    rows = np.concatenate([np.flatnonzero(lengths > s) for s in range(lengths.max())])
    order = np.lexsort((steps, rows))  # trace by trace, step by step
    frame = pd.DataFrame(
        {
            "trace_id": [group[i].trace_id for i in rows[order]],
            "step": steps[order].astype(np.int64),
            "token_id": [group[i].trace_token_ids[s] for i, s in zip(rows[order], steps[order])],
        }
    )
    for j, name in enumerate(_COLUMNS):
        frame[name] = host[order, j]
    frame["form"] = "exact"
    return frame


def _shorter(engine_a: Engine, engine_b: Engine) -> int | None:
    limits = [e.max_model_len for e in (engine_a, engine_b) if e.max_model_len is not None]
    return min(limits) if limits else None


def _bounded_pair(
    traces: Any,
    engine_a: Engine,
    engine_b: Engine,
    lacking: list,
    labels: tuple[str, str] | None,
    progress: bool,
) -> pd.DataFrame:
    """Both engines replayed as usual; the divergences bounded from top-k and tail mass."""
    from trace_replay.analysis.distribution_bounds import distribution_bounds
    from trace_replay.runs.replay import replay

    a = replay(traces, engine=engine_a, progress=progress)
    b = replay(traces, engine=engine_b, progress=progress)
    df = distribution_bounds(a, b, labels=labels)
    names = ", ".join(repr(e.name) for e in lacking)
    df.attrs["distribution_reason"] = (
        f"engine {names} gives no full distributions "
        "(no step_logits): bounds from top-k and tail mass"
    )
    return df
