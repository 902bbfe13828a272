"""What only some engines can do (trace_replay.engines.capabilities): each capability is a
small protocol, and ``supports`` says whether an engine or engine class has it, counting
EngineBase's refusing defaults as absent."""

from __future__ import annotations

import pytest

from trace_replay.engines.base import EngineBase
from trace_replay.engines.builtin.engine import TorchEngine
from trace_replay.engines.builtin.prefill import PrefillEngine
from trace_replay.engines.capabilities import ActivationSource, BatchHooks, Generates, supports
from trace_replay.engines.server.engine import ServerEngine


@pytest.mark.parametrize(
    "engine_class, generates, activations, hooks",
    [
        (TorchEngine, True, True, True),
        (PrefillEngine, False, True, True),
        (ServerEngine, False, False, False),
    ],
)
def test_each_engine_class_has_the_capabilities_it_implements(
    engine_class, generates, activations, hooks
):
    """The built-in decode engine generates and exposes its forwards; prefill exposes its
    forwards only; the server engine, whose model is elsewhere, has neither (its inherited
    generate and activations only refuse)."""
    assert (
        supports(engine_class, Generates),
        supports(engine_class, ActivationSource),
        supports(engine_class, BatchHooks),
    ) == (generates, activations, hooks)


def test_an_engine_without_the_base_class_has_what_it_defines():
    """A duck-typed engine has a capability exactly when it defines its members."""

    class Plain:
        def generate(self, prompts, *, max_tokens, temperature=0.0, seed=0, eos_token_id=None):
            return [([0] * max_tokens, [0.0] * max_tokens) for _ in prompts]

    assert supports(Plain(), Generates) and not supports(Plain(), ActivationSource)
    assert not supports(Plain(), BatchHooks)


def test_a_subclass_overriding_a_refusing_default_gains_the_capability():
    """EngineBase's ``generate`` refuses, so a subclass that keeps it does not generate; one
    that overrides it does, and ``can_generate`` agrees."""

    class Scorer(EngineBase):
        def run(self, requests, *, on_tokens=None):
            return []

    class Writer(Scorer):
        def generate(self, prompts, *, max_tokens, temperature=0.0, seed=0, eos_token_id=None):
            return []

    assert not supports(Scorer, Generates) and supports(Writer, Generates)
    assert (Scorer().can_generate, Writer().can_generate) == (False, True)
