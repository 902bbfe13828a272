"""Forward hooks map every engine forward's rows to (trace, step), once per step and site."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_replay.analysis.capture import SITES, SiteCapture, model_sites
from trace_replay.engines import make_engine
from trace_replay.runs.replay import prepare_requests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def requests(real_traces):
    return prepare_requests(real_traces, None)[0]


def test_model_sites_in_forward_order(lm):
    """Embeddings (layer -1), four sites per decoder layer, then final norm and logits."""
    sites = model_sites(lm)
    num_layers = lm.config.num_hidden_layers
    assert len(sites) == 4 * num_layers + 3
    assert [s.index for s in sites] == list(range(len(sites)))
    assert (sites[0].layer, sites[0].name) == (-1, "embeddings")
    assert [(s.layer, s.name) for s in sites[1:5]] == [
        (0, "input_norm"),
        (0, "attention"),
        (0, "mlp"),
        (0, "residual"),
    ]
    assert [(s.layer, s.name, s.width) for s in sites[-2:]] == [
        (num_layers, "final_norm", lm.config.hidden_size),
        (num_layers, "logits", lm.config.vocab_size),
    ]
    assert {s.name for s in sites} == set(SITES)


def test_model_sites_names_a_missing_layout():
    """A model without the Llama layout is refused with what is missing."""
    with pytest.raises(ValueError, match="Llama module layout"):
        model_sites(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("engine_name, batch_size", [("torch", 2), ("prefill", 4)])
def test_captured_logits_score_every_step_once(lm, requests, engine_name, batch_size):
    """The logits captured at (trace, step) give that step's logprob, for every step exactly
    once: waves, padding, prompt positions and finished rows are mapped or left out."""
    # the torch engine's hf backend: the static one (CPU default) gives no activations
    options = {"backend": "hf"} if engine_name == "torch" else {}
    engine = make_engine(engine_name, lm, batch_size=batch_size, **options)
    logits_site = model_sites(lm)[-1]
    seen: dict[tuple[int, int], torch.Tensor] = {}

    def sink(site, rows, values):
        for key, row in zip(zip(rows.trace_index.tolist(), rows.step.tolist()), values):
            assert key not in seen, key
            seen[key] = row

    source = engine.activations()  # the model whose modules the engine's forwards call
    assert source.model is lm and source.rows is None
    with SiteCapture(source.model, engine, requests, [logits_site], sink):
        results = engine.run(requests)
    assert engine.on_batch is None  # the capture leaves the engine as it found it
    assert set(seen) == {(i, s) for i, r in enumerate(requests) for s in range(r.trace_len)}
    for i, result in enumerate(results):
        for step, token in enumerate(result.token_ids):
            logprob = torch.log_softmax(seen[i, step].float(), dim=-1)[token]
            np.testing.assert_allclose(float(logprob), result.logprob[step], rtol=0, atol=1e-6)
