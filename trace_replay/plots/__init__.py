"""Matplotlib figures of replay, comparison, attribution and sweep frames.

Every function takes ``ax=None`` (or a figure where it draws several axes) and returns what it
drew on: ``frames`` (comparisons), ``trace`` (one trace), ``layers`` (attribution and sweeps).
"""
