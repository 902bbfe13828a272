"""The opening both trace kernels share: which request a batch row holds and its replay step."""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

from trace_replay._triton import tl, triton

__all__ = ["trace_position"]


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
