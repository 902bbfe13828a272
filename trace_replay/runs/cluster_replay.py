"""``replay(..., cluster="ray")``: a trace set through a pool of Ray actors, one frame back.

The driver (this process) does what a single-process run does around its engine calls, with
the same code: it builds the engine once on the cluster to learn what the actors' engines
are (settings, tokenizer, context length: :func:`~trace_replay.runs.cluster_actor.
engine_facts`), tokenizes and checks the traces, opens the checkpoint folder (settings
refused as ever, finished traces skipped, claims held for the traces it hands out), and
hands the rest, a part's traces at a time, to Ray actors, one engine per actor
(:class:`~trace_replay.runs.cluster_actor.ReplayActor`), which write checkpoint parts
themselves. It then reads the folder as a single-process run reads it: every part verified,
one copy of each trace, in order, the same attrs plus ``attrs["cluster"]``.

The actors are plain Ray Core actors (``max_restarts=-1``, ``max_task_retries=-1``: a killed
one is started again and its part handed to it again), created with their few small
arguments inline, so Ray keeps nothing of theirs in the object store, and killed after the
run: nothing of the run stays on a cluster it joined.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from trace_replay.engines.base import ReplayRequest
from trace_replay.runs.checkpoint import Checkpoint
from trace_replay.runs.cluster import ClusterPlan, RayCluster, connect, import_ray, plan_actors
from trace_replay.runs.cluster_actor import EngineFacts, ReplayActor, engine_facts, pack
from trace_replay.runs.frame import TokenDecoder
from trace_replay.runs.stages import finish_frame, prepare_run, resuming_message, run_attrs
from trace_replay.traces.sets import TraceSet

__all__ = ["replay_on_ray"]

# engine counters that add up over actors; other stats are one value when the actors agree
_SUMMED_STATS = ("forwards", "server_requests", "server_retries")


def replay_on_ray(
    traceset: TraceSet,
    cluster: RayCluster,
    options: dict[str, Any],
    *,
    progress: bool,
    checkpoint: str | os.PathLike | None,
    shard: tuple[int, int] | None,
    truncate: bool,
    chunk_size: int | None,
    checkpoint_every: float,
    started: str,
    digest: str,
) -> pd.DataFrame:
    """Replay ``traceset`` (loaded, sharded) on ``cluster``; :func:`~trace_replay.runs.replay`'s
    frame, with ``attrs["cluster"]`` (address, actors and their resources, Ray's version).

    ``options`` are ``make_engine``'s arguments, each actor's the same. Without a
    ``checkpoint`` the parts go to a temporary folder, removed after the run (on one
    machine; a cluster of several needs a folder every node mounts). The progress bar
    names each start-up phase (connecting, the probe engine, the actors' engines loaded)
    until tokens are counted.
    """
    ray = import_ray()
    with tqdm(
        total=None, unit="tok", disable=not progress, desc=f"replay[{options.get('name')} on ray]"
    ) as bar:
        bar.set_postfix_str("connecting to Ray")
        with connect(cluster, verbose=options.get("verbose", False)) as address:
            plan = plan_actors(cluster, options.get("device"), ray.cluster_resources())
            options = {**options, "device": plan.device}
            bar.set_postfix_str("loading the engine once on the cluster (probe)")
            facts = _probe(ray, options, plan)
            traceset, requests, notes = prepare_run(
                traceset,
                tokenizer=facts.tokenizer,
                vocab_size=facts.vocab_size,
                max_model_len=facts.max_model_len,
                top_k=facts.keyed.get("top_k", 0),
                truncate=truncate,
            )
            batch = max(facts.batch_size, 1)
            # whole engine batches, at most 4 per part, and work for every actor
            chunk = chunk_size or max(1, min(4 * batch, -(-len(requests) // plan.actors)))
            bar.set_description(f"replay[{facts.name} on ray ×{plan.actors}]")
            bar.reset(total=sum(r.trace_len for r in requests))
            with _folder(checkpoint) as folder:
                result, resumed, stats = _run(
                    ray,
                    traceset,
                    requests,
                    facts,
                    options,
                    plan,
                    folder=folder,
                    named=checkpoint is not None,
                    chunk=chunk,
                    every_s=checkpoint_every,
                    bar=bar,
                )
    result = finish_frame(result, traceset, TokenDecoder(facts.tokenizer))
    # the keyed settings carry the weights' digest, as a single-process run's attrs do
    result.attrs = run_attrs(
        facts.keyed,
        stats,
        traceset=traceset,
        requests=requests,
        num_tokens=len(result),
        vocab_size=facts.vocab_size,
        resumed=resumed,
        notes=notes,
        shard=shard,
        digest=digest,
        started=started,
    )
    result.attrs["cluster"] = {
        "kind": "ray",
        "address": address,
        "actors": plan.actors,
        "num_cpus": plan.num_cpus,
        "num_gpus": plan.num_gpus,
        "ray": ray.__version__,
    }
    return result


def _run(
    ray: Any,
    traceset: TraceSet,
    requests: list[ReplayRequest],
    facts: EngineFacts,
    options: dict[str, Any],
    plan: ClusterPlan,
    *,
    folder: Path,
    named: bool,
    chunk: int,
    every_s: float,
    bar: tqdm,
) -> tuple[pd.DataFrame | None, int, dict[str, Any]]:
    """The checkpoint loop of a single-process run, a pass over the actors where it calls
    the engine.

    Returns the rows, the traces served from the folder, and the actors' stats combined.
    """
    by_id = {t.id: t for t in traceset}
    actor_args = {
        "options": options,
        "folder": str(folder),
        "keyed": facts.keyed,
        "labelled": any(t.trace_roles is not None for t in traceset),
        "every_s": every_s,
    }
    reports: dict[str, tuple[int, dict]] = {}  # actor instance -> (its calls, its stats)
    with (
        Checkpoint(
            folder,
            facts.keyed,
            requests,
            by_id,
            batch_size=facts.batch_size,
            max_traces=chunk,
            every_s=every_s,
        ) as store,
        _Actors(ray, plan, actor_args, bar) as actors,
    ):
        bar.update(store.resumed_tokens)
        if store.resumed and not bar.disable and named:
            bar.write(resuming_message(folder, store, len(requests)), file=sys.stderr)

        def report(rows: Mapping[str, np.ndarray]) -> None:
            bar.update(int(rows["tokens"].sum()))
            for instance, calls, stats in zip(rows["instance"], rows["calls"], rows["stats"]):
                if calls >= reports.get(instance, (0, None))[0]:
                    reports[instance] = (int(calls), json.loads(stats))

        result = None
        while result is None:
            group = store.claim(most=len(requests))  # all of them: the actors write parts
            if group:
                items = [(store.digest(r), r, by_id[r.trace_id]) for r in group]
                actors.run(
                    [pack(items[i : i + chunk]) for i in range(0, len(items), chunk)], report=report
                )
                store.refresh()
            elif not store.waiting():  # other runs hold claims on our traces: wait
                result = store.read()  # None: a part failed verification, go on
        bar.update(max(bar.total - bar.n, 0))
    stats = [s for _, s in reports.values()] or [facts.stats]
    return result, store.resumed, _combined(stats)


class _Actors:
    """The run's actors: started at its first pass (as many as that pass has parts, at most
    the plan's), one part at a time each (an idle actor takes the next; a restarted one is
    handed its own again by Ray), and killed when the run ends, failed or not.

    The bar's postfix counts the actors whose engine is loaded until all are.
    """

    def __init__(self, ray: Any, plan: ClusterPlan, args: dict[str, Any], bar: tqdm) -> None:
        self.ray, self.plan, self.args, self.bar = ray, plan, args, bar
        self.actors: list[Any] = []
        self.loading: dict[Any, Any] = {}  # ready() call -> its actor, until it answers

    def __enter__(self) -> _Actors:
        return self

    def __exit__(self, *_: object) -> None:
        for actor in self.actors:
            self.ray.kill(actor)  # no restart: the run is over
        self.actors.clear()

    def _start(self, count: int) -> None:
        remote = self.ray.remote(ReplayActor).options(
            num_cpus=self.plan.num_cpus,
            num_gpus=self.plan.num_gpus,
            max_restarts=-1,
            max_task_retries=-1,
        )
        self.actors = [remote.remote(**self.args) for _ in range(count)]
        self.loading = {actor.ready.remote(): actor for actor in self.actors}
        self._loaded()

    def _loaded(self) -> None:
        waiting = len(self.loading)
        self.bar.set_postfix_str(
            f"{len(self.actors) - waiting}/{len(self.actors)} actors' engines loaded"
            if waiting
            else "",
            refresh=True,
        )

    def run(
        self, parts: list[bytes], *, report: Callable[[Mapping[str, np.ndarray]], None]
    ) -> None:
        """Score ``parts`` (packed, a part's traces each); ``report`` hears of each. The
        first error an actor returns is raised; the parts written before it stay."""
        if not self.actors:
            self._start(min(self.plan.actors, len(parts)))
        queue = collections.deque(parts)
        calls = dict(self.loading)  # call -> actor; an actor with no call is idle
        busy = set(calls.values())
        for actor in self.actors:
            if actor not in busy and queue:
                calls[actor.score.remote(queue.popleft())] = actor
        while calls:
            (done,), _ = self.ray.wait(list(calls), num_returns=1)
            actor = calls.pop(done)
            answer = self.ray.get(done)
            if done in self.loading:
                del self.loading[done]
                self._loaded()
            else:
                failed = [error for error in answer["error"] if error]
                if failed:  # stops the pass; the parts written so far stay
                    raise pickle.loads(failed[0])
                report(answer)
            if queue:
                calls[actor.score.remote(queue.popleft())] = actor


def _probe(ray: Any, options: dict[str, Any], plan: ClusterPlan) -> EngineFacts:
    """Build the engine once on the cluster, with an actor's resources, to learn its facts;
    an error building it is raised here as it was raised there."""
    # its worker process exits after it (max_calls=1), so that the memory its engine held,
    # a GPU's included, is free before the actors start
    remote = ray.remote(num_cpus=plan.num_cpus, num_gpus=plan.num_gpus, max_calls=1)(
        _facts_or_error
    )
    answer = ray.get(remote.remote(options))
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _facts_or_error(options: dict[str, Any]) -> EngineFacts | BaseException:
    try:
        return engine_facts(options)
    except Exception as error:  # noqa: BLE001 - returned, so that Ray does not rewrap it
        return error


def _combined(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The actors' stats as one: counters summed, others one value when all agree, else
    one per actor."""
    combined: dict[str, Any] = {}
    for key in dict.fromkeys(k for each in stats for k in each):
        values = [each.get(key) for each in stats]
        if key in _SUMMED_STATS and all(isinstance(v, int) for v in values):
            combined[key] = sum(values)
        else:
            combined[key] = values[0] if all(v == values[0] for v in values) else values
    return combined


@contextlib.contextmanager
def _folder(checkpoint: str | os.PathLike | None) -> Iterator[Path]:
    """The run's checkpoint folder: the one given, else a temporary one removed after."""
    if checkpoint is not None:
        yield Path(checkpoint)
        return
    folder = Path(tempfile.mkdtemp(prefix="trace_replay-ray-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
