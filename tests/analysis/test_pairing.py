"""row_metrics: the four numbers kept per compared row."""

from __future__ import annotations

import numpy as np
import torch

from trace_replay.analysis.pairing import row_metrics


def test_row_metrics_by_hand():
    """max |b - a|, ‖b - a‖/‖a‖ and cosine as computed by hand; bits decide equality."""
    a = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[3.0, 5.0], [0.0, 1.0], [-0.0, 0.0]])
    metrics = row_metrics(a, b)
    np.testing.assert_allclose(metrics["max_abs_diff"], [1.0, 1.0, 0.0])
    np.testing.assert_allclose(metrics["rel_l2"], [1 / 5, np.sqrt(2), 0.0])
    np.testing.assert_allclose(metrics["cosine"], [(9 + 20) / (5 * np.sqrt(34)), 0.0, 1.0])
    # -0.0 and 0.0 are equal values but different bits
    assert metrics["bitwise_equal"].tolist() == [False, False, False]
    assert row_metrics(a, a.clone())["bitwise_equal"].all()
    assert not row_metrics(a, a.to(torch.bfloat16))["bitwise_equal"].any()
