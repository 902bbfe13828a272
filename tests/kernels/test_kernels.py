"""Tests for trace_replay.kernels: Triton kernels against the torch reference and a loop oracle."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trace_replay.kernels._triton
from trace_replay.kernels import (
    apply_trace_tokens,
    apply_trace_tokens_reference,
    apply_trace_tokens_to_verified,
    apply_trace_tokens_to_verified_reference,
    force_trace_logits,
    force_trace_logits_reference,
)
from trace_replay.kernels._triton import HAS_TRITON, use_triton

LAYOUTS = ["2d", "ragged"]
TOKEN = st.integers(0, 3) | st.integers(0, 2**31 - 1)  # small ids make drafts agree often
INT_DTYPES = st.sampled_from([torch.int32, torch.int64])
SETTINGS = settings(max_examples=60, deadline=None)


def oracle_trace_tokens(sampled, idx_mapping, traces, total_len, prompt_len):
    out = list(sampled)
    for b, r in enumerate(idx_mapping):
        if r < 0:
            continue
        step = total_len[r] - prompt_len[r]
        if 0 <= step < len(traces[r]):
            out[b] = traces[r][step]
    return out


def oracle_verified(
    sampled, num_sampled, drafts, cu_num_logits, idx_mapping, traces, total_len, prompt_len
):
    """Return (rows, counts, touched) following the spec's sequential loop."""
    rows, counts = [list(row) for row in sampled], list(num_sampled)
    touched = [False] * len(idx_mapping)
    for b, r in enumerate(idx_mapping):
        step = total_len[r] - prompt_len[r]
        if r < 0 or not 0 <= step < len(traces[r]):
            continue
        touched[b] = True
        n = cu_num_logits[b + 1] - cu_num_logits[b]
        i = 0
        while True:
            if step + i >= len(traces[r]):
                counts[b] = i
                break
            rows[b][i] = traces[r][step + i]
            if i < n - 1 and drafts[cu_num_logits[b] + i + 1] == traces[r][step + i]:
                i += 1
            else:
                counts[b] = i + 1
                break
    return rows, counts, touched


@st.composite
def replay_cases(draw, max_slots=6, max_trace_len=8, max_batch=6):
    """Slots with traces and lengths, plus a batch mapping into them (-1 = no request)."""
    num_slots = draw(st.integers(1, max_slots))
    traces = [draw(st.lists(TOKEN, max_size=max_trace_len)) for _ in range(num_slots)]
    prompt_len = [draw(st.integers(2, 5)) for _ in range(num_slots)]
    # steps from before the trace to past its end, often near its end
    steps = [draw(st.integers(-2, len(t) + 2) | st.integers(len(t) - 3, len(t))) for t in traces]
    return {
        "traces": traces,
        "prompt_len": prompt_len,
        "total_len": [p + s for p, s in zip(prompt_len, steps)],
        "idx_mapping": draw(st.lists(st.integers(-1, num_slots - 1), max_size=max_batch)),
        "trace_dtype": draw(INT_DTYPES),
        "seed": draw(st.integers(0, 2**16)),
    }


