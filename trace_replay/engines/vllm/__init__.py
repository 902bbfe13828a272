"""vLLM in the caller's process: ``engine`` (the only module that imports vllm, with
``forcing``, its logits processors), ``deterministic`` (batch-invariant mode),
``inprocess`` (a quiet, restorable start); :func:`start_engine` is the registry's factory.
"""


def start_engine(config, *, verbose: bool = False, **options):
    """The vLLM engine of ``config`` (the registry's factory for ``"vllm"``), imported and
    started quietly unless ``verbose``: importing vllm logs its platform guesses."""
    from trace_replay.engines.vllm.inprocess import quiet_startup

    with quiet_startup(verbose):
        from trace_replay.engines.vllm.engine import VLLMEngine

    return VLLMEngine(config, verbose=verbose, **options)
