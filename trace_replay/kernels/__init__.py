"""Trace-replay kernels: each a Triton kernel, its launcher, and a pure-torch reference.

Launchers edit tensors in place and run the reference when Triton cannot run (CPU
tensors without ``TRITON_INTERPRET=1``, or Triton not installed). The batch-invariant
kernels (``invariant_*``) return new tensors and leave the choice to their caller
(:class:`~trace_replay.engines.builtin.backends.invariant_model.InvariantLlama`): their reference is the CPU
path of deterministic mode, whose bits differ from the kernel's.
"""

from trace_replay.kernels.cache_attention import cache_attention, cache_attention_reference
from trace_replay.kernels.force_logits import force_trace_logits, force_trace_logits_reference
from trace_replay.kernels.invariant_attention import (
    attention_rows_reference,
    attention_rows_triton,
)
from trace_replay.kernels.invariant_linear import linear_rows_reference, linear_rows_triton
from trace_replay.kernels.invariant_rms_norm import rms_norm_rows_reference, rms_norm_rows_triton
from trace_replay.kernels.top_k import top_k_indices, top_k_indices_reference
from trace_replay.kernels.trace_tokens import apply_trace_tokens, apply_trace_tokens_reference
from trace_replay.kernels.trace_tokens_verified import (
    apply_trace_tokens_to_verified,
    apply_trace_tokens_to_verified_reference,
)

__all__ = [
    "cache_attention",
    "cache_attention_reference",
    "force_trace_logits",
    "force_trace_logits_reference",
    "attention_rows_reference",
    "attention_rows_triton",
    "linear_rows_reference",
    "linear_rows_triton",
    "rms_norm_rows_reference",
    "rms_norm_rows_triton",
    "top_k_indices",
    "top_k_indices_reference",
    "apply_trace_tokens",
    "apply_trace_tokens_reference",
    "apply_trace_tokens_to_verified",
    "apply_trace_tokens_to_verified_reference",
]
