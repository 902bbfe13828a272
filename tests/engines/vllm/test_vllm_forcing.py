"""TraceForcingProcessor driven through vLLM's logits-processor protocol, step by step.

The processor is fed the objects vLLM hands it (``BatchUpdate`` records whose output lists
grow as tokens are committed) and real logits; what it returns decides what vLLM samples.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[cpu]')")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from trace_replay.engines.vllm.engine import FORCED_LOGIT, TRACE_KEY, TraceForcingProcessor  # noqa: E402

pytestmark = pytest.mark.vllm

VOCAB = 50


def processor(max_num_seqs: int = 4) -> TraceForcingProcessor:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), speculative_config=None
    )
    return TraceForcingProcessor(config, torch.device("cpu"), False)


def params(trace=None) -> SamplingParams:
    return SamplingParams(extra_args=None if trace is None else {TRACE_KEY: trace})


def step(proc: TraceForcingProcessor, outputs: list[list[int]], update=None) -> list[int | None]:
    """One engine step: update, apply to random logits, greedy-sample, commit the tokens.

    Returns the forced token per row (None where the row's logits were left alone).
    """
    proc.update_state(update)
    logits = torch.randn(len(outputs), VOCAB)
    before = logits.clone()
    after = proc.apply(logits)
    forced = []
    for row, out in enumerate(outputs):
        changed = (after[row] != before[row]).nonzero().flatten().tolist()
        if changed:  # exactly one entry moved, to FORCED_LOGIT
            assert len(changed) == 1 and after[row, changed[0]] == FORCED_LOGIT, row
            forced.append(changed[0])
        else:
            forced.append(None)
        out.append(int(after[row].argmax()))
    return forced


def test_a_forced_row_samples_its_token_at_any_temperature():
    """The forced logit wins argmax and takes all the probability under the temperatures
    vLLM samples with (1e-5 .. 100), with top-p/min-p style filters too: no NaN, no other
    token with a non-zero probability, even against logits of +-1e4."""
    proc = processor()
    outputs = [[]]
    proc.update_state(
        BatchUpdate(batch_size=1, removed=[], moved=[], added=[added(0, [17, 3], 2, outputs[0])])
    )
    logits = torch.linspace(-1e4, 1e4, VOCAB)[None].clone()
    after = proc.apply(logits)
    assert int(after.argmax()) == 17
    for temperature in (1e-5, 0.7, 1.0, 100.0):
        probs = torch.softmax(after / temperature, dim=-1)
        assert torch.isfinite(probs).all()
        assert probs[0, 17] == 1 and probs.sum() == 1


def added(index: int, trace, prompt_len: int, output: list[int]):
    return (index, params(trace), list(range(prompt_len)), output)


def test_forces_each_trace_and_leaves_other_rows_alone():
    """Traced rows sample exactly their trace, step by step; an untraced row is untouched."""
    proc = processor()
    outputs = [[], [], []]
    update = BatchUpdate(
        batch_size=3,
        removed=[],
        moved=[],
        added=[
            added(0, [5, 6, 7], 3, outputs[0]),
            added(1, None, 2, outputs[1]),
            added(2, [9, 8, 7], 1, outputs[2]),
        ],
    )
    seen = [step(proc, outputs, update)] + [step(proc, outputs) for _ in range(2)]
    assert seen == [[5, None, 9], [6, None, 8], [7, None, 7]]
    assert outputs[0] == [5, 6, 7] and outputs[2] == [9, 8, 7]


def test_lengths_are_sent_only_when_rows_do_not_advance_by_one():
    """Steady steps send nothing to the device; a row that did not commit a token (a
    discarded chunked-prefill sample) makes the next step resend, and forcing stays exact."""
    proc = processor()
    outputs = [[], []]
    update = BatchUpdate(
        batch_size=2,
        removed=[],
        moved=[],
        added=[added(0, [1, 2, 3, 4], 2, outputs[0]), added(1, [11, 12, 13, 14], 2, outputs[1])],
    )
    assert step(proc, outputs, update) == [1, 11]
    assert step(proc, outputs) == [2, 12]
    assert proc.num_length_uploads == 1
    outputs[1].pop()  # row 1's sample of this step is discarded by the engine
    assert step(proc, outputs) == [3, 12]
    assert proc.num_length_uploads == 2
    assert step(proc, outputs) == [4, 13]
    assert proc.num_length_uploads == 2
    assert step(proc, outputs)[1] == 14


def test_moves_and_swaps_carry_the_trace_position():
    """Rows that vLLM moves or swaps keep replaying their own trace from where they were."""
    proc = processor()
    outputs = [[], [], []]
    update = BatchUpdate(
        batch_size=3,
        removed=[],
        moved=[],
        added=[
            added(0, [1, 2, 3], 1, outputs[0]),
            added(1, [21, 22, 23], 1, outputs[1]),
            added(2, [31, 32, 33], 1, outputs[2]),
        ],
    )
    assert step(proc, outputs, update) == [1, 21, 31]
    # request 0 finishes; request 2 moves into slot 0; then slots 0 and 1 swap
    swap = BatchUpdate(
        batch_size=2,
        removed=[0],
        added=[],
        moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL), (0, 1, MoveDirectionality.SWAP)],
    )
    outputs = [outputs[1], outputs[2]]
    assert step(proc, outputs, swap) == [22, 32]
    assert step(proc, outputs) == [23, 33]


def test_a_trace_token_outside_the_vocabulary_leaves_its_row_alone():
    """An id the logits have no column for is not written (no out-of-bounds store): the row
    samples freely, the engine's emitted-token check then names the trace; others still
    follow their traces."""
    proc = processor()
    outputs = [[], []]
    update = BatchUpdate(
        batch_size=2,
        removed=[],
        moved=[],
        added=[added(0, [VOCAB + 3, 4], 1, outputs[0]), added(1, [7, 8], 1, outputs[1])],
    )
    assert step(proc, outputs, update) == [None, 7]
    assert step(proc, outputs) == [4, 8]  # the row's step still advanced


# Model Runner V2 (the GPU default) builds processors with (vllm_config, req_states) and
# keeps the lengths itself: prompt_len behind a pool of buffers, total_len advanced by it.


def runner_states(max_num_reqs: int = 4):
    """What MRV2 hands a processor: per-slot lengths whose ``.gpu`` it may swap."""
    return SimpleNamespace(
        device=torch.device("cpu"),
        max_num_reqs=max_num_reqs,
        vocab_size=VOCAB,
        prompt_len=SimpleNamespace(gpu=torch.zeros(max_num_reqs, dtype=torch.int32)),
        total_len=SimpleNamespace(gpu=torch.zeros(max_num_reqs, dtype=torch.int32)),
    )


def v2_step(proc, states, slots: list[int]) -> list[int]:
    """One MRV2 step over batch rows holding ``slots``: apply, greedy-sample, commit."""
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor(slots, dtype=torch.int32))
    logits = proc.apply(torch.randn(len(slots), VOCAB), ctx)
    sampled = logits.argmax(-1).tolist()
    states.total_len.gpu[slots] += 1  # the runner commits the tokens
    return sampled


def test_one_name_loads_under_both_model_runners():
    """vLLM's V1 and V2 loaders both accept the processor's name (V2's refused it: the
    forcing path failed to start on the default GPU runner), and each runner's arguments
    build that runner's processor."""
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    from trace_replay.engines.server.serve import FORCING_PROCESSOR
    from trace_replay.engines.vllm.forcing import V1TraceForcing, V2TraceForcing

    assert _load_logitsprocs_by_fqcns([FORCING_PROCESSOR]) == [TraceForcingProcessor]
    assert _load_v2_logitsprocs_by_fqcns([FORCING_PROCESSOR]) == [TraceForcingProcessor]
    assert isinstance(processor(), V1TraceForcing)
    config = SimpleNamespace(speculative_config=None)
    assert isinstance(TraceForcingProcessor(config, runner_states()), V2TraceForcing)


def test_v2_forces_traces_from_the_runner_lengths():
    """Under MRV2 the step is the runner's total_len - prompt_len, read at each apply (its
    prompt_len buffer is swapped between steps); rows come in any order; an untraced
    request is declined and left alone; a slot reused without a trace is not forced."""
    states = runner_states()
    proc = TraceForcingProcessor(SimpleNamespace(speculative_config=None), states)
    assert proc.add_request(0, params([5, 6, 7])) is True
    assert proc.add_request(1, params()) is False
    assert proc.add_request(2, params([9, 8, 7])) is True
    proc.apply_staged_writes()
    states.prompt_len.gpu = torch.tensor([3, 2, 1, 0], dtype=torch.int32)
    states.total_len.gpu[:] = states.prompt_len.gpu
    assert v2_step(proc, states, [2, 0]) == [9, 5]
    states.prompt_len.gpu = states.prompt_len.gpu.clone()  # MRV2 rotates the buffer
    assert v2_step(proc, states, [0, 2]) == [6, 8]
    assert v2_step(proc, states, [2, 0]) == [7, 7]
    proc.add_request(0, params())  # the slot's next request has no trace
    proc.apply_staged_writes()
    states.total_len.gpu[0] = states.prompt_len.gpu[0]
    logits = torch.full((1, VOCAB), 0.5)
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([0], dtype=torch.int32))
    assert (proc.apply(logits, ctx) == 0.5).all()


def test_v2_refuses_speculative_decoding():
    """Several logits rows per request would force the wrong steps: refused at start."""
    config = SimpleNamespace(speculative_config=object())
    with pytest.raises(ValueError, match="speculative decoding"):
        TraceForcingProcessor(config, runner_states())
