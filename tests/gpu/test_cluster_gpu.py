"""A cluster run on one GPU: one actor holding the GPU, bitwise the single-process run.

The CPU suite's cluster tests run CPU actors; here the actor's engine runs on the GPU Ray
gives it (``num_gpus=1``, the default where the engine's device is CUDA), in deterministic
mode, against the same replay in this process. The model is random (a 4-layer Llama of
SmolLM2-135M's widths) saved to a folder with a byte-level tokenizer (256 ids, no merges),
so that the actor loads it from a path as on a real cluster; the traces are random ids of
that tokenizer. Run by hand on a GPU machine with Ray installed (``pip install
'trace-replay[ray]'``); CI skips the module.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from trace_replay.runs.cluster import RayCluster  # noqa: E402
from trace_replay.runs.replay import replay  # noqa: E402


@pytest.fixture(scope="module")
def model_folder(save_smol_llama):
    """A random 4-layer Llama of SmolLM2-135M's widths, with a byte-level tokenizer."""
    return save_smol_llama("model", byte_tokenizer=True)


@pytest.fixture(scope="module")
def cluster(local_ray):
    with local_ray(num_gpus=1):
        yield RayCluster(actors=1)


def test_one_gpu_actor_is_the_single_process_run(
    cluster, model_folder, assert_frames_bitwise_equal
):
    """Deterministic replay of 24 traces on one GPU actor: bitwise the in-process replay,
    with the GPU in attrs['cluster']."""
    gen = torch.Generator().manual_seed(0)
    traces = [
        {
            "id": f"t{i}",
            "prompt_token_ids": torch.randint(3, 256, (4 + i,), generator=gen).tolist(),
            "trace_token_ids": torch.randint(3, 256, (1 + 3 * i,), generator=gen).tolist(),
        }
        for i in range(24)
    ]
    options = {
        "engine": "torch",
        "device": "cuda",
        "deterministic": True,
        "batch_size": 8,
        "progress": False,
    }
    single = replay(traces, model_folder, **options)
    df = replay(traces, model_folder, **options, cluster=cluster)
    assert_frames_bitwise_equal(df, single)
    assert df.attrs["cluster"]["num_gpus"] == 1 and df.attrs["device"] == single.attrs["device"]
