"""locate_divergence on the embedded model: planted perturbations are found where they are."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from trace_replay.analysis.attribution import divergence_origin, locate_divergence
from trace_replay.analysis.capture import SITES

PERTURBED_LAYER = 7


@pytest.fixture(scope="module")
def traces(real_traces):
    """Three short traces: two prompts of several tokens and a one-token prompt."""
    return real_traces.select(["paris", "code", "short-prompt"])


@pytest.fixture(scope="module")
def perturbed(lm):
    """A copy of the model whose layer-7 MLP down projection moved by ~1e-4 per weight."""
    model = copy.deepcopy(lm)
    weight = model.model.layers[PERTURBED_LAYER].mlp.down_proj.weight
    with torch.no_grad():
        weight += 1e-4 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    yield model
    del model


def _tokens(traces) -> int:
    return sum(len(t.trace_token_ids) for t in traces)


@pytest.mark.slow
def test_identical_settings_give_zero_differences(lm, traces):
    """The same settings twice: every site of every step and layer is bitwise equal."""
    frame = locate_divergence(traces, {"model": lm}, {"model": lm}, progress=False)
    num_layers = lm.config.num_hidden_layers
    assert len(frame) == _tokens(traces) * (4 * num_layers + 3)
    assert frame["bitwise_equal"].all()
    assert (frame["max_abs_diff"] == 0).all() and (frame["rel_l2"] == 0).all()
    assert (frame["cosine"] == 1).all()
    assert (
        frame["layer"].min() == -1
        and frame["layer"].max() == num_layers == frame.attrs["num_layers"]
    )
    assert divergence_origin(frame)["layer"].isna().all()


@pytest.mark.slow
def test_planted_perturbation_is_the_first_divergence(lm, perturbed, traces):
    """A change to layer 7's MLP weights: that MLP is the first divergent site at every step,
    and every earlier site (layers < 7, and layer 7's norm and attention) is bitwise equal."""
    frame = locate_divergence(traces, {"model": lm}, {"model": perturbed}, progress=False)
    origin = divergence_origin(frame)
    assert origin["first_divergence_step"].tolist() == [0] * len(traces)
    assert origin["layer"].tolist() == [PERTURBED_LAYER] * len(traces)
    assert origin["site"].tolist() == ["mlp"] * len(traces)
    per_step = divergence_origin(frame, by="step")
    assert len(per_step) == _tokens(traces)
    assert (per_step["layer"] == PERTURBED_LAYER).all() and (per_step["site"] == "mlp").all()
    before = (frame["layer"] < PERTURBED_LAYER) | (
        (frame["layer"] == PERTURBED_LAYER) & frame["site"].isin(["input_norm", "attention"])
    )
    assert frame.loc[before, "bitwise_equal"].all()
    assert (frame.loc[~before, "max_abs_diff"] > 0).all()


@pytest.mark.slow
def test_decode_vs_prefill_with_other_batches_pairs_every_step(lm, traces):
    """Decode (batch 2) vs prefill (batch 3): every (trace, step, layer, site) is compared once;
    the embedding lookup is bitwise equal and the rest agree to float32 rounding."""
    frame = locate_divergence(
        traces,
        {"model": lm, "batch_size": 2},
        {"model": lm, "engine": "prefill", "batch_size": 3},
        progress=False,
    )
    keys = frame[["trace_id", "step", "layer", "site"]]
    assert not keys.duplicated().any()
    assert len(frame) == _tokens(traces) * (4 * lm.config.num_hidden_layers + 3)
    assert frame["trace_id"].unique().tolist() == traces.ids
    assert frame.loc[frame["site"] == "embeddings", "bitwise_equal"].all()
    assert frame["rel_l2"].max() < 1e-4
    assert frame.attrs["a"]["engine"] == "torch" and frame.attrs["b"]["engine"] == "prefill"


@pytest.mark.slow
def test_small_budget_splits_passes_with_equal_results(lm, perturbed, traces):
    """A held-memory budget below one site's activations runs one pass per site; the numbers
    are those of a single pass."""
    settings = ({"model": lm}, {"model": perturbed})
    sites = ["final_norm", "logits"]
    two = traces.select(["paris", "short-prompt"])
    one = locate_divergence(two, *settings, sites=sites, progress=False)
    split = locate_divergence(two, *settings, sites=sites, progress=False, max_held_bytes=1)
    assert one.attrs["passes"] == 1
    assert split.attrs["passes"] == 2
    pd.testing.assert_frame_equal(one, split)


def test_unsupported_settings_are_refused_before_loading():
    """vLLM, the static backend and speculative verify are refused."""
    with pytest.raises(ValueError, match=r"can be watched \(torch, prefill\), not .vllm."):
        locate_divergence([], {"engine": "vllm"}, {})
    with pytest.raises(ValueError, match="backend='hf'"):
        locate_divergence([], {}, {"backend": "static"})
    with pytest.raises(ValueError, match="speculative"):
        locate_divergence([], {"speculative": {"method": "trace", "num_tokens": 2}}, {})
    with pytest.raises(ValueError, match="unknown sites"):
        locate_divergence([], {}, {}, sites=["attn"])


def test_setting_typos_name_the_key_and_the_valid_settings():
    """A misspelt setting of run a or b is refused before loading, naming the run, the key,
    the closest valid name and every setting that engine takes (not only its own options)."""
    with pytest.raises(
        ValueError,
        match=r"^locate_divergence a: unknown setting 'dtyp' "
        r"\(did you mean 'dtype'\?\); engine 'torch' takes engine, model, dtype,",
    ):
        locate_divergence([], {"dtyp": "float32"}, {})
    with pytest.raises(
        ValueError,
        match=r"^locate_divergence b: unknown setting 'batch_sise' "
        r"\(did you mean 'batch_size'\?\); engine 'prefill' takes .*batch_size",
    ):
        locate_divergence([], {}, {"engine": "prefill", "batch_sise": 2})


def _frame(rows: list[tuple]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=["trace_id", "step", "layer", "site", "max_abs_diff"])
    frame["site"] = pd.Categorical(frame["site"], categories=SITES, ordered=True)
    frame["rel_l2"] = frame["max_abs_diff"] / 10
    frame.attrs = {"tol": 0.0}
    return frame


def test_divergence_origin_takes_the_first_in_forward_order():
    """Per trace: the first step with a difference beyond tol, and its first (layer, site);
    a trace without one gets <NA>; a NaN difference counts as divergent."""
    frame = _frame(
        [
            ("t0", 0, 0, "attention", 0.0),
            ("t0", 0, 0, "mlp", 1e-9),
            ("t0", 1, 0, "attention", 1e-3),
            ("t0", 1, 0, "mlp", 1e-2),
            ("t1", 0, 0, "attention", 0.0),
            ("t1", 0, 0, "mlp", 0.0),
            ("t2", 0, -1, "embeddings", np.nan),
            ("t2", 0, 0, "mlp", 1.0),
        ]
    )
    origin = divergence_origin(frame)
    assert origin["trace_id"].tolist() == ["t0", "t1", "t2"]
    assert origin["first_divergence_step"].tolist()[0::2] == [0, 0] and pd.isna(
        origin["first_divergence_step"][1]
    )
    assert origin.loc[0, ["layer", "site", "max_abs_diff"]].tolist() == [0, "mlp", 1e-9]
    assert origin.loc[2, ["layer", "site"]].tolist() == [-1, "embeddings"]
    assert origin["n_divergent_steps"].tolist() == [2, 0, 1]
    strict = divergence_origin(frame, tol=1e-6)
    assert strict.loc[0, ["first_divergence_step", "layer", "site"]].tolist() == [1, 0, "attention"]
    per_step = divergence_origin(frame, tol=1e-6, by="step")
    assert per_step[["trace_id", "step"]].values.tolist() == [
        ["t0", 0],
        ["t0", 1],
        ["t1", 0],
        ["t2", 0],
    ]
    assert per_step["layer"].isna().tolist() == [True, False, True, False]
    assert per_step.loc[1, "site"] == "attention"


@pytest.mark.slow
def test_deterministic_decode_and_prefill_agree_at_every_site(lm, traces):
    """Deterministic mode, decode at batch 2 vs teacher-forced prefill at batch 3: every site
    of every step and layer is bitwise equal (the row arithmetic is shared, so the property
    that the outputs show holds inside the model too); the logits site is included."""
    frame = locate_divergence(
        traces,
        {"model": lm, "batch_size": 2, "deterministic": True},
        {"model": lm, "engine": "prefill", "batch_size": 3, "deterministic": True},
        progress=False,
    )
    assert len(frame) == _tokens(traces) * (4 * lm.config.num_hidden_layers + 3)
    assert not frame[["trace_id", "step", "layer", "site"]].duplicated().any()
    assert frame["bitwise_equal"].all()
    assert frame.attrs["a"]["deterministic"] and frame.attrs["b"]["deterministic"]


@pytest.mark.slow
def test_deterministic_against_default_and_a_planted_change(lm, perturbed, traces):
    """Deterministic mode runs the model's weights through other (row-wise) arithmetic:
    against the default run the embedding lookup is bitwise equal and every site agrees to
    float32 rounding (measured here: from layer 0 on, median rel. L2 ~1e-6). With a perturbed model on one side, both in deterministic mode, the planted
    layer's MLP is the first divergent site and everything before it is bitwise equal."""
    two = traces.select(["paris", "short-prompt"])
    frame = locate_divergence(
        two, {"model": lm}, {"model": lm, "deterministic": True}, progress=False
    )
    assert frame.loc[frame["site"] == "embeddings", "bitwise_equal"].all()
    assert frame["rel_l2"].max() < 1e-4
    planted = locate_divergence(
        two,
        {"model": lm, "deterministic": True},
        {"model": perturbed, "deterministic": True},
        progress=False,
    )
    origin = divergence_origin(planted)
    assert origin["layer"].tolist() == [PERTURBED_LAYER] * 2
    assert origin["site"].tolist() == ["mlp"] * 2
    before = (planted["layer"] < PERTURBED_LAYER) | (
        (planted["layer"] == PERTURBED_LAYER) & planted["site"].isin(["input_norm", "attention"])
    )
    assert planted.loc[before, "bitwise_equal"].all()
