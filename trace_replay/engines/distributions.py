"""Beyond the sampled token: what an engine can say about a step's whole distribution.

Every engine records, per step, the log of the probability mass outside the top-k it stores
(``TraceResult.tail_logmass``): the built-in engines from the full logits on the device,
engines that see only top-k logprobs (vLLM, a server) as ``log(1 - sum(exp(top-k)))``
(:func:`tail_from_top`). With it, two result files bound each full-distribution divergence
(:mod:`trace_replay.analysis.distributions`).

:class:`StepLogits` is an optional capability: an engine running in this process that hands
out each step's full logits, so that a paired replay
(:func:`~trace_replay.analysis.distributions.replay_pair`) reduces two engines'
distributions on the device, step by step, and gets the exact numbers. It is checked where
it is used (``isinstance(engine, StepLogits)``), never by an engine's name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

    from trace_replay.engines.protocol import ReplayRequest

__all__ = ["StepLogits", "tail_from_top"]


@runtime_checkable
class StepLogits(Protocol):
    """Full logits per replay step, for a batch of requests, in a fixed order.

    Design contract: ``step_logits(requests)`` (at most ``batch_size`` requests, run as one
    batch) yields, for ``step = 0, 1, ..., max(trace_len) - 1``, a ``[n_step, V]`` tensor on
    the engine's device: the logits that score trace token ``step`` of each request with
    ``trace_len > step``, those requests in the order given. A yielded tensor is valid until
    the next is asked for (the engine may reuse its memory), so a consumer holds at most one
    step's logits per engine. The trace tokens are forced as ``run`` forces them; the logits
    are the unmodified ones its scores are read from.
    """

    batch_size: int

    def step_logits(self, requests: Sequence[ReplayRequest]) -> Iterator[torch.Tensor]: ...


def tail_from_top(top_logprobs: np.ndarray) -> np.ndarray:
    """Log of the mass outside the listed top-k, from their logprobs alone ([T, k] -> [T]).

    ``log(1 - sum(exp(top)))`` in float64: exact up to the rounding of the listed logprobs,
    which is all an engine that returns only top-k logprobs can give (a tail below ~1e-7
    is lost to that rounding; a sum that rounds past 1 gives ``-inf``, mass 0).

    Examples
    --------
    >>> np.exp(tail_from_top(np.log([[0.5, 0.3]]))).round(6).tolist()
    [0.2]
    """
    top = np.asarray(top_logprobs, dtype=np.float64)
    inside = np.exp(top if top.ndim == 2 else top.reshape(len(top), -1)).sum(axis=1)
    with np.errstate(divide="ignore"):
        return np.log1p(-np.minimum(inside, 1.0))
