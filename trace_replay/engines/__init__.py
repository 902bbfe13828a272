"""Engines that drive forced decoding. ``make_engine`` builds one by name.

The names are the registry's (:mod:`~trace_replay.engines.registry`, one
:class:`~trace_replay.engines.registry.EngineSpec` each):

* ``"torch"``  — built-in batched decode loop over a transformers model (CPU, CUDA).
* ``"prefill"`` — teacher-forced scoring, one forward over prompt + trace.
* ``"vllm"``   — vLLM, native trace replay or logits-processor forcing.
* ``"vllm-server"`` — a running vLLM server that loads the forcing logits processor, over
  HTTP (``engine_args={"base_url": "http://host:port/v1"}``); this client never imports vllm.
* ``"auto"``   — vLLM when it imports and starts, else torch; the choice is in the
  engine's ``settings()["selected_by"]``.

Every engine implements :class:`~trace_replay.engines.protocol.Engine`.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

from trace_replay.engines.base import Engine, EngineConfig
from trace_replay.engines.registry import ENGINE_OPTIONS, ENGINES, engine_spec
from trace_replay.engines.vllm.deterministic import deterministic_unavailable

__all__ = ["ENGINES", "ENGINE_OPTIONS", "Engine", "EngineConfig", "make_engine"]


def make_engine(
    name: str,
    model: Any = None,
    *,
    dtype=None,
    device=None,
    batch_size: int | None = None,
    top_k: int = 5,
    deterministic: bool = False,
    verbose: bool = False,
    **options: Any,
) -> Engine:
    """Build the engine ``name``.

    Parameters
    ----------
    name
        One of :data:`ENGINES`, the registered engines
        (:func:`~trace_replay.engines.registry.register_engine` adds one).
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
    spec = engine_spec(name)
    config = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        batch_size=batch_size,
        top_k=top_k,
        deterministic=deterministic,
    )
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(spec.takes()))
    if unknown:
        takes = ", ".join(spec.takes()) or "no options"
        raise ValueError(f"engine {name!r} does not take {', '.join(unknown)} (it takes {takes})")
    if spec.verbose:
        options["verbose"] = verbose
    return spec.load()(config, **options)


def _make_auto(config: EngineConfig, *, verbose: bool = False, **options: Any) -> Engine:
    """vLLM when it is installed and starts, else the torch engine; say which and why (the
    registry's factory for ``"auto"``)."""
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
        warnings.warn(
            f"engine='auto' falls back to the torch engine ({reason})", RuntimeWarning, stacklevel=3
        )
    torch_options = {k: v for k, v in options.items() if k in ENGINE_OPTIONS["torch"]}
    engine = make_engine("torch", **vars(config), **torch_options)
    engine.selected_by = f"auto: torch ({reason})"
    return engine
