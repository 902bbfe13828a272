"""vLLM's routed experts (``enable_return_routed_experts``, Model Runner V2, GPU only) line
up with the prefill engine's router hooks on a tiny random Qwen3-MoE: same (trace, step,
layer) rows, and the same experts wherever the router's choice is not a near-tie."""

from __future__ import annotations

import pytest
import torch

import trace_replay as tr
from trace_replay.analysis.routing import record_routing, routing_flips

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRACES = [
    {"id": "a", "prompt": "The capital of France is", "completion": " Paris, a city"},
    {"id": "b", "prompt": "One, two,", "completion": " three, four, five, six"},
]


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, save_byte_tokenizer):
    """A random 4-layer Qwen3-MoE (head_dim 64, 8 experts, top-2) saved with the embedded
    byte-level tokenizer (tests/conftest.py), float32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trace_replay.engines.routing import find_routers

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        pad_token_id=0,
    )
    model = Qwen3MoeForCausalLM(config)
    for router in find_routers(model).values():
        torch.nn.init.normal_(router.weight, std=0.5)
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    return folder


def test_vllm_routing_matches_the_router_hooks(moe_folder):
    """vLLM (GPU, routed experts on) and the prefill engine record the same rows; at least
    95% of (step, layer) expert sets agree (float32 both; a near-tie may flip)."""
    with tr.make_engine(
        "vllm",
        model=str(moe_folder),
        dtype="float32",
        engine_args={"enable_return_routed_experts": True},
    ) as vllm:
        df_a, ra = record_routing(TRACES, vllm)
    with tr.make_engine(
        "prefill", model=str(moe_folder), dtype="float32", device="cuda"
    ) as prefill:
        df_b, rb = record_routing(TRACES, prefill)
    assert len(ra) == len(rb) == len(df_a) * 4
    flips = routing_flips(ra, rb, tr.compare(df_a, df_b))
    assert flips["flip_rate"].max() <= 0.05, flips
