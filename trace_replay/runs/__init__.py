"""Runs: a trace set through an engine into one tidy frame, resumable and shardable.

``replay`` (the loop over batches), ``frame`` (the result rows), ``checkpoint`` and ``parts``
(finished traces on disk), ``claims`` (which live run computes what), ``merge`` (shards into one), ``recording`` (new traces from an engine).
"""
