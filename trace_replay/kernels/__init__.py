"""Trace-replay kernels: each a Triton kernel, its launcher, and a pure-torch reference.

Launchers edit tensors in place and run the reference when Triton cannot run (CPU
tensors without ``TRITON_INTERPRET=1``, or Triton not installed).
"""

from trace_replay.kernels.trace_tokens import apply_trace_tokens, apply_trace_tokens_reference
from trace_replay.kernels.verified import (
    apply_trace_tokens_to_verified,
    apply_trace_tokens_to_verified_reference,
)

__all__ = [
    "apply_trace_tokens",
    "apply_trace_tokens_reference",
    "apply_trace_tokens_to_verified",
    "apply_trace_tokens_to_verified_reference",
]
