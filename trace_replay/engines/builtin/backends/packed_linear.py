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

import torch

__all__ = ["PackedLinears", "packed_copy_fits", "packed_linears_available"]


def packed_linears_available(dtype: torch.dtype) -> bool:
    """Whether this torch can pack ``dtype`` weights for oneDNN (float32 with mkldnn)."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def packed_copy_fits(lm: torch.nn.Module, available: int | None = None) -> bool:
    """Whether a packed copy of ``lm``'s linear weights takes at most half of ``available``
    bytes (default: the memory the system has available now, ``/proc/meminfo``; true where
    that cannot be read).

    The copy sits beside the model's own weights, which the model keeps (other backends use
    them): a model near the machine's memory must not be doubled by the default backend.
    """
    weights = {m.weight for m in lm.modules() if isinstance(m, torch.nn.Linear)}
    needed = sum(w.numel() * w.element_size() for w in weights)
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
    oneDNN-packed copies of the weights it is given.

    Design contract: a weight is packed at its first product and again whenever it was
    changed in place since (torch's version counter), so an edited model is never
    multiplied with its old weights. The packed copies live as long as this object (one
    per backend): one more copy of every linear's weight in memory.
    """

    def __init__(self) -> None:
        # id(weight) -> (weight, its version when packed, packed copy)
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        if entry is None or entry[1] != weight._version:
            entry = (
                weight,
                weight._version,
                torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
            )
            self._packed[id(weight)] = entry
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")
