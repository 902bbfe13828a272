"""``make_backend``: the built-in engine's forward pass, built by kind.

The backends' modules are imported only when one of their kind is built, so the CPU path
never imports the static backend's compiler passes and kernels. This module imports the
backends and :mod:`~trace_replay.engines.builtin.backends.base`; they import neither it nor
each other through it (no circle).
"""

from __future__ import annotations

import torch

from trace_replay.engines.builtin.backends.base import Backend, BackendOptions, check_backend

__all__ = ["KINDS", "make_backend"]

# what make_backend builds: "auto" is static on CUDA where the model is supported, else hf
KINDS = ("auto", "hf", "static", "deterministic")


def make_backend(
    kind: str, lm: torch.nn.Module, pad_id: int, options: BackendOptions = BackendOptions()
) -> Backend:
    """The backend ``kind`` (one of :data:`KINDS`) over ``lm``, checked.

    Parameters
    ----------
    kind
        ``"hf"``, ``"static"``, ``"deterministic"`` or ``"auto"``.
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
        kind = "hf"
        if next(lm.parameters()).device.type == "cuda":
            from trace_replay.engines.builtin.backends.static import supports

            kind = "static" if supports(lm) else "hf"
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
