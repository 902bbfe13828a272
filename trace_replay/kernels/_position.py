"""The opening the trace kernels share: which request a batch row holds and its replay step.

:func:`trace_position` is the kernels' (one batch row per program); :func:`active_rows` is
the same rule over the whole batch for their pure-torch references.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import torch

from trace_replay.kernels._triton import tl, triton

__all__ = ["active_rows", "position_args", "trace_position"]


@triton.jit
def trace_position(
    batch_idx,
    idx_mapping_ptr,  # [num_reqs], int32 or int64; < 0 marks a row without a request
    trace_row_stride,
    trace_offsets_ptr,  # [max_num_reqs], int64; read only if RAGGED
    trace_len_ptr,  # [max_num_reqs], int32
    total_len_ptr,  # [max_num_reqs], int32
    prompt_len_ptr,  # [max_num_reqs], int32
    RAGGED: tl.constexpr,
):
    """Return ``(active, step, trace_len, start)`` for batch row ``batch_idx``.

    ``active`` is false for a row without a request and for a step outside ``[0, trace_len)``
    (which includes requests without a trace, ``trace_len <= 0``); the caller returns early
    on it. ``start`` is the offset of the request's trace in the trace buffer. Nothing is
    read for a row without a request: its loads are masked.
    """
    req_idx = tl.load(idx_mapping_ptr + batch_idx)
    has_request = req_idx >= 0
    trace_len = tl.load(trace_len_ptr + req_idx, mask=has_request, other=0)
    total_len = tl.load(total_len_ptr + req_idx, mask=has_request, other=0)
    step = total_len - tl.load(prompt_len_ptr + req_idx, mask=has_request, other=0)
    # trace_len is 0 for a row without a request, so step >= trace_len covers it too
    active = (step >= 0) & (step < trace_len)
    if RAGGED:
        start = tl.load(trace_offsets_ptr + req_idx, mask=active, other=0)
    else:
        start = req_idx.to(tl.int64) * trace_row_stride
    return active, step, trace_len, start


def position_args(
    trace_token_ids: torch.Tensor,
    trace_offsets: torch.Tensor | None,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
) -> tuple:
    """A launcher's arguments for :func:`trace_position`'s parameters, in kernel order:
    tokens, row stride (0 when ragged), offsets (``trace_len`` as an unread placeholder
    pointer when 2-D), trace, total and prompt lengths. ``RAGGED`` is ``trace_offsets is not
    None``."""
    if trace_offsets is not None:
        return trace_token_ids, 0, trace_offsets, trace_len, total_len, prompt_len
    return trace_token_ids, trace_token_ids.stride(0), trace_len, trace_len, total_len, prompt_len


def active_rows(
    idx_mapping: torch.Tensor,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`trace_position` over the batch: ``(rows, req_idx, step, trace_len)`` (int64) of
    the rows whose request is inside its trace. Synchronizes on CUDA (``nonzero``)."""
    req_idx = idx_mapping.long()
    rows = torch.nonzero(req_idx >= 0).squeeze(1)
    req_idx = req_idx[rows]
    length = trace_len[req_idx].long()
    step = (total_len[req_idx] - prompt_len[req_idx]).long()
    keep = (step >= 0) & (step < length)
    return rows[keep], req_idx[keep], step[keep], length[keep]
