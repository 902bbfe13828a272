"""Force speculative-decoding verification to follow the trace.

Each request's verified tokens become its trace tokens; a draft is accepted only when it
equals the trace token at its position, so the accepted prefix is exactly the part of the
draft that agrees with the trace.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import torch

from trace_replay.kernels._triton import tl, triton, use_triton
from trace_replay.kernels.trace_tokens import active_rows, position_args, trace_position

__all__ = ["apply_trace_tokens_to_verified", "apply_trace_tokens_to_verified_reference"]


@triton.jit
def _verified_kernel(
    sampled_ptr,  # [num_reqs, num_cols], int64, mutated in place
    sampled_row_stride,
    sampled_col_stride,
    num_sampled_ptr,  # [num_reqs], int32, mutated in place
    draft_sampled_ptr,  # [num_logits], int32 or int64; logits row j verifies draft_sampled[j + 1]
    cu_num_logits_ptr,  # [num_reqs + 1], int32
    idx_mapping_ptr,  # [num_reqs], int32 or int64; < 0 marks a row without a request
    trace_token_ids_ptr,  # [max_num_reqs, max_trace_len] or flat [num_tokens] if RAGGED, int32/64
    trace_row_stride,
    trace_offsets_ptr,  # [max_num_reqs], int64; read only if RAGGED
    trace_len_ptr,  # [max_num_reqs], int32
    total_len_ptr,  # [max_num_reqs], int32
    prompt_len_ptr,  # [max_num_reqs], int32
    num_cols,
    RAGGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # next power of 2 >= num_cols
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
    first_logit = tl.load(cu_num_logits_ptr + batch_idx)
    num_logits = tl.load(cu_num_logits_ptr + batch_idx + 1) - first_logit

    i = tl.arange(0, BLOCK_SIZE)
    in_trace = step + i < trace_len
    tokens = tl.load(trace_token_ids_ptr + start + step + i, mask=in_trace, other=0).to(tl.int64)
    # the last logits row of a request (and the last column) verifies no draft
    checked = in_trace & (i < num_logits - 1) & (i < num_cols - 1)
    drafts = tl.load(draft_sampled_ptr + first_logit + i + 1, mask=checked, other=0).to(tl.int64)
    accepted = checked & (drafts == tokens)
    # the row ends before the first position past the trace, or after the first rejection
    stop = tl.where(in_trace, tl.where(accepted, BLOCK_SIZE, i + 1), i)
    num_sampled = tl.min(stop, axis=0)

    out_ptr = sampled_ptr + batch_idx * sampled_row_stride + i * sampled_col_stride
    tl.store(out_ptr, tokens.to(sampled_ptr.dtype.element_ty), mask=i < num_sampled)
    tl.store(num_sampled_ptr + batch_idx, num_sampled.to(num_sampled_ptr.dtype.element_ty))


def apply_trace_tokens_to_verified(
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    trace_token_ids: torch.Tensor,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    *,
    trace_offsets: torch.Tensor | None = None,
) -> None:
    """Replace verified tokens with the trace, accepting a draft only if it matches.

    For batch row ``b`` with request ``r = idx_mapping[b]``, ``step = total_len[r] -
    prompt_len[r]`` and ``n`` logits rows starting at ``cu_num_logits[b]``: rows with
    ``r < 0`` or ``step`` outside ``[0, trace_len[r])`` are left alone. Otherwise, for
    ``i = 0, 1, ...``: past the trace's end the row stops with ``num_sampled[b] = i``;
    else ``sampled[b, i] = trace[r][step + i]``, and the row goes on only if ``i < n - 1``
    and the draft verified by logits row ``cu_num_logits[b] + i`` equals that token, else
    it stops with ``num_sampled[b] = i + 1``. Entries past ``num_sampled[b]`` are
    unspecified.

    Runs the Triton kernel when :func:`~trace_replay.kernels._triton.use_triton` allows it (CUDA
    tensors, or ``TRITON_INTERPRET=1``); otherwise runs
    :func:`apply_trace_tokens_to_verified_reference`, which is the CPU production path.

    Parameters
    ----------
    sampled : torch.Tensor
        ``[num_reqs, num_spec + 1]`` int64 verified tokens, mutated in place. Any strides.
    num_sampled : torch.Tensor
        ``[num_reqs]`` int32 count of valid tokens per row, mutated in place.
    draft_sampled : torch.Tensor
        ``[num_logits]`` int32 or int64; logits row ``j`` verifies ``draft_sampled[j + 1]``.
    cu_num_logits : torch.Tensor
        ``[num_reqs + 1]`` int32 first logits row of each request; ``n <= num_spec + 1``.
    idx_mapping, trace_token_ids, trace_len, total_len, prompt_len, trace_offsets
        As in :func:`~trace_replay.kernels.apply_trace_tokens`.
    """
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    if trace_token_ids.stride(-1) != 1:
        raise ValueError("trace_token_ids must have unit stride along its last dimension")
    tensors = (
        sampled,
        num_sampled,
        draft_sampled,
        cu_num_logits,
        idx_mapping,
        trace_token_ids,
        trace_len,
        total_len,
        prompt_len,
        trace_offsets,
    )
    if not use_triton(*tensors):
        apply_trace_tokens_to_verified_reference(*tensors[:-1], trace_offsets=trace_offsets)
        return
    num_cols = sampled.shape[1]
    _verified_kernel[(num_reqs,)](
        sampled,
        sampled.stride(0),
        sampled.stride(1),
        num_sampled,
        draft_sampled,
        cu_num_logits,
        idx_mapping,
        *position_args(trace_token_ids, trace_offsets, trace_len, total_len, prompt_len),
        num_cols,
        RAGGED=trace_offsets is not None,
        BLOCK_SIZE=triton.next_power_of_2(num_cols),
        num_warps=1,
    )


def apply_trace_tokens_to_verified_reference(
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    trace_token_ids: torch.Tensor,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    *,
    trace_offsets: torch.Tensor | None = None,
) -> None:
    """Pure-torch :func:`apply_trace_tokens_to_verified`: same signature, same result.

    The CPU production path and the kernel's test oracle. Vectorized over the batch and
    the ``num_spec + 1`` positions; on CUDA it synchronizes (``nonzero``).
    """
    num_cols = sampled.shape[1]
    rows, req_idx, step, length = active_rows(idx_mapping, trace_len, total_len, prompt_len)

    i = torch.arange(num_cols, device=sampled.device)
    pos = step[:, None] + i
    in_trace = pos < length[:, None]
    pos = torch.minimum(pos, length[:, None] - 1)  # clamped lanes are masked out below
    if trace_offsets is None:
        tokens = trace_token_ids[req_idx[:, None], pos]
    else:
        tokens = trace_token_ids[trace_offsets[req_idx][:, None] + pos]
    tokens = tokens.long()

    first_logit = cu_num_logits[rows].long()
    num_logits = cu_num_logits[rows + 1].long() - first_logit
    # the last logits row of a request (and the last column) verifies no draft
    checked = in_trace & (i < num_logits[:, None] - 1) & (i < num_cols - 1)
    draft_idx = torch.where(checked, first_logit[:, None] + i + 1, 0)
    drafts = draft_sampled[draft_idx].long() if draft_sampled.numel() else torch.zeros_like(tokens)
    accepted = checked & (drafts == tokens)
    # the row ends before the first position past the trace, or after the first rejection
    stop = torch.where(in_trace, torch.where(accepted, num_cols, i + 1), i)
    count = stop.min(dim=1).values

    sampled[rows] = torch.where(i < count[:, None], tokens.to(sampled.dtype), sampled[rows])
    num_sampled[rows] = count.to(num_sampled.dtype)
