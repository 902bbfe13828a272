"""Mixture-of-experts routing of a replay: which experts each token went to, per layer.

:class:`RoutingRecorder` hooks the router modules of a transformers MoE model (Qwen3-MoE's
and Mixtral's ``*TopKRouter``, whose forward returns ``(router_logits, router_scores,
router_indices)``) and, with the engine's ``on_batch`` (the
:class:`~trace_replay.engines.capabilities.BatchHooks` capability), pairs each forward's rows
with the traces of the batch. Step ``s`` of a trace is routed where the logits that score
trace token ``s`` are computed: the input token at position ``prompt_len - 1 + s``.

Where a forward's rows sit depends on the engine's forward, which the engine declares as
``routing_layout`` (the :class:`RoutingSource` capability): ``"teacher-forced"`` (one
right-padded forward per batch, step ``s`` at column ``prompt_len - 1 + s``) or ``"decode"``
(a left-padded prefill whose last column is step 0, then one forward per step).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from trace_replay.engines.capabilities import BatchHooks

if TYPE_CHECKING:
    import torch

    from trace_replay.engines.protocol import ReplayRequest

__all__ = ["LAYOUTS", "RoutedExperts", "RoutingRecorder", "RoutingSource", "find_routers"]

LAYOUTS = ("teacher-forced", "decode")


@runtime_checkable
class RoutingSource(BatchHooks, Protocol):
    """An engine whose forwards run a transformers model's own modules in this process
    (``activations().model``), calling ``on_batch`` before each batch, laid out as
    ``routing_layout`` (one of :data:`LAYOUTS`)."""

    name: str
    routing_layout: str

    def activations(self): ...


@runtime_checkable
class RoutedExperts(Protocol):
    """An engine whose runtime reports each trace's routed experts itself (vLLM with
    ``enable_return_routed_experts``): when ``returns_routing`` is true, a replay leaves
    ``routed[trace_id]``, an int array ``[steps, layers, top_k]`` of expert ids."""

    returns_routing: bool
    routed: dict[str, np.ndarray]


def find_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The router of each MoE layer of ``model``, by layer index (empty for a dense model).

    A router is a module whose class name ends in ``Router`` and that has ``top_k``
    (transformers 5's ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``…), under a module path
    holding ``layers.<i>``.
    """
    routers = {}
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Router") and hasattr(module, "top_k"):
            found = re.search(r"layers\.(\d+)\.", name)
            if found:
                routers[int(found.group(1))] = module
    return dict(sorted(routers.items()))


class RoutingRecorder:
    """Record the experts and router weights of every token an engine scores.

    Use as a context manager around ``replay(…, engine=engine)``; :meth:`frame` then gives
    one row per (trace, step, layer). The hooks and ``on_batch`` are removed on exit.

    Raises
    ------
    ValueError
        When the engine's model has no router module (a dense model) or its layout is
        unknown.
    """

    def __init__(self, engine: RoutingSource) -> None:
        if getattr(engine, "routing_layout", None) not in LAYOUTS:
            raise ValueError(
                f"engine {engine.name!r} cannot record routing: its forwards do "
                "not run a transformers model's modules in this process"
            )
        self.engine, self.layout = engine, engine.routing_layout
        self.routers = find_routers(engine.activations().model)
        if not self.routers:
            raise ValueError(
                "the model has no mixture-of-experts router modules (a dense model routes nothing)"
            )
        self._batch: list[ReplayRequest] = []
        self._forward = -1  # forwards of the current batch, counted at its first layer
        self._rows: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        self._handles = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in self.routers.items()
        ]
        self.engine.on_batch = self._on_batch
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.engine.on_batch = None

    def _on_batch(self, batch: Sequence[ReplayRequest]) -> None:
        self._batch, self._forward = list(batch), -1

    def _hook(self, layer: int):
        first = min(self.routers)

        def record(module, inputs, output) -> None:
            if layer == first:
                self._forward += 1
            _, scores, indices = output
            batch = len(self._batch)
            indices = indices.detach().cpu().numpy().reshape(batch, -1, indices.shape[-1])
            scores = scores.detach().float().cpu().numpy().reshape(indices.shape)
            for row, trace, step, column in self._where(indices.shape[1]):
                self._rows[(trace, step, layer)] = (indices[row, column], scores[row, column])

        return record

    def _where(self, width: int):
        """(batch row, trace id, step, column) of each step this forward routes."""
        for row, request in enumerate(self._batch):
            if self.layout == "teacher-forced":
                # one forward: every step, at column prompt_len - 1 + step
                for step in range(request.trace_len):
                    yield row, request.trace_id, step, request.prompt_len - 1 + step
            elif self._forward < request.trace_len:
                # decode: forward f scores step f (prefill: the last, left-padded column)
                yield row, request.trace_id, self._forward, width - 1

    def frame(self):
        """One row per (trace_id, step, layer): ``experts`` (tuple of expert ids, ascending)
        and ``weights`` (the router weights of those experts, same order)."""
        import pandas as pd

        rows = []
        for (trace, step, layer), (experts, weights) in self._rows.items():
            order = np.argsort(experts)
            rows.append(
                (
                    trace,
                    step,
                    layer,
                    tuple(int(e) for e in experts[order]),
                    tuple(float(w) for w in weights[order]),
                )
            )
        df = pd.DataFrame(rows, columns=["trace_id", "step", "layer", "experts", "weights"])
        return df.sort_values(["trace_id", "step", "layer"], kind="stable", ignore_index=True)
