"""Engines that drive forced decoding. ``make_engine`` builds one by name.

* ``"torch"``  — built-in batched decode loop over a transformers model (CPU, CUDA).
* ``"prefill"`` — teacher-forced scoring, one forward over prompt + trace.
* ``"vllm"``   — vLLM, native trace replay or logits-processor forcing.
* ``"auto"``   — vLLM when it imports and starts, else torch; the choice is recorded.
"""

from __future__ import annotations

import importlib.util

__all__ = ["ENGINES", "make_engine"]

ENGINES = ("auto", "torch", "prefill", "vllm")


def make_engine(name: str, model=None, *, dtype=None, device=None, batch_size=None, top_k=5,
                speculative=None, engine_args=None):
    """Build the engine ``name``; returns ``(engine, note)`` where note explains an auto choice."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    if speculative is not None and name not in ("torch", "auto"):
        raise ValueError(f"speculative verify runs in the torch engine, not {name!r}")
    if engine_args and name in ("torch", "prefill"):
        raise ValueError(f"engine_args are passed to vllm.LLM; engine {name!r} takes none")
    note = None
    if name == "auto":
        if speculative is None and importlib.util.find_spec("vllm") is not None:
            try:
                return make_engine("vllm", model, dtype=dtype, device=device,
                                   batch_size=batch_size, top_k=top_k,
                                   engine_args=engine_args)[0], "auto: vllm"
            except Exception as exc:  # noqa: BLE001 - any start-up failure falls back
                note = f"auto: torch (vllm failed to start: {type(exc).__name__}: {exc})"
        else:
            note = "auto: torch (" + ("speculative verify" if speculative is not None
                                      else "vllm not installed") + ")"
        name = "torch"
    if name == "torch":
        from trace_replay.engines.torch_engine import TorchEngine

        return TorchEngine(model, dtype=dtype, device=device, batch_size=batch_size,
                           top_k=top_k, speculative=speculative), note
    if name == "prefill":
        from trace_replay.engines.prefill import PrefillEngine

        return PrefillEngine(model, dtype=dtype, device=device, batch_size=batch_size,
                             top_k=top_k), note
    from trace_replay.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model, dtype=dtype, device=device, batch_size=batch_size, top_k=top_k,
                      engine_args=engine_args), note
