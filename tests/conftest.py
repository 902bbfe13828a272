"""Shared pytest fixtures, and the settings every test module runs under."""

from __future__ import annotations

import os
import sys

import torch

# Before anything imports triton: trace_replay.kernels._triton reads it once, and triton.jit when it
# decorates a kernel. Without CUDA the interpreter runs the real kernels on CPU tensors (the
# launchers take the kernel path, not the torch reference); with CUDA they compile.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

matplotlib.use("Agg")  # tests draw into files and buffers; no window is ever opened

# One intra-op thread: on a 2-core machine any other busy process (a vLLM engine core, a
# notebook kernel) makes two OpenMP threads spin against each other, measured here as 30x
# slower small matmuls; one thread keeps the suite's run time predictable.
torch.set_num_threads(1)

# Markers of the tests that load the embedded model or start an engine, a server, a Ray head
# or a browser (pyproject.toml); their modules are the suite's long work units under xdist.
_HEAVY_MARKERS = ("slow", "vllm", "browser", "gpu")
# The longest modules (minutes each on 2 cores, measured 2026-12-07: vLLM started in fresh
# interpreters, a vLLM server, notebooks, TP=2 on CPU, a Ray head, a wheel install) start first.
_LONGEST = (
    "tests/engines/vllm/test_inprocess.py",
    "tests/engines/server/test_server_engine.py",
    "tests/test_notebooks.py",
    "tests/engines/vllm/test_vllm_tp_cpu.py",
    "tests/runs/test_cluster_jobs.py",
    "tests/engines/test_determinism.py",
    "tests/analysis/test_distributions.py",
    "tests/test_packaging.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadfile --no-loadscope-reorder``,
    so each module runs whole on one worker and its module fixtures start once): the longest
    modules first, then the others with heavy tests (most first), the quick modules last,
    where they fill the workers' final gaps. A serial run keeps the collection order."""
    if not hasattr(config, "workerinput"):
        return
    heavy: dict[str, int] = {}
    for item in items:
        if any(item.get_closest_marker(name) for name in _HEAVY_MARKERS):
            module = item.nodeid.split("::", 1)[0]
            heavy[module] = heavy.get(module, 0) + 1
    order = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int, int]:
        module = item.nodeid.split("::", 1)[0]
        first = _LONGEST.index(module) if module in _LONGEST else len(_LONGEST)
        return first, -heavy.get(module, 0), order[id(item)]

    items.sort(key=key)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist the controller converts the embedded model into its cache before
    the workers start: on a fresh machine each worker would otherwise convert it too (safely,
    trace_replay.models.load renames a finished folder into place, but twice the work)."""
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    from trace_replay.models.load import hf_folder

    try:
        hf_folder()
    except Exception as exc:  # noqa: BLE001 - the tests that need the model report it
        print(f"\nthe embedded model was not converted before the workers started: {exc}")


@pytest.fixture(
    scope="session",
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
        ),
    ],
)
def device(request) -> str:
    """Where a kernel or state test runs: CPU (Triton's interpreter, or the torch reference
    without Triton) and, on a machine with one, CUDA (``-k cuda`` selects those)."""
    return request.param


@pytest.fixture(autouse=True)
def _close_figures():
    """Close every matplotlib figure a test opened, so figures never pile up across tests."""
    yield
    if "matplotlib.pyplot" in sys.modules:  # a test that never plots does not import it
        sys.modules["matplotlib.pyplot"].close("all")


# --- synthetic replay frames (analysis, plots, tokens_html, explorer, report) ---------------

_VOCAB = [
    " the",
    " cat",
    "\n",
    "\t",
    "<script>alert(1)</script>",
    " &amp;",
    " Paris",
    ".",
    "  ",
    "é",
    " sat",
    " on",
    " mat",
    '"q"',
    "x" * 12,
]


def _synthetic_replay(n_traces: int, n_steps: int, seed: int, top_k: int = 5) -> pd.DataFrame:
    """Replay frame whose rank, logprob and top-k lists agree with one another."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(n_traces):
        for step in range(n_steps):
            # the j-th most likely token has p <= 1/j: 0.25 below it, a second run's drift
            # (_second_run) keeps every rank possible
            bound = -np.log(np.arange(1, top_k + 1)) - np.r_[0.0, np.full(top_k - 1, 0.25)]
            top_lp = np.minimum(np.sort(rng.uniform(-8.0, -0.05, top_k))[::-1], bound)
            top_ids = rng.choice(5000, top_k, replace=False)
            rank = int(rng.choice([1, 1, 1, 2, 3, 15, 250, 4000]))
            if rank <= top_k:
                token_id, logprob = int(top_ids[rank - 1]), float(top_lp[rank - 1])
            else:
                token_id = int(rng.integers(5000, 6000))
                logprob = min(float(top_lp[-1] - rank / 500), -np.log(rank) - 0.25)
            logprob, top_lp = _within_one(logprob, top_lp, listed=rank <= top_k)
            rows.append(
                dict(
                    trace_id=f"t{t}",
                    step=step,
                    position=10 + step,
                    token_id=token_id,
                    token=_VOCAB[token_id % len(_VOCAB)],
                    logprob=logprob,
                    rank=rank,
                    top_token_ids=[int(i) for i in top_ids],
                    top_logprobs=list(top_lp),
                    top_tokens=[_VOCAB[i % len(_VOCAB)] for i in top_ids],
                    entropy=float(rng.uniform(0.1, 3.0)),
                    ref_logprob=logprob + float(rng.normal(0, 2e-3)),
                )
            )
    df = pd.DataFrame(rows)
    df.attrs = {"model": "synthetic", "engine": "hf", "dtype": "float32", "top_k": top_k}
    return df


