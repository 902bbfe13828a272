"""Tests for trace_replay.engines.replay_state: staging, slot reuse, ragged storage and
compaction."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trace_replay.engines.replay_state as state_module
from trace_replay.engines.replay_state import RequestState, TraceReplayState

NOT_REPLAYED = -7


def make_state(device, max_num_reqs=8, min_capacity=4):
    req_states = RequestState(max_num_reqs, device)
    return req_states, TraceReplayState(req_states, min_capacity=min_capacity)


def start_request(state, req_states, slot, trace, prompt_len=3):
    """Stage ``trace`` on ``slot`` as a fresh request (step 0)."""
    state.add_request(slot, trace)
    req_states.prompt_len[slot] = prompt_len
    req_states.total_len[slot] = prompt_len


def replay(state, slots, device):
    """The tokens ``apply_trace`` forces for a batch of ``slots`` (NOT_REPLAYED if none)."""
    sampled = torch.full((len(slots),), NOT_REPLAYED, dtype=torch.int64, device=device)
    state.apply_trace(sampled, torch.tensor(slots, dtype=torch.int32, device=device))
    return sampled.tolist()


def held_traces(state):
    """Every slot's trace as stored on the device, read back through offsets and lengths."""
    tokens = state.trace_token_ids.tolist()
    offsets, lengths = state.trace_offsets.tolist(), state.trace_len.tolist()
    return {r: tokens[o : o + n] for r, (o, n) in enumerate(zip(offsets, lengths)) if n > 0}


def test_reused_slot_never_replays_the_old_trace(device):
    """Re-adding a slot replaces its trace, whether the new one is shorter or None."""
    req_states, state = make_state(device)
    start_request(state, req_states, 0, [1, 2, 3, 4])
    state.apply_staged_writes()
    req_states.total_len[0] += 2
    assert replay(state, [0], device) == [3]

    start_request(state, req_states, 0, [9])
    state.apply_staged_writes()
    assert replay(state, [0], device) == [9]
    req_states.total_len[0] += 1
    assert replay(state, [0], device) == [NOT_REPLAYED]

    start_request(state, req_states, 0, None)
    state.apply_staged_writes()
    assert replay(state, [0], device) == [NOT_REPLAYED]
    assert state.num_trace_tokens == 0


def test_remove_then_apply_leaves_row_untouched(device):
    """A removed slot stops replaying at the next apply_staged_writes and frees its tokens."""
    req_states, state = make_state(device)
    start_request(state, req_states, 1, [5, 6])
    start_request(state, req_states, 2, [7, 8])
    state.apply_staged_writes()
    state.remove_request(1)
    assert replay(state, [1, 2], device) == [5, 7]  # staged only: nothing changes yet
    state.apply_staged_writes()
    assert replay(state, [1, 2], device) == [NOT_REPLAYED, 7]
    assert state.num_trace_tokens == 2


def test_interleaved_adds_and_removes_in_one_step(device):
    """Within one step the last staged action per slot wins; other slots keep their traces."""
    req_states, state = make_state(device)
    start_request(state, req_states, 0, [10, 11])
    start_request(state, req_states, 1, [20])
    state.remove_request(0)
    start_request(state, req_states, 2, [30, 31, 32])
    state.remove_request(1)
    start_request(state, req_states, 1, [40, 41])
    state.apply_staged_writes()
    assert held_traces(state) == {1: [40, 41], 2: [30, 31, 32]}
    assert replay(state, [0, 1, 2, -1], device) == [NOT_REPLAYED, 40, 30, NOT_REPLAYED]


def test_empty_batch_is_a_no_op(device):
    """apply_trace and apply_trace_to_verified accept a batch with no rows."""
    req_states, state = make_state(device)
    start_request(state, req_states, 0, [1, 2])
    state.apply_staged_writes()
    assert replay(state, [], device) == []
    empty = torch.empty(0, dtype=torch.int32, device=device)
    sampled = torch.empty(0, 3, dtype=torch.int64, device=device)
    cu_num_logits = torch.zeros(1, dtype=torch.int32, device=device)
    state.apply_trace_to_verified(sampled, empty, empty, cu_num_logits, empty)


