"""Which of the package's files a warm ``tr.replay`` runs (issue 56 item 9: at most ~15): a
cProfile of a first call (engine started, modules imported) and of a second, identical call
(the steady state), counting the package files whose functions ran.

By default the call is made as a user makes it: ``tr.replay(traces, engine="torch")``, the
engine by name (started by the first call, kept for the second), text traces tokenized by the
engine's tokenizer, the engine's default backend on ``--device``. The model is a folder
holding a random 2-layer Llama and the embedded model's tokenizer, so nothing large loads;
``--model embedded`` replays the embedded SmolLM2-135M itself (the README's call exactly: the
same files run). ``--engine-object`` instead passes an engine built with ``make_engine`` and
token-id traces (``--backend`` then picks its forward pass).

    python benchmarks/files_touched.py --device cuda
    python benchmarks/files_touched.py --device cpu --functions
    python benchmarks/files_touched.py --device cpu --engine-object --backend static
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile

import pandas as pd
import torch
import transformers

import trace_replay as tr
from trace_replay.models.load import load_tokenizer

TEXT_TRACES = [
    {"id": "a", "prompt": "The capital of France is", "completion": " Paris."},
    {"id": "b", "prompt": "def f(x):\n", "completion": "   return x"},
]
TOKEN_TRACES = pd.DataFrame(
    {
        "id": ["a", "b"],
        "prompt_token_ids": [[1, 2, 3], [4, 5]],
        "trace_token_ids": [[7, 8, 9, 10], [11, 12]],
    }
)


class IdTokenizer:
    """Token ids as text ("<7>"): what the replay frame's token column needs, nothing loaded."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids, **_) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def functions_run(fn) -> dict[str, list[str]]:
    """Package files (relative to trace_replay/) with the functions of each that ran during
    ``fn()``."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    files: dict[str, list[str]] = {}
    for path, _, name in pstats.Stats(profile).stats:
        if "/trace_replay/" in path and "/site-packages/" not in path:
            files.setdefault(path.split("/trace_replay/", 1)[1], []).append(name)
    return {path: sorted(set(names)) for path, names in sorted(files.items())}


def tiny_llama(vocab_size: int) -> transformers.PreTrainedModel:
    """A random 2-layer Llama (seeded): the shapes of a real one, nothing to load."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def by_name(device: str, model: str, folder: str) -> tuple[dict, dict, str]:
    """A first and a second ``replay(text traces, engine="torch")``: the files each ran."""
    if model == "tiny":  # the embedded tokenizer beside a random model of its vocabulary
        tokenizer = load_tokenizer()
        tiny_llama(len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    source = None if model == "embedded" else folder

    def call() -> pd.DataFrame:
        return tr.replay(TEXT_TRACES, source, engine="torch", device=device, progress=False)

    first = functions_run(call)
    frames = []
    steady = functions_run(lambda: frames.append(call()))
    return first, steady, frames[0].attrs["engine_path"]


def engine_object(device: str, backend: str | None) -> tuple[dict, dict, str]:
    """A first and a second ``replay(token-id traces, engine=<an engine object>)``."""
    lm = tiny_llama(1024).to(device)
    engine = None

    def first() -> None:
        nonlocal engine
        engine = tr.make_engine("torch", lm, device=device, backend=backend)
        engine.tokenizer = IdTokenizer(1024)
        tr.replay(TOKEN_TRACES, engine=engine, progress=False)

    first_call = functions_run(first)
    steady = functions_run(lambda: tr.replay(TOKEN_TRACES, engine=engine, progress=False))
    return first_call, steady, engine.settings()["engine_path"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model", choices=("tiny", "embedded"), default="tiny", help="the model replayed by name"
    )
    parser.add_argument(
        "--engine-object",
        action="store_true",
        help="pass an engine object and token-id traces instead of the engine's name and text",
    )
    parser.add_argument("--backend", default=None, help="with --engine-object: hf or static")
    parser.add_argument(
        "--functions", action="store_true", help="also list the functions each steady file ran"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    if args.backend is not None and not args.engine_object:
        parser.error("--backend needs --engine-object (replay by name runs the default backend)")
    with tempfile.TemporaryDirectory() as folder:
        if args.engine_object:
            first, steady, path = engine_object(args.device, args.backend)
        else:
            first, steady, path = by_name(args.device, args.model, folder)
        tr.close_engines()
    call = "engine object, token ids" if args.engine_object else "by name, text traces"
    print(
        f"{args.device}, {path} ({call}): first call {len(first)} files (module bodies "
        f"included), steady state {len(steady)}"
    )
    print("steady state:", " ".join(steady))
    print("first call only:", " ".join(sorted(set(first) - set(steady))))
    if args.functions:
        for file, names in steady.items():
            print(f"  {file}: {' '.join(names)}")
    if args.json:
        print(json.dumps({"engine_path": path, "steady": sorted(steady)}))


if __name__ == "__main__":
    main()
