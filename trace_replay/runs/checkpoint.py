"""Resumable replays: finished traces in checksummed Parquet parts, keyed by their content.

What a checkpoint folder holds::

    settings.json          the engine settings of the run that made the folder
    part-<ns>-<sha>.parquet  finished traces; <sha> is the start of the file's SHA-256
    claims/<run>.claim     digests each live run is computing now (see claims.py)
    .lock                  the folder lock
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from trace_replay._io import remove_stale_temporaries, write_atomic
from trace_replay.engines.base import ReplayRequest
from trace_replay.runs.claims import Claims
from trace_replay.runs.parts import (
    PART_NAME,
    CorruptPart,
    not_saved,
    part_settings_key,
    read_part,
    write_checked,
)
from trace_replay.traces.trace import Trace

__all__ = [
    "BATCH_SETTINGS",
    "ROW_FIELDS",
    "Checkpoint",
    "call_size",
    "deterministic_run",
    "number_settings",
    "settings_key",
    "trace_digest",
]

# settings that size the engine's batches: they change no number of a batch-invariant run
BATCH_SETTINGS = ("batch_size",)


def settings_key(settings: dict) -> str:
    """A digest of the settings that decide the numbers (engine, model, dtype, top_k…)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def deterministic_run(settings: dict) -> bool:
    """Whether a run with these engine settings gives every trace the same bits whatever
    its batch: deterministic mode (torch and prefill engines), or vLLM's batch-invariant
    mode where it ran (``settings["deterministic_active"]``; False where the platform has none)."""
    return bool(settings.get("deterministic_active", settings.get("deterministic")))


def number_settings(settings: dict) -> dict:
    """``settings`` without those that change none of a trace's numbers: a batch-invariant
    run (:func:`deterministic_run`) drops :data:`BATCH_SETTINGS`, since deterministic mode
    guarantees every column of a trace's rows whatever ``batch_size`` (as well as
    ``chunk_size``, ``shard`` and the other traces, which are no engine settings)."""
    if not deterministic_run(settings):
        return dict(settings)
    return {key: value for key, value in settings.items() if key not in BATCH_SETTINGS}


# the Trace fields that to_frame copies into a trace's rows (ref_logprob, turn, role columns)
ROW_FIELDS = ("ref_logprobs", "trace_turns", "trace_roles")


def trace_digest(key: str, request: ReplayRequest, trace: Trace | None = None) -> str:
    """What a finished trace's rows depend on: the settings' ``key``, the trace id, the exact
    prompt and trace tokens of ``request``, and the ``ROW_FIELDS`` of ``trace`` (``None``:
    a trace without them), the values its rows copy."""
    digest = hashlib.sha256(key.encode())
    digest.update(json.dumps(request.trace_id).encode())
    for values in (request.prompt_token_ids, request.trace_token_ids):
        digest.update(len(values).to_bytes(8, "little"))
        digest.update(np.asarray(values, dtype="<i8").tobytes())
    for name in ROW_FIELDS:  # one JSON line each; floats as repr, so exact
        row = getattr(trace, name, None)
        digest.update(json.dumps(None if row is None else list(row)).encode() + b"\n")
    return digest.hexdigest()[:32]


