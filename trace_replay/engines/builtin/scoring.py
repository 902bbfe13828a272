"""The one scoring rule every engine shares: logprob, rank, top-k and entropy of a token;
and scored steps gathered into per-trace results, one host transfer per batch."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from trace_replay.engines.base import ReplayRequest, TraceResult
from trace_replay.engines.builtin.passes.compiling import compile_function

__all__ = [
    "Steps",
    "TokenScores",
    "chunked_argmax",
    "collect_rows",
    "greedy_tokens",
    "score_tokens",
    "score_with_top",
    "scorer_for",
    "split_results",
    "tail_logmass",
    "top_from_logprob",
    "wave_results",
]


# On CUDA, up to this many rows take the two-pass argmax of :func:`greedy_tokens`
_CHUNKED_ARGMAX_ROWS = 16
# chunks per row it tries, the first that divides the vocabulary (else the one-pass argmax)
_ARGMAX_CHUNKS = (256, 128, 64)


class TokenScores(NamedTuple):
    """Device tensors for N scored positions."""

    logprob: torch.Tensor  # [N] float32
    rank: torch.Tensor  # [N] int64
    top_token_ids: torch.Tensor  # [N, top_k] int64
    top_logprobs: torch.Tensor  # [N, top_k] float32
    entropy: torch.Tensor  # [N] float32
    tail_logmass: torch.Tensor  # [N] float32, log of the mass outside the top-k (tail_logmass)


# per forward: the scores of its rows (flattened [B * q]) and the tokens they committed
Steps = list[tuple[TokenScores, torch.Tensor]]


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
    """Score ``token_ids`` under the unmodified distribution ``logits`` ([N, V]).

    Log-softmax runs in float32 whatever the model dtype, as vLLM's sampler does. Rank is
    1 + the number of tokens with a strictly greater logprob, so ties share the best rank.
    The top ``top_k`` are those of the logits (log-softmax keeps their order; ties in any
    order). Everything stays on the device: no host synchronization.
    """
    return score_with_top(logits, token_ids, _top_ids(logits, token_ids, top_k))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[N, V]`` logits: the same indices, the first of equal
    maxima (a NaN counting as the largest).

    On CUDA, for a few rows of a vocabulary that a chunk count divides, in two passes
    (:func:`chunked_argmax`): torch's one-pass argmax reduces a row in one thread block.
    """
    rows, vocab = logits.shape
    if logits.device.type == "cuda" and rows <= _CHUNKED_ARGMAX_ROWS:
        for chunks in _ARGMAX_CHUNKS:
            if vocab % chunks == 0 and vocab >= 64 * chunks:
                return chunked_argmax(logits, chunks)
    return logits.argmax(dim=-1)


