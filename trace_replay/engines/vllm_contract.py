"""What the package's vLLM-side code and its clients agree on, with no vllm import.

The forcing processor (:mod:`trace_replay.engines.vllm.forcing`) reads a request's trace from
``SamplingParams.extra_args`` under :data:`TRACE_KEY`; the in-process vLLM engine puts it there,
and the server engine sends it in ``vllm_xargs``. A server loads the processor by the import
path :data:`FORCING_PROCESSOR`. Engines of more than one GPU start their processes with
:data:`MULTICAST_OFF`. Keeping these here lets the vLLM engine, the server engine and the
``serve`` command share them without importing each other.
"""

from __future__ import annotations

__all__ = ["FORCING_PROCESSOR", "MULTICAST_OFF", "TRACE_KEY"]

FORCING_PROCESSOR = "trace_replay.engines.vllm.forcing:TraceForcingProcessor"
TRACE_KEY = "trace_replay_token_ids"  # the SamplingParams.extra_args key the processor reads
# NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM: on a shared multi-GPU
# host a program that uses it can put the host's GPUs out of service
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
