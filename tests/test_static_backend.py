"""The static-cache backend computes what the transformers model computes (HF backend)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trace_replay.engines.hf_backend import HFBackend
from trace_replay.engines.static_backend import StaticLlamaBackend, supports
from trace_replay.engines import make_engine
from trace_replay.replay import replay

pytestmark = pytest.mark.slow

PROMPTS = [[504, 3575, 282, 4649], [1], [9519, 30, 2114], [504, 3575]]


def assert_same_replay(a, b, atol=1e-4):
    """Identical tokens; logprobs within ``atol``; ranks equal up to ±1 at near-ties."""
    assert a["trace_id"].tolist() == b["trace_id"].tolist()
    assert a["token_id"].tolist() == b["token_id"].tolist()
    np.testing.assert_allclose(a["logprob"], b["logprob"], atol=atol)
    np.testing.assert_allclose(np.stack(a["top_logprobs"]), np.stack(b["top_logprobs"]), atol=atol)
    np.testing.assert_allclose(a["entropy"], b["entropy"], atol=atol)
    assert (np.abs(a["rank"] - b["rank"]) <= 1).all()


def _engine(lm, backend, method=None, batch_size=4):
    speculative = None if method is None else {"method": method, "num_tokens": 3}
    return make_engine("torch", lm, batch_size=batch_size, backend=backend,
                       speculative=speculative)


@pytest.fixture(scope="module")
def hf_result(lm, real_traces):
    return replay(real_traces, engine=_engine(lm, "hf"), progress=False)


def test_supports_llama(lm):
    """The embedded SmolLM2 (LlamaForCausalLM) is supported; other model types are not."""
    assert supports(lm)
    assert not supports(torch.nn.Linear(2, 2))
    other = SimpleNamespace(config=SimpleNamespace(model_type="gpt2"), model=lm.model)
    assert not supports(other)


def test_backend_choice(lm):
    """``auto`` is hf on CPU; ``static`` runs without graphs on CPU; unknown names raise."""
    assert _engine(lm, "auto").backend.name == "hf"
    assert _engine(lm, "static").backend.name == "static"
    with pytest.raises(ValueError, match="backend"):
        _engine(lm, "bogus")
    with pytest.raises(ValueError, match="cuda_graphs"):
        StaticLlamaBackend(lm, 0, cuda_graphs=True)


def test_replay_equals_hf(lm, real_traces, hf_result):
    """Step-by-step replay (left padding, two waves in four slots) matches the HF backend."""
    engine = _engine(lm, "static")
    result = replay(real_traces, engine=engine, progress=False)
    assert_same_replay(result, hf_result)
    assert result.attrs["engine_path"] == "torch-decode[static]"


@pytest.mark.parametrize("method", ["trace", "ngram"])
def test_verify_equals_hf(lm, real_traces, method):
    """The verify path (k = 3, rejected drafts dropped by ``keep``) matches the HF backend's."""
    ours = replay(real_traces, engine=_engine(lm, "static", method), progress=False)
    theirs = replay(real_traces, engine=_engine(lm, "hf", method), progress=False)
    assert_same_replay(ours, theirs)
    assert ours.attrs["acceptance_rate"] == theirs.attrs["acceptance_rate"]


def test_keep_then_decode_equals_hf(lm):
    """After ``keep`` drops drafts (some trailing, one in the middle), logits match HF's."""
    ours, theirs = StaticLlamaBackend(lm, 2, max_query_len=3), HFBackend(lm, 2)
    with torch.inference_mode():
        for backend in (ours, theirs):
            first = backend.prefill(PROMPTS, max_new_tokens=8)
            tokens = torch.tensor([[11, 12, 13]] * len(PROMPTS))
            lens = torch.tensor([len(p) for p in PROMPTS])
            backend.decode(tokens, lens[:, None] + torch.arange(3))
            keep = torch.tensor([[True, False, False], [True, True, True],
                                 [True, False, True], [False, False, False]])
            backend.keep(keep)
            if backend is ours:
                cursor = ours.cursor.tolist()
            kept = keep.sum(1)
            last = backend.decode(tokens[:, :2] + 5, (lens + kept)[:, None] + torch.arange(2))
            if backend is ours:
                a = (first, last.clone())
            else:
                b = (first, last.clone())
    torch.testing.assert_close(a[0], b[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=0)
    # trailing drops are given back: cursor = prompt width + slots up to the last kept one
    assert cursor == [4 + 1, 4 + 3, 4 + 3, 4 + 0]


def test_smaller_wave_reuses_cache(lm):
    """A wave with fewer rows in the same length bucket reuses the cache; padding rows are inert."""
    ours, theirs = StaticLlamaBackend(lm, 2), HFBackend(lm, 2)
    with torch.inference_mode():
        ours.prefill(PROMPTS, max_new_tokens=4)
        cache, shape = ours.k_cache.data_ptr(), ours.shape
        small = PROMPTS[1:3]
        a = ours.prefill(small, max_new_tokens=5)
        b = theirs.prefill(small, max_new_tokens=5)
        assert (ours.k_cache.data_ptr(), ours.shape) == (cache, shape)
        positions = torch.tensor([[len(p)] for p in small])
        a2 = ours.decode(a.argmax(-1)[:, None], positions).clone()
        b2 = theirs.decode(b.argmax(-1)[:, None], positions)
    assert a2.shape == b2.shape
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    torch.testing.assert_close(a2, b2, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("method", [None, "trace"])
def test_cuda_graphs_equal_hf(lm, real_traces, method):
    """On CUDA, the captured static backend replays what the HF backend replays."""
    gpu = copy.deepcopy(lm).to("cuda")
    ours_engine = _engine(gpu, "auto", method)
    assert ours_engine.backend.name == "static+cudagraph"
    ours = replay(real_traces, engine=ours_engine, progress=False)
    theirs = replay(real_traces, engine=_engine(gpu, "hf", method), progress=False)
    assert_same_replay(ours, theirs, atol=2e-4)
