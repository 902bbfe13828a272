"""Rollout-vs-trainer mismatch metrics under the names RL trainers log.

Side a is the behaviour run (the rollout engine, the trace's recorded logprobs), side b the
target run (the trainer's forward pass); see :mod:`trace_replay.analysis.metrics` for the
convention and the naming scheme. The per-token quantities are columns of
:func:`~trace_replay.compare`; :func:`trainer_metrics` reduces a comparison frame to the
dataset-level numbers that verl, slime and prime-rl log.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import pandas as pd

__all__ = [
    "NOISE_SE",
    "ROUNDING_NATS",
    "NegativeEstimateWarning",
    "bit_mismatch",
    "ulp_distance",
    "trainer_metrics",
    "repeated_step",
    "require_comparison",
    "warn_negative",
]

_COMPARISON = ("trace_id", "step", "logprob_a", "logprob_b", "delta")
_ASSUMPTION = (
    "k1 and chi-squared estimate KL(a || b) and chi2 without bias only when the trace tokens "
    "are samples of side a's distribution (on-policy); their true values are >= 0, so these "
    "traces evidently are not such samples (fixed, human-written or another model's traces) "
    "or are too few: read the value as a mismatch statistic, not a divergence (mean_k3 is "
    ">= 0 on any traces)"
)
# a negative estimate warns when it is below zero by more than NOISE_SE standard errors: on
# side a's own samples an estimate of a value >= 0 rarely falls that far (~0.1 %)
NOISE_SE = 3.0
# ... and by more than a rounding bias of ROUNDING_NATS on every token could move it. Float32
# engines of one model score one token ~1e-6 nats apart (mean |delta| 1.0e-6 to 2.3e-6 for the
# torch, prefill and vLLM engines against the embedded model's recorded logprobs), and that
# rounding need not average out: its mean can sit many standard errors from zero while being
# far below what the logprobs resolve, so its sign is no evidence about the traces.
ROUNDING_NATS = 1e-6


class NegativeEstimateWarning(UserWarning):
    """A k1 or chi-squared estimate came out negative beyond its sampling error: the traces
    are not samples of side a."""


def repeated_step(frame: pd.DataFrame) -> pd.Series | None:
    """The first row whose (``trace_id``, ``step``) an earlier row already holds; None when
    each trace step is there once (a frame without ``step`` counts as once)."""
    if "step" not in frame.columns:
        return None
    twice = frame.duplicated(["trace_id", "step"]).to_numpy()
    return frame.iloc[int(np.argmax(twice))] if twice.any() else None


def require_comparison(cmp: pd.DataFrame, caller: str, *, one: bool = False) -> None:
    """Raise a `ValueError` unless ``cmp`` is a comparison frame from ``compare(a, b)``;
    with ``one``, a single one (each trace step once: per-trace statistics of concatenated
    comparisons would mix them)."""
    missing = [c for c in _COMPARISON if c not in getattr(cmp, "columns", ())]
    if not missing:
        row = repeated_step(cmp) if one else None
        if row is not None:
            raise ValueError(
                f"{caller} takes one comparison, but cmp holds trace "
                f"{row['trace_id']!r} step {row['step']} more than once "
                f"(comparisons concatenated? {caller} each one; the plots take "
                "them with hue=)"
            )
        return
    if not isinstance(cmp, pd.DataFrame):
        got = f"a {type(cmp).__name__}"
    elif "logprob" in cmp.columns:
        got = (
            "a replay frame (per-run column 'logprob'); compare it with another run, "
            'compare(df, other), or with its ref_logprob column, compare(df, "ref"), or '
            "summarize one run with trace_summary(df)"
        )
    else:
        got = f"a frame with columns {list(cmp.columns)}"
    raise ValueError(
        f"{caller} needs a comparison frame from compare(a, b) (columns "
        f"{', '.join(_COMPARISON)}); lacking {missing}, got {got}"
    )


def warn_negative(
    estimates: Mapping[str, tuple[float, float, float]], *, stacklevel: int = 3
) -> None:
    """Warn once (`NegativeEstimateWarning`) naming every estimate below zero by more than
    :data:`NOISE_SE` standard errors plus its rounding floor, with its value and standard
    error.

    ``estimates`` maps a name (``mean_k1``, ``chi2_token``, a per-trace description) to a
    k1 or chi-squared estimate (a mean), its standard error (NaN: unknown, as for a mean of
    one value, when only the floor counts) and its floor: how far a rounding bias of
    :data:`ROUNDING_NATS` on every token's delta moves the estimate. An estimate within its
    noise or its floor of zero, as on side a's own samples scored by two engines of one
    model, does not warn; NaN never does.
    """
    negative = {
        name: (value, se)
        for name, (value, se, floor) in estimates.items()
        if value < -(NOISE_SE * np.nan_to_num(se) + floor)
    }
    if negative:
        listed = ", ".join(f"{name} = {value:.4g}" for name, (value, _) in negative.items())
        errors = ", ".join(f"{se:.2g}" for _, se in negative.values())
        unknown = (
            "; nan: a mean of one value, whose error is unknown"
            if any(np.isnan(se) for _, se in negative.values())
            else ""
        )
        warnings.warn(
            f"negative estimate: {listed}. {_ASSUMPTION}; below zero by more than "
            f"{NOISE_SE:g} standard errors ({errors}{unknown}) and than a rounding "
            f"of {ROUNDING_NATS:g} nats per token could move it, so not noise",
            NegativeEstimateWarning,
            stacklevel=stacklevel,
        )


def standard_error(values: np.ndarray) -> float:
    """The standard error of the mean of ``values`` (NaN for fewer than two)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        return np.nan
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.std(values, ddof=1) / np.sqrt(values.size))


