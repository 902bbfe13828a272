"""How many intra-op threads a CPU engine uses, set only while it runs.

torch's default is one OpenMP thread per core. A decode step is hundreds of small ops, each
a parallel region that ends at a barrier where finished threads spin for the others; when
any other process holds a core (a notebook kernel, vLLM's worker busy-looping after each
step, another shard of the same run), a thread waits a whole scheduler slice there. So a
CPU engine keeps one core free for everything else, as vLLM's CPU worker does for its
scheduler: all CPUs this process may use but one, at least one, never more than the
caller's own setting.
``OMP_NUM_THREADS``, when set, decides instead. The caller's setting is put back after each
run, so an engine never changes the threads of the code around it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["available_cpus", "engine_threads", "intra_op_threads"]


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    # os.cpu_count() is None where it cannot tell
    count = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, count or 1)


def engine_threads() -> int:
    """Intra-op threads for a CPU engine's run (module docstring)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, min(torch.get_num_threads(), available_cpus() - 1))


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (``None``: unchanged), then restore."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
