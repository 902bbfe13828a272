"""Text traces tokenized as the model sees them: prompt and completion together.

Tokenizing a prompt and its completion apart puts a token boundary at the prompt's end that the
model never saw in the joined text: ``"def f(x):\\n"`` + ``"   return x"`` becomes ``"\\n"`` and
``"   "`` apart, but ``"\\n  "`` and ``" return"`` together, and the model, which only ever saw
the second, gives the first a rank in the hundreds. So the text is tokenized once, whole, and
split where the prompt ends.

The split rule (lm-eval's context/continuation rule, without its assumption that the prompt's
own tokens are a prefix of the whole text's): the prompt keeps the longest run of leading tokens
that the prompt alone also encodes to, and the trace is the rest. So

* prompt + trace tokens are exactly the tokens of the joined text;
* the prompt tokens are the prompt's own, and cover a prefix of its text;
* a token that straddles the prompt's end belongs to the trace: the split moves back to the
  token boundary before the prompt's end, and the prompt's last characters are then scored as
  part of the trace's first token. ``split_text`` returns those characters so they can be
  recorded (``Trace.meta["prompt_tail_in_trace"]``).

To score other tokens than these, give ``prompt_token_ids``/``trace_token_ids`` instead.

Special-token text: a prompt is text as a request sends it, so ``"<|im_start|>"`` in a prompt
is the control token, as in vLLM and ``transformers``. A completion is what the model wrote,
and the same characters there are ambiguous (the control token, or text about it?), so
completion text holding a special token's text is refused, naming the token: to force
control tokens, give ``trace_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from trace_replay.traces.trace import Trace, TraceError

__all__ = [
    "common_prefix_length",
    "encode",
    "refuse_special_text",
    "split_text",
    "tokenize_text_trace",
]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    """``tokenizer.encode(text)``, with or without the special tokens it adds (e.g. BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=special))


def split_text(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int], str]:
    """Tokenize ``prompt + completion`` together and split it at the prompt's end.

    The joined text gets the tokenizer's special tokens (e.g. BOS), as a request would.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Anything with ``encode(text, add_special_tokens=...)`` and ``decode(ids)``.
    prompt, completion : str
        The two texts; ``completion`` is the trace.

    Returns
    -------
    prompt_token_ids, trace_token_ids : list of int
        Together exactly ``encode(prompt + completion)``.
    prompt_tail : str
        The end of ``prompt`` that the trace's first tokens carry ('' when the split falls
        exactly at the prompt's end).

    Raises
    ------
    TraceError
        If no token lies wholly inside the prompt, or the completion adds no token.

    Examples
    --------
    >>> from trace_replay.models.load import load_tokenizer
    >>> tok = load_tokenizer()
    >>> prompt_ids, trace_ids, tail = split_text(tok, "def f(x):\\n", "   return x")
    >>> [tok.decode([t]) for t in trace_ids], tail
    (['\\n  ', ' return', ' x'], '\\n')
    """
    whole = encode(tokenizer, prompt + completion, special=True)
    alone = encode(tokenizer, prompt, special=True)
    cut = common_prefix_length(whole, alone)
    if cut == 0:
        raise TraceError(
            "tokenized together with the completion, no token lies wholly inside "
            "the prompt; give prompt_token_ids and trace_token_ids"
        )
    if cut == len(whole):
        raise TraceError("completion tokenizes to no tokens")
    tail = ""
    if cut < len(alone):
        tail = tokenizer.decode(
            alone[cut:], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
    return whole[:cut], whole[cut:], tail


def refuse_special_text(tokenizer: Any, text: str, name: str) -> None:
    """Raise `TraceError` if ``text`` holds a special token's text (e.g. ``<|im_end|>``)."""
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    specials |= {
        token.content
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
        if getattr(token, "special", False)
    }
    found = [(text.find(token), token) for token in specials if token and token in text]
    if found:
        at, token = min(found)
        raise TraceError(
            f"{name} holds the special token text {token!r} at character {at}, "
            "which could mean the control token or plain text; give "
            "trace_token_ids to force control tokens"
        )


def tokenize_text_trace(trace: Trace, tokenizer: Any) -> Trace:
    """``trace`` (prompt/completion, not chat) with its missing token ids filled in
    (`TraceSet.tokenize` hands over only traces that miss some).

    Both texts: `split_text`, recording a moved boundary in ``meta["prompt_tail_in_trace"]``.
    One text beside given ids: a prompt is encoded with the tokenizer's special tokens (e.g.
    BOS), a completion without them, each alone.
    """
    if trace.trace_token_ids is None:
        refuse_special_text(tokenizer, trace.completion, "completion")
    if trace.prompt_token_ids is None and trace.trace_token_ids is None:
        prompt_ids, trace_ids, tail = split_text(tokenizer, trace.prompt, trace.completion)
        meta = {**trace.meta, "prompt_tail_in_trace": tail} if tail else trace.meta
        return replace(trace, prompt_token_ids=prompt_ids, trace_token_ids=trace_ids, meta=meta)
    prompt_ids = trace.prompt_token_ids or encode(tokenizer, trace.prompt, special=True)
    trace_ids = trace.trace_token_ids or encode(tokenizer, trace.completion, special=False)
    if not prompt_ids:
        raise TraceError("prompt tokenizes to no tokens")
    if not trace_ids:
        raise TraceError("completion tokenizes to no tokens")
    return replace(trace, prompt_token_ids=prompt_ids, trace_token_ids=trace_ids)
