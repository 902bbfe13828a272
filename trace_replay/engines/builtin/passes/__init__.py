"""Compiler passes over the static backend's model: ``compiling`` (what every compile needs),
``graph_nodes`` (shared helpers), ``linear_groups``, ``norm_folds``, ``residual_adds`` (batch-1
fusions), ``kernel_view`` (modules that run the package's kernels).
"""
