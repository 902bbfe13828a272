"""trace_replay: replay token traces through a language model's real decode path.

``import trace_replay`` is cheap and side-effect free: it imports neither vLLM nor
transformers. Public names are resolved lazily from their modules on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Trace": "trace_replay.traces",
    "TraceSet": "trace_replay.traces",
    "TraceError": "trace_replay.traces",
    "load_traces": "trace_replay.traces",
    "RequestState": "trace_replay.state",
    "TraceReplayState": "trace_replay.state",
    "replay": "trace_replay.replay",
    "record": "trace_replay.record",
    "compare": "trace_replay.analysis",
    "summarize": "trace_replay.analysis",
    "dataset_summary": "trace_replay.analysis",
    "trace_summary": "trace_replay.analysis",
    "plot_trace": "trace_replay.plots",
    "plot_divergence_heatmap": "trace_replay.plots",
    "plot_delta_hist": "trace_replay.plots",
    "plot_logprob_scatter": "trace_replay.plots",
    "plot_first_divergence": "trace_replay.plots",
    "plot_rank_buckets": "trace_replay.plots",
    "render_tokens": "trace_replay.tokens_html",
    "explore": "trace_replay.explorer",
    "write_report": "trace_replay.report",
    "locate_divergence": "trace_replay.attribution",
    "divergence_origin": "trace_replay.attribution",
    "sweep": "trace_replay.sweep",
    "plot_layer_divergence": "trace_replay.plots_layers",
    "plot_layer_profile": "trace_replay.plots_layers",
    "plot_sweep": "trace_replay.plots_layers",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trace_replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    # importing a module may import submodules named like exports (trace_replay.replay), and
    # the import system binds the submodule to the package attribute; the export wins
    for export, home in _EXPORTS.items():
        if getattr(globals().get(export), "__name__", None) == home == f"{__name__}.{export}":
            globals()[export] = getattr(importlib.import_module(home), export)
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
