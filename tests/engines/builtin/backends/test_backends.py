"""Tests for trace_replay.engines.builtin.backends.base: every shipped backend is a Backend, a
class lacking a member is refused by name, and make_backend builds each kind it names."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from trace_replay.engines import make_engine
from trace_replay.engines.base import Activations
from trace_replay.engines.builtin.backends.base import BACKEND_MEMBERS, check_backend
from trace_replay.engines.builtin.backends.factory import KINDS, make_backend
from trace_replay.engines.builtin.backends.packed_linear import packed_linears_available


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "auto"])
def test_every_shipped_backend_has_every_member(tiny_llama, kind):
    """hf, static and invariant each define every member the protocol declares."""
    backend = make_backend(kind, tiny_llama, 0)
    check_backend(backend)
    assert backend.name.startswith(kind)


def test_the_protocol_declares_what_the_engine_and_its_loop_call():
    """The members are the ones TorchEngine, decode and verify use: a change to either side
    shows up here."""
    assert set(BACKEND_MEMBERS) == {
        "activations",
        "decode",
        "forwards",
        "keep",
        "name",
        "prefill",
        "score",
        "settings",
        "static_logits",
    }


class _NoKeep:
    """Every member but ``keep`` and ``activations`` (a verify-less, unwatchable pass)."""

    name, forwards, static_logits = "no-keep", 0, False

    def prefill(self, prompts, max_new_tokens):
        return torch.zeros(len(prompts), 8)

    def decode(self, tokens, positions):
        return torch.zeros(*tokens.shape, 8)

    def score(self, logits, token_ids, top_k):
        raise NotImplementedError

    def settings(self):
        return {}


def test_a_backend_lacking_members_is_refused_naming_them():
    """check_backend names each missing member, in the protocol's order."""
    with pytest.raises(TypeError, match=r"_NoKeep .* lacks activations, keep \("):
        check_backend(_NoKeep())


def test_auto_on_the_cpu_is_static_for_float32_only(tiny_llama):
    """On the CPU "auto" builds the static backend for a float32 Llama where torch packs
    float32 linears for oneDNN, and hf for the same model in bfloat16."""
    fast = "static+onednn" if packed_linears_available(torch.float32) else "hf"
    assert make_backend("auto", tiny_llama, 0).name == fast
    half = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    assert make_backend("auto", half, 0).name == "hf"


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown backend kind 'fast'; choose one of auto, hf"):
        make_backend("fast", None, 0)


@pytest.mark.parametrize("name", ["torch", "prefill"])
def test_deterministic_attention_reaches_the_row_wise_model(tiny_llama, name):
    """The engine option picks the row-wise model's Triton attention (decode and prefill
    must share one); by default it is "tiles"."""
    chosen = make_engine(name, tiny_llama, deterministic=True, deterministic_attention="rows")
    assert chosen.backend.model.attention == "rows"
    assert make_engine(name, tiny_llama, deterministic=True).backend.model.attention == "tiles"


def test_backends_answer_activations_as_the_engine_contract_says(tiny_llama):
    """hf: the model's own modules; invariant: the row-wise model's rows over the same
    weights; static: none, with the backend to build instead."""
    assert make_backend("hf", tiny_llama, 0).activations() == Activations(tiny_llama)
    invariant = make_backend("deterministic", tiny_llama, 0)
    assert invariant.activations() == Activations(tiny_llama, invariant.model)
    with pytest.raises(NotImplementedError, match="backend='hf'"):
        make_backend("static", tiny_llama, 0).activations()


# modules of the static and deterministic backends alone, and the kernels only they launch
_NOT_ON_THE_CPU_PATH = (
    "backends.static",
    "backends.captured_step",
    "backends.deterministic",
    "passes.batch1_fusions",
    "passes.linear_groups",
    "kernels.gemv",
    "kernels.gated_gemv",
    "kernels.grouped_members",
    "kernels.fp32_linear",
    "kernels.rms_norm",
    "kernels.cache_attention",
    "kernels.top_k",
    "kernels.invariant",
)


def test_the_hf_engine_imports_no_static_backend():
    """A torch engine on its hf backend imports neither the static backend nor the
    deterministic one, nor their compiler passes and kernels: their module bodies are not on
    its path."""
    code = (
        "import sys, transformers\n"
        "from trace_replay.engines import make_engine\n"
        "config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        "lm = transformers.AutoModelForCausalLM.from_config(config).eval()\n"
        "assert make_engine('torch', lm, device='cpu', backend='hf').backend.name == 'hf'\n"
        "print(sorted(m for m in sys.modules if m.startswith('trace_replay.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    imported = [m for m in eval(out) if any(f".{part}" in m for part in _NOT_ON_THE_CPU_PATH)]
    assert imported == []
