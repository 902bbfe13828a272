"""Tensor parallelism kept tested without GPUs: vLLM's CPU build runs TP=2 over gloo, two
worker processes with one core each (``VLLM_CPU_OMP_THREADS_BIND="0|1"``), in process
(``make_engine("vllm", engine_args={"tensor_parallel_size": 2})``) and served
(``trace-replay serve``'s command with ``--tensor-parallel-size 2``, through
``engine="vllm-server"``). Both follow exactly the traces given and agree with TP=1 within
:data:`TP_TOL`: float32 partial sums of the sharded matmuls are added in another order, so the
logprobs move by rounding only (measured: docs/engines.md, benchmarks/RESULTS.md).

The model is a random 2-layer Llama (4 heads, 2 key-value heads, vocabulary 1024, float32)
saved to a folder with a byte-level tokenizer; the traces are random ids, so most forced
tokens are far from the top (ranks in the hundreds). One engine start per test; TP=1 is the
reference, built first.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[cpu]')")

from trace_replay.engines import make_engine  # noqa: E402
from trace_replay.engines.base import ReplayRequest  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="the CPU build's gloo ranks (tests/gpu on GPUs)"
    ),
]

VOCAB = 1024
# max |Δ logprob| TP=2 against TP=1 allowed: measured 2.2e-5 (median 2.9e-6), in process and
# served alike (2026-12-07, x86_64, 2 cores; issue 33's one-off scripts saw 1.2e-5 and
# 1.4e-5 on another model): 4.5x margin, still far below what a wrong shard or token moves
TP_TOL = 1e-4
ARGS = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 512}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank


@pytest.fixture(scope="module")
def folder(tmp_path_factory, save_random_llama) -> str:
    return save_random_llama(
        tmp_path_factory.mktemp("random-llama-tp"),
        byte_tokenizer=True,
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
    )


@pytest.fixture(scope="module")
def requests() -> list[ReplayRequest]:
    """4 traces of 24 random tokens after 8-token random prompts."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (4, 32), generator=gen).tolist()
    return [ReplayRequest(f"t{i}", tuple(row[:8]), tuple(row[8:])) for i, row in enumerate(ids)]


def _run(folder, requests, tp: int):
    engine = make_engine(
        "vllm", folder, batch_size=4, top_k=5, engine_args={**ARGS, "tensor_parallel_size": tp}
    )
    try:
        return engine.settings(), engine.run(requests)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tp1(folder, requests):
    return _run(folder, requests, 1)[1]


def _agree(results, reference, requests) -> float:
    """Every trace followed exactly; logprobs within TP_TOL of the reference's, ranks equal
    but for near-ties (off by one at most, 97% equal); the worst |Δ| is returned."""
    for result, request in zip(results, requests):
        assert result.token_ids.tolist() == list(request.trace_token_ids), result.trace_id
    delta = np.concatenate([np.abs(a.logprob - b.logprob) for a, b in zip(results, reference)])
    ranks = np.concatenate([a.rank - b.rank for a, b in zip(results, reference)])
    print(
        f"TP=2 vs TP=1: median |Δ| {np.median(delta):.1e}, max {delta.max():.1e}, "
        f"ranks equal {np.mean(ranks == 0):.3f}"
    )
    assert delta.max() <= TP_TOL
    assert np.abs(ranks).max() <= 1 and np.mean(ranks == 0) >= 0.97
    return float(delta.max())


def test_tp2_in_process_agrees_with_tp1(folder, requests, tp1, monkeypatch):
    """make_engine("vllm", engine_args={"tensor_parallel_size": 2}) on the CPU build: two
    gloo ranks, the size in settings(), the traces followed, TP=1's numbers within TP_TOL."""
    for key, value in BIND.items():
        monkeypatch.setenv(key, value)
    settings, results = _run(folder, requests, 2)
    assert settings["tensor_parallel_size"] == 2
    assert settings["engine_path"] == "vllm-logits-processor-forcing"
    _agree(results, tp1, requests)


def test_tp2_served_agrees_with_tp1(folder, requests, tp1, tmp_path, monkeypatch):
    """``trace-replay serve``'s command with ``--tensor-parallel-size 2`` (two gloo ranks
    behind one server), replayed through engine="vllm-server": TP=1's numbers within
    TP_TOL, the traces followed."""
    from trace_replay.engines.server.serve import (
        serve_command,
        start_server,
        stop_server,
        wait_for_server,
    )

    for key, value in BIND.items():
        monkeypatch.setenv(key, value)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = serve_command(
        folder,
        port=port,
        extra_args=[
            "--max-model-len",
            str(ARGS["max_model_len"]),
            "--max-num-seqs",
            "8",
            "--tensor-parallel-size",
            "2",
            # what 8 sequences of 128 tokens need, many times over: left to itself the CPU
            # build's server takes ~6.4 GiB per rank (the in-process engine sizes its own);
            # an engine-core start failed here while another run's TP=2 server held ~13 GiB
            # of the 24 GiB machine
            "--kv-cache-memory-bytes",
            str(64 << 20),
        ],
    )
    log = tmp_path / "server.log"
    server = start_server(command, log)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        wait_for_server(url, server, timeout_s=600, log_path=log)
        with make_engine("vllm-server", top_k=5, engine_args={"base_url": url}) as engine:
            results = engine.run(requests)
    finally:
        stop_server(server)
    _agree(results, tp1, requests)
