"""A cluster run's worker: one engine per Ray actor, scoring batches into checkpoint parts.

Nothing here imports Ray: the driver makes :class:`ReplayActor` a Ray actor
(``ray.remote(ReplayActor)``) and calls its :meth:`~ReplayActor.score` with one part's
traces at a time, packed by :func:`pack`. The actor writes the parts a single-process run
writes (:func:`~trace_replay.runs.parts.write_checked`, the run's settings key), so a
folder is shared between both kinds of run, and a killed actor or driver loses only the
traces in flight.
"""

from __future__ import annotations

import json
import pickle
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from trace_replay._io import HOST
from trace_replay.engines import make_engine
from trace_replay.engines.base import ReplayRequest, engine_identity
from trace_replay.engines.moving_weights import MovingWeights
from trace_replay.runs.checkpoint import call_size, settings_key
from trace_replay.runs.frame import TokenDecoder, run_checked
from trace_replay.runs.parts import PART_NAME, not_saved, write_checked
from trace_replay.runs.weights_watch import WeightsWatch

__all__ = ["EngineFacts", "ReplayActor", "engine_facts", "pack"]


@dataclass(frozen=True)
class EngineFacts:
    """What the driver of a cluster run needs of the engine its actors build."""

    name: str
    stats: dict[str, Any]  # engine.stats() of an engine that ran nothing
    # engine_identity(engine): its settings and weights' digest, the run's attrs and what
    # the folder is keyed on
    keyed: dict[str, Any]
    vocab_size: int | None
    max_model_len: int | None
    batch_size: int
    tokenizer: Any


def engine_facts(options: Mapping[str, Any]) -> EngineFacts:
    """Build the engine as each actor will (``make_engine(**options)``), say what it is,
    and close it."""
    with make_engine(**options) as engine:
        return EngineFacts(
            engine.name,
            engine.stats(),
            engine_identity(engine),
            engine.vocab_size,
            engine.max_model_len,
            engine.batch_size,
            engine.tokenizer,
        )


def pack(items: list[tuple[str, ReplayRequest, Any]]) -> bytes:
    """One part's traces for :meth:`ReplayActor.score`: ``(trace_digest, request, tokenized
    trace)`` each, pickled, so that the driver decides what a call holds."""
    return pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)


