"""The static backend's product on the CPU: oneDNN linears over weights packed once.

torch's ``F.linear`` on the CPU hands every call to MKL's ``sgemm`` with the weight as it is
stored; at decode sizes (a few rows against a wide weight) the product is bound by reading the
weight, and a layout that oneDNN chose for its own kernels reads it faster. vLLM's CPU build
does the same (its ``onednn_mm`` with a handle made once per linear). Here the layout is
torch's own oneDNN reorder (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
weight prepacking uses on the CPU), and the product ``torch.ops.mkldnn._linear_pointwise``.
Both multiply and accumulate in float32; they sum in another order than MKL, so results
agree with ``F.linear`` to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "GROUPS",
    "GROUP_ROWS",
    "PackedLinears",
    "grouped_bytes",
    "linear_bytes",
    "packed_copy_fits",
    "packed_linears_available",
]

# children of one module that the model calls on the same input (attention, gated MLP)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# inputs of at most this many rows (decode steps up to batch 8) run a group as one product;
# longer ones (prompts) run each member's own: measured on the 2-core EPYC (2026-12-07, one
# thread, SmolLM2's shapes in the model), one product per group took 5% off a 1-row step and
# nothing at 8 rows, and made an 8-prompt prefill 6-25% slower
GROUP_ROWS = 8


def packed_linears_available(dtype: torch.dtype) -> bool:
    """Whether this torch can pack ``dtype`` weights for oneDNN (float32 with mkldnn)."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def linear_bytes(lm: torch.nn.Module) -> int:
    """Bytes of ``lm``'s linear weights, each weight once (a tied one is one weight)."""
    weights = {m.weight for m in lm.modules() if isinstance(m, torch.nn.Linear)}
    return sum(w.numel() * w.element_size() for w in weights)


def grouped_bytes(lm: torch.nn.Module) -> int:
    """Bytes of ``lm``'s linear weights that belong to a group of :data:`GROUPS` (children
    of one module, all ``nn.Linear``), each weight once."""
    weights: set[torch.Tensor] = set()
    for parent in lm.modules():
        for names in GROUPS:
            children = [parent._modules.get(name) for name in names]
            linears = [child for child in children if isinstance(child, torch.nn.Linear)]
            if len(linears) == len(names):
                weights.update(linear.weight for linear in linears)
    return sum(w.numel() * w.element_size() for w in weights)


def packed_copy_fits(lm: torch.nn.Module, available: int | None = None) -> bool:
    """Whether the packed copies of ``lm``'s linear weights take at most half of
    ``available`` bytes (default: the memory the system has available now,
    ``/proc/meminfo``; true where that cannot be read).

    The copies sit beside the model's own weights, which the model keeps (other backends use
    them): a model near the machine's memory must not be doubled by the default backend.
    They are every linear weight once and the grouped ones (:data:`GROUPS`) a second time,
    as their groups' concatenation (short inputs) and on their own (long ones).
    """
    needed = linear_bytes(lm) + grouped_bytes(lm)
    if available is None:
        try:
            with open("/proc/meminfo") as meminfo:
                fields = dict(line.split(":", 1) for line in meminfo)
            available = int(fields["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return True
    return needed <= available // 2


class PackedLinears:
    """``product(x, weight, bias)`` (the signature of
    :class:`~trace_replay.engines.builtin.backends.static_view.KernelLinear`'s product) over
    oneDNN-packed copies of the weights it is given; :meth:`group` multiplies by several
    weights that read the same input as one product over their packed concatenation.

    Design contract: a weight (or group) is packed at its first product and again whenever
    it (any member's weight or bias) was changed in place since (torch's version counter),
    so an edited model is never multiplied with its old weights. A group's packed copy
    holds its members' rows, beside the members' own copies where they are also multiplied
    alone (long inputs). The packed copies live as long as this object (one per backend).
    """

    def __init__(self) -> None:
        # the weights' ids -> (weights and biases, their versions when packed, packed
        # weight, concatenated biases or None)
        self._packed: dict[tuple[int, ...], tuple[tuple, tuple, torch.Tensor, Any]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights held now (their shapes' elements; oneDNN may pad)."""
        return sum(entry[2].numel() * entry[2].element_size() for entry in self._packed.values())

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed, _ = self._pack((weight,), ())
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def group(
        self,
        x: torch.Tensor,
        weights: tuple[torch.Tensor, ...],
        biases: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """``x`` times every one of ``weights`` (``[N_i, K]``, plus ``biases``: one per
        weight, or none), their outputs side by side in the last dimension: ``[..., ΣN_i]``.

        Each column is the same float32 dot product as the member's own, summed in another
        order: equal to the separate products to float32 rounding.
        """
        packed, bias = self._pack(weights, biases)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def _pack(
        self, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed concatenation of ``weights`` and of ``biases``, made again where any
        of them changed since it was made."""
        key = tuple(map(id, weights))
        tensors = weights + biases
        versions = tuple(t._version for t in tensors)
        entry = self._packed.get(key)
        if entry is None or entry[1] != versions:
            merged = weights[0] if len(weights) == 1 else torch.cat(weights)
            packed = torch.ops.mkldnn._reorder_linear_weight(merged.detach(), None)
            bias = torch.cat(biases).detach() if biases else None
            # the tensors are kept so that their ids stay theirs while the entry lives
            entry = (tensors, versions, packed, bias)
            self._packed[key] = entry
        return entry[2], entry[3]
