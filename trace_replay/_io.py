"""Atomic file writes: readers never see a partial file, and a crash's temporary is cleaned.

A temporary is named ``.{target}.{host}.{pid}.{random}.tmp`` beside its target, so a later
writer on the same host can tell a dead process's leftover (removed) from a live writer's
file (kept). A temporary from another host, or from a reused pid, is kept: removing a live
writer's file would be worse than leaving a dead one's.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_atomic", "remove_stale_temporaries", "pid_alive", "HOST"]

# host names may hold dots and other characters; temporaries are parsed on dots
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"
_TEMPORARY = re.compile(
    r"^\.(?P<target>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temporaries(folder: str | os.PathLike, target: str | None = None) -> list[Path]:
    """Remove temporaries in ``folder`` whose writer, a process of this host, is dead.

    Parameters
    ----------
    folder
        Where the temporaries lie.
    target
        Only temporaries of this file name (``None``: of any file).

    Returns
    -------
    list of Path
        The removed files.
    """
    removed = []
    pattern = f".{target}.*.tmp" if target is not None else ".*.tmp"
    for path in Path(folder).glob(pattern):
        match = _TEMPORARY.match(path.name)
        if match is None or match["host"] != HOST or (target and match["target"] != target):
            continue
        if not pid_alive(int(match["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(temporary)`` on a file beside ``path``, then rename it onto ``path``.

    Dead writers' temporaries of ``path`` are removed first. An ``OSError`` (no space,
    no permission…) is raised again naming ``path``, not the temporary.
    """
    path = Path(path)
    remove_stale_temporaries(path.parent, path.name)
    temporary = path.with_name(f".{path.name}.{HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno is None:
            raise OSError(f"cannot write {path}: {reason}") from error
        # OSError(errno, ...) picks the matching subclass (PermissionError, ...)
        raise OSError(error.errno, f"cannot write {path}: {reason}") from error
    finally:
        temporary.unlink(missing_ok=True)
