"""Force each request's next sampled token to the token its trace holds at this step.

Also the opening every trace kernel shares (this one,
:mod:`~trace_replay.kernels.trace_tokens_verified`, :mod:`~trace_replay.kernels.force_logits`):
:func:`trace_position`, which request a batch row holds and its replay step (one batch row per
program), :func:`position_args`, a launcher's arguments for it, and :func:`active_rows`, the
same rule over the whole batch for the pure-torch references.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import torch

from trace_replay.kernels._triton import tl, triton, use_triton

__all__ = [
    "active_rows",
    "apply_trace_tokens",
    "apply_trace_tokens_reference",
    "position_args",
    "trace_position",
]


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


@triton.jit
def _trace_tokens_kernel(
    sampled_ptr,  # [num_reqs], int64, mutated in place
    sampled_stride,
    idx_mapping_ptr,  # [num_reqs], int32 or int64; < 0 marks a row without a request
    trace_token_ids_ptr,  # [max_num_reqs, max_trace_len] or flat [num_tokens] if RAGGED, int32/64
    trace_row_stride,
    trace_offsets_ptr,  # [max_num_reqs], int64; read only if RAGGED
    trace_len_ptr,  # [max_num_reqs], int32
    total_len_ptr,  # [max_num_reqs], int32
    prompt_len_ptr,  # [max_num_reqs], int32
    RAGGED: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    active, step, trace_len, start = trace_position(
        batch_idx,
        idx_mapping_ptr,
        trace_row_stride,
        trace_offsets_ptr,
        trace_len_ptr,
        total_len_ptr,
        prompt_len_ptr,
        RAGGED,
    )
    if not active:
        return
    token = tl.load(trace_token_ids_ptr + start + step)
    tl.store(sampled_ptr + batch_idx * sampled_stride, token.to(sampled_ptr.dtype.element_ty))


def apply_trace_tokens(
    sampled: torch.Tensor,
    idx_mapping: torch.Tensor,
    trace_token_ids: torch.Tensor,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    *,
    trace_offsets: torch.Tensor | None = None,
) -> None:
    """Overwrite each row's sampled token with its trace token at the current step.

    For batch row ``b`` with request ``r = idx_mapping[b]`` and replay step
    ``step = total_len[r] - prompt_len[r]``, sets ``sampled[b] = trace[r][step]`` when
    ``r >= 0`` and ``0 <= step < trace_len[r]``; every other row is left alone. The step
    is read on the device, so no host synchronization is needed.

    Runs the Triton kernel when :func:`~trace_replay.kernels._triton.use_triton` allows it (CUDA
    tensors, or ``TRITON_INTERPRET=1``); otherwise runs
    :func:`apply_trace_tokens_reference`, which is the CPU production path.

    Parameters
    ----------
    sampled : torch.Tensor
        ``[num_reqs]`` sampled token ids (int64), mutated in place. Any stride.
    idx_mapping : torch.Tensor
        ``[num_reqs]`` request slot of each batch row; negative means no request.
    trace_token_ids : torch.Tensor
        ``[max_num_reqs, max_trace_len]`` int32 or int64 traces (any row stride, unit
        column stride), or, with ``trace_offsets``, a flat ``[num_tokens]`` ragged buffer.
    trace_len : torch.Tensor
        ``[max_num_reqs]`` int32 trace lengths; ``<= 0`` means no trace.
    total_len : torch.Tensor
        ``[max_num_reqs]`` int32 tokens committed so far (prompt plus emitted).
    prompt_len : torch.Tensor
        ``[max_num_reqs]`` int32 prompt lengths.
    trace_offsets : torch.Tensor, optional
        ``[max_num_reqs]`` int64 start of each request's trace in the flat buffer.

    Examples
    --------
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> sampled = torch.tensor([7, 7])
    >>> trace = i32(5, 6, 8).view(1, 3)
    >>> apply_trace_tokens(sampled, i32(0, -1), trace, i32(3), total_len=i32(4), prompt_len=i32(3))
    >>> sampled.tolist()
    [6, 7]
    """
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    if trace_token_ids.stride(-1) != 1:
        raise ValueError("trace_token_ids must have unit stride along its last dimension")
    tensors = (
        sampled,
        idx_mapping,
        trace_token_ids,
        trace_len,
        total_len,
        prompt_len,
        trace_offsets,
    )
    if not use_triton(*tensors):
        apply_trace_tokens_reference(*tensors[:-1], trace_offsets=trace_offsets)
        return
    _trace_tokens_kernel[(num_reqs,)](
        sampled,
        sampled.stride(0),
        idx_mapping,
        *position_args(trace_token_ids, trace_offsets, trace_len, total_len, prompt_len),
        RAGGED=trace_offsets is not None,
        num_warps=1,
    )


def apply_trace_tokens_reference(
    sampled: torch.Tensor,
    idx_mapping: torch.Tensor,
    trace_token_ids: torch.Tensor,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    *,
    trace_offsets: torch.Tensor | None = None,
) -> None:
    """Pure-torch :func:`apply_trace_tokens`: same signature, same result.

    The CPU production path and the kernel's test oracle. Vectorized over the batch;
    on CUDA it synchronizes (``nonzero``), which is why the kernel exists.
    """
    rows, req_idx, step, _ = active_rows(idx_mapping, trace_len, total_len, prompt_len)
    if trace_offsets is None:
        tokens = trace_token_ids[req_idx, step]
    else:
        tokens = trace_token_ids[trace_offsets[req_idx] + step]
    sampled[rows] = tokens.to(sampled.dtype)
