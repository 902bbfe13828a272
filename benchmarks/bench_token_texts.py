"""The token column's texts (``TokenDecoder.completed``, issue 52 item 9) against each id
decoded alone (``TokenDecoder.many``), in one process, on 64 traces x 256 tokens of random
ids, of text whose characters span tokens (Chinese, Hebrew, emoji) and of English; median
of 15 runs each, alternating, with the embedded model's tokenizer.

Usage::

    python benchmarks/bench_token_texts.py
"""

import time

import numpy as np

from trace_replay.models.load import load_tokenizer
from trace_replay.runs.frame import TokenDecoder

tok = load_tokenizer()
rng = np.random.default_rng(0)
rand = rng.integers(0, 49152, 64 * 256)
text = " ".join(["The quick brown fox 你好 שלום 🙂 jumps over the lazy dog."] * 40)
real = np.concatenate([tok.encode(text, add_special_tokens=False)[:256] for _ in range(64)])
eng = " ".join(["The quick brown fox jumps over the lazy dog, said the model."] * 40)
english = np.concatenate([tok.encode(eng, add_special_tokens=False)[:256] for _ in range(64)])
steps = np.full(64, 256)
d = TokenDecoder(tok)
for name, ids in (("random ids", rand), ("multilingual", real), ("english", english)):
    d.many(ids)
    d.completed(ids, steps)
    a, b = [], []
    for _ in range(15):
        s = time.perf_counter()
        d.many(ids)
        a.append(time.perf_counter() - s)
        s = time.perf_counter()
        d.completed(ids, steps)
        b.append(time.perf_counter() - s)
    split = sum("\ufffd" in d(i) for i in ids.tolist())
    print(
        f"{name}: many {np.median(a) / 64 * 1e3:.3f} ms/trace, completed {np.median(b) / 64 * 1e3:.3f} ms/trace, ratio {np.median(b) / np.median(a):.2f}, split tokens {split / len(ids):.1%}"
    )
