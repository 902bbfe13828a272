"""The engine registry (trace_replay.engines.registry): an engine registered by name is built
by make_engine and used by name everywhere an engine is named (tr.replay, the CLI, record,
the model cache, kept engines), with nothing else to change. The engine registered here is
a real one: a bigram model (embedding and head, seeded) whose scores are checked against
the model's own numbers."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import trace_replay as tr
from trace_replay.cli import main
from trace_replay.engines import ENGINE_OPTIONS, ENGINES, make_engine
from trace_replay.engines.base import EngineBase, TraceResult, check_engine
from trace_replay.engines.cache import ModelCache, check_settings
from trace_replay.engines.capabilities import ActivationSource, BatchHooks, Generates, supports
from trace_replay.engines.registry import (
    EngineSpec,
    engine_spec,
    engine_specs,
    register_engine,
    unregister_engine,
)
from trace_replay.models.load import load_tokenizer

pytestmark = pytest.mark.slow  # an engine runs (the embedded model's tokenizer)


class Bigram(torch.nn.Module):
    """Next-token logprobs from the previous token alone (seeded weights)."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.head = torch.nn.Linear(width, vocab_size, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab_size, width, generator=generator))
            self.head.weight.copy_(torch.randn(vocab_size, width, generator=generator))

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(previous)).double().log_softmax(-1)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


class BigramEngine(EngineBase):
    """A whole engine in a few lines: scores each trace token from the token before it, and
    generates greedily or by seeded sampling."""

    name, engine_path, model_label, dtype, device = "bigram", "bigram", "bigram", "float32", "cpu"
    builds = 0

    def __init__(self, config, *, engine_args: dict | None = None) -> None:
        args = dict(engine_args or {})
        self.width = int(args.pop("width", 8))
        if args:
            raise ValueError(f"the bigram engine takes engine_args width only, not {sorted(args)}")
        self.tokenizer = load_tokenizer()
        self.lm = Bigram(len(self.tokenizer), self.width).eval()
        self.batch_size, self.top_k = config.batch_size or 4, config.top_k
        BigramEngine.builds += 1

    def settings(self) -> dict:
        return {**super().settings(), "width": self.width}

    @torch.no_grad()
    def run(self, requests, *, on_tokens=None) -> list[TraceResult]:
        results = []
        for request in requests:
            ids = torch.tensor(request.prompt_token_ids + request.trace_token_ids)
            logprobs = self.lm(ids[request.prompt_len - 1 : -1])  # [T, V]: step t from token t-1
            tokens = ids[request.prompt_len :]
            own = logprobs.gather(1, tokens[:, None])[:, 0]
            top = logprobs.topk(self.top_k, dim=1)
            results.append(
                TraceResult(
                    request.trace_id,
                    request.prompt_len,
                    tokens.numpy(),
                    own.numpy(),
                    ((logprobs > own[:, None]).sum(1) + 1).numpy(),
                    top.indices.numpy(),
                    top.values.numpy(),
                    -(logprobs.exp() * logprobs).sum(1).numpy(),
                )
            )
            if on_tokens is not None:
                on_tokens(request.trace_len)
        return results

    @torch.no_grad()
    def generate(self, prompts, *, max_tokens, temperature=0.0, seed=0, eos_token_id=None):
        generator, out = torch.Generator().manual_seed(seed), []
        for prompt in prompts:
            tokens, logprobs, last = [], [], prompt[-1]
            for _ in range(max_tokens):
                step = self.lm(torch.tensor([last]))[0]
                last = (
                    int(step.argmax())
                    if temperature == 0
                    else int(
                        torch.multinomial((step / temperature).softmax(0), 1, generator=generator)
                    )
                )
                tokens.append(last)
                logprobs.append(float(step[last]))
                if last == eos_token_id:
                    break
            out.append((tokens, logprobs))
        return out


TRACES = [
    {"id": "a", "prompt_token_ids": [1, 504, 3458], "trace_token_ids": [282, 4536, 30]},
    {"id": "b", "prompt_token_ids": [9], "trace_token_ids": [17, 17, 2]},
]


@pytest.fixture
def bigram():
    """The bigram engine registered for one test, then removed (and its kept engine closed)."""
    spec = register_engine(
        EngineSpec(
            "bigram",
            BigramEngine,
            "a bigram model (a test's)",
            options=("engine_args",),
            generates=True,
            loaded_model=False,
        )
    )
    yield spec
    tr.close_engines()
    unregister_engine("bigram")


def _expected(traces: list[dict], width: int = 8) -> np.ndarray:
    """Each trace token's logprob under the bigram model, computed directly."""
    model = Bigram(len(load_tokenizer()), width)
    with torch.no_grad():
        return np.concatenate(
            [
                model(torch.tensor([t["prompt_token_ids"][-1], *t["trace_token_ids"][:-1]]))
                .gather(1, torch.tensor(t["trace_token_ids"])[:, None])[:, 0]
                .numpy()
                for t in traces
            ]
        )


