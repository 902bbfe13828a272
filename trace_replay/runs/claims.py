"""Claims: which traces each live run on a checkpoint folder is computing now.

Two runs on one folder split the work: a run claims traces before computing them, and the
others skip what a live run has claimed. A run's liveness is a lock the kernel keeps for it:
the run holds an exclusive ``flock`` on its own claim file for its whole life, and the
kernel drops the lock when the process ends, however it ends (``kill -9`` included). A run
that can take the lock of a claim file knows its owner is dead and removes the file, which
frees its traces. All bookkeeping happens under one folder-wide ``flock``, held for
milliseconds, so no run ever reads a half-written claim.

Without ``fcntl`` (Windows) there is no locking: runs on one folder are not coordinated.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

from trace_replay._io import HOST

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]  # checked for None before each use

__all__ = ["Claims"]


class Claims:
    """This run's claims in ``folder/claims/``, and a view of the other live runs' claims.

    Parameters
    ----------
    folder
        The checkpoint folder (created by the caller).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder / "claims"
        self.owner = f"{HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.mine: frozenset[str] = frozenset()
        # opening a FIFO named .lock would block forever; a file named claims cannot hold claims
        for path, kind, right in (
            (folder / ".lock", "a regular file", os.path.isfile),
            (self.folder, "a folder", os.path.isdir),
        ):
            if os.path.lexists(path) and not right(path):
                raise ValueError(f"checkpoint {path} is not {kind}; use a new folder")
        self._lock = open(folder / ".lock", "a")  # noqa: SIM115 - held for the run's life
        self._own: TextIO | None = None
        with self.locked():
            self.folder.mkdir(exist_ok=True)
            # created under the folder lock: no other run can see it before it is locked
            self._own = open(self.folder / f"{self.owner}.claim", "w")  # noqa: SIM115
            if fcntl is not None:
                fcntl.flock(self._own, fcntl.LOCK_EX | fcntl.LOCK_NB)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder-wide lock (blocks while another run does its bookkeeping)."""
        if fcntl is None:
            yield
            return
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def others(self) -> set[str]:
        """Digests claimed by other live runs; dead runs' claim files are removed.

        Call under :meth:`locked`.
        """
        taken: set[str] = set()
        if fcntl is None:
            return taken
        for path in self.folder.glob("*.claim"):
            if path.name == f"{self.owner}.claim" or not path.is_file():
                continue  # ours, or not a claim any run writes (a FIFO, a folder)
            try:
                file = open(path, "r+")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                continue
            with file:
                try:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its run is alive
                    taken.update(line for line in file.read().split() if line)
                    continue
                path.unlink(missing_ok=True)  # its run died: the kernel released its lock
        return taken

    def set(self, digests: Iterable[str]) -> None:
        """Make ``digests`` this run's claims. Call under :meth:`locked`."""
        self.mine = frozenset(digests)
        assert self._own is not None, "claims set after close"
        self._own.seek(0)
        self._own.truncate()
        self._own.write("".join(f"{digest}\n" for digest in sorted(self.mine)))
        self._own.flush()

    def close(self) -> None:
        """Drop every claim of this run (its claim file goes; so does its lock)."""
        if self._own is None:
            return
        with self.locked():
            (self.folder / f"{self.owner}.claim").unlink(missing_ok=True)
            self._own.close()
            self._own = None
            self.mine = frozenset()
        self._lock.close()
