"""Trace-replay kernels: each a Triton kernel, its launcher, and a pure-torch reference.

Launchers edit tensors in place and run the reference when Triton cannot run (CPU
tensors without ``TRITON_INTERPRET=1``, or Triton not installed). The batch-invariant
kernels (``invariant_*``) return new tensors and leave the choice to their caller
(:class:`~trace_replay.engines.builtin.backends.deterministic_model.DeterministicLlama`): their reference is the CPU
path of deterministic mode, whose bits differ from the kernel's.

The names below are resolved from their modules on first use, so importing one kernel (the
trace kernels of a CPU replay) runs no other kernel module's body. The static backend's
attention is not among them: its function would share the name of its module
(``from trace_replay.kernels.cache_attention import cache_attention``).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "force_trace_logits": "force_logits",
    "force_trace_logits_reference": "force_logits",
    "attention_rows_reference": "deterministic_attention",
    "attention_rows_triton": "deterministic_attention",
    "linear_rows_reference": "deterministic_linear",
    "linear_rows_triton": "deterministic_linear",
    "rms_norm_rows_reference": "deterministic_rms_norm",
    "rms_norm_rows_triton": "deterministic_rms_norm",
    "top_k_indices": "top_k",
    "top_k_indices_reference": "top_k",
    "apply_trace_tokens": "trace_tokens",
    "apply_trace_tokens_reference": "trace_tokens",
    "apply_trace_tokens_to_verified": "trace_tokens_verified",
    "apply_trace_tokens_to_verified_reference": "trace_tokens_verified",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trace_replay.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trace_replay.kernels.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