def test_apply_staged_writes_without_staging_does_nothing(device):
    """With nothing staged, no copy is made and no device tensor is written or replaced."""
    req_states, state = make_state(device)
    start_request(state, req_states, 0, [1, 2, 3])
    state.apply_staged_writes()
    assert state.num_staged_copies == 1
    tensors = (state.trace_token_ids, state.trace_offsets, state.trace_len)
    before = [(t.data_ptr(), t._version) for t in tensors]
    state.apply_staged_writes()
    state.apply_staged_writes()
    after = [
        (t.data_ptr(), t._version)
        for t in (state.trace_token_ids, state.trace_offsets, state.trace_len)
    ]
    assert after == before
    assert state.num_staged_copies == 1


def test_staged_writes_take_one_copy_per_step(device):
    """However many slots are staged, one apply_staged_writes makes one host-to-device copy."""
    req_states, state = make_state(device)
    for slot in range(6):
        start_request(state, req_states, slot, list(range(slot + 1)))
    state.remove_request(3)
    state.apply_staged_writes()
    assert state.num_staged_copies == 1


def test_apply_trace_skips_launch_without_traces(device, monkeypatch):
    """No launch while no slot holds a trace, including after every trace was removed."""
    req_states, state = make_state(device)

    def fail(*args, **kwargs):
        raise AssertionError("launched without traces")

    monkeypatch.setattr(state, "_apply_trace", fail)  # the launcher chosen for its device
    monkeypatch.setattr(state_module, "apply_trace_tokens_to_verified", fail)
    start_request(state, req_states, 0, None)
    state.apply_staged_writes()
    assert replay(state, [0], device) == [NOT_REPLAYED]
    start_request(state, req_states, 0, [1])
    state.apply_staged_writes()
    with pytest.raises(AssertionError, match="launched"):
        replay(state, [0], device)
    state.remove_request(0)
    state.apply_staged_writes()
    assert replay(state, [0], device) == [NOT_REPLAYED]
    state.apply_trace_to_verified(*([torch.empty(0, dtype=torch.int32)] * 5))


def test_add_request_copies_its_input(device):
    """Staging copies the trace: mutating the caller's list or tensor afterwards has no effect."""
    req_states, state = make_state(device)
    as_list, as_tensor = [1, 2], torch.tensor([3, 4])
    start_request(state, req_states, 0, as_list)
    start_request(state, req_states, 1, as_tensor)
    as_list[0], as_tensor[0] = 100, 100
    state.apply_staged_writes()
    assert held_traces(state) == {0: [1, 2], 1: [3, 4]}


def test_add_request_rejects_a_slot_out_of_range(device):
    """Slots are checked on the host, before anything is staged."""
    _, state = make_state(device, max_num_reqs=2)
    with pytest.raises(IndexError):
        state.add_request(2, [1])
    with pytest.raises(IndexError):
        state.remove_request(-1)


def test_peek_returns_the_next_trace_tokens(device):
    """peek gives trace[step : step + k] per row, 0 past the trace and for unmapped rows."""
    req_states, state = make_state(device)
    start_request(state, req_states, 0, [10, 11, 12, 13])
    start_request(state, req_states, 1, [20, 21])
    state.apply_staged_writes()
    req_states.total_len[0] += 1
    idx_mapping = torch.tensor([1, -1, 0, 2], dtype=torch.int32, device=device)
    assert state.peek(idx_mapping, 3).tolist() == [[20, 21, 0], [0, 0, 0], [11, 12, 13], [0, 0, 0]]


def test_compaction_preserves_every_live_trace(device):
    """Compacting into a smaller buffer keeps each live trace intact and replayable."""
    req_states, state = make_state(device, max_num_reqs=16)
    traces = {slot: [100 * slot + i for i in range(20 + slot)] for slot in range(16)}
    for slot, trace in traces.items():
        start_request(state, req_states, slot, trace)
    state.apply_staged_writes()
    capacity = state.trace_token_ids.numel()
    for slot in range(0, 16, 4):
        state.remove_request(slot)
    for slot in range(1, 16, 4):
        state.remove_request(slot)
    state.apply_staged_writes()
    for slot in range(2, 16, 4):  # holes now outnumber live tokens: this write compacts
        state.remove_request(slot)
    start_request(state, req_states, 0, [7, 8, 9])
    state.apply_staged_writes()
    live = {slot: traces[slot] for slot in range(3, 16, 4)} | {0: [7, 8, 9]}

    assert state.trace_token_ids.numel() < capacity
    assert held_traces(state) == live
    assert state.num_trace_tokens == sum(map(len, live.values()))
    slots = sorted(live)
    for step in range(max(map(len, live.values()))):
        expected = [live[s][step] if step < len(live[s]) else NOT_REPLAYED for s in slots]
        assert replay(state, slots, device) == expected
        req_states.total_len += 1


def test_bytes_per_trace_token_stays_bounded(device):
    """After many add/remove cycles the state holds at most 16 bytes per live trace token."""
    req_states, state = make_state(device, max_num_reqs=64, min_capacity=256)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        for slot in torch.randint(0, 64, (8,), generator=gen).tolist():
            if torch.rand((), generator=gen) < 0.4:
                state.remove_request(slot)
            else:
                length = int(torch.randint(32, 257, (), generator=gen))
                state.add_request(slot, torch.randint(0, 50_000, (length,), generator=gen))
        state.apply_staged_writes()
        assert state.bytes_per_trace_token <= 16
    assert state.num_trace_tokens == sum(len(t) for t in held_traces(state).values())


SLOT = st.integers(0, 5)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), SLOT, st.none() | st.lists(st.integers(0, 1000), max_size=6)),
        st.tuples(st.just("remove"), SLOT),
        st.tuples(st.just("step"), st.lists(st.integers(-1, 5), max_size=6, unique=True)),
    ),
    max_size=30,
)


@settings(max_examples=50, deadline=None)
@given(ops=OPS)
def test_state_matches_a_dict_model(device, ops):
    """Random add/remove/step sequences replay exactly what a dict of traces predicts,
    with storage holding exactly the live traces."""
    req_states, state = make_state(device, max_num_reqs=6, min_capacity=4)
    applied, staged, total_len, prompt_len = {}, {}, [0] * 6, [0] * 6
    for op, *args in ops:
        if op == "add":
            slot, trace = args
            start_request(state, req_states, slot, trace, prompt_len=slot + 1)
            staged[slot] = trace or None
            prompt_len[slot] = total_len[slot] = slot + 1
        elif op == "remove":
            state.remove_request(args[0])
            staged[args[0]] = None
        else:
            state.apply_staged_writes()
            for slot, trace in staged.items():
                if trace is None:
                    applied.pop(slot, None)
                else:
                    applied[slot] = trace
            staged.clear()
            slots = args[0]
            expected = []
            for r in slots:
                trace, step = applied.get(r, []), total_len[r] - prompt_len[r]
                expected.append(trace[step] if r >= 0 and step < len(trace) else NOT_REPLAYED)
            assert replay(state, slots, device) == expected
            for r in slots:
                if r >= 0:
                    total_len[r] += 1
                    req_states.total_len[r] += 1
            assert held_traces(state) == applied
            assert state.num_trace_tokens == sum(map(len, applied.values()))


def test_force_logits_walks_each_trace_and_advances_every_row(device):
    """``force_logits(advance=True)`` raises each traced row's current trace token and moves
    every request row a step, so successive calls walk the traces; a row without a trace
    is never written but still advances; nothing is staged twice."""
    req_states, state = make_state(device)
    start_request(state, req_states, 0, [5, 1, 2])
    start_request(state, req_states, 2, None)
    start_request(state, req_states, 3, [4, 6])
    state.apply_staged_writes()
    rows = torch.tensor([3, 2, 0], dtype=torch.int32, device=device)
    picks = []
    for _ in range(3):
        logits = torch.zeros(3, 8, device=device)
        state.force_logits(logits, rows, value=1.0, advance=True)
        picks.append([row.nonzero().flatten().tolist() for row in logits.cpu()])
    assert picks == [[[4], [], [5]], [[6], [], [1]], [[], [], [2]]]
    assert req_states.total_len[[0, 2, 3]].tolist() == [6, 6, 6]
