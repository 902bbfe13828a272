"""The built-in engines' full logits per replay step
(:class:`~trace_replay.engines.distributions.StepLogits`), for a paired replay.

Decode (:func:`decode_step_logits`) runs the engine's own backend, ``prefill`` then one
``decode`` per step with the trace token fed, so the logits are those its ``run`` scores
(the batch is the one given, not re-cut into waves by length). Teacher forcing
(:func:`prefill_step_logits`) runs the body once per batch and the head on as many steps'
rows at a time as its own scoring chunk holds (``score_chunk_bytes``), yielding them step by
step. Either way the logits held never grow with the traces' length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.packing import pack, packed_states
from trace_replay.engines.threads import intra_op_threads

__all__ = ["decode_step_logits", "prefill_step_logits"]


def decode_step_logits(engine, requests: Sequence[ReplayRequest]) -> Iterator[torch.Tensor]:
    """Step ``s``'s logits for the requests with ``trace_len > s``, in order, from a
    :class:`~trace_replay.engines.builtin.engine.TorchEngine`'s backend."""
    _check_batch(engine, requests)
    backend, device = engine.backend, engine.torch_device
    lengths = torch.tensor([r.trace_len for r in requests])
    longest = int(lengths.max())
    traces = torch.full((len(requests), longest), engine.pad_id, dtype=torch.long)
    for row, r in enumerate(requests):
        traces[row, : r.trace_len] = torch.tensor(r.trace_token_ids)
    traces = traces.to(device)
    prompt_len = torch.tensor([r.prompt_len for r in requests], device=device)
    with torch.inference_mode(), intra_op_threads(engine.threads):
        logits = backend.prefill([r.prompt_token_ids for r in requests], longest)
    for step in range(longest):
        yield _live(logits, lengths, step)
        if step + 1 == longest:
            return
        # rows whose trace ended run on with the batch (their logits are never yielded)
        with torch.inference_mode(), intra_op_threads(engine.threads):
            logits = backend.decode(traces[:, step : step + 1], (prompt_len + step)[:, None])[:, -1]


def prefill_step_logits(engine, requests: Sequence[ReplayRequest]) -> Iterator[torch.Tensor]:
    """Step ``s``'s logits for the requests with ``trace_len > s``, in order, from a
    :class:`~trace_replay.engines.builtin.prefill.PrefillEngine`: one teacher-forced body
    forward for the batch, then its head on blocks of consecutive steps whose rows fit the
    engine's scoring chunk (:func:`_step_blocks`), each block's logits yielded a step at a
    time (views of it).

    Raises
    ------
    ValueError
        For a model whose head is more than a projection (its own forward would hold every
        position's logits at once).
    """
    _check_batch(engine, requests)
    if not engine.deterministic and not engine._split:
        raise ValueError(
            f"prefill: {engine.model_label} has no plain lm_head; its step "
            "logits would need every position's logits at once"
        )
    device = engine.torch_device
    lengths = torch.tensor([r.trace_len for r in requests])
    # logits at position p predict the token at p + 1
    sequences = [r.prompt_token_ids + r.trace_token_ids[:-1] for r in requests]
    starts = torch.cumsum(lengths, 0) - lengths  # a trace's first scored row (flat states)
    flat = engine.deterministic or engine._packed
    with torch.inference_mode(), intra_op_threads(engine.threads):
        if engine.deterministic:
            scored = [range(r.prompt_len - 1, r.prompt_len - 1 + r.trace_len) for r in requests]
            states = engine.backend.teacher_forced_states(sequences, scored)
            head = engine.backend.lm_head
        elif engine._packed:  # the arithmetic of the engine's run: one unpadded row
            packed = pack(requests, device)
            states = packed_states(engine.lm, packed)[packed.scored]
            head = engine._head
        else:
            width = max(len(s) for s in sequences)
            input_ids = torch.zeros((len(requests), width), dtype=torch.long)
            mask = torch.zeros((len(requests), width), dtype=torch.long)
            for row, seq in enumerate(sequences):
                input_ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            states = engine.lm.base_model(
                input_ids=input_ids.to(device), attention_mask=mask.to(device)
            ).last_hidden_state
            head = engine._head
        engine._forwards += 1
    prompt_len = torch.tensor([r.prompt_len for r in requests])
    live = [torch.nonzero(lengths > step).squeeze(1) for step in range(int(lengths.max()))]
    for block in _step_blocks([len(rows) for rows in live], engine._chunk_rows()):
        rows = torch.cat([live[step] for step in block])
        steps = torch.cat([torch.full_like(live[step], step) for step in block])
        with torch.inference_mode(), intra_op_threads(engine.threads):
            if flat:
                hidden = states[(starts[rows] + steps).to(device)]
            else:
                hidden = states[rows.to(device), (prompt_len[rows] - 1 + steps).to(device)]
            logits = head(hidden)
        yield from logits.split([len(live[step]) for step in block])


def _step_blocks(sizes: Sequence[int], budget: int) -> list[range]:
    """Consecutive steps grouped so that each group's rows (``sizes[step]``) stay within
    ``budget`` (a step larger than it alone): the head reads its weights once per group
    instead of once per step (a ``[n, d] x [d, V]`` product for a few rows is bound by
    reading the ``[d, V]`` weights).

    Examples
    --------
    >>> _step_blocks([4, 4, 4, 3, 2], 8)
    [range(0, 2), range(2, 4), range(4, 5)]
    """
    blocks, start, rows = [], 0, 0
    for step, size in enumerate(sizes):
        if rows and rows + size > budget:
            blocks.append(range(start, step))
            start, rows = step, 0
        rows += size
    blocks.append(range(start, len(sizes)))
    return blocks


def _live(logits: torch.Tensor, lengths: torch.Tensor, step: int) -> torch.Tensor:
    """The rows of ``logits`` whose trace has a token at ``step`` (all: ``logits`` itself)."""
    live = lengths > step
    if bool(live.all()):
        return logits
    return logits[torch.nonzero(live).squeeze(1).to(logits.device)]


def _check_batch(engine, requests: Sequence[ReplayRequest]) -> None:
    if engine.lm is None:
        from trace_replay.engines.base import EngineClosed

        raise EngineClosed(f"{engine.name} engine is closed")
    if not requests or len(requests) > engine.batch_size:
        raise ValueError(
            f"step_logits takes 1 to batch_size={engine.batch_size} requests, got {len(requests)}"
        )
