"""vLLM's batch-invariant mode: never claimed where it cannot run; the switch is scoped."""

from __future__ import annotations

import os

import pytest
import torch

from trace_replay.engines.vllm.deterministic import (
    ENV,
    deterministic_env,
    deterministic_unavailable,
)


def test_cpu_has_no_batch_invariant_vllm():
    """On the CPU (asked for, or the only device) a reason is given, never None."""
    assert "CPU" in deterministic_unavailable("cpu")
    if not torch.cuda.is_available():
        assert deterministic_unavailable() is not None


@pytest.mark.parametrize("before", [None, "0"])
def test_env_set_for_the_start_only(monkeypatch, before):
    """VLLM_BATCH_INVARIANT=1 inside the block, its previous value (or absence) after."""
    if before is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, before)
    with deterministic_env(True):
        assert os.environ[ENV] == "1"
    assert os.environ.get(ENV) == before
    with deterministic_env(False):
        assert os.environ.get(ENV) == before
