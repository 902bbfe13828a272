"""Tests for trace_replay.engines.builtin.decode's slots: waves of requests and their slots."""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.decode import SlotTable, waves

CPU = torch.device("cpu")
NOT_REPLAYED = -7


def request(trace_id: str, prompt_len: int, trace: list[int]) -> ReplayRequest:
    return ReplayRequest(trace_id, tuple(range(1, prompt_len + 1)), tuple(trace))


def forced(slots: SlotTable, idx_mapping: torch.Tensor) -> list[int]:
    """The tokens apply_trace forces this step (NOT_REPLAYED where it forces none)."""
    sampled = torch.full((len(idx_mapping),), NOT_REPLAYED, dtype=torch.int64)
    slots.trace_state.apply_trace(sampled, idx_mapping)
    return sampled.tolist()


def test_waves_cover_every_request_once_shortest_first():
    """Waves hold at most ``size`` requests, every index exactly once, by trace length."""
    requests = [request(str(i), 2, [0] * n) for i, n in enumerate([5, 1, 4, 2, 3, 6, 1])]
    batches = list(waves(requests, 3))
    assert [len(b) for b in batches] == [3, 3, 1]
    assert sorted(i for b in batches for i in b) == list(range(len(requests)))
    lengths = [requests[i].trace_len for b in batches for i in b]
    assert lengths == sorted(lengths)


def test_admit_starts_every_row_at_step_zero():
    """After admit, row b holds wave[b]: prompt_len = total_len = its prompt, 0 steps done,
    and the first forced token is the first trace token."""
    slots = SlotTable(4, CPU)
    wave = [request("a", 3, [10, 11]), request("b", 1, [20, 21, 22])]
    idx_mapping = slots.admit(wave)
    assert idx_mapping.tolist() == [0, 1]
    assert slots.total_len(idx_mapping).tolist() == [3, 1]
    assert slots.steps_done(idx_mapping).tolist() == [0, 0]
    assert forced(slots, idx_mapping) == [10, 20]


def test_advance_moves_each_row_along_its_trace():
    """advance commits tokens per row; each row's forced token follows its own step, and a row
    past its trace's end is left alone."""
    slots = SlotTable(2, CPU)
    idx_mapping = slots.admit([request("a", 2, [10, 11]), request("b", 4, [20, 21, 22])])
    slots.advance(idx_mapping)
    assert forced(slots, idx_mapping) == [11, 21]
    slots.advance(idx_mapping, torch.tensor([1, 1], dtype=torch.int32))
    assert slots.steps_done(idx_mapping).tolist() == [2, 2]
    assert forced(slots, idx_mapping) == [NOT_REPLAYED, 22]


def test_smaller_wave_releases_the_slots_left_over():
    """A wave smaller than the last one frees the slots it does not use: they replay nothing."""
    slots = SlotTable(3, CPU)
    slots.admit([request(str(i), 1, [i + 10]) for i in range(3)])
    idx_mapping = slots.admit([request("x", 1, [99])])
    assert forced(slots, torch.tensor([0, 1, 2])) == [99, NOT_REPLAYED, NOT_REPLAYED]
    assert idx_mapping.tolist() == [0]


def test_a_wave_larger_than_the_slots_is_refused():
    """More requests than slots is a ValueError, before any slot is touched."""
    slots = SlotTable(1, CPU)
    with pytest.raises(ValueError, match="a wave of 2 requests for 1 slots"):
        slots.admit([request("a", 1, [1]), request("b", 1, [2])])
