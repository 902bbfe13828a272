"""RowCapture maps the deterministic model's flat rows to (trace, step), once each.

Invariant: on a deterministic decode run, every site hands the sink each replay step of
each trace exactly once (prompt positions, finished rows and padding left out), and the
logits it derives from the final norm are the engine's: scored by the engine's own
row-invariant scorer they give the replay's logprobs bit for bit (deterministic mode
guarantees a row's bits whatever rows share a call).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from trace_replay.analysis.capture import model_sites
from trace_replay.analysis.capture_rows import RowCapture
from trace_replay.engines import make_engine
from trace_replay.runs.replay import prepare_requests


@pytest.fixture(scope="module")
def requests(real_traces):
    traces = real_traces.select(["paris", "code", "short-prompt"])
    return prepare_requests(traces, None)[0]


def test_every_step_once_per_site_and_logits_match_the_engine(lm, requests):
    engine = make_engine("torch", lm, batch_size=2, deterministic=True)
    sites = [s for s in model_sites(lm) if s.layer in (-1, 0) or s.name in ("final_norm", "logits")]
    seen: Counter = Counter()
    logits: dict[tuple[int, int], torch.Tensor] = {}

    def sink(site, rows, values):
        assert values.shape == (len(rows.step), site.width)
        for i, key in enumerate(zip(rows.trace_index.tolist(), rows.step.tolist())):
            seen[(site.name, *key)] += 1
            if site.name == "logits":
                logits[key] = values[i]

    model = engine.activations().rows  # deterministic forwards bypass the modules
    with RowCapture(model, engine, requests, sites, sink) as capture:
        results = engine.run(requests)
    assert model.observer is None and engine.on_batch is None
    assert capture.model is model is engine.backend.model
    expected = {(t, s) for t, r in enumerate(requests) for s in range(r.trace_len)}
    for site in sites:
        assert {key[1:] for key in seen if key[0] == site.name} == expected
        assert all(seen[(site.name, *key)] == 1 for key in expected)
    for t, (request, result) in enumerate(zip(requests, results)):
        rows = torch.stack([logits[t, s] for s in range(request.trace_len)])
        ours = engine.backend.score(rows, torch.tensor(request.trace_token_ids), 0).logprob
        np.testing.assert_array_equal(ours.double().numpy(), result.logprob)


def test_a_second_observer_is_refused(lm, requests):
    engine = make_engine("torch", lm, batch_size=2, deterministic=True)
    model = engine.backend.model
    with RowCapture(model, engine, requests, [], lambda *a: None):
        with pytest.raises(RuntimeError, match="already observed"):
            RowCapture(model, engine, requests, [], lambda *a: None).__enter__()
    assert model.observer is None
