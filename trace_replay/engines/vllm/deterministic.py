"""vLLM's batch-invariant mode: where it exists, and switching it on for one engine start.

vLLM reads ``VLLM_BATCH_INVARIANT`` in the processes an ``LLM(...)`` starts (deterministic
attention, fixed-order reductions, no split-K GEMMs); its own docs list NVIDIA GPUs of
compute capability >= 8.0, AMD Instinct and Intel XPU. The CPU build has no such mode.
This module does not import vLLM, so ``make_engine("auto", deterministic=True)`` can ask.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["deterministic_unavailable", "deterministic_env"]

ENV = "VLLM_BATCH_INVARIANT"


def deterministic_unavailable(device: str | torch.device | None = None) -> str | None:
    """Why vLLM's batch-invariant mode cannot run here (None when it can)."""
    if device is not None and torch.device(device).type == "cpu":
        return "vLLM's batch-invariant mode runs on GPUs only, not on the CPU"
    if torch.cuda.is_available():
        if torch.version.hip is not None or torch.cuda.get_device_capability() >= (8, 0):
            return None
        return "vLLM's batch-invariant mode needs a GPU of compute capability >= 8.0"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return None
    return "vLLM's batch-invariant mode runs on GPUs only, not on this CPU build"


@contextlib.contextmanager
def deterministic_env(enabled: bool) -> Iterator[None]:
    """``VLLM_BATCH_INVARIANT=1`` while the block runs (an engine starts), then as before."""
    previous = os.environ.get(ENV)
    if enabled:
        os.environ[ENV] = "1"
    try:
        yield
    finally:
        if enabled:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous
