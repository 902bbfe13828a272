"""Analysis of replay frames: pandas in, pandas out.

``metrics`` (compare, summaries), ``mismatch`` (rollout-vs-trainer metrics), ``ranks`` (GLTR
buckets), ``sweep`` (grids of settings), ``attribution`` with ``capture``, ``capture_rows`` and
``pairing`` (where two runs part ways inside the model), ``distributions`` with
``distribution_bounds`` (full-distribution divergence: exact from a paired replay, bounded from
result files), ``routing`` (MoE routing flips).
"""
