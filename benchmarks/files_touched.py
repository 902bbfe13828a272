"""Which of the package's files run during ``tr.replay(df, engine=<torch engine>)`` (issue 31's
"touches at most ~15 files"): a cProfile of the first call (engine built, module bodies run on
import) and of a second call with the same engine (steady state), counting the package files
whose functions ran. A random 2-layer Llama and a stand-in tokenizer, so nothing is loaded.

    python benchmarks/files_touched.py --device cuda           # the default backend there
    python benchmarks/files_touched.py --device cpu --backend static --functions
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import pandas as pd
import torch
import transformers

import trace_replay as tr


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default=None, help="hf or static (default: the engine's)")
    parser.add_argument(
        "--functions",
        action="store_true",
        help="also list the functions each steady-state file ran",
    )
    args = parser.parse_args()
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config).eval().to(args.device)
    df = pd.DataFrame(
        {
            "id": ["a", "b"],
            "prompt_token_ids": [[1, 2, 3], [4, 5]],
            "trace_token_ids": [[7, 8, 9, 10], [11, 12]],
        }
    )
    engine = None

    def first() -> None:
        nonlocal engine
        engine = tr.make_engine("torch", lm, device=args.device, backend=args.backend)
        engine.tokenizer = IdTokenizer(config.vocab_size)
        tr.replay(df, engine=engine, progress=False)

    first_call = functions_run(first)
    steady = functions_run(lambda: tr.replay(df, engine=engine, progress=False))
    print(
        f"{args.device}, {engine.settings()['engine_path']}: first call {len(first_call)} "
        f"files (module bodies included), steady state {len(steady)}"
    )
    print("steady state:", " ".join(steady))
    print("first call only:", " ".join(sorted(set(first_call) - set(steady))))
    if args.functions:
        for path, names in steady.items():
            print(f"  {path}: {' '.join(names)}")


if __name__ == "__main__":
    main()