def build_traces(traces, layout, dtype, device, seed):
    """(trace_token_ids, trace_offsets) in the given layout, padded with garbage -5."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "2d":
        width = max(map(len, traces)) + 1
        # a column slice of a wider tensor: the row stride exceeds the row length
        wide = torch.full((len(traces), width + 3), -5, dtype=dtype)
        for r, t in enumerate(traces):
            wide[r, : len(t)] = torch.tensor(t, dtype=dtype)
        return wide.to(device)[:, :width], None
    order = torch.randperm(len(traces), generator=gen).tolist()
    flat, offsets = [], [0] * len(traces)
    for r in order:
        flat += [-5] * int(torch.randint(0, 3, (), generator=gen))  # gaps between traces
        offsets[r] = len(flat)
        flat += traces[r]
    flat_t = torch.tensor(flat, dtype=dtype, device=device)
    return flat_t, torch.tensor(offsets, dtype=torch.int64, device=device)


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def test_use_triton_runs_kernels_under_the_interpreter():
    """With Triton and TRITON_INTERPRET=1, CPU tensors take the kernel path (not the reference)."""
    if not HAS_TRITON or os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    assert use_triton(torch.zeros(1), None)


def test_use_triton_is_false_for_cpu_tensors_without_interpreter(monkeypatch):
    """Without the interpreter, CPU tensors always take the reference path."""
    monkeypatch.setattr(trace_replay.kernels._triton, "_INTERPRET", False)
    assert not use_triton(torch.zeros(1), torch.zeros(1))


def test_kernels_import_and_fall_back_without_triton():
    """With triton unimportable, the kernel modules still import and launchers run the reference."""
    code = (
        "import sys, torch; sys.modules['triton'] = None\n"
        "from trace_replay.kernels._triton import HAS_TRITON\n"
        "from trace_replay.kernels import apply_trace_tokens\n"
        "i32 = lambda *v: torch.tensor(v, dtype=torch.int32)\n"
        "sampled = torch.zeros(1, dtype=torch.int64)\n"
        "apply_trace_tokens(sampled, i32(0), i32(4, 5).view(1, 2), i32(2), i32(1), i32(0))\n"
        "assert not HAS_TRITON and sampled.tolist() == [5]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(case=replay_cases())
def test_apply_trace_tokens_matches_reference_and_oracle(device, layout, case):
    """Kernel == reference == loop oracle: row b gets trace[r][step] iff r >= 0 and
    0 <= step < trace_len[r]; other rows and the other column stay untouched."""
    trace_ids, offsets = build_traces(
        case["traces"], layout, case["trace_dtype"], device, case["seed"]
    )
    batch = len(case["idx_mapping"])
    # a strided column of a wider tensor
    wide = torch.arange(2 * batch, dtype=torch.int64, device=device).view(batch, 2) + 100
    args = (
        int32(case["idx_mapping"], device),
        trace_ids,
        int32([len(t) for t in case["traces"]], device),
        int32(case["total_len"], device),
        int32(case["prompt_len"], device),
    )
    expected = oracle_trace_tokens(
        wide[:, 1].tolist(),
        case["idx_mapping"],
        case["traces"],
        case["total_len"],
        case["prompt_len"],
    )
    wide_ref = wide.clone()
    apply_trace_tokens(wide[:, 1], *args, trace_offsets=offsets)
    apply_trace_tokens_reference(wide_ref[:, 1], *args, trace_offsets=offsets)

    assert torch.equal(wide, wide_ref)
    assert wide[:, 1].tolist() == expected
    assert wide[:, 0].tolist() == [100 + 2 * b for b in range(batch)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@SETTINGS
@given(case=replay_cases(), advance=st.booleans())
def test_force_trace_logits_matches_reference_and_oracle(device, layout, dtype, case, advance):
    """Kernel == reference == oracle: row b's logit at trace[r][step] becomes the forced
    value iff r >= 0, 0 <= step < trace_len[r] and the token is inside the vocabulary; no
    other logit moves; with ``advance`` every request row's total_len grows by one."""
    vocab = 16  # TOKEN draws ids up to 2**31 - 1: many fall outside and must be skipped
    trace_ids, offsets = build_traces(
        case["traces"], layout, case["trace_dtype"], device, case["seed"]
    )
    idx_mapping = list(dict.fromkeys(case["idx_mapping"]))  # a request sits in one row
    batch = len(idx_mapping)
    gen = torch.Generator().manual_seed(case["seed"])
    # a column slice of a wider tensor: the row stride exceeds the vocabulary
    wide = torch.randn(batch, vocab + 5, generator=gen).to(dtype).to(device)
    original = wide.clone()
    logits, logits_ref = wide[:, :vocab], wide.clone()[:, :vocab]
    total_len = int32(case["total_len"], device)
    total_len_ref = total_len.clone()
    args = (int32(idx_mapping, device), trace_ids, int32([len(t) for t in case["traces"]], device))
    prompt_len = int32(case["prompt_len"], device)
    force_trace_logits(
        logits, *args, total_len, prompt_len, trace_offsets=offsets, value=1e30, advance=advance
    )
    force_trace_logits_reference(
        logits_ref,
        *args,
        total_len_ref,
        prompt_len,
        trace_offsets=offsets,
        value=1e30,
        advance=advance,
    )

    expected = original[:, :vocab].clone()
    forced = oracle_trace_tokens(
        [-1] * batch, idx_mapping, case["traces"], case["total_len"], case["prompt_len"]
    )
    for b, token in enumerate(forced):
        if 0 <= token < vocab:
            expected[b, token] = 1e30
    assert torch.equal(logits, logits_ref) and torch.equal(logits, expected)
    assert torch.equal(wide[:, vocab:], original[:, vocab:])  # past the slice: never written
    grown = [n + (advance and r in idx_mapping) for r, n in enumerate(case["total_len"])]
    assert total_len.tolist() == total_len_ref.tolist() == grown


