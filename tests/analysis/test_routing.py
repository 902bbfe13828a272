"""trace_replay.engines.routing and trace_replay.analysis.routing: the experts each token was
routed to, per layer, recorded from a tiny random MoE (Qwen3-MoE, Mixtral) on the CPU; a
planted change to one expert's router row in one layer is found at that layer."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import trace_replay as tr
from trace_replay.analysis.routing import flip_matrix, record_routing, routing_flips
from trace_replay.engines.routing import RoutingRecorder, find_routers

pytestmark = pytest.mark.slow

TRACES = [
    {"id": "a", "prompt": "The capital of France is", "completion": " Paris, a city"},
    {"id": "b", "prompt": "One, two,", "completion": " three, four, five, six"},
]


def tiny_moe(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random 3-layer MoE over the embedded tokenizer's vocabulary, float32."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        num_experts_per_tok=2,
        pad_token_id=0,
    )
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        config = MixtralConfig(**common, intermediate_size=32, num_local_experts=8)
        model = MixtralForCausalLM(config)
    for router in find_routers(model).values():  # transformers starts them at zero
        torch.nn.init.normal_(router.weight, std=0.5)
    return model.eval()


def engine(name: str, model: torch.nn.Module, tokenizer, **options):
    """``make_engine(name, model=model)`` with the embedded tokenizer (the tiny model's
    vocabulary is the embedded model's)."""
    made = tr.make_engine(name, model=model, **options)
    made.tokenizer = tokenizer
    return made


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request):
    return request.param, tiny_moe(request.param)


def test_routers_are_found_per_layer(moe):
    """Every decoder layer's router is found, by layer index."""
    _, model = moe
    assert list(find_routers(model)) == [0, 1, 2]


def test_decode_and_teacher_forced_routing_agree(moe, tokenizer):
    """The built-in engine's hf decode and the prefill engine (same float32 weights) route
    every (trace, step, layer) to the same experts, with router weights within rounding:
    the two layouts pair rows with steps alike."""
    _, model = moe
    with (
        engine("torch", model, tokenizer, backend="hf", batch_size=2) as decode,
        engine("prefill", model, tokenizer, batch_size=2) as prefill,
    ):
        df_a, ra = record_routing(TRACES, decode)
        df_b, rb = record_routing(TRACES, prefill)
    assert len(ra) == len(df_a) * 3 and len(rb) == len(df_b) * 3
    flips = routing_flips(ra, rb)
    assert (flips["flips"] == 0).all()
    np.testing.assert_allclose(np.stack(ra["weights"]), np.stack(rb["weights"]), atol=1e-4)
    assert all(len(set(e)) == 2 for e in ra["experts"])


def test_a_planted_router_change_is_found_at_its_layer(moe, tokenizer):
    """One expert's router row raised in layer 1 only: the first flip of every trace that
    flips is at layer 1 (layer 0 routes alike), the expert sets differ there and gain the
    planted expert, and the logprob divergence is reported beside it."""
    _, model = moe
    planted = copy.deepcopy(model)
    router = find_routers(planted)[1]
    with torch.no_grad():
        router.weight[5] += (
            2.0
            * router.weight.norm(dim=1).mean()
            * torch.sign(
                torch.randn(router.weight.shape[1], generator=torch.Generator().manual_seed(1))
            )
        )
    with engine("prefill", model, tokenizer) as a, engine("prefill", planted, tokenizer) as b:
        df_a, ra = record_routing(TRACES, a)
        df_b, rb = record_routing(TRACES, b)
    flips = routing_flips(ra, rb, tr.compare(df_a, df_b))
    assert (flips["first_flip_layer"] == 1).all(), flips
    for _, row in flips.iterrows():
        assert row.experts_a != row.experts_b and 5 in row.experts_b
        assert 0 <= row.first_divergence_step
    matrix = flip_matrix(ra, rb, "a")
    assert not matrix.loc[0].any() and matrix.loc[1].any()


def test_a_dense_model_has_no_routing():
    """The embedded (dense) model has no router: recording is refused, naming why."""
    with tr.make_engine("prefill") as engine:
        with pytest.raises(ValueError, match="no mixture-of-experts router"):
            RoutingRecorder(engine)


@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's refusal")
def test_vllm_routing_on_the_cpu_is_refused_with_a_reason():
    """vLLM returns routed experts from Model Runner V2 on GPUs only: on the CPU the engine
    refuses before starting, saying what to use instead."""
    with pytest.raises(ValueError, match="GPUs only.*prefill engine"):
        tr.make_engine("vllm", engine_args={"enable_return_routed_experts": True})


@pytest.mark.vllm
def test_vllm_cpu_forcing_replays_a_tiny_qwen3_moe(tmp_path, tokenizer):
    """vLLM's CPU build (forcing path) replays a tiny random Qwen3-MoE (head_dim 64, which its
    CPU attention takes), and its logprobs are the prefill engine's within float32
    rounding of two kernels."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        pad_token_id=0,
    )
    model = Qwen3MoeForCausalLM(config)
    for router in find_routers(model).values():
        torch.nn.init.normal_(router.weight, std=0.5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with tr.make_engine("vllm", model=str(tmp_path), dtype="float32", native=False) as vllm:
        got = tr.replay(TRACES, engine=vllm, progress=False)
    with tr.make_engine("prefill", model=str(tmp_path), dtype="float32") as prefill:
        want = tr.replay(TRACES, engine=prefill, progress=False)
    cmp = tr.compare(got, want)
    assert cmp["abs_delta"].max() < 1e-3 and (cmp["rank_a"] == cmp["rank_b"]).mean() > 0.9
    assert got["tail_logmass"].notna().all()
