"""Forward passes of the built-in engine: ``base`` (the ``Backend`` protocol and its check),
``factory`` (``make_backend``), ``hf`` (eager transformers), ``static`` with ``static_view``
and ``static_cache`` (compiled, graph-captured), ``deterministic`` with
``deterministic_model`` and ``deterministic_ops`` (batch-invariant), ``captured_step``
(CUDA-graph capture shared by two backends).
"""
