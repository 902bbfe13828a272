"""Intra-op threads of a CPU engine (trace_replay.engines.threads): one core left free, and the
caller's own setting always put back."""

from __future__ import annotations

import os

import pytest
import torch

from trace_replay.engines.threads import available_cpus, engine_threads, intra_op_threads


@pytest.fixture
def caller_threads():
    """The caller runs on 2 threads during the test; the session's setting is put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_threads_are_set_inside_and_restored_after(caller_threads):
    """Inside the block torch runs on the threads asked for; after it, on the caller's."""
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == caller_threads


def test_threads_are_restored_when_the_block_raises(caller_threads):
    """An error inside the block still gives the caller's threads back."""
    with pytest.raises(RuntimeError, match="inside"):
        with intra_op_threads(1):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == caller_threads


def test_none_leaves_the_threads_alone(caller_threads):
    """``intra_op_threads(None)`` changes nothing."""
    with intra_op_threads(None):
        assert torch.get_num_threads() == caller_threads
    assert torch.get_num_threads() == caller_threads


def test_engine_keeps_one_cpu_free(caller_threads, monkeypatch):
    """Without OMP_NUM_THREADS an engine takes all usable CPUs but one, at least one, never
    more than the caller's threads."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine_threads() == max(1, min(caller_threads, available_cpus() - 1))
    with intra_op_threads(1):
        assert engine_threads() == 1


@pytest.mark.parametrize("value, threads", [("3", 3), ("0", 1), ("many", None)])
def test_omp_num_threads_decides_when_set(caller_threads, monkeypatch, value, threads):
    """OMP_NUM_THREADS, when a number, is the engine's thread count (at least 1), whatever
    the caller's; anything else is ignored."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    expected = threads or max(1, min(caller_threads, available_cpus() - 1))
    assert engine_threads() == expected


def test_available_cpus_is_within_the_affinity_mask():
    """Usable CPUs: at least one, at most those this process may be scheduled on."""
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
