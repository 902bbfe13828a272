"""Build the GSM8K chain-of-thought traces: exemplar answers (human) and greedy answers (model).

Source: the 8 few-shot exemplars (question + chain-of-thought ``target``) under
``fewshot_config.samples`` in ``lm_eval/tasks/gsm8k/gsm8k-cot.yaml``, shipped by the PyPI
package ``lm-eval`` (EleutherAI, MIT licence; the exemplars come from Wei et al. 2022,
"Chain-of-Thought Prompting"). Only the YAML file is read; ``lm_eval`` is not imported.

Writes, under ``--out-dir``:

* ``gsm8k_cot_human.jsonl``: ids ``gsm8k-human/I``; prompt ``"Q: {question}\\nA:"`` (the task's
  ``doc_to_text``), completion ``" " + target``; text only.
* ``gsm8k_cot_model.jsonl``: ids ``gsm8k-model/I``; chat traces: the question alone as the user
  turn (zero-shot, rendered by the model's chat template), answered greedily by the embedded
  model (SmolLM2-135M-Instruct, torch engine, float32, deterministic mode; see
  ``chat_traces.py``), stopping at its end-of-turn token or ``--max-tokens``, with the token ids
  and the logprobs the model reported.

``meta.answer`` holds the exemplar's final answer (``The answer is N.``) for both files.

Usage::

    pip install --no-deps lm-eval==0.4.13
    python data/build_gsm8k.py --limit 8 --out-dir trace_replay/datasets
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import time
from pathlib import Path

import yaml
from chat_traces import record_chat

import trace_replay

YAML_PATH = ("tasks", "gsm8k", "gsm8k-cot.yaml")
ANSWER = re.compile(r"The answer is (-?[0-9.,]+)\.")


def read_exemplars() -> list[dict]:
    """The ``{"question", "target"}`` exemplars of lm-eval's ``gsm8k_cot`` task, in order."""
    # find_spec locates the package without running its heavy __init__
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the PyPI package 'lm-eval': pip install --no-deps lm-eval")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*YAML_PATH)
    with open(path, encoding="utf-8") as file:
        return yaml.safe_load(file)["fewshot_config"]["samples"]


def _meta(i: int, exemplar: dict, source: str) -> dict:
    return {
        "dataset": "gsm8k-cot",
        "exemplar": i,
        "answer": ANSWER.search(exemplar["target"]).group(1),
        "source": source,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=8, help="number of exemplars")
    parser.add_argument("--out-dir", type=Path, default=Path("trace_replay/datasets"))
    parser.add_argument("--max-tokens", type=int, default=256, help="model answer cap")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    exemplars = read_exemplars()[: args.limit]
    human = trace_replay.load_traces(
        [
            {
                "id": f"gsm8k-human/{i}",
                "prompt": f"Q: {e['question']}\nA:",
                "completion": " " + e["target"],
                "meta": _meta(i, e, "human"),
            }
            for i, e in enumerate(exemplars)
        ]
    )
    human.to_jsonl(args.out_dir / "gsm8k_cot_human.jsonl")

    model = record_chat(
        [
            {"id": f"gsm8k-model/{i}", "user": e["question"], "meta": _meta(i, e, "model")}
            for i, e in enumerate(exemplars)
        ],
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
    )
    model.to_jsonl(args.out_dir / "gsm8k_cot_model.jsonl")

    print(f"{len(human)} human + {len(model)} model traces in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
