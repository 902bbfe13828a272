"""The one module that imports Triton.

Kernel modules take ``triton`` and ``tl`` from here. Without Triton both are stand-ins
whose ``jit`` returns the function unchanged, so every kernel module still imports and
every launcher falls back to its pure-torch reference.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    class _constexpr:  # an annotation, and a module constant's wrapper: ``_constexpr(v)`` is v
        def __new__(cls, value):
            return value

    triton = SimpleNamespace(jit=_jit)
    tl = SimpleNamespace(constexpr=_constexpr)
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "can_launch", "interpreting", "triton", "tl", "use_triton"]

# read once, as triton.jit does when it decorates a kernel: setting it later changes neither
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return HAS_TRITON and _INTERPRET


def can_launch() -> bool:
    """Whether this process can run Triton kernels at all: Triton is importable and there is
    a CUDA device or ``TRITON_INTERPRET=1`` was set before this module was imported."""
    return HAS_TRITON and (_INTERPRET or torch.cuda.is_available())


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether a launcher should run its Triton kernel on these tensors.

    Parameters
    ----------
    *tensors
        The launcher's tensor arguments; ``None`` entries are ignored.

    Returns
    -------
    bool
        True when Triton is importable and either every tensor is on CUDA or
        ``TRITON_INTERPRET=1`` was set before this module was imported (the interpreter
        runs the real kernels on CPU tensors).
    """
    if not HAS_TRITON:
        return False
    if _INTERPRET:
        return True
    return all(t.is_cuda for t in tensors if t is not None)
