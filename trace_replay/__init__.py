"""trace_replay: replay token traces through a language model's real decode path.

``import trace_replay`` is cheap and side-effect free: it imports neither vLLM nor
transformers. Public names are resolved lazily from their modules on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Trace": "trace_replay.traces.trace",
    "TraceSet": "trace_replay.traces.sets",
    "TraceError": "trace_replay.traces.trace",
    "load_traces": "trace_replay.traces.sets",
    "load_model": "trace_replay.models.load",
    "load_tokenizer": "trace_replay.models.load",
    "make_engine": "trace_replay.engines",
    "RequestState": "trace_replay.engines.replay_state",
    "TraceReplayState": "trace_replay.engines.replay_state",
    "replay": "trace_replay.runs.replay",
    "RayCluster": "trace_replay.runs.cluster",
    "close_engines": "trace_replay.runs.kept_engines",
    "record": "trace_replay.runs.recording",
    "compare": "trace_replay.analysis.metrics",
    "summarize": "trace_replay.analysis.metrics",
    "dataset_summary": "trace_replay.analysis.metrics",
    "trace_summary": "trace_replay.analysis.metrics",
    "engine_table": "trace_replay.analysis.metrics",
    "replay_pair": "trace_replay.analysis.distributions",
    "distribution_bounds": "trace_replay.analysis.distribution_bounds",
    "record_routing": "trace_replay.analysis.routing",
    "routing_flips": "trace_replay.analysis.routing",
    "plot_trace": "trace_replay.plots.trace",
    "plot_divergence_heatmap": "trace_replay.plots.frames",
    "plot_delta_hist": "trace_replay.plots.frames",
    "plot_logprob_scatter": "trace_replay.plots.frames",
    "plot_first_divergence": "trace_replay.plots.frames",
    "plot_rank_buckets": "trace_replay.plots.frames",
    "plot_distribution_strip": "trace_replay.plots.distributions",
    "plot_distribution_hist": "trace_replay.plots.distributions",
    "plot_first_past": "trace_replay.plots.distributions",
    "plot_routing_flips": "trace_replay.plots.distributions",
    "render_tokens": "trace_replay.html.tokens",
    "explore": "trace_replay.explorer",
    "write_report": "trace_replay.html.report",
    "locate_divergence": "trace_replay.analysis.attribution",
    "divergence_origin": "trace_replay.analysis.attribution",
    "sweep": "trace_replay.analysis.sweep",
    "ModelCache": "trace_replay.engines.cache",
    "plot_layer_divergence": "trace_replay.plots.layers",
    "plot_layer_profile": "trace_replay.plots.layers",
    "plot_sweep": "trace_replay.plots.layers",
}

# modules reached as attributes, e.g. ``tr.datasets.load(...)``
_SUBMODULES = ("datasets",)

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"trace_replay.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'trace_replay' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