def call_size(seconds_per_trace: float, *, batch_size: int, every_s: float, most: int) -> int:
    """Traces for the next engine call, given the last call's seconds per trace: about half
    the part interval ``every_s`` of compute, in whole batches of ``batch_size`` (at least
    one), at most ``most``. A single-process run and a cluster actor size their calls by
    this one rule, so both hand the engine the same work per call."""
    fit = int(every_s / 2 / max(seconds_per_trace, 1e-6))
    return min(most, max(batch_size, fit // batch_size * batch_size))


class Checkpoint:
    """The finished traces of one run's ``requests`` in a folder, and the claims on the rest.

    Invariants, whatever kills a run and when:

    * Every row carries ``trace_digest`` (settings, trace id, prompt and trace ids, and
      what the rows copy from the trace: ``ref_logprobs``, ``trace_turns``,
      ``trace_roles``). A trace is served from the folder only when its digest matches, so
      an edited trace is recomputed, never served stale. A folder written with other
      settings is refused; without its ``settings.json``, it is written again when every
      part records this run's settings key, else the folder is refused.
    * A part appears whole (temporary, then rename); its name carries the SHA-256 of its
      bytes, its pages carry CRCs, and its values are checked on read. A part failing any
      check is renamed ``*.corrupt`` with a warning, and its traces are recomputed. A
      folder or file named like a part but not one is skipped with a warning.
    * Rows are checked as a read would check them before they are written: impossible ones
      (a NaN logprob) are an :class:`~trace_replay.engines.validate.ImpossibleResult`
      naming the trace, step and problem, the batch's other traces saved. A run computes a
      trace at most ``max_computations`` times (its rows lost again: an error), so nothing
      loops.
    * Runs claim traces before computing them (:class:`~trace_replay.runs.claims.Claims`): two
      runs on one folder split the work; a dead run's claims are taken over.
    * A part is written every ``max_traces`` traces and every ``every_s`` seconds of
      compute (at engine-call granularity; calls shrink to fit ``every_s``).
    * Before a part is written, ``verify`` hears of its traces; when it raises (the
      engine's weights changed, :mod:`~trace_replay.runs.weights_watch`), the part's rows
      are dropped, never written, on the way out of the error too.

    The run loop: ``claim()`` traces, compute them, ``add()`` their frame; when ``claim()``
    gives nothing, ``waiting()`` sleeps while other runs hold claims on this run's traces,
    then ``read()`` gives the result. Leaving the ``with`` block on an error or Ctrl-C saves
    what was computed and drops this run's claims.

    Parameters
    ----------
    path
        The folder (created if missing).
    settings
        The engine's :func:`~trace_replay.engines.base.engine_identity`; the folder is keyed on their
        :func:`number_settings` (a deterministic run's folder takes any batch size).
    requests
        What this run replays; trace ids are unique.
    traces
        The tokenized traces by trace id, whose ``ROW_FIELDS`` the rows copy (missing: none).
    batch_size
        Engine calls take whole batches of this many traces where they can.
    max_traces, every_s
        A part at least every ``max_traces`` traces and ``every_s`` seconds.
    vocab_size
        The engine's vocabulary size: parts are checked against its bounds (ranks, token
        ids, the most likely token's logprob) as the engine's results were; ``None``: not.
    verify
        Called with the trace ids of each part before it is written, in the order they
        were computed; raising refuses the part (``None``: every part is written).
    """

    poll_s = 0.5  # how often a run waiting on other runs' claims looks again
    max_computations = 2  # a trace whose rows are lost again is an error, not a loop

    def __init__(
        self,
        path: str | os.PathLike,
        settings: dict,
        requests: Sequence[ReplayRequest],
        traces: Mapping[str, Trace] | None = None,
        *,
        batch_size: int = 1,
        max_traces: int = 32,
        every_s: float = 10.0,
        vocab_size: int | None = None,
        verify: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"checkpoint {self.path} exists and is not a folder")
        self.path.mkdir(parents=True, exist_ok=True)
        settings = number_settings(settings)
        self.key = settings_key(settings)
        self.top_k, self.vocab_size = settings.get("top_k"), vocab_size
        self.batch_size, self.max_traces, self.every_s = batch_size, max_traces, every_s
        self._verify = verify
        traces = traces or {}
        self._labelled = any(t.trace_roles is not None for t in traces.values())
        self._requests = {trace_digest(self.key, r, traces.get(r.trace_id)): r for r in requests}
        self._digest_of = {r.trace_id: d for d, r in self._requests.items()}
        self._todo = dict.fromkeys(self._requests)  # ordered: digests not known to be done
        self._held: Counter[str] = Counter()  # digest -> verified parts holding it
        self._parts: dict[str, frozenset[str]] = {}  # verified part name -> its digests
        self._checked: set[str] = set()  # parts whose rows were checked as read back
        self._buffer: list[pd.DataFrame] = []
        self._last_write = time.monotonic()
        self._group = min(batch_size, max_traces)
        self._claimed_at = time.monotonic()
        self._computed: Counter[str] = Counter()  # digest -> times this run claimed it
        self._lost: dict[str, str] = {}  # digest -> why its rows were last lost
        self._claims = Claims(self.path)
        try:
            with self._claims.locked():
                self._check_settings(settings)
                remove_stale_temporaries(self.path)
                self._scan()
        except BaseException:
            self._claims.close()
            raise
        self.resumed = sum(1 for d in self._requests if self._held[d])
        self.resumed_tokens = sum(r.trace_len for d, r in self._requests.items() if self._held[d])

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        try:
            if kind is not None:  # keep what finished before an error or Ctrl-C
                self._save_quietly()
        finally:
            self._claims.close()

    # -- the run loop ---------------------------------------------------------------------

    def claim(self, most: int | None = None) -> list[ReplayRequest]:
        """Claim the next traces to compute: unfinished, unclaimed, in request order.

        At most ``most`` of them (``None``: one engine call's, see ``add``); a run whose
        workers write the parts themselves (a cluster run) claims all it hands them.
        Returns an empty list when nothing is left to claim; :meth:`waiting` then says
        whether other runs still hold claims on this run's traces.
        """
        with self._claims.locked():
            self._scan()
            taken = self._claims.others() | self._claims.mine
            # a part holds at most max_traces: fill up what is buffered, no more
            size = most or min(self._group, self.max_traces - self._buffered())
            group, finished = self._next_unclaimed(taken, size)
            self._claims.set(self._claims.mine | set(group))
        for digest in finished + group:
            del self._todo[digest]
        self._claimed_at = time.monotonic()
        return [self._requests[d] for d in group]

    def _next_unclaimed(self, taken: set[str], size: int) -> tuple[list[str], list[str]]:
        """The first ``size`` digests to compute that no run holds, in request order, each
        counted as one more computation; and the finished ones passed on the way."""
        group: list[str] = []
        finished: list[str] = []
        for digest in self._todo:  # finished and claimed digests leave, so this stays short
            if self._held[digest]:
                finished.append(digest)
            elif digest not in taken:
                self._count_computation(digest)
                group.append(digest)
                if len(group) == size:
                    break
        return group, finished

    def _count_computation(self, digest: str) -> None:
        """Count one more computation of ``digest``; refuse one beyond ``max_computations``."""
        self._computed[digest] += 1
        if self._computed[digest] > self.max_computations:
            trace_id = self._requests[digest].trace_id
            raise RuntimeError(
                f"checkpoint {self.path}: trace {trace_id!r} was computed "
                f"{self.max_computations} times and its rows were lost each time (last: "
                f"{self._lost.get(digest, 'not written')}); stopped instead of computing it "
                "again (the finished traces are kept)"
            )

    def digest(self, request: ReplayRequest) -> str:
        """The ``trace_digest`` of one of this run's requests (what its part rows carry)."""
        return self._digest_of[request.trace_id]

    def add(self, frame: pd.DataFrame) -> None:
        """Keep the frame of the last claimed traces; a part is written when one is due."""
        traces = frame["trace_id"].nunique()
        seconds = time.monotonic() - self._claimed_at
        self._buffer.append(frame)
        self._group = call_size(
            seconds / max(traces, 1),
            batch_size=self.batch_size,
            every_s=self.every_s,
            most=self.max_traces,
        )
        self._save_if_due()

    def refresh(self) -> None:
        """Verify the parts written since the last look: other runs', or those of this
        run's workers (a cluster run's actors write their parts themselves)."""
        with self._claims.locked():
            self._scan()

    def waiting(self) -> bool:
        """Whether traces of this run are still claimed by other live runs (then sleep)."""
        self._save_if_due(force=True)
        if not any(not self._held[d] for d in self._todo):
            return False
        time.sleep(self.poll_s)
        return True

    def read(self) -> pd.DataFrame | None:
        """Every requested trace, one copy each, in request order, from verified parts; the
        ``turn`` and ``role`` columns only when a trace of this run has chat labels.

        Returns ``None`` when a part failed verification since it was first read: its
        traces are unfinished again and the run loop goes on.
        """
        self._save_if_due(force=True)
        if not self._requests:
            return pd.DataFrame()
        frames: list[pd.DataFrame] = []
        served: set[str] = set()
        for name in sorted(self._parts):
            wanted = self._parts[name] & (self._requests.keys() - served)
            if not wanted:
                continue
            try:
                frame = self._load(self.path / name)
            except (CorruptPart, FileNotFoundError) as error:
                with self._claims.locked():
                    self._discard(name, error)
                return None
            frames.append(frame[frame["trace_digest"].isin(wanted)])
            served |= wanted
        missing = self._requests.keys() - served
        if missing:  # claimed but never written (an engine that dropped a trace): claim again
            with self._claims.locked():
                self._claims.set(self._claims.mine - missing)
            self._lost.update(dict.fromkeys(missing, "no rows were written for it"))
            self._todo.update(dict.fromkeys(d for d in self._requests if d in missing))
            return None
        frame = pd.concat(frames, ignore_index=True)
        if not self._labelled:  # a chat run's part gives its plain traces null labels
            frame = frame.drop(columns=["turn", "role"], errors="ignore")
        return _in_request_order(frame, list(self._requests))

    # -- parts ----------------------------------------------------------------------------

    def _save_if_due(self, force: bool = False) -> None:
        if not self._buffer:
            return
        waited = time.monotonic() - self._last_write
        due = self._buffered() >= self.max_traces or waited >= self.every_s
        if force or due:
            frame = pd.concat(self._buffer, ignore_index=True)
            if self._verify is not None:
                try:
                    self._verify(frame["trace_id"].unique().tolist())
                except BaseException:
                    self._buffer = []  # rows that failed verification are never written
                    raise
            failed = self._write(frame)
            self._buffer = []
            if failed:
                raise not_saved(self.path, failed)

    def _drop_saved(self) -> None:
        """Drop from the buffer the traces a part in the folder holds, the parts not seen
        yet verified first. When the folder cannot be looked at, nothing is dropped: a
        trace saved twice is served once, while one not saved would be computed again."""
        try:
            with self._claims.locked():
                self._scan()
        except OSError:
            return
        held = {r.trace_id for d, r in self._requests.items() if self._held[d]}
        self._buffer = [
            kept
            for frame in self._buffer
            if not (kept := frame[~frame["trace_id"].isin(held)]).empty
        ]

    def _buffered(self) -> int:
        """Traces computed and not yet written (each frame holds whole traces)."""
        return sum(frame["trace_id"].nunique() for frame in self._buffer)

    def _save_quietly(self) -> None:
        """Save what is buffered on the way out of an error or Ctrl-C. A signal can land
        after a part is renamed into place and before the run notes it: the folder is
        looked at again first, and only traces no part holds are written, so each finished
        trace is saved once."""
        try:
            self._drop_saved()
            self._save_if_due(force=True)
        except Exception as error:  # noqa: BLE001 - the error that stopped the run matters more
            warnings.warn(
                f"checkpoint {self.path}: finished traces not saved ({error})",
                RuntimeWarning,
                stacklevel=3,
            )

    def _write(self, frame: pd.DataFrame) -> dict[str, list[str]]:
        """Write the traces of ``frame`` that pass a read's checks as a part; return what is
        wrong with the others (:func:`~trace_replay.runs.parts.check_rows`)."""
        frame = frame.assign(trace_digest=frame["trace_id"].map(self._digest_of))
        # what a read would refuse is never written, so no trace comes back to compute
        part, failed = write_checked(
            self.path,
            frame,
            self.key,
            top_k=self.top_k,
            requests=self._requests,
            vocab_size=self.vocab_size,
        )
        if part is None:
            return failed
        name = part.name
        digests = frozenset(frame.loc[~frame["trace_id"].isin(failed), "trace_digest"].unique())
        self._parts[name] = digests
        self._held.update(digests)
        self._last_write = time.monotonic()
        with self._claims.locked():
            self._claims.set(self._claims.mine - digests)
        return failed

    def _scan(self) -> None:
        """Verify parts not seen before (other runs', earlier runs'). Call under the lock."""
        for path in sorted(self.path.glob("part-*.parquet")):
            if path.name in self._parts or not os.path.lexists(path):
                continue  # seen, or moved aside by another run meanwhile
            if not path.is_file() or PART_NAME.match(path.name) is None:
                self._ignore(path)
                continue
            try:
                digests = frozenset(self._load(path)["trace_digest"].unique())
            except FileNotFoundError:  # moved aside by another run meanwhile
                continue
            except CorruptPart as error:
                self._discard(path.name, error)
                continue
            self._parts[path.name] = digests
            self._held.update(digests)

    def _ignore(self, path: Path) -> None:
        """Warn once about a folder or file named like a part that is none of this version's
        (its name not :data:`~trace_replay.runs.parts.PART_NAME`); nothing is read from it."""
        what = (
            "a folder"
            if path.is_dir()
            else "not a regular file"
            if not path.is_file()
            else "not a part written by this version of trace_replay (a part's name is "
            "part-<20-digit time in ns>-<16 hex digits of its SHA-256>.parquet)"
        )
        warnings.warn(
            f"checkpoint {path} is named like a part but is {what}; ignored, "
            "nothing is read from it",
            RuntimeWarning,
            stacklevel=5,
        )
        self._parts[path.name] = frozenset()

    def _discard(self, name: str, error: Exception) -> None:
        """Move a failed part aside; its traces count as unfinished. Call under the lock."""
        warnings.warn(
            f"checkpoint part {self.path / name} is corrupt ({error}); moved to "
            f"{name}.corrupt, its traces are recomputed",
            RuntimeWarning,
            stacklevel=4,
        )
        with_error = self.path / name
        if with_error.exists():
            os.replace(with_error, self.path / f"{name}.corrupt")
        digests = self._parts.pop(name, frozenset())
        self._held.subtract(digests)
        self._lost.update(dict.fromkeys(digests, f"part {name}: {error}"))
        self._todo.update(
            dict.fromkeys(d for d in digests if d in self._requests and not self._held[d])
        )

    def _load(self, path: Path) -> pd.DataFrame:
        """A part's verified rows; its values are checked at its first read only (later
        reads verify its bytes against the SHA-256 in its name)."""
        frame = read_part(
            path,
            top_k=self.top_k,
            requests=self._requests,
            vocab_size=self.vocab_size,
            check_values=path.name not in self._checked,
        )
        self._checked.add(path.name)
        return frame

    def _check_settings(self, settings: dict) -> None:
        """Store ``settings`` on first use, else refuse other ones. Call under the lock."""
        file = self.path / "settings.json"
        settings = json.loads(json.dumps(settings, default=str))
        if not os.path.lexists(file):
            self._check_parts_settings()
            write_atomic(file, lambda p: p.write_text(json.dumps(settings, indent=1)))
            return
        if not file.is_file():  # a FIFO would block the read, a folder cannot be read
            raise ValueError(f"checkpoint {file} is not a regular file; use a new folder")
        try:
            stored = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as error:
            raise ValueError(
                f"checkpoint {file} is unreadable ({error}); use a new folder"
            ) from None
        if stored != settings:
            changed = sorted(
                k for k in set(stored) | set(settings) if stored.get(k) != settings.get(k)
            )
            weights = (
                "; weights_digest is of the weights as they were when it was started, "
                "for vllm-server of the server's address and its scores of a fixed "
                "probe"
                if "weights_digest" in changed
                else ""
            )
            raise ValueError(
                f"checkpoint {self.path} was written with other settings "
                f"({', '.join(changed)}{weights}); use a new folder"
            )

    def _check_parts_settings(self) -> None:
        """With ``settings.json`` missing, refuse parts computed with other or unknown
        settings; warn when there are parts (all of this run's settings). Call under the lock."""
        parts = [
            p for p in self.path.glob("part-*.parquet") if p.is_file() and PART_NAME.match(p.name)
        ]
        other = []
        for part in parts:
            try:
                if part_settings_key(part) != self.key:
                    other.append(part.name)
            except (CorruptPart, FileNotFoundError):
                continue  # not a part to keep: the scan moves it aside
        if other:
            raise ValueError(
                f"checkpoint {self.path}: settings.json is missing, and its parts were computed "
                f"with other settings or do not record theirs ({len(other)} of {len(parts)}: "
                f"{other[0]}{', …' if len(other) > 1 else ''}); restore settings.json or use a "
                "new folder"
            )
        if parts:
            warnings.warn(
                f"checkpoint {self.path}: settings.json was missing; written again "
                "from this run's settings, with which its parts were computed",
                RuntimeWarning,
                stacklevel=5,
            )


def _in_request_order(frame: pd.DataFrame, digests: list[str]) -> pd.DataFrame:
    frame = frame.drop_duplicates(subset=["trace_digest", "step"], keep="first")
    frame = frame.assign(_order=pd.Index(digests).get_indexer(frame["trace_digest"]))
    return (
        frame.sort_values(["_order", "step"], kind="stable")
        .drop(columns=["_order", "trace_digest"])
        .reset_index(drop=True)
    )
