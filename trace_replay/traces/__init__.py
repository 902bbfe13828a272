"""Traces: the token sequences to replay, where they come from and how they are checked.

``trace`` (one record and its error), ``sources`` (files, frames, iterables), ``sets`` (load,
validate, tokenize, shard, save), ``chat`` (chat templates and turns), ``openai_logs`` (server
logs), ``tokenization`` (text to tokens); new traces are recorded by :mod:`trace_replay.runs.recording`. The bundled
traces are a package of their own, :mod:`trace_replay.datasets`.
"""
