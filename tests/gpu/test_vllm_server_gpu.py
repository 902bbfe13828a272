"""A stock vLLM server with native trace replay (issue 53): ``vllm serve --enable-trace-replay
--enable-scale-out``, nothing of the package loaded, replayed through ``engine="vllm-server"``,
gives the offline native engine's numbers bit for bit.

Run by hand on a GPU machine with vLLM >= 0.29 (``benchmarks/h200_vllm.sh server-tests``); CI
has no GPU and skips the module. The model is a random 4-layer Llama of SmolLM2-135M's widths
(weights at init 0.3) with a byte-level tokenizer (the client checks that the server
tokenizes as it does), float32 (the package's default: FlexAttention on CUDA). The offline
engine runs first and is closed; the server then starts with the same engine arguments
(``llm_options`` of the engine's ``llm_args``). Both run eager, and each trace runs alone in
its batch on both sides: batch composition, not the server, moves a logprob's last bits.
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[gpu]')")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

from trace_replay.engines import make_engine  # noqa: E402
from trace_replay.engines.base import ReplayRequest  # noqa: E402
from trace_replay.engines.server.serve import (  # noqa: E402
    llm_options,
    start_server,
    stop_server,
    vllm_serve,
    wait_for_server,
)

VOCAB = 49152
STEPS = 40
ENGINE_ARGS = {
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_batched_tokens": 1024,
    "gpu_memory_utilization": 0.3,
}


@pytest.fixture(scope="module")
def folder(save_smol_llama):
    return save_smol_llama("random-llama-served", byte_tokenizer=True)


@pytest.fixture(scope="module")
def offline(folder):
    """Offline native replay, each trace alone: 6 greedy traces and the same with every 7th
    token replaced. Returns (requests, results, the engine's vllm.LLM arguments)."""
    engine = make_engine(
        "vllm", folder, batch_size=8, top_k=5, engine_args=ENGINE_ARGS, native=True
    )
    try:
        assert engine.settings()["engine_path"] == "vllm-native-trace-replay"
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, VOCAB, (16,), generator=gen).tolist() for _ in range(6)]
        greedy = [ids for ids, _ in engine.generate(prompts, max_tokens=STEPS)]
        off = [
            [
                int(torch.randint(3, VOCAB, (1,), generator=gen)) if s % 7 == 3 else t
                for s, t in enumerate(trace)
            ]
            for trace in greedy
        ]
        requests = [
            ReplayRequest(f"{kind}{i}", tuple(p), tuple(t))
            for kind, traces in (("on", greedy), ("off", off))
            for i, (p, t) in enumerate(zip(prompts, traces))
        ]
        results = [engine.run([request])[0] for request in requests]
        return requests, results, dict(engine.llm_args)
    finally:
        engine.close()
        # the server's memory profiling fails where this process releases memory meanwhile
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def stock_server(folder, offline):
    """``vllm serve FOLDER --enable-trace-replay --enable-scale-out`` plus the offline
    engine's arguments; its base_url."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = vllm_serve(
        folder,
        [
            "--served-model-name",
            "random-llama",
            "--enable-trace-replay",
            "--enable-scale-out",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *llm_options(offline[2]),
        ],
    )
    log = Path(tempfile.mkdtemp()) / "server.log"
    process = start_server(command, log)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        wait_for_server(url, process, timeout_s=400, log_path=log)
        yield url
    finally:
        stop_server(process)


def test_a_stock_server_replays_natively_bit_for_bit(folder, offline, stock_server):
    """The start-up check finds native trace replay on the stock server; each trace, sent
    alone, comes back exactly, with logprobs, ranks and top-5 equal in every bit to the
    offline native engine's of the same engine arguments."""
    requests, expected, _ = offline
    with make_engine(
        "vllm-server", folder, batch_size=1, top_k=5, engine_args={"base_url": stock_server}
    ) as engine:
        settings = engine.settings()
        assert settings["server_forcing"] == "native", settings
        assert settings["engine_path"] == "vllm-server-native-trace-replay[generate]"
        served = engine.run(requests)
    for request, want, got in zip(requests, expected, served):
        assert got.token_ids.tolist() == list(request.trace_token_ids), request.trace_id
        assert np.array_equal(got.logprob, want.logprob), request.trace_id
        assert got.rank.tolist() == want.rank.tolist(), request.trace_id
        assert got.top_token_ids.tolist() == want.top_token_ids.tolist(), request.trace_id
        assert np.array_equal(got.top_logprobs, want.top_logprobs), request.trace_id
