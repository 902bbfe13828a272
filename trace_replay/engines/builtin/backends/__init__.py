"""Forward passes of the built-in engine: ``base`` (the ``Backend`` protocol, its check and
``make_backend``), ``hf`` (eager transformers), ``static`` with ``static_view`` and
``static_cache`` (compiled, graph-captured), ``invariant`` with ``invariant_model`` and
``invariant_ops`` (batch-invariant), ``captured_step`` (CUDA-graph capture shared by two
backends).
"""
