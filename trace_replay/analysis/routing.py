"""MoE routing divergence: the first token and layer where two runs sent a token to other
experts, beside the first logprob divergence.

Routing replay (vLLM's R3) and trainer-side debugging ask the same question: did the
rollout and the trainer route each token alike? :func:`record_routing` replays traces
through an engine whose forwards run here (the prefill engine, the built-in engine's hf
backend) and records, per (trace, step, layer), the experts chosen and their router weights
(:class:`~trace_replay.engines.routing.RoutingRecorder`). :func:`routing_flips` compares two
such records.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trace_replay.engines.capabilities import supports
from trace_replay.engines.routing import RoutedExperts, RoutingRecorder

__all__ = ["flip_matrix", "record_routing", "routing_flips"]

_KEY = ["trace_id", "step", "layer"]


def record_routing(
    traces: Any, engine: Any, **replay_options: Any
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Replay ``traces`` through ``engine`` and record its MoE routing.

    Parameters
    ----------
    traces
        Anything :func:`~trace_replay.runs.replay` takes.
    engine
        An engine object with the routing capability
        (:class:`~trace_replay.engines.routing.RoutingSource`): ``prefill``, or ``torch``
        with its hf backend (the CPU default). vLLM records routing on GPUs only
        (``engine_args={"enable_return_routed_experts": True}``, Model Runner V2).
    **replay_options
        Passed to :func:`~trace_replay.runs.replay` (no checkpoint: a resumed run would
        not route the traces it skips).

    Returns
    -------
    tuple of DataFrame
        The replay frame, and the routing: one row per (trace_id, step, layer) with
        ``experts`` (ascending expert ids) and ``weights`` (their router weights).
    """
    from trace_replay.runs.replay import replay

    if replay_options.get("checkpoint") is not None:
        raise ValueError(
            "record_routing cannot resume a checkpoint: skipped traces would have no routing"
        )
    if supports(engine, RoutedExperts) and engine.returns_routing:  # vLLM's own (GPU)
        engine.routed.clear()
        df = replay(
            traces, engine=engine, progress=replay_options.pop("progress", False), **replay_options
        )
        routing = _from_arrays(engine.routed)
        routing.attrs = {"engine": engine.name, "routing_layout": "vllm"}
        return df, routing
    with RoutingRecorder(engine) as recorder:
        df = replay(
            traces, engine=engine, progress=replay_options.pop("progress", False), **replay_options
        )
    routing = recorder.frame()
    routing.attrs = {
        "engine": engine.name,
        "routing_layout": engine.routing_layout,
        "layers": sorted(recorder.routers),
    }
    return df, routing


def _from_arrays(routed: dict[str, np.ndarray]) -> pd.DataFrame:
    """Rows of ``{trace_id: [T, layers, top-k] expert ids}`` (no router weights: NaN)."""
    rows = [
        (trace_id, step, layer, tuple(sorted(int(e) for e in experts)), None)
        for trace_id, array in routed.items()
        for step, per_layer in enumerate(np.asarray(array))
        for layer, experts in enumerate(per_layer)
    ]
    return pd.DataFrame(rows, columns=["trace_id", "step", "layer", "experts", "weights"])


def _joined(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    both = a[[*_KEY, "experts"]].merge(
        b[[*_KEY, "experts"]], on=_KEY, suffixes=("_a", "_b"), validate="one_to_one"
    )
    if len(both) != len(a) or len(both) != len(b):
        raise ValueError(
            f"the routing records differ in their (trace, step, layer) rows: "
            f"{len(a)} and {len(b)}, {len(both)} shared"
        )
    both["flip"] = [x != y for x, y in zip(both["experts_a"], both["experts_b"])]
    return both


def routing_flips(
    a: pd.DataFrame, b: pd.DataFrame, cmp: pd.DataFrame | None = None, *, tol: float = 1e-3
) -> pd.DataFrame:
    """Per trace, the first routing flip of two routing records, beside the first logprob
    divergence.

    Parameters
    ----------
    a, b
        :func:`record_routing` frames of the same traces (a: rollout, b: trainer).
    cmp
        Optional :func:`~trace_replay.analysis.metrics.compare` frame of the two replays:
        adds ``first_divergence_step`` (first step with ``|delta| > tol``, or -1).
    tol
        The logprob tolerance of ``first_divergence_step``.

    Returns
    -------
    DataFrame
        One row per trace: ``flips`` (routed (step, layer) pairs that differ), ``flip_rate``,
        ``first_flip_step`` and ``first_flip_layer`` (-1 when none), ``experts_a`` and
        ``experts_b`` there (the two expert sets), and ``first_divergence_step`` with
        ``cmp``. The earliest step first, then the lowest layer.
    """
    both = _joined(a, b)
    rows = []
    for trace_id, group in both.groupby("trace_id", sort=False):
        flipped = group[group["flip"]].sort_values(["step", "layer"])
        first = flipped.iloc[0] if len(flipped) else None
        rows.append(
            {
                "trace_id": trace_id,
                "flips": int(group["flip"].sum()),
                "flip_rate": float(group["flip"].mean()),
                "first_flip_step": -1 if first is None else int(first.step),
                "first_flip_layer": -1 if first is None else int(first.layer),
                "experts_a": None if first is None else first.experts_a,
                "experts_b": None if first is None else first.experts_b,
            }
        )
    out = pd.DataFrame(rows)
    if cmp is not None:
        delta = cmp["delta"].astype("float64")
        off = cmp[(delta.abs() > tol) | ~np.isfinite(delta)]
        first = off.groupby("trace_id")["step"].min()
        out["first_divergence_step"] = out["trace_id"].map(first).fillna(-1).astype(int)
    return out


def flip_matrix(a: pd.DataFrame, b: pd.DataFrame, trace_id: str) -> pd.DataFrame:
    """Layers by steps of one trace: True where the two records route a token differently."""
    both = _joined(a[a["trace_id"] == trace_id], b[b["trace_id"] == trace_id])
    return both.pivot(index="layer", columns="step", values="flip").astype(bool)