class ReplayActor:
    """One engine, built once, that scores batches of a cluster run into checkpoint parts.

    A batch's traces already in a part of the folder are skipped, so a batch Ray retries
    after its actor died recomputes none that were written; the others are scored in
    engine calls sized as a single-process run sizes them
    (:func:`~trace_replay.runs.checkpoint.call_size`: one engine batch first, then about
    half of ``every_s`` of compute in whole batches, so both paths hand the engine the same
    work per call; :func:`~trace_replay.runs.frame.run_checked`), and a part is
    written when ``every_s`` seconds passed since the last one and at the batch's end, on an
    error too (the possible traces of a failed engine call included). The folder's parts
    are read by the driver, which verifies them; here only their ``trace_digest`` column
    is read, to skip. An engine whose weights can change under it (a server) has its
    weights read again before each part (:mod:`~trace_replay.runs.weights_watch`), as a
    single-process run does: a change is a ``WeightsChanged`` for the driver, and the part
    is not written.

    A failure to start (an engine that cannot be built, a folder this node cannot see,
    settings other than the run's) is raised at the first batch, as it was raised: an
    error in a Ray actor's constructor would reach the driver as Ray's own error instead.

    Parameters
    ----------
    options
        ``make_engine``'s arguments, the same for every actor.
    folder
        The checkpoint folder; the driver wrote its ``settings.json`` before the pool
        started, so a node that does not find it does not share the driver's storage.
    keyed
        The run's ``engine_identity`` (the driver's probe); this actor's engine must
        have the same.
    labelled
        Whether the rows get ``turn`` and ``role`` columns (a chat trace in the run).
    every_s
        Seconds of compute after which finished traces are written.
    """

    def __init__(
        self,
        options: Mapping[str, Any],
        folder: str,
        keyed: Mapping[str, Any],
        *,
        labelled: bool,
        every_s: float,
    ) -> None:
        self.folder, self.labelled, self.every_s = Path(folder), labelled, every_s
        self.instance = f"{HOST}:{uuid.uuid4().hex[:8]}"  # a restarted actor is a new one
        self.calls = 0
        self.written: set[str] = set()  # digests in the parts seen so far
        self._seen_parts: set[str] = set()
        self.failure: BaseException | None = None
        self.watch: WeightsWatch | None = None  # for an engine whose weights can change
        try:
            self._start(options, keyed)
        except Exception as error:  # noqa: BLE001 - raised at the first batch, see above
            self.failure = error

    def _start(self, options: Mapping[str, Any], keyed: Mapping[str, Any]) -> None:
        if not (self.folder / "settings.json").is_file():
            raise FileNotFoundError(
                f"checkpoint {self.folder} is not visible on node {HOST}: a cluster run's "
                "checkpoint folder must be on storage every node mounts at that path "
                "(pass checkpoint= such a folder)"
            )
        self.engine = make_engine(**options)
        self.batch = max(self.engine.batch_size, 1)
        self.group = self.batch  # traces of the next engine call (call_size)
        mine = json.loads(json.dumps(engine_identity(self.engine), default=str))
        wanted = json.loads(json.dumps(dict(keyed), default=str))
        if mine != wanted:
            changed = sorted(k for k in set(mine) | set(wanted) if mine.get(k) != wanted.get(k))
            raise ValueError(
                f"the engine of an actor on {HOST} has other settings than the "
                f"run's ({', '.join(changed)}): every actor of a cluster run must "
                "compute the same numbers; run it on nodes of one kind"
            )
        self.key = settings_key(dict(keyed))
        self.decode = TokenDecoder(self.engine.tokenizer)
        self.limits = {"top_k": keyed.get("top_k"), "vocab_size": self.engine.vocab_size}
        # an engine whose weights can change under it (a server): read again before a part
        if isinstance(self.engine, MovingWeights) and self.engine.weights_can_change is True:
            self.watch = WeightsWatch(
                self.engine, keyed.get("weights_digest"), kept_in=f"checkpoint {self.folder}"
            )

    def ready(self) -> str:
        """This actor's name (host and a random suffix), once its engine is built (or failed
        to be: that failure is raised at the first batch); the driver counts the answers."""
        return self.instance

    def score(self, packed: bytes) -> dict[str, np.ndarray]:
        """Score the unwritten traces of one part (:func:`pack`'s) into parts; one summary
        row per trace, or one row whose ``error`` holds the pickled error that stopped the
        batch (returned, not raised, so that it reaches the driver as it was raised)."""
        try:
            if self.failure is not None:
                raise self.failure
            return self._score(pickle.loads(packed))
        except Exception as error:  # noqa: BLE001 - every error goes to the driver as it is
            return self._rows([], error=_portable(error))

    def _score(self, items: list[tuple[str, ReplayRequest, Any]]) -> dict[str, np.ndarray]:
        self._look_for_parts()
        todo = [(digest, request) for digest, request, _ in items if digest not in self.written]
        requests = dict(todo)
        traces = {trace.id: trace for _, _, trace in items}
        digest_of = {request.trace_id: digest for digest, request in todo}
        buffer: list[pd.DataFrame] = []
        last = time.monotonic()
        try:
            start = 0
            while start < len(todo):
                group = [request for _, request in todo[start : start + self.group]]
                start += len(group)
                began = time.monotonic()
                buffer.append(
                    run_checked(
                        self.engine,
                        group,
                        traces,
                        self.decode,
                        limits=self.limits,
                        keep=buffer.append,
                        labelled=self.labelled,
                    )
                )
                # the next call sized as a single-process run sizes its calls
                self.group = call_size(
                    (time.monotonic() - began) / len(group),
                    batch_size=self.batch,
                    every_s=self.every_s,
                    most=len(items),
                )
                if time.monotonic() - last >= self.every_s:
                    self._save(buffer, digest_of, requests)
                    buffer, last = [], time.monotonic()
        except BaseException:
            self._save_quietly(buffer, digest_of, requests)
            raise
        self._save(buffer, digest_of, requests)
        self.calls += 1
        return self._rows(items)

    def _rows(
        self, items: list[tuple[str, ReplayRequest, Any]], *, error: bytes = b""
    ) -> dict[str, np.ndarray]:
        """The summary of a batch: per trace, its tokens; this actor's stats so far; or an
        error, alone in one row."""
        rows = max(len(items), 1)
        stats = json.dumps(self.engine.stats(), default=str) if self.failure is None else "{}"
        return {
            "trace_id": np.array([r.trace_id for _, r, _ in items] or [""], dtype=object),
            "tokens": np.array([r.trace_len for _, r, _ in items] or [0], dtype=np.int64),
            "instance": np.array([self.instance] * rows, dtype=object),
            "calls": np.full(rows, self.calls, dtype=np.int64),
            "stats": np.array([stats] * rows, dtype=object),
            "error": np.array([error] * rows, dtype=object),
        }

    def _save(
        self,
        frames: list[pd.DataFrame],
        digest_of: Mapping[str, str],
        requests: Mapping[str, ReplayRequest],
    ) -> None:
        """Write ``frames`` as one part; refuse (after writing the others) impossible rows.
        Traces this actor already wrote are left out, so a save on the way out of an error
        raised after a part was written (a refused trace) writes its batch-mates once."""
        if not frames:
            return
        frame = pd.concat(frames, ignore_index=True)
        frame = frame.assign(trace_digest=frame["trace_id"].map(digest_of))
        frame = frame[~frame["trace_digest"].isin(self.written)]
        if frame.empty:
            return
        if self.watch is not None:
            try:
                self.watch.check(frame["trace_id"].unique().tolist())
            except BaseException:
                frames.clear()  # rows that failed verification are never written
                raise
        part, failed = write_checked(self.folder, frame, self.key, requests=requests, **self.limits)
        if part is not None:
            self._seen_parts.add(part.name)
            self.written.update(frame.loc[~frame["trace_id"].isin(failed), "trace_digest"].unique())
        if failed:
            raise not_saved(self.folder, failed)

    def _save_quietly(
        self,
        frames: list[pd.DataFrame],
        digest_of: Mapping[str, str],
        requests: Mapping[str, ReplayRequest],
    ) -> None:
        try:
            self._save(frames, digest_of, requests)
        except Exception as error:  # noqa: BLE001 - the error that stopped the batch matters more
            warnings.warn(
                f"checkpoint {self.folder}: finished traces not saved ({error})",
                RuntimeWarning,
                stacklevel=2,
            )

    def _look_for_parts(self) -> None:
        """Add the digests of parts not seen before to ``written`` (unverified: the driver's
        read verifies every part, and recomputes the traces of one that fails)."""
        import pyarrow.parquet as pq

        for path in self.folder.glob("part-*.parquet"):
            if path.name in self._seen_parts or PART_NAME.match(path.name) is None:
                continue
            self._seen_parts.add(path.name)
            try:
                column = pq.read_table(path, columns=["trace_digest"]).column(0)
            except Exception:  # noqa: BLE001 - unreadable: left to the driver's verified read
                continue
            self.written.update(column.unique().to_pylist())


def _portable(error: BaseException) -> bytes:
    """``error`` pickled, as a RuntimeError naming its type when it cannot make the trip."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - any error that does not survive pickling
        data = pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))
    return data
