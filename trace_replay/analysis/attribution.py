"""Where two runs part ways inside the model: per step, layer and site.

:func:`locate_divergence` replays the same traces under two settings (forced decoding, so both
runs see the same tokens), reads every site of the forward at every step
(:mod:`trace_replay.analysis.capture`) and compares the two runs' activations as it goes, keeping only
four numbers per (trace, step, layer, site). :func:`divergence_origin` names where the
difference first appears.

Design: run a, then run b, one chunk of traces and one band of sites at a time. Run a's
activations of the band are held on the host; each of b's activations is compared with its
partner the moment b's forward produces it, and both are dropped. Lockstep (both runs
side by side) would hold less only when the two runs visit (trace, step) in the same order;
decode vs prefill (step-major vs layer-major) and batch 1 vs 8 (one trace at a time vs eight
side by side) transpose that order, so one side must wait for the other's whole batch anyway,
and two runs interleaved in one process would also share process-wide settings (deterministic
algorithms, thread counts) that a setting under test may change. So the held memory is set by
``max_held_bytes``: the sites of a chunk are split into bands that fit, and each band is one
pass of both runs (passes are reported in ``attrs["passes"]``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from trace_replay.analysis.capture import SITES, Site, SiteCapture, model_sites
from trace_replay.analysis.capture_rows import RowCapture
from trace_replay.analysis.pairing import METRICS, Comparer, HeldActivations
from trace_replay.engines.base import Activations, Engine, ReplayRequest
from trace_replay.engines.cache import ModelCache, check_settings
from trace_replay.engines.capabilities import ActivationSource, BatchHooks, supports
from trace_replay.engines.registry import engine_spec, engine_specs
from trace_replay.runs.replay import TraceInput, prepare_requests
from trace_replay.traces.sets import TraceSet, load_traces

__all__ = ["locate_divergence", "divergence_origin"]

_UNSUPPORTED = {
    "speculative": "verify feeds several tokens per forward and drops some",
    "engine_args": "vLLM runs its model in another process",
}


def locate_divergence(
    traces: TraceInput,
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    sites: Sequence[str] | None = None,
    tol: float = 0.0,
    progress: bool = True,
    chunk_size: int | None = None,
    max_held_bytes: int = 1 << 30,
    models: ModelCache | None = None,
) -> pd.DataFrame:
    """Compare two runs of the same traces site by site, at every step and decoder layer.

    Parameters
    ----------
    traces
        Anything :func:`~trace_replay.load_traces` reads.
    a, b
        ``replay`` settings of each run: ``engine`` (``"torch"``, the default, or
        ``"prefill"``), ``model`` (a path, a cached name, ``None`` for the embedded model, or
        a transformers model in memory), ``dtype``, ``device``, ``batch_size`` and engine
        options (``deterministic``, ...), passed to
        :func:`~trace_replay.engines.make_engine`. The torch engine runs its ``hf`` backend:
        the static backend's compiled, graph-captured steps run no Python hooks. With
        ``deterministic=True`` both engines run the row-wise model of deterministic mode
        (:mod:`~trace_replay.analysis.capture_rows` reads its sites; decode steps run eagerly).
    sites
        Site names to compare (default all): ``"embeddings"``, ``"input_norm"``,
        ``"attention"``, ``"mlp"``, ``"residual"``, ``"final_norm"``, ``"logits"``.
    tol
        Stored in ``attrs["tol"]``: the default threshold of :func:`divergence_origin` and
        :func:`~trace_replay.plot_layer_divergence`.
    progress
        Show a tqdm bar over compared steps.
    chunk_size
        Traces run per engine call; default the least common multiple of the two batch sizes,
        so both runs decode in full batches of their own size.
    max_held_bytes
        Most bytes of run a's activations held at once (see the module docstring).
    models
        A :class:`~trace_replay.engines.cache.ModelCache` to load models from (and keep them
        for later calls); default a fresh one.

    Returns
    -------
    DataFrame
        One row per (trace_id, step, layer, site), in forward order: ``layer`` is the decoder
        layer (-1 for embeddings, ``num_layers`` for final norm and logits), ``site`` an
        ordered categorical of :data:`~trace_replay.analysis.capture.SITES`; then ``max_abs_diff``
        (max |b - a|), ``rel_l2`` (‖b - a‖ / ‖a‖), ``cosine`` and ``bitwise_equal`` (same
        dtype and identical bits), computed in float64 on the host. ``attrs``: ``a`` and
        ``b`` (each engine's settings), ``tol``, ``sites``, ``num_layers``, ``passes``.

    Examples
    --------
    >>> import trace_replay as tr
    >>> traces = [{"id": "t", "prompt": "The capital of France is", "completion": " Paris."}]
    >>> frame = tr.locate_divergence(traces, {"dtype": "float32"},
    ...                              {"dtype": "float32", "engine": "prefill"}, progress=False)
    >>> frame.attrs["num_layers"], len(frame)  # 2 steps x (embeddings, 30 x 4 sites, 2)
    (30, 246)
    >>> bool(frame.loc[frame["layer"] == -1, "bitwise_equal"].all())  # the same lookup
    True
    >>> tr.divergence_origin(frame).columns.tolist()
    ['trace_id', 'first_divergence_step', 'layer', 'site', 'max_abs_diff', 'rel_l2',
     'n_divergent_steps']
    """
    for name, settings in (("a", a), ("b", b)):
        _check_settings(name, settings)
    wanted = _check_sites(sites)
    models = ModelCache() if models is None else models
    engines = []
    try:
        for settings in (a, b):
            takes = engine_spec(settings.get("engine", "torch")).takes()
            if "backend" in takes and not settings.get("deterministic"):
                settings = {"backend": "hf", **settings}  # hooks see its modules
            engines.append(models.engine(settings))
        frame = _locate(
            load_traces(traces),
            engines,
            wanted,
            progress=progress,
            chunk_size=chunk_size,
            max_held_bytes=max_held_bytes,
        )
    finally:
        for engine in engines:
            engine.close()
    frame.attrs["tol"] = tol
    return frame


def _locate(
    traceset,
    engines,
    wanted: tuple[str, ...],
    *,
    progress: bool,
    chunk_size: int | None,
    max_held_bytes: int,
) -> pd.DataFrame:
    for engine in engines:
        if not (supports(engine, ActivationSource) and supports(engine, BatchHooks)):
            raise TypeError(
                f"engine {engine.name!r} gives no activations or on_batch hook "
                "(capabilities ActivationSource and BatchHooks)"
            )
    sources = [engine.activations() for engine in engines]
    lms = [source.model for source in sources]
    all_sites = [model_sites(lm) for lm in lms]
    if [(s.layer, s.name) for s in all_sites[0]] != [(s.layer, s.name) for s in all_sites[1]]:
        raise ValueError("a and b must have the same number of decoder layers")
    site_lists = [[s for s in sites if s.name in wanted] for sites in all_sites]
    requests = _requests(traceset, engines)
    size = chunk_size or math.lcm(*(engine.batch_size for engine in engines))
    chunks = [requests[i : i + size] for i in range(0, len(requests), size)]
    plans = [_bands(chunk, site_lists[0], lms[0], max_held_bytes) for chunk in chunks]
    total = sum(len(bands) * sum(r.trace_len for r in chunk) for chunk, bands in zip(chunks, plans))
    frames = []
    with tqdm(total=total, unit="step", disable=not progress, desc="locate_divergence") as bar:
        for chunk, bands in zip(chunks, plans):
            for band in bands:
                in_band = [[s for s in sites if s.index in band] for sites in site_lists]
                frames.append(_compare_pass(engines, sources, chunk, in_band, bar))
    frame = _to_frame(frames, requests)
    frame.attrs = {
        "a": engines[0].settings(),
        "b": engines[1].settings(),
        "sites": list(wanted),
        "num_layers": all_sites[0][-1].layer,
        "passes": sum(len(bands) for bands in plans),
    }
    return frame


def _check_settings(name: str, settings: Mapping[str, Any]) -> None:
    check_settings(settings, f"locate_divergence {name}")
    engine = settings.get("engine", "torch")
    if not engine_spec(engine).activations:
        watched = ", ".join(spec.name for spec in engine_specs() if spec.activations)
        raise ValueError(
            f"{name}: layer attribution runs engines whose forwards run in this "
            f"process and can be watched ({watched}), not {engine!r}"
        )
    for key, why in _UNSUPPORTED.items():
        if settings.get(key) is not None:
            raise ValueError(f"{name}: {key} is not supported by layer attribution ({why})")
    if settings.get("backend", "hf") != "hf":
        raise ValueError(
            f"{name}: layer attribution needs backend='hf': the static backend's "
            "compiled, graph-captured steps run no Python forward hooks"
        )


def _check_sites(sites: Sequence[str] | None) -> tuple[str, ...]:
    if sites is None:
        return SITES
    sites = [sites] if isinstance(sites, str) else list(sites)
    unknown = sorted(set(sites) - set(SITES))
    if unknown or not sites:
        raise ValueError(f"unknown sites {unknown}; choose from {', '.join(SITES)}")
    return tuple(s for s in SITES if s in sites)


def _requests(traceset: TraceSet, engines) -> list[ReplayRequest]:
    """The traces, tokenized once (by run a's tokenizer), as requests both runs get."""
    if all(trace.is_tokenized for trace in traceset):
        traceset.validate_vocab(min(engine.vocab_size for engine in engines))
    else:
        traceset = traceset.tokenize(engines[0].tokenizer)
    limits = [engine.max_model_len for engine in engines if engine.max_model_len]
    requests, _ = prepare_requests(traceset, min(limits) if limits else None)
    return requests


def _bands(
    chunk: Sequence[ReplayRequest], sites: Sequence[Site], lm, max_held_bytes: int
) -> list[set[int]]:
    """Site indices per pass: consecutive sites whose held activations fit the budget."""
    tokens = sum(r.trace_len for r in chunk)
    itemsize = next(lm.parameters()).element_size()
    bands: list[set[int]] = []
    held = 0
    for site in sites:
        size = tokens * site.width * itemsize
        if not bands or held + size > max_held_bytes:
            bands.append(set())
            held = 0
        bands[-1].add(site.index)
        held += size
    return bands


def _compare_pass(engines, sources, chunk: Sequence[ReplayRequest], sites, bar) -> pd.DataFrame:
    """One pass over ``chunk``: run a holding its sites, run b comparing as it goes."""
    held = HeldActivations()
    with _capture(sources[0], engines[0], chunk, sites[0], held.put):
        engines[0].run(chunk)
    comparer = Comparer(held, chunk, sites[1][-1].index, bar)
    with _capture(sources[1], engines[1], chunk, sites[1], comparer):
        engines[1].run(chunk)
    if held.where:
        trace, step = next(iter(held.where))
        raise RuntimeError(
            f"run a computed trace {chunk[trace].trace_id!r} step {step}, which run b did not"
        )
    parts = {key: np.concatenate([p[key] for p in comparer.parts]) for key in comparer.parts[0]}
    parts["trace_id"] = np.array(
        [chunk[i].trace_id for i in parts.pop("trace_index")], dtype=object
    )
    return pd.DataFrame(parts)


def _capture(
    source: Activations, engine: Engine, chunk: Sequence[ReplayRequest], sites: Sequence[Site], sink
):
    """Module hooks on the engine's model, or the observer of its row-wise model."""
    if source.rows is not None:
        return RowCapture(source.rows, engine, chunk, sites, sink)
    return SiteCapture(source.model, engine, chunk, sites, sink)


def _to_frame(frames: list[pd.DataFrame], requests: Sequence[ReplayRequest]) -> pd.DataFrame:
    columns = ["trace_id", "step", "layer", "site", *METRICS]
    frame = (
        pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({c: [] for c in columns})
    )[columns]
    order = {r.trace_id: i for i, r in enumerate(requests)}
    frame["site"] = pd.Categorical(frame["site"], categories=SITES, ordered=True)
    frame = frame.sort_values(
        ["trace_id", "step", "layer", "site"],
        kind="stable",
        key=lambda s: s.map(order) if s.name == "trace_id" else s,
    )
    return frame.astype({"step": "int64", "layer": "int64", "bitwise_equal": bool}).reset_index(
        drop=True
    )


def divergence_origin(
    frame: pd.DataFrame, *, tol: float | None = None, by: str = "trace"
) -> pd.DataFrame:
    """Where the runs first differ by more than ``tol``: the first (step, layer, site).

    Parameters
    ----------
    frame
        Output of :func:`locate_divergence`.
    tol
        A site diverges where ``max_abs_diff > tol`` or it is not finite; default
        ``frame.attrs["tol"]`` (0: any difference).
    by
        ``"trace"``: one row per trace, its first divergent step and, at that step, the first
        divergent site in forward order. ``"step"``: one row per (trace, step).

    Returns
    -------
    DataFrame
        ``trace_id``, then ``first_divergence_step`` (``by="trace"``) or ``step``
        (``by="step"``), then ``layer``, ``site``, ``max_abs_diff`` and ``rel_l2`` of that
        site; ``<NA>``/NaN where nothing diverges. ``by="trace"`` adds
        ``n_divergent_steps``.

    Examples
    --------
    >>> traces = [{"id": "t", "prompt": "Hi", "completion": " there"}]
    >>> frame = locate_divergence(traces, {"dtype": "float32"}, {"dtype": "bfloat16"},
    ...                           progress=False)
    >>> divergence_origin(frame)[["trace_id", "first_divergence_step", "layer", "site"]]
      trace_id  first_divergence_step  layer        site
    0        t                      0     -1  embeddings
    """
    if by not in ("trace", "step"):
        raise ValueError(f'by must be "trace" or "step", got {by!r}')
    tol = frame.attrs.get("tol", 0.0) if tol is None else tol
    diff = frame["max_abs_diff"].astype("float64")
    divergent = frame[(diff > tol) | ~np.isfinite(diff)]
    keys = ["trace_id"] if by == "trace" else ["trace_id", "step"]
    # frames are in forward order, so the first row per key is where divergence enters
    first = divergent.groupby(keys, sort=False, observed=True).head(1)
    cols = ["layer", "site", "max_abs_diff", "rel_l2"]
    index = frame[keys].drop_duplicates()
    out = index.merge(
        first[[*keys, "step", *cols] if by == "trace" else [*keys, *cols]], on=keys, how="left"
    )
    out["layer"] = out["layer"].astype("Int64")
    if by == "trace":
        out = out.rename(columns={"step": "first_divergence_step"})
        out["first_divergence_step"] = out["first_divergence_step"].astype("Int64")
        counts = divergent.drop_duplicates(["trace_id", "step"]).groupby("trace_id").size()
        out["n_divergent_steps"] = out["trace_id"].map(counts).fillna(0).astype("int64")
    out.attrs = {"tol": tol}
    return out.reset_index(drop=True)