@pytest.mark.parametrize("name", ["torch", "prefill", "vllm-server"])
def test_a_spec_says_what_its_engine_class_can_do(name):
    """The package's own specs agree with their classes: ``generates`` where the class
    generates, ``activations`` where it gives activations and calls on_batch."""
    spec = engine_spec(name)
    engine_class = spec.load()
    assert spec.generates == supports(engine_class, Generates)
    assert spec.activations == (
        supports(engine_class, ActivationSource) and supports(engine_class, BatchHooks)
    )


def test_a_registered_engine_is_named_everywhere(bigram):
    """Registration alone makes the name known to the factory, its options to the settings
    check, and its capability to record; removing it makes it unknown again."""
    assert "bigram" in ENGINES and ENGINE_OPTIONS["bigram"] == ("engine_args",)
    assert engine_spec("bigram") is bigram and bigram in engine_specs()
    with make_engine("bigram", engine_args={"width": 4}) as engine:
        check_engine(engine)
        assert supports(engine, Generates) and engine.settings()["width"] == 4
    with pytest.raises(
        ValueError,
        match=r"'bigram' does not take backend \(it takes "
        r"engine_args\)",
    ):
        make_engine("bigram", backend="hf")
    with pytest.raises(ValueError, match="unknown setting 'backend'"):
        check_settings({"engine": "bigram", "backend": "hf"}, "a")
    with pytest.raises(ValueError, match="registered already"):
        register_engine(bigram)
    unregister_engine("bigram")
    assert "bigram" not in ENGINES
    with pytest.raises(ValueError, match="unknown engine 'bigram'"):
        make_engine("bigram")
    register_engine(bigram)


def test_replay_by_name_scores_with_the_registered_engine_and_keeps_it(bigram):
    """tr.replay(engine="bigram") builds the engine from its spec, scores every trace token
    as the model does, records its settings, and keeps it for the next call."""
    builds = BigramEngine.builds
    df = tr.replay(TRACES, engine="bigram", engine_args={"width": 8}, progress=False)
    np.testing.assert_allclose(df["logprob"], _expected(TRACES), rtol=1e-12)
    assert (df.attrs["engine"], df.attrs["width"]) == ("bigram", 8)
    again = tr.replay(TRACES, engine="bigram", engine_args={"width": 8}, progress=False)
    pd.testing.assert_series_equal(again["logprob"], df["logprob"])
    assert BigramEngine.builds == builds + 1  # kept between the calls
    with ModelCache().engine({"engine": "bigram", "engine_args": {"width": 8}}) as engine:
        assert engine.settings()["width"] == 8


def test_the_cli_replays_and_records_with_the_registered_engine(bigram, tmp_path):
    """`trace-replay replay --engine bigram` writes the frame tr.replay gives, its option
    passed with --engine-arg; `record --engine bigram` writes traces whose replay gives back
    their recorded logprobs (greedy: rank 1 at every step)."""
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(t) + "\n" for t in TRACES))
    out = tmp_path / "out.parquet"
    assert (
        main(
            [
                "replay",
                str(traces),
                "--engine",
                "bigram",
                "--engine-arg",
                "width=8",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    np.testing.assert_allclose(pd.read_parquet(out)["logprob"], _expected(TRACES), rtol=1e-12)
    assert (
        main(
            [
                "replay",
                str(traces),
                "--engine",
                "bigram",
                "--engine-arg",
                "depth=2",
                "--quiet",
                "--out",
                str(tmp_path / "bad.parquet"),
            ]
        )
        == 2
    )

    prompts, recorded = tmp_path / "prompts.txt", tmp_path / "recorded.jsonl"
    prompts.write_text("The capital of France is\nOnce upon a time\n")
    assert (
        main(
            [
                "record",
                str(prompts),
                "--engine",
                "bigram",
                "--max-tokens",
                "5",
                "--out",
                str(recorded),
            ]
        )
        == 0
    )
    df = tr.replay(str(recorded), engine="bigram", progress=False)
    np.testing.assert_allclose(df["logprob"], df["ref_logprob"], atol=1e-6)  # kept as float32
    assert (df["rank"] == 1).all() and df["trace_id"].nunique() == 2


def test_record_takes_the_registered_engine_by_name(bigram):
    """tr.record(engine="bigram") generates with it (seeded sampling reproducible), and an
    engine whose spec does not generate is refused naming those that do."""
    first = tr.record(["Hello"], engine="bigram", max_tokens=6, temperature=1.0, seed=3)
    second = tr.record(["Hello"], engine="bigram", max_tokens=6, temperature=1.0, seed=3)
    assert first[0].trace_token_ids == second[0].trace_token_ids
    assert first[0].meta["recorded_with"]["engine"] == "bigram"
    with pytest.raises(ValueError, match=r"generates \(auto, torch, vllm, bigram\)"):
        tr.record(["Hello"], engine="prefill", max_tokens=2)
