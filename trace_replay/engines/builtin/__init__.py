"""The built-in engine (``engine="torch"``) and the prefill scorer on a transformers model.

``engine`` (the batched decode engine), ``prefill`` (teacher-forced scoring), ``decode`` (the
one replay loop; its forced steps run eagerly or as one CUDA graph), ``verify`` (its verify
steps), ``drafts``, ``slots`` (admission), ``threads`` (CPU threads); ``backends/`` (forward
passes) and ``passes/`` (compiler passes over one model).
"""
