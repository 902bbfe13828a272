"""A cluster run whose actor holds a TP=2 vLLM engine (docs/cluster.md, the planned
multi-GPU path): one Ray actor of ``num_gpus=2``, its engine ``make_engine("vllm",
engine_args={"tensor_parallel_size": 2})``, whose two ranks vLLM starts as processes of that
node. The run follows every trace, records the size and the actor's GPUs, and agrees with a
one-GPU run in this process within bf16 noise (test_vllm_tp_gpu.py's bounds).

Run by hand on a machine with two CUDA GPUs, vLLM and the [ray] extra; skipped elsewhere
(the CPU build cannot start Ray beside a TP=2 actor on the 2-core test machine:
docs/cluster.md). The model is a random 4-layer Llama with SmolLM2-135M's widths but 8 query
and 2 key-value heads (TP=2 divides them), with a byte-level tokenizer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[gpu]')")
pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

from trace_replay.runs.cluster import RayCluster  # noqa: E402
from trace_replay.runs.replay import replay  # noqa: E402

ARGS = {"enforce_eager": True, "max_model_len": 256, "gpu_memory_utilization": 0.2}


@pytest.fixture(scope="module")
def folder(save_smol_llama):
    return save_smol_llama(
        "random-llama-tp-actor",
        byte_tokenizer=True,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def traces():
    """12 traces of random ids (prompts of 16, traces of 8-41 tokens)."""
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "id": f"t{i}",
            "prompt_token_ids": torch.randint(3, 256, (16,), generator=gen).tolist(),
            "trace_token_ids": torch.randint(3, 256, (8 + 3 * i,), generator=gen).tolist(),
        }
        for i in range(12)
    ]


def _replay(folder, traces, tp: int, **options):
    return replay(
        traces,
        folder,
        engine="vllm",
        dtype="bfloat16",
        batch_size=16,
        top_k=5,
        engine_args={**ARGS, "tensor_parallel_size": tp},
        progress=False,
        **options,
    )


def test_a_tp2_actor_agrees_with_one_gpu(folder, traces, local_ray):
    """One actor of 2 GPUs holding a TP=2 engine: every trace followed, the size in the
    frame's attrs, 2 GPUs per actor in attrs['cluster'], logprobs within bf16 noise of the
    one-GPU run (median |Δ| < 0.05) and ranks equal almost everywhere (> 0.9)."""
    one = _replay(folder, traces, 1)
    with local_ray(num_gpus=2, num_cpus=4):
        two = _replay(folder, traces, 2, cluster=RayCluster(actors=1, num_gpus=2))
    assert two.attrs["cluster"]["actors"] == 1 and two.attrs["cluster"]["num_gpus"] == 2
    assert two.attrs["tensor_parallel_size"] == 2
    for trace in traces:
        rows = two[two["trace_id"] == trace["id"]].sort_values("step")
        assert rows["token_id"].tolist() == trace["trace_token_ids"], trace["id"]
    one = one.sort_values(["trace_id", "step"]).reset_index(drop=True)
    two = two.sort_values(["trace_id", "step"]).reset_index(drop=True)
    delta = np.abs(one["logprob"].to_numpy() - two["logprob"].to_numpy())
    ranks = (one["rank"].to_numpy() == two["rank"].to_numpy()).mean()
    print(
        f"TP=2 actor vs TP=1: median |Δ| {np.median(delta):.2e}, max {delta.max():.2e}, "
        f"rank agreement {ranks:.4f}"
    )
    assert np.median(delta) < 0.05
    assert ranks > 0.9
