"""Forward passes of the built-in engine: ``hf`` (eager transformers), ``static`` (compiled,
graph-captured), ``invariant`` with ``invariant_model`` and ``invariant_ops`` (batch-invariant),
``static_cache`` (the KV cache), ``captured_step`` (CUDA-graph capture shared by two backends).
"""
