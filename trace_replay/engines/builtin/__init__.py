"""The built-in engine (``engine="torch"``) and the prefill scorer on a transformers model.

``engine`` (the batched decode engine), ``prefill`` (teacher-forced scoring), ``decode`` and
``verify`` (the step loops), ``forced_graph`` (a step captured as one CUDA graph), ``drafts``,
``slots`` (admission), ``threads`` (CPU threads); ``backends/`` (forward passes) and ``passes/``
(compiler passes over one model).
"""
