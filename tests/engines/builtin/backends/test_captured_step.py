"""A captured step replays what the step computes eagerly, and the warm-up leaves no trace.

The backends' own GPU tests (``test_static_backend``, ``test_deterministic_backend``) check the
captured decode against the HF backend; here the helper alone, on a toy step with a cursor.
"""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.builtin.backends.captured_step import capture_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


class _Toy:
    """A step over a per-row cursor: logits depend on tokens, positions and the cursor."""

    def __init__(self, rows: int) -> None:
        self.cursor = torch.zeros(rows, dtype=torch.long, device="cuda")
        # small integers: every product and sum is exact, so eager and graph agree bitwise
        self.weight = torch.randint(-3, 4, (3, 5), device="cuda").float()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.cursor += tokens.shape[1]
        features = torch.stack([tokens, positions, self.cursor[:, None].expand_as(tokens)], -1)
        return features.float() @ self.weight


def test_capture_restores_state_and_replays_the_eager_step():
    """After capture the cursor is as before; each replay equals the eager step on the same
    state, for a batch smaller than the captured rows too."""
    torch.manual_seed(0)
    toy = _Toy(rows=4)
    toy.cursor.copy_(torch.tensor([3, 0, 7, 1]))
    graph = capture_step(toy.step, 4, 2, (toy.cursor,))
    assert toy.cursor.tolist() == [3, 0, 7, 1]

    twin = _Toy(rows=4)
    twin.weight, twin.cursor = toy.weight, toy.cursor.clone()
    for batch in (4, 2):
        tokens = torch.randint(0, 50, (batch, 2), device="cuda")
        positions = torch.randint(0, 50, (batch, 2), device="cuda")
        out = graph.launch(tokens, positions)[:batch].clone()
        # the twin runs eagerly on all rows (rows past `batch` advance in both)
        padded = (
            torch.cat([tokens, graph.tokens[batch:]]),
            torch.cat([positions, graph.positions[batch:]]),
        )
        expected = twin.step(*padded)[:batch]
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert toy.cursor.tolist() == twin.cursor.tolist()
