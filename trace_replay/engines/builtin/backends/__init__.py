"""Forward passes of the built-in engine: ``base`` (the ``Backend`` protocol, its check and
``make_backend``), ``hf`` (eager transformers), ``static`` with ``static_view`` and
``static_cache`` (compiled, graph-captured), ``invariant`` with ``deterministic_model`` and
``deterministic_ops`` (batch-invariant), ``captured_step`` (CUDA-graph capture shared by two
backends).
"""