@st.composite
def verified_cases(draw):
    """A replay case plus k, per-row logits counts, and drafts that often agree with the trace."""
    case = draw(replay_cases())
    k = draw(st.integers(0, 5))
    num_logits = [draw(st.integers(1, k + 1) | st.just(k + 1)) for _ in case["idx_mapping"]]
    cu = [0]
    for n in num_logits:
        cu.append(cu[-1] + n)
    drafts = [draw(TOKEN) for _ in range(cu[-1])]
    for b, r in enumerate(case["idx_mapping"]):
        step = case["total_len"][r] - case["prompt_len"][r]
        # the first `num_agree` drafts copy the trace: from first-rejected to all-accepted
        num_agree = draw(st.integers(0, num_logits[b] - 1) | st.just(num_logits[b] - 1))
        for i in range(num_agree):
            if r >= 0 and 0 <= step + i < len(case["traces"][r]):
                drafts[cu[b] + i + 1] = case["traces"][r][step + i]
        # a trap past the last logits row: the next request's committed-token slot matches
        last = num_logits[b] - 1
        trap_ok = r >= 0 and 0 <= step + last < len(case["traces"][r]) and cu[b + 1] < cu[-1]
        if trap_ok and draw(st.booleans()):
            drafts[cu[b + 1]] = case["traces"][r][step + last]
    case.update(k=k, cu_num_logits=cu, drafts=drafts, draft_dtype=draw(INT_DTYPES))
    return case


@pytest.mark.parametrize("layout", LAYOUTS)
@SETTINGS
@given(case=verified_cases())
def test_verified_matches_reference_and_oracle(device, layout, case):
    """Kernel == reference == loop oracle on num_sampled and sampled[:num_sampled];
    skipped rows and the columns outside the sampled slice stay untouched."""
    trace_ids, offsets = build_traces(
        case["traces"], layout, case["trace_dtype"], device, case["seed"]
    )
    batch, width = len(case["idx_mapping"]), case["k"] + 1
    wide = torch.arange(batch * (width + 3), dtype=torch.int64, device=device)
    wide = -wide.view(batch, width + 3)
    num_sampled = int32([7] * batch, device)
    drafts = torch.tensor(case["drafts"], dtype=case["draft_dtype"], device=device)
    args = (
        drafts,
        int32(case["cu_num_logits"], device),
        int32(case["idx_mapping"], device),
        trace_ids,
        int32([len(t) for t in case["traces"]], device),
        int32(case["total_len"], device),
        int32(case["prompt_len"], device),
    )
    rows, counts, touched = oracle_verified(
        wide[:, 1 : 1 + width].tolist(),
        num_sampled.tolist(),
        case["drafts"],
        case["cu_num_logits"],
        case["idx_mapping"],
        case["traces"],
        case["total_len"],
        case["prompt_len"],
    )
    before, wide_ref, num_sampled_ref = wide.clone(), wide.clone(), num_sampled.clone()
    apply_trace_tokens_to_verified(
        wide[:, 1 : 1 + width], num_sampled, *args, trace_offsets=offsets
    )
    apply_trace_tokens_to_verified_reference(
        wide_ref[:, 1 : 1 + width], num_sampled_ref, *args, trace_offsets=offsets
    )

    assert num_sampled.tolist() == counts
    assert torch.equal(num_sampled, num_sampled_ref)
    for b in range(batch):
        count = counts[b] if touched[b] else width
        assert wide[b, 1 : 1 + count].tolist() == rows[b][:count]
        assert wide_ref[b, 1 : 1 + count].tolist() == rows[b][:count]
    outside = torch.ones_like(wide, dtype=torch.bool)
    outside[:, 1 : 1 + width] = False
    assert torch.equal(wide[outside], before[outside])
    assert torch.equal(wide_ref[outside], before[outside])


