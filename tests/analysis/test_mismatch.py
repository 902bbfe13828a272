"""Tests for trace_replay.analysis.mismatch: float32 bit patterns and ULP distances."""

from __future__ import annotations

import numpy as np

from trace_replay.analysis.mismatch import bit_mismatch, ulp_distance


def f32(x: float) -> float:
    return float(np.float32(x))


def test_ulp_distance_counts_float32_steps_across_zero():
    """The smallest positive and negative float32 are 2 ULPs apart (0.0 between them)."""
    tiny = float(np.nextafter(np.float32(0), np.float32(1)))
    assert ulp_distance([tiny, -tiny, 0.0], [-tiny, -tiny, -0.0]).tolist() == [2, 0, 0]


def test_ulp_distance_of_infinity_and_nan():
    """inf is one ULP past the largest float32; NaN on either side gives NA."""
    largest = float(np.finfo(np.float32).max)
    out = ulp_distance([np.inf, -np.inf, np.nan, 1.0], [largest, -largest, 1.0, np.nan])
    assert out[:2].tolist() == [1, 1] and out[2:].isna().all()


def test_ulp_distance_is_symmetric_and_matches_nextafter_walks():
    """Walking k float32 steps from a logprob gives distance k, in either order."""
    start = np.float32(-3.25)
    walked = start
    for _ in range(5):
        walked = np.nextafter(walked, np.float32(0))
    assert ulp_distance([float(start)], [float(walked)]).tolist() == [5]
    assert ulp_distance([float(walked)], [float(start)]).tolist() == [5]


def test_bit_mismatch_rounds_to_float32_first():
    """Differences below float32 resolution are no mismatch; one float32 ULP is."""
    x = f32(-0.7)
    next_up = float(np.nextafter(np.float32(x), np.float32(0)))
    assert bit_mismatch([x, x], [x + 1e-12, next_up]).tolist() == [False, True]
