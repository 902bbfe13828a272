"""Chat traces: a conversation rendered by the model's chat template, split into turns.

The conversation is rendered once, whole, and tokenized once, so the tokens are exactly those of
``tokenizer.apply_chat_template(messages)``. Turn boundaries come from rendering the
conversation's prefixes: ``messages[:i]`` (where message ``i`` starts) and ``messages[:i]`` with
the generation prompt (where the model starts writing assistant message ``i``). A boundary is
placed on the tokens with the rule of `trace_replay.traces.tokenization`: a token that straddles it
belongs to the later part.

An assistant turn, as the model emits it, is its content and the end-of-turn token (the
tokenizer's EOS when the turn has one, else the first special token after the content, e.g.
``<|im_end|>``); what the template writes after that token (``"\\n"``) and the header before
the next assistant turn (``"<|im_start|>assistant\\n"``) are template formatting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trace_replay.traces.tokenization import common_prefix_length, encode
from trace_replay.traces.trace import TEMPLATE_ROLE, Trace, TraceError

__all__ = [
    "ChatTokens",
    "TEMPLATE_ROLE",
    "tokenize_chat",
    "tokenize_chat_prompt",
    "tokenize_chat_trace",
]


@dataclass(frozen=True)
class ChatTokens:
    """A tokenized conversation: the prompt, the trace and one label pair per trace token."""

    prompt_token_ids: list[int]
    trace_token_ids: list[int]
    turns: list[int]  # per trace token: index of its message
    roles: list[str]  # per trace token: its message's role, or TEMPLATE_ROLE


def tokenize_chat(
    tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None, turns: str = "last"
) -> ChatTokens:
    """Render ``messages`` with the chat template and cut out the assistant turns to replay.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        With a chat template (``apply_chat_template``).
    messages : list of dict
        OpenAI chat format; at least one message has role ``"assistant"``.
    tools : list of dict, optional
        Passed to the template, as a chat request's ``tools``.
    turns : {"last", "all"}
        ``"last"``: the trace is the last assistant turn, everything before it the prompt.
        ``"all"``: the trace runs from the first assistant turn to the end of the last one,
        every token in between (user turns, tool results, template formatting) forced too.
        Messages after the last assistant turn are not rendered.

    Returns
    -------
    ChatTokens
        ``prompt_token_ids + trace_token_ids`` is a prefix of the whole conversation's tokens
        (it ends at the last replayed turn's end-of-turn token).

    Raises
    ------
    TraceError
        If the tokenizer has no chat template, the template fails, or it renders a prefix of
        the conversation differently from the start of the whole (a template that rewrites
        earlier turns cannot be split into turns).
    """
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant:
        raise TraceError("messages has no assistant turn to replay")
    last = assistant[-1]
    replayed = assistant if turns == "all" else [last]
    render = _Renderer(tokenizer, messages[: last + 1], tools)
    # (first character, turn, role) of each part of the trace, in text order
    parts: list[tuple[int, int, str]] = []
    for i in range(replayed[0], last + 1):
        role = messages[i]["role"]
        if role == "assistant":
            if i != replayed[0]:
                parts.append((render.start(i), i, TEMPLATE_ROLE))
            parts.append((render.start(i, generation=True), i, role))
        else:
            parts.append((render.start(i), i, role))
    whole = encode(tokenizer, render.whole, special=False)
    cuts = _token_cuts(tokenizer, whole, render.whole, [start for start, _, _ in parts])
    ends = cuts[1:] + [len(whole)]
    trace_turns: list[int] = []
    trace_roles: list[str] = []
    for (_, turn, role), cut, end in zip(parts, cuts, ends):
        labels = [role] * (end - cut)
        if role == "assistant":
            stop = _end_of_turn(tokenizer, whole[cut:end])
            labels[stop + 1 :] = [TEMPLATE_ROLE] * (len(labels) - stop - 1)
        trace_turns += [turn] * len(labels)
        trace_roles += labels
    # The trace ends with the last replayed turn's end-of-turn token.
    length = 1 + max((i for i, role in enumerate(trace_roles) if role == "assistant"), default=-1)
    if length == 0:
        raise TraceError(f"assistant messages[{last}] renders to no tokens")
    prompt = whole[: cuts[0]]
    if not prompt:
        raise TraceError("the chat template renders nothing before the first replayed turn")
    return ChatTokens(
        prompt, whole[cuts[0] : cuts[0] + length], trace_turns[:length], trace_roles[:length]
    )


def tokenize_chat_prompt(
    tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None
) -> list[int]:
    """Tokens of ``messages`` rendered with the generation prompt: what a chat request sends."""
    text = _Renderer(tokenizer, messages, tools).render(len(messages), generation=True)
    return encode(tokenizer, text, special=False)


def tokenize_chat_trace(trace: Trace, tokenizer: Any) -> Trace:
    """``trace`` (with ``messages``) with token ids and per-token ``trace_turns``/``trace_roles``.

    Without ``trace_token_ids``: `tokenize_chat` with the trace's ``turns``. With them, the
    messages are the request and the given tokens its reply: the prompt is the messages
    rendered with the generation prompt (unless ``prompt_token_ids`` are given), and every
    trace token is labelled ``"assistant"`` of turn ``len(messages)``.
    """
    if trace.trace_token_ids is None:
        chat = tokenize_chat(
            tokenizer, trace.messages, tools=trace.tools, turns=trace.turns or "last"
        )
        return replace(
            trace,
            prompt_token_ids=chat.prompt_token_ids,
            trace_token_ids=chat.trace_token_ids,
            trace_turns=chat.turns,
            trace_roles=chat.roles,
        )
    prompt_ids = trace.prompt_token_ids or tokenize_chat_prompt(
        tokenizer, trace.messages, tools=trace.tools
    )
    if trace.trace_roles is not None:
        return replace(trace, prompt_token_ids=prompt_ids)
    count = len(trace.trace_token_ids)
    return replace(
        trace,
        prompt_token_ids=prompt_ids,
        trace_turns=(len(trace.messages),) * count,
        trace_roles=("assistant",) * count,
    )


class _Renderer:
    """Renders prefixes of one conversation and checks each is a prefix of the whole text."""

    def __init__(self, tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TraceError(
                "the model's tokenizer has no chat template, so 'messages' cannot "
                "be rendered; give prompt/completion text or token ids instead"
            )
        self.tokenizer = tokenizer
        self.messages = messages
        self.tools = tools
        self.whole = self.render(len(messages), generation=False)

    def render(self, count: int, *, generation: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                self.messages[:count],
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=generation,
            )
        except Exception as error:  # noqa: BLE001 - a template raises whatever it likes
            raise TraceError(
                f"the chat template fails on messages[:{count}]: {type(error).__name__}: {error}"
            ) from None

    def start(self, index: int, *, generation: bool = False) -> int:
        """Character where message ``index`` (its generated part, with ``generation``) starts."""
        if index == 0 and not generation:
            return 0
        prefix = self.render(index, generation=generation)
        if not self.whole.startswith(prefix):
            what = "with the generation prompt " if generation else ""
            raise TraceError(
                f"the chat template renders messages[:{index}] {what}as text that "
                "does not start the whole conversation (it rewrites earlier turns), "
                f"so messages[{index}] cannot be split off"
            )
        return len(prefix)


def _token_cuts(tokenizer: Any, whole: list[int], text: str, starts: list[int]) -> list[int]:
    """Token index of each character boundary: the tokens before it are those of the text
    before it, so a token that straddles a boundary falls after it."""
    cuts, previous = [], 0
    for start in starts:
        cut = common_prefix_length(whole, encode(tokenizer, text[:start], special=False))
        previous = max(previous, cut)
        cuts.append(previous)
    return cuts


def _end_of_turn(tokenizer: Any, tokens: list[int]) -> int:
    """Index of the token that ends an assistant turn (its last token when none is special)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos in tokens:
        return tokens.index(eos)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return next((i for i, token in enumerate(tokens) if token in special), len(tokens) - 1)