def chunked_argmax(logits: torch.Tensor, chunks: int) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` as the best of ``chunks`` equal chunks per row: each chunk's
    maximum and its first index, then the first chunk holding the row's maximum. Both passes
    take the first of equal values and count a NaN as the largest (``torch.max``'s rule, as
    ``argmax``'s), so the index is argmax's own.

    Examples
    --------
    >>> chunked_argmax(torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 0.0, 0.0, 5.0]]), 2).tolist()
    [1, 3]
    """
    rows, vocab = logits.shape
    width = vocab // chunks
    maxima, within = logits.reshape(rows, chunks, width).max(dim=-1)
    best = maxima.argmax(dim=-1, keepdim=True)
    return (best * width + within.gather(1, best)).squeeze(1)


def score_with_top(
    logits: torch.Tensor, token_ids: torch.Tensor, top_ids: torch.Tensor
) -> TokenScores:
    """:func:`score_tokens` with the top-k indices ``top_ids`` ([N, k] int64) given."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_ids = token_ids.long()
    logprob = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    rank = (logprobs > logprob[:, None]).sum(dim=1) + 1
    probs = logprobs.exp()
    # p * log p is 0 for p = 0 (log p = -inf gives NaN otherwise)
    entropy = -(probs * logprobs).nan_to_num(nan=0.0).sum(dim=1)
    return TokenScores(
        logprob=logprob,
        rank=rank,
        top_token_ids=top_ids,
        top_logprobs=logprobs.gather(1, top_ids),
        entropy=entropy,
        tail_logmass=_tail_from_probs(probs, logprobs, top_ids),
    )


# below this rest mass a float32 sum of exp(logprob) loses digits to subnormals
_TINY_REST = 1e-30


def _tail_from_probs(
    probs: torch.Tensor, logprobs: torch.Tensor, top_ids: torch.Tensor
) -> torch.Tensor:
    """:func:`tail_logmass` from the entropy's own ``probs = exp(logprobs)`` ([N, V] float32,
    overwritten): the top-k zeroed in place and the rest summed, one pass instead of
    :func:`tail_logmass`'s three (log-softmax already normalised the row, so no second
    normaliser). Still a sum of the rest, not ``1 - sum(top)``. Rows whose rest falls below
    :data:`_TINY_REST` (their terms subnormal or 0 in float32) take :func:`tail_logmass`."""
    if top_ids.shape[1] == 0:
        return probs.new_zeros(len(probs))
    if torch.compiler.is_compiling() or probs.device.type != "cpu":
        # the check below would synchronize with the device; inductor fuses this one
        return tail_logmass(logprobs, top_ids)
    rest = probs.scatter_(1, top_ids.long(), 0.0).sum(dim=1)
    tail = rest.log()
    tiny = rest < _TINY_REST
    if tiny.any():  # a CPU tensor: no device to wait for
        tail[tiny] = tail_logmass(logprobs[tiny], top_ids[tiny])
    return tail


def _tail_from_logits(
    logits: torch.Tensor, top_ids: torch.Tensor, token_ids: torch.Tensor, logprob: torch.Tensor
) -> torch.Tensor:
    """:func:`tail_logmass` of raw ``logits`` whose normaliser the scoring pass already has:
    ``logsumexp = logit(token) - logprob(token)``, so one ``logsumexp`` (of the rest) instead
    of two. Equal to :func:`tail_logmass` within a float32 rounding of the normaliser."""
    if top_ids.shape[1] == 0:
        return torch.zeros_like(logprob)
    x = logits.float()
    normaliser = x.gather(1, token_ids.long()[:, None]).squeeze(1) - logprob
    return torch.logsumexp(x.scatter(1, top_ids.long(), float("-inf")), dim=1) - normaliser


def tail_logmass(logprobs: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Log of the probability mass outside ``top_ids`` ([N, k]) under ``logprobs`` ([N, V],
    log-softmax or raw logits: the row's own normaliser is subtracted), float32.

    ``logsumexp`` of the other entries less ``logsumexp`` of all: no ``1 - sum(top)``
    cancellation, so a tail of 1e-12 keeps its digits. 0 for ``k == 0``, ``-inf`` when the
    top-k holds the whole vocabulary. On the device, no host synchronization.

    Examples
    --------
    >>> lp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    >>> round(tail_logmass(lp, torch.tensor([[0, 1]])).exp().item(), 6)
    0.2
    """
    logprobs = logprobs.float()
    whole = torch.logsumexp(logprobs, dim=1)
    if top_ids.shape[1] == 0:
        return whole - whole
    rest = logprobs.scatter(1, top_ids.long(), float("-inf"))
    return torch.logsumexp(rest, dim=1) - whole


def scorer_for(device: torch.device | str, *, rows: str = "static"):
    """The scorer for ``device``: :func:`score_tokens`, or its fast form on CUDA.

    On CUDA the top-k and its logprobs come from
    :func:`~trace_replay.kernels.top_k.top_k_scores` (the logits read once; two launches;
    their logprobs by :func:`top_from_logprob`'s rule) and the rest is compiled by inductor
    into a few fused reductions. Same rule, same dtype; the fused reductions may round
    differently in the last bits (tests compare within tolerance). CPU keeps the eager
    function: compiling there costs seconds of start-up for little gain.

    ``rows`` (CUDA): ``"static"`` compiles one graph per row count — for decode loops,
    whose few row counts (a wave's rows, the last wave's, verify's rows × (k + 1)) each
    repeat for every step, and whose reductions inductor then shapes for that count;
    ``"dynamic"``, one graph for all — for the prefill engine, whose last chunk of each
    batch has a row count of its own.
    """
    if rows not in ("static", "dynamic"):
        raise ValueError(f"rows={rows!r}; choose 'static' or 'dynamic'")
    if torch.device(device).type != "cuda":
        return score_tokens
    if rows not in _CUDA_SCORERS:
        from trace_replay.kernels.top_k import MAX_TOP_K, top_k_scores

        # static rows: one graph per row count and dtype
        compiled = _quiet_compiles(
            compile_function(score_with_top, dynamic=rows == "dynamic", fullgraph=True)
        )

        def score_cuda(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
            if not 0 < top_k <= min(MAX_TOP_K, logits.shape[1]) or logits.stride(1) != 1:
                return top_from_logprob(
                    compiled, logits, token_ids, _top_ids(logits, token_ids, top_k)
                )
            # the top-k kernel also writes the top logprobs, by top_from_logprob's rule
            scores = compiled(logits, token_ids, _top_ids(logits, token_ids, 0))
            ids, top = top_k_scores(logits, top_k, token_ids, scores.logprob)
            return scores._replace(
                top_token_ids=ids,
                top_logprobs=top,
                tail_logmass=_tail_from_logits(logits, ids, token_ids, scores.logprob),
            )

        _CUDA_SCORERS[rows] = score_cuda
    return _CUDA_SCORERS[rows]


def top_from_logprob(
    reductions, logits: torch.Tensor, token_ids: torch.Tensor, top_ids: torch.Tensor
) -> TokenScores:
    """Scores from ``reductions`` (:func:`score_with_top` or its compiled form) run without
    top-k, the top-k logprobs taken from the token's: ``logprob + (logit_top - logit_token)``.

    One compiled graph then serves greedy (no top-k) and replay alike. A top token's
    logprob differs from ``log_softmax``'s by a float32 rounding or two at the size of the
    numbers involved (about 2e-6 for logits and logprobs under 16 in magnitude), and equals
    ``logprob`` exactly where it is the scored token.
    """
    scores = reductions(logits, token_ids, _top_ids(logits, token_ids, 0))
    if top_ids.shape[1] == 0:
        return scores
    token_logit = logits.gather(1, token_ids.long()[:, None]).float()
    top = scores.logprob[:, None] + (logits.gather(1, top_ids).float() - token_logit)
    return scores._replace(
        top_token_ids=top_ids,
        top_logprobs=top,
        tail_logmass=_tail_from_logits(logits, top_ids, token_ids, scores.logprob),
    )


_CUDA_SCORERS: dict = {}  # rows -> the CUDA scorer


def _quiet_compiles(compiled):
    """``compiled`` whose first call per input shape and dtypes (where it compiles) drops
    inductor's "Online softmax is disabled" warning; the warning filters are left as
    they were."""
    seen = set()

    def run(logits: torch.Tensor, token_ids: torch.Tensor, top_ids: torch.Tensor):
        key = (logits.shape, logits.dtype, token_ids.dtype, top_ids.shape[1])
        if key in seen:
            return compiled(logits, token_ids, top_ids)
        with warnings.catch_warnings():
            # older inductor says so at each compile that splits the vocabulary reduction:
            # an internal choice, nothing a user can act on
            warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")
            scores = compiled(logits, token_ids, top_ids)
        seen.add(key)
        return scores

    return run


def _top_ids(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int, pick=None) -> torch.Tensor:
    """``[N, top_k]`` indices of the largest logits: ``pick(logits, k)``, else ``torch.topk``."""
    if top_k == 0:
        return token_ids.new_zeros((len(token_ids), 0), dtype=torch.long)
    if pick is not None and top_k <= logits.shape[1]:
        return pick(logits, top_k)
    return logits.topk(top_k, dim=-1).indices


def collect_rows(scores: TokenScores, token_ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Move one batch of scores to the host in a single transfer per field."""
    host = {name: value.cpu().numpy() for name, value in scores._asdict().items()}
    host["token_ids"] = token_ids.long().cpu().numpy()
    host["logprob"] = host["logprob"].astype(np.float64)
    host["top_logprobs"] = host["top_logprobs"].astype(np.float64)
    host["entropy"] = host["entropy"].astype(np.float64)
    host["tail_logmass"] = host["tail_logmass"].astype(np.float64)
    return host


# from device scores to per-trace host results
def split_results(
    requests: Sequence[ReplayRequest],
    host: dict[str, Any],  # TraceResult's array fields by name: collect_rows' arrays
    rows: Sequence[np.ndarray | slice],
) -> list[TraceResult]:
    """One :class:`TraceResult` per request from host arrays, taking ``rows[i]`` for request i."""
    return [
        TraceResult(
            trace_id=r.trace_id,
            prompt_len=r.prompt_len,
            **{name: values[take] for name, values in host.items()},
        )
        for r, take in zip(requests, rows)
    ]


def wave_results(
    wave: Sequence[ReplayRequest], steps: Steps, counts: torch.Tensor
) -> list[TraceResult]:
    """Results of a decoded wave; ``counts[f, b]`` tokens of row b were committed by forward f.

    Forward f scored ``width_f = len(tokens_f) // B`` positions per row, row-major; the first
    ``counts[f, b]`` of row b's are its committed tokens, and a row keeps its first
    ``trace_len`` committed tokens (rows that finished early ran on with the batch).
    The host arrays are put in row order once, so each result holds views of them.
    """
    host = collect_rows(
        TokenScores(*(torch.cat(parts) for parts in zip(*(s for s, _ in steps)))),
        torch.cat([tokens for _, tokens in steps]),
    )
    order, lengths = _committed_order(
        wave, [len(tokens) for _, tokens in steps], counts.cpu().numpy()
    )
    host = {name: values[order] for name, values in host.items()}
    ends = np.cumsum(lengths)
    return split_results(wave, host, [slice(end - n, end) for end, n in zip(ends, lengths)])


def _committed_order(
    wave: Sequence[ReplayRequest], sizes: Sequence[int], counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of each row's kept tokens, row after row, and how many each row keeps.

    Forward f, row b committed the tokens at ``bounds[f] + b * width_f + [0, counts[f, b])``;
    they are listed row-major over (row, forward), so each row's tokens come in order.
    """
    batch = len(wave)
    bounds = np.cumsum([0, *sizes])[:-1]
    widths = np.asarray(sizes) // batch
    starts = (bounds[:, None] + np.arange(batch)[None, :] * widths[:, None]).T.ravel()
    n = counts.T.ravel().astype(np.int64)
    flat = np.repeat(starts, n) + np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    per_row = counts.sum(axis=0).astype(np.int64)
    # keep each row's first trace_len tokens
    trace_len = np.array([r.trace_len for r in wave])
    within = np.arange(len(flat)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    keep = within < np.repeat(trace_len, per_row)
    return flat[keep], np.minimum(per_row, trace_len)
