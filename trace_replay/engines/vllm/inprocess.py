"""vLLM as a guest in the caller's process: started quietly, leaving the process as it was.

The vLLM engine runs its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
With its own processes, vLLM starts them with ``spawn``, and a spawned process re-imports the
caller's ``__main__``: an unguarded script ran once per process (three times on the CPU
build: engine core, worker, caller). In-process, vLLM's worker set-up acts on this
interpreter instead, and :func:`hosted_startup` undoes what it leaves behind:

* the CPU worker replaces ``torch.set_num_threads`` with a no-op that only warns, so the
  torch engine could never again choose its threads; the function and the thread count
  are put back;
* the worker seeds the global ``random``, NumPy and torch generators; their states are put
  back;
* the engine core freezes the garbage collector's heap (``gc.freeze``); it is unfrozen, so
  the caller's cyclic garbage is still collected;
* the platform sets environment variables for worker processes (``OMP_*``,
  ``TORCHINDUCTOR_COMPILE_THREADS``...); the environment is put back.

Start-up is offline, as every model load of the package is
(:func:`~trace_replay.models.load.offline`); processes started then inherit it.

Start-up is quiet unless ``verbose``: vLLM's logger is held at ERROR for the engine's life
(:class:`QuietLogs`), Python warnings raised during start-up are dropped, and lines printed
by C++ code to the process's stderr are held back and shown only if start-up fails. Where
start-up leaves processes running (tensor or pipeline parallelism: vLLM's executor starts one
worker process per device, with the engine core here or in its own process), stderr is not
held: those processes inherit it, and what they print later (a worker's traceback) must reach
the terminal, not a deleted file.

With several GPUs, :func:`multicast_off` keeps NVLink multicast off in the engine's processes
(NCCL, PyTorch symmetric memory, NVSHMEM) unless the user chose otherwise.

No vllm import here: this module also wraps the import of vllm itself.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from trace_replay.engines.vllm_contract import MULTICAST_OFF
from trace_replay.models.load import offline

__all__ = [
    "IN_PROCESS_ENV",
    "MULTICAST_OFF",
    "QuietLogs",
    "engine_core_mode",
    "hosted_startup",
    "multicast_off",
    "quiet_startup",
]

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_LOGGER = "vllm"


def engine_core_mode() -> str:
    """``"in-process"`` unless the user set ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` themselves."""
    return "own process" if os.environ.get(IN_PROCESS_ENV, "0") != "0" else "in-process"


class QuietLogs:
    """Hold vLLM's logger at ERROR until :meth:`restore` (no-op when ``verbose``)."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        logger = logging.getLogger(_LOGGER)
        self._previous = logger.level
        if not verbose:
            logger.setLevel(logging.ERROR)

    def restore(self) -> None:
        if not self.verbose:
            logging.getLogger(_LOGGER).setLevel(self._previous)


@contextlib.contextmanager
def _held_stderr() -> Iterator[None]:
    """Route file descriptor 2 to a temporary file; replay it if the block raises.

    C++ code (torch's ``TORCH_WARN``, vLLM's kernels) writes to the descriptor directly,
    past ``sys.stderr``.
    """
    try:
        fd = sys.__stderr__.fileno() if sys.__stderr__ is not None else 2
        saved = os.dup(fd)
    except (OSError, ValueError):  # no real descriptor (embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as held:
        sys.stderr.flush()
        os.dup2(held.fileno(), fd)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, fd)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)


@contextlib.contextmanager
def quiet_startup(verbose: bool, *, hold_stderr: bool = True) -> Iterator[None]:
    """Drop vLLM's log records below ERROR and Python warnings, hold back C-level stderr
    (unless ``hold_stderr`` is False), while vLLM imports or starts."""
    if verbose:
        yield
        return
    logs = QuietLogs(verbose)
    try:
        with warnings.catch_warnings(), _held_stderr() if hold_stderr else contextlib.nullcontext():
            warnings.simplefilter("ignore")
            yield
    finally:
        logs.restore()


@contextlib.contextmanager
def multicast_off(enabled: bool) -> Iterator[None]:
    """While the block runs (an engine starts its processes), set each of
    :data:`MULTICAST_OFF` the user has not set; then remove exactly those again."""
    added = {k: v for k, v in MULTICAST_OFF.items() if k not in os.environ} if enabled else {}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def hosted_startup(verbose: bool, *, workers: bool = False) -> Iterator[None]:
    """Start vLLM in this process, then put back what its start-up changed (module doc).

    ``workers``: start-up leaves processes running (tensor or pipeline parallelism), so
    stderr is not held back (they inherit it).
    """
    environ = dict(os.environ)
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    os.environ.setdefault(IN_PROCESS_ENV, "0")
    if not verbose:
        # vLLM's own logging set-up would put its logger back to INFO
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        # offline as every load of the package is; the processes it starts inherit it
        with offline(), quiet_startup(verbose, hold_stderr=not workers):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        gc.unfreeze()
        os.environ.clear()
        os.environ.update(environ)
