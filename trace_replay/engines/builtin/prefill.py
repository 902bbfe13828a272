"""Teacher-forced scoring: one forward over prompt + trace, what a trainer computes.

The baseline to set decode replay against: same weights, but prefill kernels over the
whole sequence instead of one decode step at a time. With ``deterministic`` the forward is
:class:`~trace_replay.engines.builtin.backends.deterministic.DeterministicBackend`'s, row by row: a trace's
numbers do not depend on the batch, and they are the bits its decode replay gives.

Memory: the model body runs once per batch; the lm_head and the log-softmax run over the
scored positions in chunks of ``score_chunk_bytes``, so full-vocabulary logits never exist
for more than one chunk and peak memory does not grow with trace length beyond the model's
own activations. Deterministic mode chunks the same way (in whole scoring blocks): its
head and scoring are row-invariant, so the chunks change no bit. While ``on_batch`` is set
(the :class:`~trace_replay.engines.base.Engine` contract for watched forwards), the default
mode runs the model's own forward instead, logits included, so hooks on its modules see
``[batch, width, ...]`` activations. Otherwise, on the CPU, a batch's sequences run
packed: back to back in one row, no padding (:mod:`~trace_replay.engines.builtin.packing`),
where the model passes the packing check.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trace_replay.engines.base import (
    Activations,
    EngineBase,
    EngineConfig,
    ReplayRequest,
    TraceResult,
)
from trace_replay.engines.builtin.backends.base import BackendOptions
from trace_replay.engines.builtin.packing import pack, packed_states, packing_is_exact
from trace_replay.engines.builtin.scoring import (
    TokenScores,
    collect_rows,
    scorer_for,
    split_results,
)
from trace_replay.engines.threads import engine_threads, intra_op_threads
from trace_replay.models.load import model_for_engine

__all__ = ["PrefillEngine", "SCORE_CHUNK_BYTES"]

# memory for one chunk of scored positions: logits and the log-softmax temporaries
SCORE_CHUNK_BYTES = 256 * 2**20
_BYTES_PER_LOGIT = 20  # float32 logits, log-probs, p*log(p), a comparison mask, slack


def _batches(requests: Sequence[ReplayRequest], size: int) -> list[list[int]]:
    """Indices of ``requests`` in batches of at most ``size``, shortest sequences first.

    A batch is padded to its longest prompt + trace: sequences of similar length waste
    fewer padded positions (measured 15% more tokens than scored in bundle order).
    """
    order = sorted(
        range(len(requests)), key=lambda i: requests[i].prompt_len + requests[i].trace_len
    )
    return [order[start : start + size] for start in range(0, len(order), size)]


class PrefillEngine(EngineBase):
    """Score traces with a single teacher-forced forward per batch (on the CPU packed into
    one unpadded row, :mod:`~trace_replay.engines.builtin.packing`; else right padded).

    ``config`` as for every engine (``batch_size``: traces per forward, default 8 on CPU,
    64 on CUDA; ``deterministic``: batch-invariant arithmetic, Llama-family models).
    ``deterministic_attention``: as for
    :class:`~trace_replay.engines.builtin.engine.TorchEngine` (a decode replay and a prefill
    give the same bits only with the same one).
    """

    name = "prefill"
    # BatchHooks: set by a caller watching the forwards (layer attribution)
    on_batch: Callable[[Sequence[ReplayRequest]], None] | None = None
    engine_path = "teacher-forced-prefill"

    def __init__(
        self, config: EngineConfig | None = None, *, deterministic_attention: str = "tiles"
    ) -> None:
        config = config or EngineConfig()
        options = BackendOptions(deterministic_attention=deterministic_attention)  # checked
        self.lm, self.model_label, self.tokenizer_source = model_for_engine(
            config.model, dtype=config.dtype, device=config.device
        )
        weight = next(self.lm.parameters())
        self.torch_device = weight.device
        self.device = str(weight.device)
        self.dtype = str(weight.dtype).replace("torch.", "")
        self.batch_size = config.batch_size or (64 if weight.device.type == "cuda" else 8)
        self.top_k = config.top_k
        self.threads = engine_threads() if weight.device.type == "cpu" else None
        self.max_model_len = getattr(self.lm.config, "max_position_embeddings", None)
        self.score_chunk_bytes = SCORE_CHUNK_BYTES
        self.deterministic = config.deterministic
        self.backend = None
        self._backend_settings: dict = {}  # fixed once built, kept after close
        if self.deterministic:
            from trace_replay.engines.builtin.backends.deterministic import DeterministicBackend

            self.backend = DeterministicBackend(
                self.lm, cuda_graphs=False, attention=options.deterministic_attention
            )
            self.engine_path += "[deterministic]"
            self._backend_settings = self.backend.settings()
        self._forwards = 0
        self._split = self._head_is_separable()
        # sequences packed into one row, no padding: the CPU's default forward where it is
        # exact (on CUDA, a loop of per-sequence attention launches, not measured there)
        self._packed = (
            self._split
            and not self.deterministic
            and weight.device.type == "cpu"
            and packing_is_exact(self.lm, self.torch_device)
        )

    def settings(self) -> dict:
        settings = super().settings()
        settings.update(self._backend_settings)
        return settings

    def stats(self) -> dict:
        stats = {"forwards": self._forwards}
        if self.threads is not None:
            stats["threads"] = self.threads
        return stats

    def close(self) -> None:
        self.lm = self.backend = None

    def activations(self) -> Activations:
        """``lm``'s own modules, or in deterministic mode the row-wise model's rows."""
        return Activations(self.lm) if self.backend is None else self.backend.activations()

    @property
    def routing_layout(self) -> str | None:
        """``"teacher-forced"`` (:class:`~trace_replay.engines.routing.RoutingSource`): with
        ``on_batch`` set, one forward of the model's own modules per batch; None in
        deterministic mode, whose rows bypass them."""
        return None if self.deterministic else "teacher-forced"

    def step_logits(self, requests: Sequence[ReplayRequest]):
        """Each replay step's full logits, one step at a time
        (:class:`~trace_replay.engines.distributions.StepLogits`)."""
        from trace_replay.engines.builtin.step_logits import prefill_step_logits

        return prefill_step_logits(self, requests)

    @torch.inference_mode()
    def run(
        self, requests: Sequence[ReplayRequest], *, on_tokens: Callable[[int], None] | None = None
    ) -> list[TraceResult]:
        """Score ``requests`` in batches of similar length; results come back in the order
        given."""
        results: dict[int, TraceResult] = {}
        with intra_op_threads(self.threads):
            for indices in _batches(requests, self.batch_size):
                batch = [requests[i] for i in indices]
                results.update(zip(indices, self._run_batch(batch)))
                if on_tokens is not None:
                    on_tokens(sum(r.trace_len for r in batch))
        return [results[i] for i in range(len(requests))]

    def _run_batch(self, batch: Sequence[ReplayRequest]) -> list[TraceResult]:
        if self.on_batch is not None:
            self.on_batch(batch)
        if self.deterministic:
            return self._run_deterministic(batch)
        # watched forwards (on_batch set) run the model's own modules: the Engine contract
        if self._packed and self.on_batch is None:
            return self._run_packed(batch)
        # the last trace token is scored but never fed
        width = max(r.prompt_len + r.trace_len - 1 for r in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        rows: list[int] = []
        cols: list[int] = []
        targets: list[int] = []
        for row, r in enumerate(batch):
            seq = list(r.prompt_token_ids) + list(r.trace_token_ids[:-1])
            input_ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            # logits at position p predict the token at p + 1
            rows += [row] * r.trace_len
            cols += range(r.prompt_len - 1, r.prompt_len - 1 + r.trace_len)
            targets += r.trace_token_ids
        device = self.torch_device
        rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        targets_t = torch.tensor(targets, device=device)
        input_ids, mask = input_ids.to(device), mask.to(device)
        if self._split and self.on_batch is None:
            states = self.lm.base_model(input_ids=input_ids, attention_mask=mask)
            scored, head = states.last_hidden_state[rows_t, cols_t], self._head
        else:  # the model's own logits, only where a trace token is scored
            first = min(cols)
            keep = torch.arange(first, max(cols) + 1, device=device)
            logits = self.lm(input_ids=input_ids, attention_mask=mask, logits_to_keep=keep).logits
            scored, head = logits[rows_t, cols_t - first], None
        self._forwards += 1
        # chunks' row counts differ per batch: one dynamic-shape scoring graph for them all
        score = scorer_for(device, rows="dynamic")
        host = collect_rows(self._score_in_chunks(scored, targets_t, head, score), targets_t)
        bounds = np.cumsum([0] + [r.trace_len for r in batch])
        return split_results(batch, host, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])])

    def _run_packed(self, batch: Sequence[ReplayRequest]) -> list[TraceResult]:
        """The batch's sequences back to back in one row, each attending only to itself."""
        packed = pack(batch, self.torch_device)
        scored = packed_states(self.lm, packed)[packed.scored]
        self._forwards += 1
        score = scorer_for(self.torch_device, rows="dynamic")
        host = collect_rows(
            self._score_in_chunks(scored, packed.targets, self._head, score), packed.targets
        )
        bounds = np.cumsum([0] + [r.trace_len for r in batch])
        return split_results(batch, host, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])])

    def _run_deterministic(self, batch: Sequence[ReplayRequest]) -> list[TraceResult]:
        """Teacher forcing through the batch-invariant backend, scored row-invariantly."""
        sequences = [r.prompt_token_ids + r.trace_token_ids[:-1] for r in batch]
        # logits at position p predict the token at p + 1
        scored = [range(r.prompt_len - 1, r.prompt_len - 1 + r.trace_len) for r in batch]
        backend = self.backend
        assert backend is not None  # this path runs only with the deterministic backend
        states = backend.teacher_forced_states(sequences, scored)
        targets = torch.tensor(
            [t for r in batch for t in r.trace_token_ids], device=self.torch_device
        )
        self._forwards += 1
        # whole scoring blocks per chunk: a partial one would be padded (same bits, more work)
        scores = self._score_in_chunks(
            states,
            targets,
            backend.lm_head,
            backend.score,
            multiple=backend.model.blocks.score,
        )
        host = collect_rows(scores, targets)
        bounds = np.cumsum([0] + [r.trace_len for r in batch])
        return split_results(batch, host, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])])

    def _chunk_rows(self, multiple: int = 1) -> int:
        """Scored positions per chunk: as many as ``score_chunk_bytes`` holds, rounded down to
        a multiple of ``multiple`` (at least one multiple)."""
        vocab_size = self.vocab_size
        assert vocab_size is not None  # a model in this process: its head's size
        rows = self.score_chunk_bytes // (vocab_size * _BYTES_PER_LOGIT)
        return max(multiple, rows // multiple * multiple)

    def _score_in_chunks(
        self,
        states: torch.Tensor,
        targets: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor] | None,
        score: Callable[[torch.Tensor, torch.Tensor, int], TokenScores],
        *,
        multiple: int = 1,
    ) -> TokenScores:
        """``score`` of ``targets`` under ``head(states)`` (``states`` are logits already when
        ``head`` is None), one chunk of :meth:`_chunk_rows` positions at a time."""
        step = self._chunk_rows(multiple)
        chunks = []
        for a in range(0, len(targets), step):
            logits = states[a : a + step] if head is None else head(states[a : a + step])
            chunks.append(score(logits, targets[a : a + step], self.top_k))
        return TokenScores(*(torch.cat(parts) for parts in zip(*chunks)))

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from final hidden states, as the model's own forward computes them."""
        logits = self.lm.get_output_embeddings()(hidden)
        cap = getattr(self.lm.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def _head_is_separable(self) -> bool:
        """Whether body + :meth:`_head` give the model's own logits (checked on 3 tokens).

        A model whose head does more than a projection and soft-capping (a logit scale…)
        falls back to its own forward, which holds logits for every scored position.
        """
        body, head = self.lm.base_model, self.lm.get_output_embeddings()
        if body is self.lm or head is None:
            separable = False
        else:
            ids = torch.tensor([[1, 2, 3]], device=self.torch_device)
            own = self.lm(input_ids=ids).logits.float()
            split = self._head(body(input_ids=ids).last_hidden_state).float()
            separable = torch.allclose(own, split, rtol=1e-3, atol=1e-3)
        if not separable:
            warnings.warn(
                f"prefill: {self.model_label} has no plain lm_head; scoring uses its "
                "full logits (memory grows with trace length)",
                RuntimeWarning,
                stacklevel=3,
            )
        return separable