_SIGN = np.int64(0x7FFFFFFF)


def _float32_bits(x: np.ndarray) -> np.ndarray:
    """Bit patterns of ``x`` rounded to float32, widened to int64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32).view(np.int32).astype(np.int64)


def bit_mismatch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether the float32 bit patterns of ``a`` and ``b`` differ (prime-rl's bit mismatch).

    Both inputs are rounded to float32 first (the dtype every engine computes logprobs in),
    so a float64 difference below float32 resolution is no mismatch; ``0.0`` and ``-0.0``
    mismatch; a NaN matches only a NaN with the same float32 payload.

    Parameters
    ----------
    a, b : array-like of float
        Logprobs of the two sides, same shape.

    Returns
    -------
    ndarray of bool

    Examples
    --------
    >>> bit_mismatch([-1.0, 0.0, -1.0], [-1.0, -0.0, -1.0 + 1e-12]).tolist()
    [False, True, False]
    """
    return _float32_bits(a) != _float32_bits(b)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> pd.arrays.IntegerArray:
    """Number of float32 values between ``a`` and ``b``, both rounded to float32.

    Float32 bit patterns are mapped onto one ordered integer line (negative floats mirrored,
    so ``0.0`` and ``-0.0`` are both 0); the distance is the difference on that line: 0 for
    equal values, 1 for neighbouring floats. Infinities are the values just past the
    largest finite float; a NaN on either side gives ``<NA>``.

    Parameters
    ----------
    a, b : array-like of float
        Logprobs of the two sides, same shape.

    Returns
    -------
    pandas IntegerArray (Int64)

    Examples
    --------
    >>> one_below = float(np.nextafter(np.float32(-1.0), np.float32(-2.0)))
    >>> ulp_distance([-1.0, -1.0, 0.0], [-1.0, one_below, -0.0]).tolist()
    [0, 1, 0]
    """
    bits_a, bits_b = _float32_bits(a), _float32_bits(b)
    ordered_a = np.where(bits_a < 0, -(bits_a & _SIGN), bits_a)
    ordered_b = np.where(bits_b < 0, -(bits_b & _SIGN), bits_b)
    nan = np.isnan(np.asarray(a, dtype=np.float64)) | np.isnan(np.asarray(b, dtype=np.float64))
    return pd.arrays.IntegerArray(np.abs(ordered_a - ordered_b), nan)


