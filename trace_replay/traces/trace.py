"""One trace record (`Trace`) and the error every bad record raises (`TraceError`)."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import NoReturn

__all__ = ["FIELDS", "JSON_FIELDS", "TEMPLATE_ROLE", "TURNS", "VLLM_NEG_INF", "Trace", "TraceError"]

TURNS = ("last", "all")  # which assistant turns of a chat trace are replayed
TEMPLATE_ROLE = "template"  # tokens the chat template adds around an assistant turn
_LOGPROB_SLACK = 1e-6  # producers round log(1) to tiny positive values; more is no logprob
VLLM_NEG_INF = -9999.0  # vLLM writes a -inf logprob as this in JSON (and nothing below it)


class TraceError(ValueError):
    """A trace record that cannot be replayed; ``str()`` reads ``LOCATION: trace 'ID': PROBLEM``.

    The location (``path:LINE``, ``path[INDEX]`` or ``SOURCE row INDEX``) and the trace id are
    left out of the message only when they are unknown.
    """

    def __init__(self, problem: str, *, trace_id: str | None = None, location: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.trace_id = trace_id
        self.location = location

    def __str__(self) -> str:
        trace = None if self.trace_id is None else f"trace {self.trace_id!r}"
        return ": ".join(part for part in (self.location, trace, self.problem) if part is not None)

    def at(self, location: str) -> TraceError:
        """Return the same error placed at ``location``."""
        return TraceError(self.problem, trace_id=self.trace_id, location=location)


@dataclass(frozen=True)
class Trace:
    """One record to replay: a prompt and the trace of tokens forced after it.

    The prompt is ``prompt`` text or ``prompt_token_ids``; the trace is ``completion`` text or
    ``trace_token_ids``. A chat trace gives ``messages`` (OpenAI chat format, optionally with
    ``tools``) instead of text: the model's chat template renders it, and ``turns`` says which
    assistant turns are the trace (``"last"``, the default, or ``"all"``). ``messages`` with
    ``trace_token_ids`` are a chat request and its reply (``completion`` may then hold the
    reply's text). Token ids, when present, always win over text and messages.

    Construction validates the record and normalizes the sequences to tuples of ``int``,
    ``float`` and ``str``, so every ``Trace`` is well formed except for the vocabulary bound,
    which needs a model (`TraceSet.validate_vocab`).

    ``trace_turns`` and ``trace_roles`` label each trace token of a tokenized chat trace with
    the index of the message it belongs to and that message's role; tokens the chat template
    adds around an assistant turn (its header, its formatting after the end-of-turn token)
    have role ``"template"``. Turn ``len(messages)`` is the reply to the messages (a chat
    request's trace), an assistant turn. Plain text and token traces leave both ``None``.
    Given labels are checked against ``messages``: each turn is a message (or the reply),
    and each role is its message's, or ``"template"`` on an assistant turn.
    """

    id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    completion: str | None = None
    trace_token_ids: tuple[int, ...] | None = None
    ref_logprobs: tuple[float, ...] | None = None  # one per trace token, as its producer reported
    meta: dict = field(default_factory=dict, hash=False)
    messages: list[dict] | None = field(default=None, hash=False)
    tools: list[dict] | None = field(default=None, hash=False)
    turns: str | None = None  # None means "last"
    trace_turns: tuple[int, ...] | None = None  # per trace token: index into messages
    trace_roles: tuple[str, ...] | None = None  # per trace token: its message's role

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():  # a blank id names nothing
            raise TraceError(f"id must be a non-empty str, not only whitespace, got {self.id!r}")
        for name in ("prompt", "completion", "turns"):
            if not isinstance(getattr(self, name), (str, type(None))):
                self._fail(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        for name in ("prompt_token_ids", "trace_token_ids"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, self._token_ids(name))
        if self.ref_logprobs is not None:
            object.__setattr__(self, "ref_logprobs", self._logprobs())
        if self.messages is not None:
            self._check_chat()
        elif self.tools is not None or self.turns is not None:
            self._fail("tools and turns apply to chat traces only (give 'messages')")
        if self.prompt is None and self.prompt_token_ids is None and self.messages is None:
            self._fail("missing prompt: give 'prompt' or 'prompt_token_ids'")
        if self.completion is None and self.trace_token_ids is None and self.messages is None:
            self._fail("missing trace: give 'trace_token_ids' or 'completion'")
        if self.trace_token_ids is None and self.completion == "":
            self._fail("completion is empty")
        self._check_per_token()
        if not isinstance(self.meta, dict):
            self._fail(f"meta must be a dict, got {type(self.meta).__name__}")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as error:
            self._fail(f"meta is not JSON-serializable: {error}")
        self._check_unicode()

    @property
    def is_tokenized(self) -> bool:
        """Whether both the prompt and the trace are token ids."""
        return self.prompt_token_ids is not None and self.trace_token_ids is not None

    @property
    def is_chat(self) -> bool:
        """Whether the trace is a conversation (``messages``) rather than prompt text."""
        return self.messages is not None

    def _fail(self, problem: str) -> NoReturn:
        raise TraceError(problem, trace_id=self.id)

    def _sequence(self, name: str, of: str) -> tuple:
        values = getattr(self, name)
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
            self._fail(f"{name} must be a list of {of}, got {type(values).__name__}")
        return tuple(values)

    def _token_ids(self, name: str) -> tuple[int, ...]:
        values = self._sequence(name, of="ints")
        if not values:
            self._fail(f"{name} is empty")
        if set(map(type, values)) == {int} and min(values) >= 0:
            return values  # plain ints (as JSON gives), none negative: nothing to name
        for i, token_id in enumerate(values):
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                self._fail(
                    f"{name}[{i}] = {token_id!r} is not an integer ({type(token_id).__name__})"
                )
            if token_id < 0:
                self._fail(f"{name}[{i}] = {token_id} is negative")
        return tuple(int(token_id) for token_id in values)

    def _logprobs(self) -> tuple[float, ...]:
        values = self._sequence("ref_logprobs", of="floats")
        if set(map(type, values)) <= {float, int} and all(  # plain numbers, all possible
            VLLM_NEG_INF < value <= _LOGPROB_SLACK for value in values
        ):  # (NaN is not)
            return tuple(float(value) for value in values)
        for i, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                self._fail(f"ref_logprobs[{i}] = {value!r} is not a number")
            # NaN reads as "no reference" downstream; -inf (p = 0) cannot be a recorded
            # token's logprob (its producer emitted it) and would make every delta infinite
            if math.isnan(value):
                self._fail(
                    f"ref_logprobs[{i}] is NaN (leave out ref_logprobs when a trace has none)"
                )
            if value == -math.inf:
                self._fail(
                    f"ref_logprobs[{i}] = -inf is infinite; a recorded token's logprob is finite"
                )
            if value <= VLLM_NEG_INF:
                self._fail(
                    f"ref_logprobs[{i}] = {value} is vLLM's stand-in for -inf; a "
                    "recorded token's logprob is finite"
                )
            if value > _LOGPROB_SLACK:
                self._fail(f"ref_logprobs[{i}] = {value} is positive; a log-probability is <= 0")
        return tuple(float(value) for value in values)

    def _check_unicode(self) -> None:
        """Text must be valid Unicode: a lone surrogate (JSON ``"\\ud800"``) cannot be encoded."""
        texts = {"id": self.id, "prompt": self.prompt, "completion": self.completion}
        texts |= {
            name: json.dumps(getattr(self, name), ensure_ascii=False)
            for name in ("messages", "tools", "meta")
            if getattr(self, name) is not None
        }
        for name, text in texts.items():
            if text is None:
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                self._fail(
                    f"{name} holds a lone surrogate {text[error.start]!r} (character "
                    f"{error.start}), which is not valid Unicode text"
                )

    def _check_chat(self) -> None:
        # a recorded reply may keep its text beside its ids, which win (as for text traces)
        if self.prompt is not None or (
            self.completion is not None and self.trace_token_ids is None
        ):
            self._fail("give either 'messages' or 'prompt'/'completion' text, not both")
        if self.prompt_token_ids is not None and self.trace_token_ids is None:
            self._fail("a chat trace with prompt_token_ids needs trace_token_ids too")
        messages = list(self._sequence("messages", of="message objects"))
        if not messages:
            self._fail("messages is empty")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                self._fail(f"messages[{i}] must be an object, got {type(message).__name__}")
            if not isinstance(message.get("role"), str) or not message["role"]:
                self._fail(f"messages[{i}] has no 'role'")
        object.__setattr__(self, "messages", [dict(message) for message in messages])
        if self.tools is not None:
            tools = list(self._sequence("tools", of="tool objects"))
            if not all(isinstance(tool, Mapping) for tool in tools):
                self._fail("tools must be a list of objects")
            object.__setattr__(self, "tools", [dict(tool) for tool in tools])
        if self.turns is not None and self.turns not in TURNS:
            self._fail(f"turns must be one of {', '.join(map(repr, TURNS))}, got {self.turns!r}")
        replays_messages = self.trace_token_ids is None
        if replays_messages and not any(m["role"] == "assistant" for m in messages):
            self._fail("messages has no assistant turn to replay")
        try:
            json.dumps([messages, self.tools])
        except (TypeError, ValueError) as error:
            self._fail(f"messages or tools are not JSON-serializable: {error}")

    def _check_per_token(self) -> None:
        if None not in (self.ref_logprobs, self.trace_token_ids):
            if len(self.ref_logprobs) != len(self.trace_token_ids):
                self._fail(
                    f"ref_logprobs has {len(self.ref_logprobs)} values "
                    f"for {len(self.trace_token_ids)} trace tokens"
                )
        if (self.trace_turns is None) != (self.trace_roles is None):
            self._fail("trace_turns and trace_roles come together")
        if self.trace_turns is None:
            return
        if self.trace_token_ids is None:
            self._fail("trace_turns and trace_roles need trace_token_ids")
        turns = self._sequence("trace_turns", of="ints")
        roles = self._sequence("trace_roles", of="strs")
        for name, values in (("trace_turns", turns), ("trace_roles", roles)):
            if len(values) != len(self.trace_token_ids):
                self._fail(
                    f"{name} has {len(values)} values for {len(self.trace_token_ids)} trace tokens"
                )
        for i, turn in enumerate(turns):
            if isinstance(turn, bool) or not isinstance(turn, numbers.Integral) or turn < 0:
                self._fail(f"trace_turns[{i}] = {turn!r} is not a message index")
        for i, role in enumerate(roles):
            if not isinstance(role, str):
                self._fail(f"trace_roles[{i}] = {role!r} is not a str")
        object.__setattr__(self, "trace_turns", tuple(int(turn) for turn in turns))
        object.__setattr__(self, "trace_roles", roles)
        self._check_labels_match_messages()

    def _check_labels_match_messages(self) -> None:
        """Each labelled turn is a message or the reply to them (``len(messages)``), and each
        role is that turn's own, or the template's on an assistant turn."""
        if self.messages is None:
            self._fail(
                "trace_turns and trace_roles label the tokens of a chat trace: give its 'messages'"
            )
        reply = len(self.messages)
        for i, (turn, role) in enumerate(zip(self.trace_turns, self.trace_roles)):
            if turn > reply:
                self._fail(
                    f"trace_turns[{i}] = {turn} is no message: messages has {reply} "
                    f"(0-{reply - 1}; {reply} is the reply to them)"
                )
            own = "assistant" if turn == reply else self.messages[turn]["role"]
            if role != own and not (role == TEMPLATE_ROLE and own == "assistant"):
                turn_is = "the reply" if turn == reply else f"messages[{turn}]"
                also = " or 'template'" if own == "assistant" else ""
                self._fail(
                    f"trace_roles[{i}] = {role!r}, but trace_turns[{i}] = {turn} is "
                    f"{turn_is}, role {own!r}: the label must be {own!r}{also}"
                )


FIELDS = tuple(f.name for f in fields(Trace))  # a record's keys, in order
JSON_FIELDS = ("meta", "messages", "tools")  # objects that Parquet stores as JSON strings
