"""Record the bundled model traces as chat traces: one user turn, the embedded model's reply.

Both build scripts use `record_chat`. Each request is rendered with the embedded model's chat
template and generation prompt (a default system turn included, as the template adds it) and
answered greedily by the built-in torch engine in deterministic mode, whose numbers for a trace
do not depend on the batch it runs in: a rebuild on the same machine is byte-identical whatever
``--batch-size``, and a deterministic replay there gives back every ``ref_logprob`` bit.

The stored record is the conversation (``messages``: the user turn and the assistant turn holding
the reply's text), the token ids generation used and produced (``prompt_token_ids``;
``trace_token_ids``: the reply and the ``<|im_end|>`` that ended it, if it ended) and the
logprobs the engine reported. The ids are what the model wrote, and they win over the text on
replay. ``meta["retokenizes"]`` says whether rendering ``messages`` with the chat template gives
these ids back (for a reply cut at ``max_tokens``, up to the end-of-turn token the template adds
after it): not always, as a model may emit tokens that its tokenizer would not produce for the
same text (``"')", "))]"`` where the text encodes as ``"')))", "]"``), and the end-of-turn token
after a cut reply may merge differently with the text before it. The request itself must render
to the ids the reply was generated from.
"""

from __future__ import annotations

import trace_replay
from trace_replay.traces.chat import tokenize_chat
from trace_replay.traces.sets import Trace, TraceSet

__all__ = ["record_chat"]


def record_chat(requests: list[dict], *, max_tokens: int, batch_size: int) -> TraceSet:
    """Record the model's greedy reply to each request as a chat trace.

    Parameters
    ----------
    requests : list of dict
        ``{"id", "user", "meta"}``: the trace id, the user turn's text and the trace's meta.
    max_tokens : int
        Reply tokens at most; a reply stops earlier at the end-of-turn token (kept).
    batch_size : int
        Requests generated together; the numbers do not depend on it (deterministic mode).

    Returns
    -------
    TraceSet
        Chat traces with ``messages``, token ids, ``trace_turns``/``trace_roles`` (every trace
        token belongs to the assistant turn, message 1) and ``ref_logprobs``; ``meta`` adds
        ``retokenizes`` and ``recorded_with`` (model, engine path, sampling, ``deterministic``).

    Raises
    ------
    SystemExit
        If the chat template does not render a request to the ids it was generated from.
    """
    engine = trace_replay.make_engine("torch", deterministic=True, batch_size=batch_size)
    try:
        recorded = trace_replay.runs.recording(
            [
                {
                    "id": r["id"],
                    "messages": [{"role": "user", "content": r["user"]}],
                    "meta": r["meta"],
                }
                for r in requests
            ],
            engine=engine,
            max_tokens=max_tokens,
            temperature=0.0,
            seed=0,
        )
        tokenizer, deterministic = engine.tokenizer, engine.settings()["deterministic"]
    finally:
        engine.close()
    return TraceSet(
        [_chat_trace(trace, tokenizer, deterministic) for trace in recorded], source=recorded.source
    )


def _chat_trace(trace: Trace, tokenizer, deterministic: bool) -> Trace:
    ids = list(trace.trace_token_ids)
    ended = ids[-1] == tokenizer.eos_token_id  # <|im_end|> is this tokenizer's EOS
    reply = ids[:-1] if ended else ids
    messages = [*trace.messages, {"role": "assistant", "content": tokenizer.decode(reply)}]
    chat = tokenize_chat(tokenizer, messages)
    if chat.prompt_token_ids != list(trace.prompt_token_ids):
        raise SystemExit(
            f"{trace.id}: the chat template renders the request to other ids "
            "than the ones the reply was generated from"
        )
    # the template renders an end-of-turn token after a cut reply too
    retokenizes = chat.trace_token_ids == ids if ended else chat.trace_token_ids[:-1] == ids
    recorded_with = {**trace.meta["recorded_with"], "deterministic": deterministic}
    return Trace(
        id=trace.id,
        messages=messages,
        prompt_token_ids=trace.prompt_token_ids,
        trace_token_ids=ids,
        ref_logprobs=trace.ref_logprobs,
        trace_turns=(1,) * len(ids),
        trace_roles=("assistant",) * len(ids),
        meta={**trace.meta, "retokenizes": retokenizes, "recorded_with": recorded_with},
    )