@pytest.fixture(scope="session")
def make_replay():
    """Factory ``make_replay(n_traces, n_steps, seed)`` for module-scoped fixtures."""
    return _synthetic_replay


@pytest.fixture
def replay_df() -> pd.DataFrame:
    """Three traces of 40 steps; rank, logprob and top-k lists are consistent."""
    return _synthetic_replay(n_traces=3, n_steps=40, seed=0)


def _within_one(logprob: float, top_lp: np.ndarray, *, listed: bool) -> tuple[float, np.ndarray]:
    """The scores moved down together so that the top-k (and the token's own, when ranked
    past them) hold a probability mass <= 1, as a distribution's do."""
    excess = np.log(np.exp(top_lp).sum() + (0 if listed else np.exp(logprob)))
    if excess <= 0:
        return logprob, top_lp
    return float(logprob - excess - 1e-3), top_lp - excess - 1e-3


def _second_run(replay: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    b = replay.drop(columns="ref_logprob").copy()
    rng = np.random.default_rng(1)
    drift = np.zeros(len(b))
    for trace_id, start in (("t1", 7), ("t2", 20)):
        late = (b["trace_id"] == trace_id) & (b["step"] >= start)
        drift[late.to_numpy()] = rng.normal(0, 0.05, late.sum())
    # the whole distribution drifts, so that b's rows stay possible scores
    rows = [
        _within_one(lp + d, np.asarray(top) + d, listed=rank <= len(top))
        for lp, top, d, rank in zip(b["logprob"], b["top_logprobs"], drift, b["rank"])
    ]
    b["logprob"] = [lp for lp, _ in rows]
    b["top_logprobs"] = [list(top) for _, top in rows]
    for row in b.index[(b["trace_id"] == "t2") & (b["step"] == 25)]:
        _second_behind_another(b, row)
    b.attrs = {**replay.attrs, "engine": "vllm", "dtype": "bfloat16"}
    return replay.drop(columns="ref_logprob"), b


def _second_behind_another(frame: pd.DataFrame, row: int) -> None:
    """Make ``row``'s token rank 2, behind a token none of the others is (id 6000); tokens
    6001… fill the list where too few were below it."""
    token, logprob = frame.at[row, "token_id"], frame.at[row, "logprob"]
    width = len(frame.at[row, "top_token_ids"])
    below = [
        (i, lp)
        for i, lp in zip(frame.at[row, "top_token_ids"], frame.at[row, "top_logprobs"])
        if i != token and lp < logprob
    ]
    below += [(6001 + j, logprob - 0.5 * (j + 1) - 10) for j in range(width)]
    top = [(6000, logprob + 0.1), (token, logprob), *below][:width]
    logprob, top_lp = _within_one(logprob, np.array([lp for _, lp in top]), listed=True)
    ids = [int(i) for i, _ in top]
    frame.at[row, "logprob"], frame.at[row, "rank"] = logprob, 2
    frame.at[row, "top_token_ids"], frame.at[row, "top_logprobs"] = ids, list(top_lp)
    frame.at[row, "top_tokens"] = [_VOCAB[i % len(_VOCAB)] for i in ids]


@pytest.fixture(scope="session")
def make_pair():
    """Factory ``make_pair(replay) -> (a, b)`` as in ``replay_pair``."""
    return _second_run


@pytest.fixture
def replay_pair(replay_df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The same replay and a second run: t0 identical, t1 drifts from step 7, t2 from step 20."""
    return _second_run(replay_df)


# --- the embedded model and an independent float64 reference (engine tests) -----------------

REAL_TRACES = [
    {
        "id": "paris",
        "prompt": "The capital of France is",
        "completion": " Paris. It is a big city.",
    },
    {"id": "code", "prompt": "def add(a, b):", "completion": "\n    return a + b\n"},
    # " Hi!<|im_end|> Then it goes on." with the real EOS (id 2): completion text may not hold
    # special-token text, so control tokens are given as ids
    {
        "id": "eos-inside",
        "prompt": "Say hi.",
        "trace_token_ids": [21041, 17, 2, 3875, 357, 3935, 335, 30],
    },
    {"id": "one-token", "prompt": "Once upon a", "completion": " time"},
    {"id": "short-prompt", "prompt_token_ids": [504], "trace_token_ids": [3575, 282, 4649, 314]},
    {
        "id": "long",
        "prompt": "List three colours:",
        "completion": " red, green and blue. Then three animals: cat, dog and horse. That is all.",
    },
]


@pytest.fixture(scope="session")
def tokenizer():
    from trace_replay.models.load import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def lm():
    """The embedded model, float32 on CPU, loaded once per session."""
    from trace_replay.models.load import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def real_records() -> list[dict]:
    """The six real traces as records (copies of REAL_TRACES), before loading."""
    return [dict(record) for record in REAL_TRACES]


@pytest.fixture(scope="session")
def real_traces(tokenizer):
    """Six real traces: EOS inside, a 1-token trace, a 1-token prompt, mixed lengths."""
    from trace_replay.traces.sets import load_traces

    return load_traces(REAL_TRACES, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def reference64(lm, real_traces):
    """Teacher-forced float64 logprobs of every trace token: {trace_id: [T, V] log-softmax}."""
    import copy

    import torch

    lm64 = copy.deepcopy(lm).double()
    out = {}
    with torch.inference_mode():
        for trace in real_traces:
            ids = list(trace.prompt_token_ids) + list(trace.trace_token_ids)
            logits = lm64(input_ids=torch.tensor([ids])).logits[0].double()
            start = len(trace.prompt_token_ids) - 1
            rows = logits[start : start + len(trace.trace_token_ids)]
            out[trace.id] = torch.log_softmax(rows, dim=-1).numpy()
    del lm64
    return out


@pytest.fixture(scope="session")
def assert_matches_reference(reference64):
    """``assert_matches_reference(df, tol=2e-3, tie=1e-4)`` checks a replay of ``real_traces``.

    Per token, |Δlogprob| <= tol against the float64 reference, and rank equal to the
    reference's up to near-ties (tokens within ``tie`` of the trace token may rank either
    way). Returns the worst |Δlogprob|.
    """

    def check(df: pd.DataFrame, tol: float = 2e-3, tie: float = 1e-4) -> float:
        worst = 0.0
        for trace_id, group in df.groupby("trace_id", sort=False):
            ref = reference64[trace_id]
            assert len(group) == len(ref), trace_id
            for row, lp64 in zip(group.itertuples(), ref):
                target = lp64[row.token_id]
                worst = max(worst, abs(row.logprob - target))
                lo = 1 + int((lp64 > target + tie).sum())
                hi = 1 + int((lp64 > target - tie).sum())
                assert lo <= row.rank <= hi, (trace_id, row.step, row.rank, lo, hi)
        assert worst <= tol, worst
        return worst

    return check


@pytest.fixture(scope="session")
def assert_frames_bitwise_equal():
    """``assert_frames_bitwise_equal(a, b)``: every column equal, floats exactly (NaN matches
    NaN); list cells compared as lists (a checkpoint's Parquet gives numpy arrays where an
    in-memory run gives lists)."""

    def plain(frame: pd.DataFrame) -> pd.DataFrame:
        frame = frame.reset_index(drop=True).copy()
        for column in ("top_token_ids", "top_logprobs", "top_tokens"):
            if column in frame:
                frame[column] = frame[column].map(lambda v: np.asarray(v).tolist())
        return frame

    def check(a: pd.DataFrame, b: pd.DataFrame) -> None:
        pd.testing.assert_frame_equal(plain(a), plain(b), check_exact=True)

    return check


# --- a local Ray cluster (cluster runs) -------------------------------------------------------


@pytest.fixture(scope="session")
def local_ray():
    """``with local_ray(**resources) as ray:`` a new local Ray cluster of those resources
    (``num_cpus=2``…; no dashboard, workers' logs kept out), shut down after the block;
    skips without Ray, or when this process is connected to a cluster already."""
    import contextlib
    import logging

    ray = pytest.importorskip(
        "ray", reason="ray is not installed (pip install 'trace-replay[ray]')"
    )

    @contextlib.contextmanager
    def start(**resources):
        if ray.is_initialized():
            pytest.skip("this process is connected to another Ray cluster")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(
            address="local",
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            **resources,
        )
        try:
            yield ray
        finally:
            ray.shutdown()

    return start


# --- a tiny random Llama (engine internals: decode, verify, invariant model) ----------------

_TINY_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.3,
    pad_token_id=0,
)


def _tiny_lm(
    config_name: str = "LlamaConfig", *, attn_implementation: str = "sdpa", **overrides
) -> torch.nn.Module:
    """A seeded random float32 model from a transformers config (2 layers, hidden 64); weights
    large enough (init 0.3) that its distributions are far from uniform."""
    import transformers

    config = getattr(transformers, config_name)(**{**_TINY_CONFIG, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    ).eval()


@pytest.fixture(scope="session")
def make_tiny_lm():
    """Factory ``make_tiny_lm(config_name="LlamaConfig", *, attn_implementation="sdpa",
    **config_overrides)``: a new model per call."""
    return _tiny_lm


def _save_byte_tokenizer(folder) -> None:
    """A byte-level tokenizer (256 ids, no merges) saved in ``folder``: text traces tokenize
    without the embedded model's files (which a GPU machine does not have)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


def _save_random_llama(folder, *, byte_tokenizer: bool = False, **overrides) -> str:
    """``_tiny_lm``'s seeded random Llama with ``overrides`` (bos 1, eos 2, pad 0) saved to
    ``folder`` as an engine loads a model from a path, and with ``byte_tokenizer`` a
    byte-level tokenizer beside it; returns the folder as a str."""
    config = {"bos_token_id": 1, "eos_token_id": 2, **overrides}
    _tiny_lm("LlamaConfig", **config).save_pretrained(folder)
    if byte_tokenizer:
        _save_byte_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def save_random_llama():
    """Factory ``save_random_llama(folder, *, byte_tokenizer=False, **config_overrides)``:
    a random Llama folder for engines that load from a path (vLLM, servers, Ray actors)."""
    return _save_random_llama


@pytest.fixture(scope="session")
def save_byte_tokenizer():
    """Factory ``save_byte_tokenizer(folder)``: a byte-level tokenizer (256 ids) saved there."""
    return _save_byte_tokenizer


@pytest.fixture(scope="session")
def tiny_llama() -> torch.nn.Module:
    """The tiny random Llama, built once per session (no download)."""
    return _tiny_lm()


@pytest.fixture(scope="session")
def tiny_requests():
    """Five requests for ``tiny_llama``: uneven prompt and trace lengths (left padding), a
    one-token trace, a one-token prompt, and a trace that repeats its prompt (n-gram drafts
    find it)."""
    from trace_replay.engines.base import ReplayRequest

    gen = torch.Generator().manual_seed(1)
    requests = []
    for i, (prompt_len, trace_len) in enumerate([(4, 9), (1, 12), (3, 5), (6, 1)]):
        ids = torch.randint(3, 128, (prompt_len + trace_len,), generator=gen).tolist()
        requests.append(ReplayRequest(f"r{i}", tuple(ids[:prompt_len]), tuple(ids[prompt_len:])))
    prompt = (17, 42, 99, 5, 61)
    requests.append(ReplayRequest("repeat", prompt, prompt * 2 + (17, 42)))
    return requests


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama, tiny_requests) -> dict[str, np.ndarray]:
    """Teacher-forced float64 log-softmax of ``tiny_llama`` at every trace token of
    ``tiny_requests``: {trace_id: [T, V]}, each sequence run alone and unpadded."""
    import copy

    lm64 = copy.deepcopy(tiny_llama).double()
    out = {}
    with torch.inference_mode():
        for request in tiny_requests:
            ids = list(request.prompt_token_ids) + list(request.trace_token_ids)
            logits = lm64(input_ids=torch.tensor([ids])).logits[0]
            start = request.prompt_len - 1
            out[request.trace_id] = torch.log_softmax(
                logits[start : start + request.trace_len], dim=-1
            ).numpy()
    return out


@pytest.fixture(scope="session")
def assert_results_match(tiny_reference):
    """``assert_results_match(results, tol=1e-4, tie=1e-5)`` checks TraceResults of
    ``tiny_requests`` against ``tiny_reference``: per token, |Δlogprob| <= tol, rank equal up
    to near-ties (within ``tie``), the top-k logprobs the reference's best ones."""

    def check(results, tol: float = 1e-4, tie: float = 1e-5) -> None:
        for result in results:
            ref = tiny_reference[result.trace_id]
            assert len(result.logprob) == len(ref), result.trace_id
            target = ref[np.arange(len(ref)), result.token_ids]
            np.testing.assert_allclose(result.logprob, target, atol=tol, rtol=0)
            lo = 1 + (ref > target[:, None] + tie).sum(1)
            hi = 1 + (ref > target[:, None] - tie).sum(1)
            assert ((lo <= result.rank) & (result.rank <= hi)).all(), result.trace_id
            k = result.top_logprobs.shape[1]
            best = -np.sort(-ref, axis=1)[:, :k]
            np.testing.assert_allclose(result.top_logprobs, best, atol=tol, rtol=0)

    return check
