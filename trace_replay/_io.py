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
import stat
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["write_atomic", "write_target", "remove_stale_temporaries", "pid_alive", "HOST"]

# host names may hold dots and other characters; temporaries are parsed on dots
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"
_TEMPORARY = re.compile(
    r"^\.(?P<target>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$"
)


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


def write_target(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """The file a write to ``path`` replaces: ``path``, or the final target of a symlink.

    Renaming a new file onto anything but a regular file would destroy it (a device such as
    ``/dev/full``, a FIFO, a socket, a folder), and renaming onto a symlink would replace the
    link, so those are refused with a ``ValueError`` naming ``path``; a link is written
    through. So is the file of one of ``inputs``, however either path is spelled (relative,
    through a link, a hard link), and a path ending with a slash (a folder's name). A path
    that does not exist yet (or a dangling link's target) is returned as is.
    """
    if os.fspath(path).endswith(("/", os.sep)) and not os.path.isdir(path):
        raise ValueError(
            f"{path} ends with {os.sep}, so it names a folder; name the file "
            "to write (e.g. r.parquet in it)"
        )
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new path (its folder: the writer's)
        return target
    via = f" (a link to {target})" if os.path.islink(path) else ""
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else _KINDS.get(stat.S_IFMT(mode), "not a file")
        raise ValueError(f"{path}{via} is {kind}, not a regular file: refusing to replace it")
    for source in inputs:
        if os.path.exists(source) and os.path.samefile(target, source):
            raise ValueError(
                f"{path}{via} is the input file {source}: writing it would "
                "destroy the input; choose another path"
            )
    return target


_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def write_atomic(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Call ``write(temporary)`` on a file beside ``path``, then rename it onto ``path``.

    ``path`` is checked by :func:`write_target` first: a symlink is written through (the
    link stays), anything but a regular file or a new path is refused. Dead writers'
    temporaries of it are removed first. An ``OSError`` (no space, no permission…) is raised
    again naming ``path``, not the temporary.
    """
    path = write_target(path)
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
