"""Force each request's trace token at the logits: one write per row, in one launch.

A logits processor that forces a trace (vLLM's V1 sampler path) needs, per step: each row's
trace token at its replay step, that token's logit raised above every other, and the step
advanced for the next call. Done with torch ops that is eight small launches and their
host dispatch, per step, on the critical path of a host-bound decode loop; this kernel does
it in one.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import functools

import torch

from trace_replay.kernels._triton import tl, triton, use_triton
from trace_replay.kernels.trace_tokens import active_rows, position_args, trace_position

__all__ = ["force_trace_logits", "force_trace_logits_reference"]


@triton.jit
def _force_logits_kernel(
    logits_ptr,  # [num_reqs, vocab], float, one entry per active row written
    logits_stride,
    vocab,
    value,
    idx_mapping_ptr,  # [num_reqs], int32 or int64; < 0 marks a row without a request
    trace_token_ids_ptr,  # [max_num_reqs, max_trace_len] or flat [num_tokens] if RAGGED
    trace_row_stride,
    trace_offsets_ptr,  # [max_num_reqs], int64; read only if RAGGED
    trace_len_ptr,  # [max_num_reqs], int32
    total_len_ptr,  # [max_num_reqs], int32; += 1 per request if ADVANCE
    prompt_len_ptr,  # [max_num_reqs], int32
    RAGGED: tl.constexpr,
    ADVANCE: tl.constexpr,
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
    token = tl.load(trace_token_ids_ptr + start + step, mask=active, other=-1).to(tl.int64)
    in_vocab = active & (token >= 0) & (token < vocab)
    row = logits_ptr + batch_idx.to(tl.int64) * logits_stride
    tl.store(row + token, value, mask=in_vocab)  # cast to the logits dtype by the store
    if ADVANCE:
        # the step was read above, in this program: the increment is for the next call
        req_idx = tl.load(idx_mapping_ptr + batch_idx)
        total_len = tl.load(total_len_ptr + req_idx, mask=req_idx >= 0, other=0)
        tl.store(total_len_ptr + req_idx, total_len + 1, mask=req_idx >= 0)


def force_trace_logits(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    trace_token_ids: torch.Tensor,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    *,
    trace_offsets: torch.Tensor | None = None,
    value: float = 1e30,
    advance: bool = False,
) -> None:
    """Set each row's trace-token logit to ``value``; optionally advance every request a step.

    For batch row ``b`` with request ``r = idx_mapping[b] >= 0`` and replay step
    ``step = total_len[r] - prompt_len[r]`` with ``0 <= step < trace_len[r]``, sets
    ``logits[b, trace[r][step]] = value`` (a token outside ``[0, vocab)`` is skipped: the row
    is left as it is, and the caller's check of emitted tokens names it). Nothing else in
    ``logits`` is touched. With ``advance``, ``total_len[r] += 1`` for every request row,
    traced or not, after its step is read (``idx_mapping`` must not repeat a request). The
    step is read on the device: no host synchronization.

    Runs the Triton kernel when :func:`~trace_replay.kernels._triton.use_triton` allows it (CUDA
    tensors, or ``TRITON_INTERPRET=1``); otherwise :func:`force_trace_logits_reference`.

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_reqs, vocab]`` floating logits, unit stride along the vocabulary; mutated.
    idx_mapping, trace_token_ids, trace_len, total_len, prompt_len, trace_offsets
        As in :func:`~trace_replay.kernels.trace_tokens.apply_trace_tokens`.
    value : float
        The forced logit, cast to ``logits.dtype`` (1e30 is ``inf`` in float16).
    advance : bool
        Also move every request row to its next step.

    Examples
    --------
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> logits, total_len = torch.zeros(2, 4), i32(4, 3)
    >>> trace = i32(1, 2, 3, 0, 0, 0).view(2, 3)
    >>> force_trace_logits(logits, i32(0, 1), trace, i32(3, 0), total_len, i32(3, 3),
    ...                    value=9.0, advance=True)
    >>> logits.tolist(), total_len.tolist()
    ([[0.0, 0.0, 9.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [5, 4])
    """
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    if trace_token_ids.stride(-1) != 1 or logits.stride(-1) != 1:
        raise ValueError(
            "trace_token_ids and logits must have unit stride along their last dimension"
        )
    tensors = (
        logits,
        idx_mapping,
        trace_token_ids,
        trace_len,
        total_len,
        prompt_len,
        trace_offsets,
    )
    if not use_triton(*tensors):
        force_trace_logits_reference(
            *tensors[:-1], trace_offsets=trace_offsets, value=value, advance=advance
        )
        return
    _force_logits_kernel[(num_reqs,)](
        logits,
        logits.stride(0),
        logits.shape[-1],
        _rounded(value, logits.dtype),
        idx_mapping,
        *position_args(trace_token_ids, trace_offsets, trace_len, total_len, prompt_len),
        RAGGED=trace_offsets is not None,
        ADVANCE=advance,
        num_warps=1,
    )


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as ``dtype`` holds it, rounded as torch rounds (the kernel's store would
    convert it its own way); cached: the launcher runs every decode step."""
    return torch.tensor(value, dtype=dtype).item()


def force_trace_logits_reference(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    trace_token_ids: torch.Tensor,
    trace_len: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    *,
    trace_offsets: torch.Tensor | None = None,
    value: float = 1e30,
    advance: bool = False,
) -> None:
    """Pure-torch :func:`force_trace_logits`: same signature, same result.

    The CPU production path and the kernel's test oracle. Vectorized over the batch; on
    CUDA it synchronizes (``nonzero``), which is why the kernel exists.
    """
    rows, req_idx, step, _ = active_rows(idx_mapping, trace_len, total_len, prompt_len)
    if trace_offsets is None:
        tokens = trace_token_ids[req_idx, step].long()
    else:
        tokens = trace_token_ids[trace_offsets[req_idx] + step].long()
    in_vocab = (tokens >= 0) & (tokens < logits.shape[-1])
    logits[rows[in_vocab], tokens[in_vocab]] = value
    if advance:  # every request row, traced or not
        total_len[idx_mapping[idx_mapping >= 0].long()] += 1