def run_verified(device, layout, trace, step, drafts_after_committed, k):
    """One request on slot 0 with ``k + 1`` logits rows; return (sampled row, num_sampled)."""
    trace_ids, offsets = build_traces([trace], layout, torch.int32, device, seed=0)
    sampled = torch.full((1, k + 1), -1, dtype=torch.int64, device=device)
    num_sampled = int32([0], device)
    drafts = torch.tensor([99, *drafts_after_committed], dtype=torch.int64, device=device)
    apply_trace_tokens_to_verified(
        sampled,
        num_sampled,
        drafts,
        int32([0, k + 1], device),
        int32([0], device),
        trace_ids,
        int32([len(trace)], device),
        int32([3 + step], device),
        int32([3], device),
        trace_offsets=offsets,
    )
    return sampled[0].tolist(), int(num_sampled[0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verified_all_drafts_accepted(device, layout):
    """Drafts equal to the trace are all accepted: k + 1 trace tokens are emitted."""
    row, count = run_verified(device, layout, [10, 11, 12, 13, 14, 15], 1, [11, 12, 13], k=3)
    assert (row, count) == ([11, 12, 13, 14], 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verified_first_draft_rejected(device, layout):
    """A first draft off the trace is rejected: exactly one (trace) token is emitted."""
    row, count = run_verified(device, layout, [10, 11, 12, 13, 14, 15], 1, [12, 12, 13], k=3)
    assert (row[:count], count) == ([11], 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verified_trace_ends_inside_row(device, layout):
    """Accepted drafts never run past the trace: the row stops at its last trace token."""
    row, count = run_verified(device, layout, [10, 11, 12], 1, [11, 12, 13], k=3)
    assert (row[:count], count) == ([11, 12], 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verified_last_logits_row_checks_no_draft(device, layout):
    """A request with n logits rows emits at most n tokens, even when the slot after its
    last row (the next request's committed token) equals the next trace token."""
    trace_ids, offsets = build_traces([[10, 11, 12, 13], [20, 21]], layout, torch.int32, device, 0)
    sampled = torch.full((2, 4), -1, dtype=torch.int64, device=device)
    num_sampled = int32([0, 0], device)
    # request 0: rows 0..1, verifies draft 1 (= 10); slot 2 holds 11 but belongs to request 1
    drafts = torch.tensor([99, 10, 11, 0, 0], dtype=torch.int64, device=device)
    apply_trace_tokens_to_verified(
        sampled,
        num_sampled,
        drafts,
        int32([0, 2, 5], device),
        int32([0, 1], device),
        trace_ids,
        int32([4, 2], device),
        int32([3, 3], device),
        int32([3, 3], device),
        trace_offsets=offsets,
    )
    assert num_sampled.tolist() == [2, 1]
    assert sampled[0, :2].tolist() == [10, 11]
    assert sampled[1, :1].tolist() == [20]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("step", [-1, 3, 4])
def test_verified_step_outside_trace_leaves_row(device, layout, step):
    """Before or past the trace, sampled and num_sampled are untouched."""
    row, count = run_verified(device, layout, [10, 11, 12], step, [11, 12, 13], k=3)
    assert (row, count) == ([-1, -1, -1, -1], 0)


def test_empty_batch_is_a_no_op(device):
    """A batch with no rows launches nothing and raises nothing."""
    empty = torch.empty(0, dtype=torch.int32, device=device)
    traces = torch.zeros(2, 4, dtype=torch.int32, device=device)
    lens = int32([4, 4], device)
    apply_trace_tokens(empty.long(), empty, traces, lens, lens, lens)
    apply_trace_tokens_to_verified(
        torch.empty(0, 3, dtype=torch.int64, device=device),
        empty,
        empty,
        int32([0], device),
        empty,
        traces,
        lens,
        lens,
        lens,
    )


def test_force_trace_logits_empty_batch_is_a_no_op(device):
    """No rows: nothing launched, lengths untouched even with ``advance``."""
    lens = int32([4, 4], device)
    force_trace_logits(
        torch.zeros(0, 8, device=device),
        torch.empty(0, dtype=torch.int32, device=device),
        torch.zeros(2, 4, dtype=torch.int32, device=device),
        lens,
        lens,
        lens,
        advance=True,
    )
    assert lens.tolist() == [4, 4]


def test_trace_with_strided_columns_is_rejected():
    """The kernels index trace tokens contiguously, so a strided last dimension is refused."""
    traces = torch.zeros(2, 8, dtype=torch.int32)[:, ::2]
    lens, sampled = int32([4, 4], "cpu"), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="unit stride"):
        apply_trace_tokens(sampled, int32([0], "cpu"), traces, lens, lens, lens)
