"""``make_backend``: the built-in engine's forward pass, built by kind.

The backends' modules are imported only when one of their kind is built, so an hf engine
never imports the static backend's compiler passes and kernels. This module imports the
backends and :mod:`~trace_replay.engines.builtin.backends.base`; they import neither it nor
each other through it (no circle).
"""

from __future__ import annotations

import torch

from trace_replay.engines.builtin.backends.base import Backend, BackendOptions, check_backend
from trace_replay.engines.builtin.backends.packed_linear import packed_linears_available

__all__ = ["KINDS", "auto_kind", "make_backend"]

# what make_backend builds; "auto" is :func:`auto_kind`'s choice
KINDS = ("auto", "hf", "static", "deterministic")


def auto_kind(lm: torch.nn.Module) -> str:
    """What ``"auto"`` builds for ``lm``: ``"static"`` where the static backend supports the
    model and runs faster than hf (CUDA, any dtype; the CPU, float32 with oneDNN-packed
    linears), else ``"hf"``.

    On the CPU a bfloat16 or float16 model stays on hf: torch has no packed half-precision
    linears here and the static backend's speed at those dtypes on the CPU was not measured.
    """
    param = next(lm.parameters())
    if param.device.type == "cpu" and not packed_linears_available(param.dtype):
        return "hf"
    if param.device.type not in ("cpu", "cuda"):
        return "hf"
    from trace_replay.engines.builtin.backends.static import supports

    return "static" if supports(lm) else "hf"


def make_backend(
    kind: str, lm: torch.nn.Module, pad_id: int, options: BackendOptions = BackendOptions()
) -> Backend:
    """The backend ``kind`` (one of :data:`KINDS`) over ``lm``, checked.

    Parameters
    ----------
    kind
        ``"hf"``, ``"static"``, ``"deterministic"`` or ``"auto"`` (:func:`auto_kind`).
    lm
        A transformers causal LM (the kind decides which it must be).
    pad_id
        Token fed at left padding (the deterministic backend pads nothing).
    options
        The engine's choices (:class:`BackendOptions`).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown backend kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = auto_kind(lm)
    backend: Backend
    if kind == "hf":
        from trace_replay.engines.builtin.backends.hf import HFBackend

        backend = HFBackend(lm, pad_id)
    elif kind == "static":
        from trace_replay.engines.builtin.backends.static import StaticCacheBackend

        backend = StaticCacheBackend(
            lm,
            pad_id,
            max_query_len=options.max_query_len,
            float32_matmul=options.float32_matmul,
            batch1_fusions=options.batch1_fusions,
        )
    else:
        from trace_replay.engines.builtin.backends.deterministic import DeterministicBackend

        backend = DeterministicBackend(
            lm, max_query_len=options.max_query_len, attention=options.deterministic_attention
        )
    check_backend(backend)
    return backend