def trainer_metrics(cmp: pd.DataFrame) -> dict[str, float]:
    """Dataset-level mismatch metrics of a comparison frame, under trainer-compatible names.

    With ``d = logprob_b - logprob_a`` and the importance ratio ``w = exp(d) = p_b / p_a``
    (verl's ρ = π_train / π_rollout when a is the rollout and b the trainer), over the N
    tokens with a finite ``d`` (non-finite tokens are counted by ``n_nonfinite`` in
    :func:`~trace_replay.dataset_summary` and left out here):

    - ``mean_k1`` = mean(-d): the k1 estimate of KL(a ‖ b) (verl ``rollout_corr/kl``).
    - ``mean_k3`` = mean(w - 1 - d): the k3 estimate of KL(a ‖ b), never negative (verl
      ``rollout_corr/k3_kl``).
    - ``chi2_token`` = mean(w²) - 1 (verl ``rollout_corr/chi2_token``).
    - ``chi2_seq`` = mean over traces of exp(2 Σ d) - 1, Σ over a trace's finite deltas
      (verl ``rollout_corr/chi2_seq``).

    k1 and the chi-squared estimates are unbiased only when the trace tokens are samples of
    side a's distribution (on-policy: a rollout's own tokens, with a the rollout engine);
    their true values are >= 0, but on fixed traces (human-written text, another model's
    output) they can come out negative. One negative by more than three standard errors
    (beyond sampling noise) raises a `NegativeEstimateWarning` naming it, its value and
    standard error; k3 is >= 0 on any traces.
    - ``mean_ratio, std_ratio, min_ratio, max_ratio``: of w, population std (verl
      ``rollout_corr/rollout_is_mean``, ``_std``, ``_min``, ``_max``).
    - ``ess`` = (Σ w)² / (N Σ w²) = 1 / mean((w / mean w)²), in (0, 1]; 1 when every
      weight is equal (verl ``rollout_corr/rollout_is_eff_sample_size``).
    - ``frac_ratio_outside_0.5_2``: fraction of all tokens with w < 0.5 or w > 2, a
      non-finite d counting as outside (verl ``rollout_is_ratio_fraction_low`` +
      ``_high`` at threshold 2).
    - ``mean_abs_delta_prob, std_abs_delta_prob, max_abs_delta_prob``: of
      |exp(logprob_b) - exp(logprob_a)|, population std (verl
      ``training/rollout_probs_diff_mean``, ``_std``, ``_max``).
    - ``n_bit_mismatch, frac_bit_mismatch``: tokens whose float32 logprobs differ in any bit,
      over all tokens (prime-rl ``logprob_bit_mismatch``); see :func:`bit_mismatch`.
    - ``mean_ulp_distance, max_ulp_distance``: float32 ULP distance over tokens with no NaN;
      see :func:`ulp_distance`.

    verl truncates weights before some of these (ESS and std on weights clamped to its
    rejection thresholds, exponents clamped to ±20); these are the untruncated values, so
    they match verl's where no weight reaches its thresholds.

    Parameters
    ----------
    cmp : DataFrame
        Output of :func:`~trace_replay.compare`.

    Returns
    -------
    dict of str to float
        In the order listed above; NaN where no token qualifies.

    Raises
    ------
    ValueError
        If ``cmp`` is not a comparison frame (e.g. a replay frame).

    Examples
    --------
    >>> from trace_replay.analysis.metrics import compare
    >>> rollout = pd.DataFrame({"trace_id": "t", "step": [0, 1, 2], "token_id": [11, 12, 13],
    ...                         "logprob": [-0.5, -1.0, -2.0], "rank": [1, 2, 1]})
    >>> trainer = rollout.assign(logprob=[-0.5, -1.25, -2.0])
    >>> metrics = trainer_metrics(compare(rollout, trainer))
    >>> round(metrics["mean_k1"], 4), metrics["n_bit_mismatch"], round(metrics["min_ratio"], 4)
    (0.0833, 1.0, 0.7788)
    """
    require_comparison(cmp, "trainer_metrics", one=True)
    delta = cmp["delta"].to_numpy(dtype="float64", na_value=np.nan)
    finite = np.isfinite(delta)
    d = delta[finite]
    trace_ids = cmp["trace_id"].to_numpy()[finite]
    samples = _divergence_terms(d, trace_ids)
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.exp(d)
        probs = np.abs(np.exp(_values(cmp, "logprob_b")) - np.exp(_values(cmp, "logprob_a")))
    probs = probs[np.isfinite(probs)]
    ulps = cmp["ulp_distance"].astype("Float64").dropna().to_numpy(dtype="float64")
    mismatched = cmp["bit_mismatch"].to_numpy(dtype=bool)
    outside = ~((np.exp(delta) >= 0.5) & (np.exp(delta) <= 2.0))  # NaN compares False

    def stat(fn, values: np.ndarray) -> float:
        return float(fn(values)) if values.size else np.nan

    metrics = {
        "mean_k1": stat(np.mean, samples["mean_k1"]),
        "mean_k3": stat(np.mean, np.expm1(d) - d),
        "chi2_token": stat(np.mean, samples["chi2_token"]) - 1.0,
        "chi2_seq": stat(np.mean, samples["chi2_seq"]) - 1.0,
        "mean_ratio": stat(np.mean, w),
        "std_ratio": stat(np.std, w),
        "min_ratio": stat(np.min, w),
        "max_ratio": stat(np.max, w),
        "ess": stat(np.sum, w) ** 2 / (len(w) * stat(np.sum, w**2)) if len(w) else np.nan,
        "frac_ratio_outside_0.5_2": stat(np.mean, outside),
        "mean_abs_delta_prob": stat(np.mean, probs),
        "std_abs_delta_prob": stat(np.std, probs),
        "max_abs_delta_prob": stat(np.max, probs),
        "n_bit_mismatch": float(mismatched.sum()),
        "frac_bit_mismatch": stat(np.mean, mismatched),
        "mean_ulp_distance": stat(np.mean, ulps),
        "max_ulp_distance": stat(np.max, ulps),
    }
    rounded = _divergence_terms(d + ROUNDING_NATS, trace_ids)  # every token rounded one way
    warn_negative(
        {
            name: (
                metrics[name],
                standard_error(values),
                abs(float(np.mean(rounded[name]) - np.mean(values))) if values.size else 0.0,
            )
            for name, values in samples.items()
        }
    )
    return metrics


def _divergence_terms(d: np.ndarray, trace_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The samples whose means are the k1 and chi-squared estimates (chi-squared's minus 1):
    per token for ``mean_k1`` and ``chi2_token``, per trace for ``chi2_seq``."""
    with np.errstate(over="ignore"):
        seq_sum = pd.Series(d).groupby(trace_ids, sort=False).sum().to_numpy()
        return {"mean_k1": -d, "chi2_token": np.exp(2.0 * d), "chi2_seq": np.exp(2.0 * seq_sum)}


def _values(cmp: pd.DataFrame, column: str) -> np.ndarray:
    return pd.to_numeric(cmp[column]).to_numpy(dtype="float64", na_value=np.nan)
