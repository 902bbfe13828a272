"""Tensor and pipeline parallelism in the vLLM engine, without GPUs: the sizes checked and
recorded before vLLM starts, the KV cache of one CPU rank, NVLink multicast kept off while
the engine's processes start, and worker processes' stderr not held back. No vLLM starts
here (tests/gpu/test_vllm_tp_gpu.py runs TP=2 on two GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trace_replay.engines.server.serve import MULTICAST_OFF
from trace_replay.engines.vllm.inprocess import hosted_startup, multicast_off


@pytest.fixture(scope="module")
def vllm_engine():
    pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[cpu]')")
    from trace_replay.engines.vllm import engine as vllm_engine

    return vllm_engine


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True, None])
@pytest.mark.parametrize("option", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_parallel_size_that_is_not_a_positive_integer_is_refused(vllm_engine, option, bad):
    """tensor/pipeline_parallel_size must be positive integers (a bool or a string is not):
    the error names the option and the value given."""
    with pytest.raises(
        ValueError,
        match=rf"engine_args\['{option}'\] must be a positive "
        rf"integer, got {bad!r}",
    ):
        vllm_engine.parallel_sizes({option: bad}, None)


def test_make_engine_refuses_a_bad_size_before_vllm_starts(vllm_engine, capsys):
    """make_engine("vllm", engine_args={"tensor_parallel_size": 0}) is refused by the package,
    naming the option, before any start-up line (vLLM is never asked)."""
    from trace_replay.engines import make_engine

    with pytest.raises(ValueError, match=r"engine_args\['tensor_parallel_size'\] must be"):
        make_engine("vllm", None, engine_args={"tensor_parallel_size": 0})
    assert "starting vLLM" not in capsys.readouterr().err


def test_more_ranks_than_cuda_devices_are_refused_naming_both(vllm_engine, monkeypatch):
    """On CUDA, tensor x pipeline ranks above the visible devices: the error gives the sizes,
    the devices needed and those visible (with CUDA_VISIBLE_DEVICES when set)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size 2 x pipeline_parallel_size 1 "
        r"needs 2 CUDA devices.*but 1 is visible "
        r"\(CUDA_VISIBLE_DEVICES=3\)",
    ):
        vllm_engine.parallel_sizes({"tensor_parallel_size": 2}, 1)
    with pytest.raises(ValueError, match="needs 4 CUDA devices.*but 2 are visible"):
        vllm_engine.parallel_sizes({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 2)


def test_sizes_are_taken_as_given(vllm_engine, monkeypatch):
    """Absent sizes are 1; sizes that fit the devices (on vLLM's CPU build, ranks whose
    threads are bound by VLLM_CPU_OMP_THREADS_BIND) come back as the settings record them."""
    assert vllm_engine.parallel_sizes({}, None) == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
    }
    assert vllm_engine.parallel_sizes({"tensor_parallel_size": 2}, 2) == {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
    }
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0|1")
    assert (
        vllm_engine.parallel_sizes({"tensor_parallel_size": 4}, None)["tensor_parallel_size"] == 4
    )


def test_cpu_ranks_without_numa_nodes_or_a_binding_are_refused(vllm_engine, monkeypatch):
    """On vLLM's CPU build, more ranks than NUMA nodes with automatic thread binding: a clear
    error naming the sizes, the nodes and VLLM_CPU_OMP_THREADS_BIND with an example (vLLM
    itself fails later with an assertion in its worker start-up)."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA", raising=False)
    ranks = len(get_visible_memory_node()) + 1
    with pytest.raises(
        ValueError,
        match=rf"binds each of the {ranks} ranks to a NUMA node.*"
        r"set VLLM_CPU_OMP_THREADS_BIND to one CPU list per "
        r"rank, e\.g\. '0\|1",
    ):
        vllm_engine.parallel_sizes({"tensor_parallel_size": ranks}, None)


def test_a_cpu_rank_sizes_its_kv_cache_to_its_share(vllm_engine, tmp_path):
    """vLLM's kv_cache_memory_bytes is per worker: with TP=2 a rank holds half the key-value
    heads, with PP=2 half the layers (rounded up); with fewer heads than ranks a rank still
    holds one (vLLM replicates them)."""
    import json

    config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_size": 256,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    one = vllm_engine.kv_cache_bytes(tmp_path, torch.float32, 4, 64)
    assert (
        vllm_engine.kv_cache_bytes(tmp_path, torch.float32, 4, 64, tensor_parallel_size=2) * 2
        == one
    )
    assert (
        vllm_engine.kv_cache_bytes(tmp_path, torch.float32, 4, 64, pipeline_parallel_size=2) * 3
        == one * 2
    )
    assert (
        vllm_engine.kv_cache_bytes(tmp_path, torch.float32, 4, 64, tensor_parallel_size=8) * 4
        == one
    )


def test_multicast_is_off_while_the_engine_starts_then_as_before(monkeypatch):
    """multicast_off(True) sets each NVLink-multicast variable the user has not set, keeps the
    user's own value, and afterwards (also after an error) removes exactly the ones it set."""
    for key in MULTICAST_OFF:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's choice
    with pytest.raises(RuntimeError), multicast_off(True):
        assert os.environ["NCCL_NVLS_ENABLE"] == "1"
        assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
        raise RuntimeError("start-up failed")
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in os.environ
    assert "NVSHMEM_DISABLE_NVLS" not in os.environ
    with multicast_off(False):
        assert "NVSHMEM_DISABLE_NVLS" not in os.environ


def test_worker_processes_keep_the_real_stderr(capfd):
    """A process started during a start-up that leaves workers (workers=True) writes to the
    process's real stderr after start-up ends (a worker's later traceback is seen); without
    workers, C-level stderr is still held back during start-up."""
    late = "import sys, time; time.sleep(0.5); sys.stderr.write('worker says late')"
    with hosted_startup(False, workers=True):
        child = subprocess.Popen([sys.executable, "-c", late])
    child.wait(timeout=30)
    assert "worker says late" in capfd.readouterr().err
    with hosted_startup(False):
        os.write(2, b"held back")
    assert "held back" not in capfd.readouterr().err
