"""The batch-invariant backend: the model's numbers, independent of the batch, decode = prefill."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trace_replay.engines import make_engine
from trace_replay.engines.builtin.backends.deterministic import DeterministicBackend
from trace_replay.engines.builtin.backends.hf import HFBackend

pytestmark = pytest.mark.slow

PROMPTS = [[504, 3575, 282, 4649], [1], [9519, 30, 2114]]


@pytest.fixture(scope="module")
def backend(lm):
    return DeterministicBackend(lm, max_query_len=3)


def test_prefill_and_decode_match_hf(lm, backend):
    """Prompt and decode logits agree with the transformers model within float32 rounding."""
    hf = HFBackend(lm, 0)
    positions = torch.tensor([[len(p)] for p in PROMPTS])
    with torch.inference_mode():
        ours, theirs = backend.prefill(PROMPTS, 4), hf.prefill(PROMPTS, 4)
        tokens = theirs.argmax(-1)[:, None]
        ours2, theirs2 = backend.decode(tokens, positions), hf.decode(tokens, positions)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)
    torch.testing.assert_close(ours2, theirs2, atol=2e-4, rtol=0)


def test_row_bits_ignore_the_batch(backend):
    """A prompt's logits and its next step's are the same bits alone or among others."""
    token = torch.tensor([[42]])
    with torch.inference_mode():
        crowd = backend.prefill(PROMPTS, 4).clone()
        crowd_step = backend.decode(
            torch.tensor([[7], [9], [42]]), torch.tensor([[4], [1], [3]])
        ).clone()
        alone = backend.prefill(PROMPTS[2:], 4).clone()
        alone_step = backend.decode(token, torch.tensor([[3]]))
    assert torch.equal(alone[0], crowd[2])
    assert torch.equal(alone_step[0], crowd_step[2])


def test_decode_equals_teacher_forcing_bitwise(backend):
    """Decode steps give the bits of one teacher-forced forward over the same tokens."""
    prompt, fed = PROMPTS[0], [11, 12, 13]
    with torch.inference_mode():
        steps = [backend.prefill([prompt], 4)[0].clone()]
        for i, token in enumerate(fed):
            steps.append(
                backend.decode(torch.tensor([[token]]), torch.tensor([[len(prompt) + i]]))[
                    0, 0
                ].clone()
            )
        forced = backend.teacher_forced(
            [prompt + fed], [range(len(prompt) - 1, len(prompt) + len(fed))]
        )
    assert all(torch.equal(a, b) for a, b in zip(steps, forced))


def test_dropped_drafts_leave_no_trace(backend):
    """After ``keep`` drops trailing drafts, the next step equals never having fed them."""
    prompt = PROMPTS[2]
    p = len(prompt)
    with torch.inference_mode():
        backend.prefill([prompt], 6)
        backend.decode(torch.tensor([[5, 6, 7]]), torch.tensor([[p, p + 1, p + 2]]))
        backend.keep(torch.tensor([[True, False, False]]))
        after = backend.decode(torch.tensor([[8]]), torch.tensor([[p + 1]]))[0, 0].clone()
        backend.prefill([prompt], 6)
        backend.decode(torch.tensor([[5]]), torch.tensor([[p]]))
        direct = backend.decode(torch.tensor([[8]]), torch.tensor([[p + 1]]))[0, 0]
    assert torch.equal(after, direct)


def test_unsupported_models_are_refused(lm):
    """Non-Llama models are refused naming their type (the reasons: test_deterministic_model);
    hf/static backends do not combine with deterministic mode."""
    other = SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))
    with pytest.raises(ValueError, match="gpt2"):
        DeterministicBackend(other)
    with pytest.raises(ValueError, match="own backend"):
        make_engine("torch", lm, backend="hf", deterministic=True)


def test_settings_record_the_arithmetic(lm):
    """deterministic and the arithmetic chosen (block sizes, kernels) are in the settings."""
    settings = make_engine("prefill", lm, deterministic=True).settings()
    assert settings["deterministic"] is True
    assert settings["engine_path"] == "teacher-forced-prefill[deterministic]"
    assert {"linear", "norm", "attention", "key_block", "score"} <= set(settings["arithmetic"])
    assert make_engine("prefill", lm).settings()["deterministic"] is False
