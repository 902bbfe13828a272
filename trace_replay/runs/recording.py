"""``record``: generate traces with the logprobs the generating engine reported."""

from __future__ import annotations

import math
from collections.abc import Iterable

from trace_replay.engines import make_engine
from trace_replay.engines.base import check_engine
from trace_replay.engines.capabilities import Generates, supports
from trace_replay.engines.registry import engine_specs
from trace_replay.traces.chat import tokenize_chat_prompt
from trace_replay.traces.sets import Trace, TraceSet

__all__ = ["record"]


def _prompt_records(prompts) -> list[dict]:
    records: list[dict[str, object]] = []
    for i, prompt in enumerate(prompts if not isinstance(prompts, (str, dict)) else [prompts]):
        if isinstance(prompt, str):
            records.append({"id": f"p{i}", "prompt": prompt})
        elif isinstance(prompt, Trace):
            records.append(
                {
                    "id": prompt.id,
                    "prompt": prompt.prompt,
                    "prompt_token_ids": prompt.prompt_token_ids,
                    "messages": prompt.messages,
                    "tools": prompt.tools,
                    "meta": dict(prompt.meta),
                }
            )
        elif isinstance(prompt, dict):
            records.append({"id": str(prompt.get("id", f"p{i}")), **prompt})
        else:
            raise TypeError(f"prompt {i}: expected str, dict or Trace, got {type(prompt).__name__}")
    return records


def record(
    prompts: Iterable,
    model=None,
    *,
    engine="vllm",
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    top_k: int = 5,
    batch_size: int | None = None,
    engine_args: dict | None = None,
    stop_at_eos: bool = True,
    verbose: bool = False,
) -> TraceSet:
    """Generate one trace per prompt, keeping the engine's own logprobs as ``ref_logprobs``.

    Parameters
    ----------
    prompts
        Strings, dicts with ``id`` and ``prompt`` (or ``prompt_token_ids``, or ``messages``
        in OpenAI chat format with optional ``tools``) and optional ``meta``, or
        :class:`~trace_replay.Trace` objects. Messages are rendered with the model's chat
        template and its generation prompt, as a chat request is; the trace is the
        assistant's reply, and the recorded trace keeps the messages (a request and its
        reply, see :func:`~trace_replay.load_traces`).
    model
        As in :func:`trace_replay.runs.replay`.
    engine
        The name of a registered engine that generates (``"vllm"``, ``"torch"``,
        ``"auto"``), or an :class:`~trace_replay.engines.Engine` that
        generates (:class:`~trace_replay.engines.capabilities.Generates`).
    max_tokens
        Tokens generated per prompt at most; generation stops earlier at EOS when
        ``stop_at_eos`` (the EOS is kept in the trace).
    temperature, seed
        Greedy at 0, else seeded sampling.
    top_k, batch_size, engine_args, verbose
        As in :func:`trace_replay.runs.replay` (``top_k`` is unused by generation).

    Returns
    -------
    TraceSet
        Tokenized traces with ``completion`` text, ``ref_logprobs`` (the raw logprob of each
        emitted token under the generating engine) and generation settings in ``meta``.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature < math.inf
    ):  # NaN fails too
        raise ValueError(
            f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}"
        )
    owned = isinstance(engine, str)
    if owned:
        if engine not in generating_engines():
            raise ValueError(
                f"record runs on an engine that generates "
                f"({', '.join(generating_engines())}), not {engine!r}"
            )
        engine = make_engine(
            engine,
            model,
            batch_size=batch_size,
            top_k=top_k,
            engine_args=engine_args,
            verbose=verbose,
        )
    else:
        check_engine(engine)
    if not supports(engine, Generates):
        raise TypeError(
            f"engine {engine.name!r} cannot generate; record with an engine "
            f"that does ({', '.join(generating_engines())})"
        )
    try:
        return _record(
            prompts,
            engine,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop_at_eos=stop_at_eos,
        )
    finally:
        if owned:
            engine.close()


def generating_engines() -> list[str]:
    """The registered engines that generate, by name (the registry's ``generates``)."""
    return [spec.name for spec in engine_specs() if spec.generates]


def _record(
    prompts, engine, *, max_tokens: int, temperature: float, seed: int, stop_at_eos: bool
) -> TraceSet:
    tokenizer = engine.tokenizer
    records = _prompt_records(prompts)
    prompt_ids = []
    for i, r in enumerate(records):
        if r.get("prompt_token_ids"):
            ids = r["prompt_token_ids"]
        elif r.get("messages"):
            ids = tokenize_chat_prompt(tokenizer, r["messages"], tools=r.get("tools"))
        elif isinstance(r.get("prompt"), str):
            ids = tokenizer.encode(r["prompt"], add_special_tokens=True)
        else:
            raise ValueError(
                f"prompt {i} ({r['id']!r}): needs 'prompt' text, 'messages' or 'prompt_token_ids'"
            )
        prompt_ids.append([int(t) for t in ids])
    eos = tokenizer.eos_token_id if stop_at_eos else None
    generated = engine.generate(
        prompt_ids, max_tokens=max_tokens, temperature=temperature, seed=seed, eos_token_id=eos
    )
    engine_settings = engine.settings()
    settings = {
        "model": engine_settings["model"],
        "engine": engine.name,
        "engine_path": engine_settings["engine_path"],
        "temperature": temperature,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    out = []
    for r, ids, (tokens, logprobs) in zip(records, prompt_ids, generated):
        out.append(
            Trace(
                id=r["id"],
                prompt=r.get("prompt"),
                prompt_token_ids=tuple(ids),
                completion=tokenizer.decode(tokens),
                trace_token_ids=tuple(tokens),
                messages=r.get("messages"),
                tools=r.get("tools"),
                ref_logprobs=tuple(logprobs),
                meta={**(r.get("meta") or {}), "recorded_with": settings},
            )
        )
    return TraceSet(out, source=f"record({settings['engine_path']})")
