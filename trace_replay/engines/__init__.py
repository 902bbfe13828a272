"""Engines that drive forced decoding. ``make_engine`` builds one by name.

* ``"torch"``  — built-in batched decode loop over a transformers model (CPU, CUDA).
* ``"prefill"`` — teacher-forced scoring, one forward over prompt + trace.
* ``"vllm"``   — vLLM, native trace replay or logits-processor forcing.
* ``"vllm-server"`` — a running vLLM server that loads the forcing logits processor, over
  HTTP (``engine_args={"base_url": "http://host:port/v1"}``); this client never imports vllm.
* ``"auto"``   — vLLM when it imports and starts, else torch; the choice is in the
  engine's ``settings()["selected_by"]``.

Every engine implements :class:`~trace_replay.engines.base.Engine`.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

from trace_replay.engines.base import Engine, EngineConfig
from trace_replay.engines.vllm.deterministic import deterministic_unavailable

__all__ = ["ENGINES", "ENGINE_OPTIONS", "Engine", "EngineConfig", "make_engine"]

ENGINES = ("auto", "torch", "prefill", "vllm", "vllm-server")
# keyword options each engine takes beyond EngineConfig
ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("speculative", "backend", "float32_matmul", "batch1_fusions",
              "deterministic_attention"),
    "prefill": ("deterministic_attention",),
    "vllm": ("engine_args", "native"),  # and verbose, which every engine takes
    "vllm-server": ("engine_args",),
}


def make_engine(name: str, model: Any = None, *, dtype=None, device=None,
                batch_size: int | None = None, top_k: int = 5, deterministic: bool = False,
                verbose: bool = False,
                **options: Any) -> Engine:
    """Build the engine ``name``.

    Parameters
    ----------
    name
        One of :data:`ENGINES`.
    model, dtype, device, batch_size, top_k
        The :class:`~trace_replay.engines.base.EngineConfig` fields, validated before
        anything is loaded.
    deterministic
        Batch-invariant arithmetic: every number of a trace is the same bits whatever the
        batch, the other traces and their order (torch and prefill engines; vLLM's
        batch-invariant mode where its platform has one, else a warning).
    verbose
        Show the engine's own start-up logging (vLLM prints ~30 lines); by default only
        its errors are shown.
    **options
        Engine-specific: ``speculative``, ``backend``, ``float32_matmul``,
        ``batch1_fusions`` (torch); ``deterministic_attention`` (torch and prefill);
        ``engine_args``, ``native``
        (vllm); ``engine_args`` (vllm-server: ``base_url``, ``api``, ``api_key``,
        ``timeout_s``, ``max_retries``). ``None`` values count as not given.

    Returns
    -------
    Engine
        Ready to ``run``; close it (or use ``with``) to release its model and processes.
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    config = EngineConfig(model=model, dtype=dtype, device=device, batch_size=batch_size,
                          top_k=top_k, deterministic=deterministic)
    options = {k: v for k, v in options.items() if v is not None}
    if name == "auto":
        return _make_auto(config, options, verbose)
    unknown = sorted(set(options) - set(ENGINE_OPTIONS[name]))
    if unknown:
        takes = ", ".join(ENGINE_OPTIONS[name]) or "no options"
        raise ValueError(f"engine {name!r} does not take {', '.join(unknown)} (it takes {takes})")
    if name == "torch":
        from trace_replay.engines.builtin.engine import TorchEngine

        return TorchEngine(config, **options)
    if name == "prefill":
        from trace_replay.engines.builtin.prefill import PrefillEngine

        return PrefillEngine(config, **options)
    if name == "vllm-server":  # the server's own logging stays in the server
        from trace_replay.engines.server.engine import ServerEngine

        return ServerEngine(config, **options)
    from trace_replay.engines.vllm.inprocess import quiet_startup

    with quiet_startup(verbose):  # importing vllm logs platform guesses (Triton, CPU)
        from trace_replay.engines.vllm.engine import VLLMEngine

    return VLLMEngine(config, verbose=verbose, **options)


def _make_auto(config: EngineConfig, options: dict[str, Any], verbose: bool) -> Engine:
    """vLLM when it is installed and starts, else the torch engine; say which and why."""
    if "speculative" in options:
        reason = "speculative verify runs in the torch engine"
    elif config.deterministic and (why := deterministic_unavailable(config.device)):
        reason = f"deterministic: {why}"
    else:
        if importlib.util.find_spec("vllm") is None:
            reason = "vllm is not installed; pip install 'trace-replay[cpu]' or '[gpu]'"
        else:
            try:
                engine = make_engine("vllm", **vars(config), verbose=verbose, **options)
            except Exception as exc:  # noqa: BLE001 - any start-up failure falls back, said below
                reason = f"vllm failed to start: {type(exc).__name__}: {exc}"
            else:
                engine.selected_by = "auto: vllm"
                return engine
        warnings.warn(f"engine='auto' falls back to the torch engine ({reason})",
                      RuntimeWarning, stacklevel=3)
    torch_options = {k: v for k, v in options.items() if k in ENGINE_OPTIONS["torch"]}
    engine = make_engine("torch", **vars(config), **torch_options)
    engine.selected_by = f"auto: torch ({reason})"
    return engine

