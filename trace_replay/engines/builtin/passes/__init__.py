"""Compiler passes over the static backend's model: ``compiling`` (what every compile needs),
``graph_nodes`` (shared helpers), ``linear_groups``; ``batch1_fusions`` (the batch-1 fusions'
modules) with their passes ``norm_folds`` and ``residual_adds``.
"""
