"""Force each request's next sampled token to the token its trace holds at this step."""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import torch

from trace_replay.kernels._triton import tl, triton, use_triton
from trace_replay.kernels._position import active_rows, position_args, trace_position

__all__ = ["apply_trace_tokens", "apply_trace_tokens_reference"]


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
        batch_idx, idx_mapping_ptr, trace_row_stride, trace_offsets_ptr, trace_len_ptr,
        total_len_ptr, prompt_len_ptr, RAGGED,
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
        sampled, idx_mapping, trace_token_ids, trace_len, total_len, prompt_len, trace_offsets
    )  # fmt: skip
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
