"""``replay(..., cluster="ray")``: a trace set through a Ray Data actor pool, one frame back.

The driver (this process) does what a single-process run does around its engine calls, with
the same code: it builds the engine once on the cluster to learn what the actors' engines
are (settings, tokenizer, context length: :func:`~trace_replay.runs.cluster_actor.
engine_facts`), tokenizes and checks the traces, opens the checkpoint folder (settings
refused as ever, finished traces skipped, claims held for the traces it hands out), and
streams the rest through ``map_batches`` over an actor pool, one engine per actor
(:class:`~trace_replay.runs.cluster_actor.ReplayActor`), which write checkpoint parts
themselves. It then reads the folder as a single-process run reads it: every part verified,
one copy of each trace, in order, the same attrs plus ``attrs["cluster"]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
from trace_replay.runs.cluster_actor import ITEMS, EngineFacts, ReplayActor, engine_facts, pack
from trace_replay.runs.frame import TokenDecoder
from trace_replay.runs.stages import finish_frame, prepare_run, resuming_message, run_attrs
from trace_replay.traces.sets import TraceSet

__all__ = ["replay_on_ray"]

# engine counters that add up over actors; other stats are one value when the actors agree
_SUMMED_STATS = ("forwards", "server_requests", "server_retries")


def replay_on_ray(traceset: TraceSet, cluster: RayCluster, options: dict[str, Any], *,
                  progress: bool, checkpoint: str | Path | None,
                  shard: tuple[int, int] | None, truncate: bool, chunk_size: int | None,
                  checkpoint_every: float, started: str, digest: str) -> pd.DataFrame:
    """Replay ``traceset`` (loaded, sharded) on ``cluster``; :func:`~trace_replay.runs.replay`'s
    frame, with ``attrs["cluster"]`` (address, actors and their resources, Ray's version).

    ``options`` are ``make_engine``'s arguments, each actor's the same. Without a
    ``checkpoint`` the parts go to a temporary folder, removed after the run (on one
    machine; a cluster of several needs a folder every node mounts).
    """
    ray = import_ray()
    with connect(cluster, verbose=options.get("verbose", False)) as address:
        plan = plan_actors(cluster, options.get("device"), ray.cluster_resources())
        options = {**options, "device": plan.device}
        facts = _probe(ray, options, plan)
        traceset, requests, notes = prepare_run(
            traceset, tokenizer=facts.tokenizer, vocab_size=facts.vocab_size,
            max_model_len=facts.max_model_len, top_k=facts.keyed.get("top_k", 0),
            truncate=truncate)
        batch = max(facts.batch_size, 1)
        # whole engine batches, at most 4 per part, and work for every actor
        chunk = chunk_size or max(1, min(4 * batch, -(-len(requests) // plan.actors)))
        with _folder(checkpoint) as folder:
            result, resumed, stats = _run(ray, traceset, requests, facts, options, plan,
                                          folder=folder, named=checkpoint is not None,
                                          chunk=chunk, every_s=checkpoint_every,
                                          progress=progress)
    result = finish_frame(result, traceset, TokenDecoder(facts.tokenizer))
    # the keyed settings carry the weights' digest, as a single-process run's attrs do
    result.attrs = run_attrs(facts.keyed, stats, traceset=traceset, requests=requests,
                             num_tokens=len(result), vocab_size=facts.vocab_size,
                             resumed=resumed, notes=notes, shard=shard, digest=digest,
                             started=started)
    result.attrs["cluster"] = {"kind": "ray", "address": address, "actors": plan.actors,
                               "num_cpus": plan.num_cpus, "num_gpus": plan.num_gpus,
                               "ray": ray.__version__}
    return result


def _run(ray: Any, traceset: TraceSet, requests: list[ReplayRequest], facts: EngineFacts,
         options: dict[str, Any], plan: ClusterPlan, *, folder: Path, named: bool, chunk: int,
         every_s: float, progress: bool) -> tuple[pd.DataFrame | None, int, dict[str, Any]]:
    """The checkpoint loop of a single-process run, a pool pass where it calls the engine.

    Returns the rows, the traces served from the folder, and the actors' stats combined.
    """
    by_id = {t.id: t for t in traceset}
    actor_args = {"options": options, "folder": str(folder), "keyed": facts.keyed,
                  "labelled": any(t.trace_roles is not None for t in traceset),
                  "every_s": every_s}
    reports: dict[str, tuple[int, dict]] = {}  # actor instance -> (its calls, its stats)
    total = sum(r.trace_len for r in requests)
    with tqdm(total=total, unit="tok", disable=not progress,
              desc=f"replay[{facts.name} on ray ×{plan.actors}]") as bar, \
            Checkpoint(folder, facts.keyed, requests, by_id, batch_size=facts.batch_size,
                       max_traces=chunk, every_s=every_s) as store:
        bar.update(store.resumed_tokens)
        if store.resumed and progress and named:
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
                batches = [pack(items[i:i + chunk]) for i in range(0, len(items), chunk)]
                _pass(ray, batches, plan, actor_args, report=report)
                store.refresh()
            elif not store.waiting():  # other runs hold claims on our traces: wait
                result = store.read()  # None: a part failed verification, go on
        bar.update(max(total - bar.n, 0))
    stats = [s for _, s in reports.values()] or [facts.stats]
    return result, store.resumed, _combined(stats)


def _pass(ray: Any, batches: list[bytes], plan: ClusterPlan, actor_args: dict[str, Any], *,
          report: Callable[[Mapping[str, np.ndarray]], None]) -> None:
    """One pass of ``batches`` (packed, a part's traces each) through a pool of actors, one
    batch per task and at most one task per actor at a time (an idle actor takes the next
    batch; a dead one takes only its own back to the queue); ``report`` hears of each."""
    pool = ray.data.ActorPoolStrategy(size=min(plan.actors, len(batches)),  # none idle
                                      max_tasks_in_flight_per_actor=1)
    dataset = ray.data.from_items([{ITEMS: batch} for batch in batches],
                                  override_num_blocks=len(batches)).map_batches(
        ReplayActor, batch_size=1, batch_format="numpy", compute=pool,
        num_cpus=plan.num_cpus, num_gpus=plan.num_gpus, fn_constructor_kwargs=actor_args)
    verbose = actor_args["options"].get("verbose", False)
    dataset.context.enable_progress_bars = verbose  # the run's own bar counts the tokens
    dataset.context.print_on_execution_start = verbose
    with _logging_at(logging.getLogger("ray.data"), logging.INFO if verbose else logging.ERROR):
        for rows in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            failed = [error for error in rows["error"] if error]
            if failed:  # stops the pass; the parts written so far stay
                raise pickle.loads(failed[0])
            report(rows)


@contextlib.contextmanager
def _logging_at(logger: logging.Logger, level: int) -> Iterator[None]:
    """Ray Data's logging at ``level`` for the block (its notes on each execution, and on
    the progress bars this run turns off, are noise beside the run's own bar)."""
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _probe(ray: Any, options: dict[str, Any], plan: ClusterPlan) -> EngineFacts:
    """Build the engine once on the cluster, with an actor's resources, to learn its facts;
    an error building it is raised here as it was raised there."""
    # its worker process exits after it (max_calls=1), so that the memory its engine held,
    # a GPU's included, is free before the actors start
    remote = ray.remote(num_cpus=plan.num_cpus, num_gpus=plan.num_gpus,
                        max_calls=1)(_facts_or_error)
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
def _folder(checkpoint: str | Path | None) -> Iterator[Path]:
    """The run's checkpoint folder: the one given, else a temporary one removed after."""
    if checkpoint is not None:
        yield Path(checkpoint)
        return
    folder = Path(tempfile.mkdtemp(prefix="trace_replay-ray-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
