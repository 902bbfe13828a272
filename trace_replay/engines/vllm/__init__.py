"""vLLM in the caller's process: ``engine`` (the only module that imports vllm, with
``forcing``, its logits processors), ``deterministic`` (batch-invariant mode),
``inprocess`` (a quiet, restorable start); :func:`start_engine` is the registry's factory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trace_replay.engines.base import EngineConfig
    from trace_replay.engines.vllm.engine import VLLMEngine


def start_engine(config: EngineConfig, *, verbose: bool = False, **options: Any) -> VLLMEngine:
    """The vLLM engine of ``config`` (the registry's factory for ``"vllm"``), imported and
    started quietly unless ``verbose``: importing vllm logs its platform guesses."""
    from trace_replay.engines.vllm.inprocess import quiet_startup

    with quiet_startup(verbose):
        from trace_replay.engines.vllm.engine import VLLMEngine

    return VLLMEngine(config, verbose=verbose, **options)
