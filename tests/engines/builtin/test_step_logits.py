"""trace_replay.engines.builtin.step_logits: each step's full logits, in the StepLogits
order (step by step, the live requests in the order given), are the model's teacher-forced
distributions, however many steps the prefill engine's head takes at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trace_replay as tr
from trace_replay.engines.builtin.step_logits import _step_blocks


def per_trace(engine, requests) -> dict[str, list[np.ndarray]]:
    """The yielded rows regrouped per trace: {trace_id: [V] log-softmax rows, step order}."""
    lengths = np.array([r.trace_len for r in requests])
    out = {r.trace_id: [] for r in requests}
    for step, logits in enumerate(engine.step_logits(requests)):
        live = np.flatnonzero(lengths > step)
        assert logits.shape == (len(live), engine.vocab_size)
        for i, row in zip(live, torch.log_softmax(logits.double(), dim=-1).numpy()):
            out[requests[i].trace_id].append(row)
    return out


@pytest.mark.parametrize("chunk_rows", [1, 7, None])  # each step alone, a few, all at once
def test_prefill_step_logits_are_teacher_forced_in_any_block(
    tiny_llama, tiny_requests, tiny_reference, chunk_rows
):
    """The prefill engine's step logits equal the float64 teacher-forced reference within
    float32 rounding whether its head takes one step, a few or every step per product."""
    with tr.make_engine("prefill", model=tiny_llama, batch_size=len(tiny_requests)) as engine:
        if chunk_rows is not None:
            engine.score_chunk_bytes = chunk_rows * engine.vocab_size * 20
        got = per_trace(engine, tiny_requests)
    for trace_id, rows in got.items():
        np.testing.assert_allclose(np.stack(rows), tiny_reference[trace_id], atol=1e-4)


def test_step_blocks_keep_whole_steps_within_the_budget():
    """Blocks are consecutive, cover every step once, and exceed the budget only with a
    single step larger than it."""
    sizes = [5, 5, 4, 4, 2, 9, 1]
    blocks = _step_blocks(sizes, 8)
    assert [s for b in blocks for s in b] == list(range(len(sizes)))
    for block in blocks:
        assert sum(sizes[s] for s in block) <= 8 or len(block) == 1
