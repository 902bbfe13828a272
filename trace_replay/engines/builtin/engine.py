"""The built-in engine: a readable batched decode loop over a transformers causal LM.

``run`` splits requests into waves (:func:`~trace_replay.engines.builtin.decode.waves`), prefills a wave's
prompts together, replays it in the one replay loop (:mod:`~trace_replay.engines.builtin.decode`;
the steps of :mod:`~trace_replay.engines.builtin.verify` under ``speculative``) and turns the
scores into results (:mod:`~trace_replay.engines.builtin.scoring`). Each step the model's greedy
choice is overwritten by ``TraceReplayState.apply_trace`` and scored on the unmodified logits.
The forward pass itself is a backend
(:class:`~trace_replay.engines.builtin.backends.base.Backend`, the only members used):
``hf`` (the transformers model with a growing cache) or ``static`` (whose CUDA graphs also
take the per-step forcing and scoring, :class:`~trace_replay.engines.builtin.decode.ForcedSteps`);
with ``deterministic`` it is
:class:`~trace_replay.engines.builtin.backends.deterministic.DeterministicBackend`, which also does
the scoring, so that no number of a trace depends on its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
from trace_replay.engines.builtin.backends.factory import make_backend
from trace_replay.engines.builtin.decode import SlotTable, generate_steps, replay_steps, waves
from trace_replay.engines.builtin.drafts import parse_speculative
from trace_replay.engines.builtin.scoring import wave_results
from trace_replay.engines.builtin.verify import verify_steps
from trace_replay.engines.threads import engine_threads, intra_op_threads
from trace_replay.models.load import model_for_engine

__all__ = ["BACKENDS", "TorchEngine"]

BACKENDS = ("auto", "hf", "static")


class TorchEngine(EngineBase):
    """Forced decoding with transformers models, on CPU or CUDA.

    Parameters
    ----------
    config
        Model, dtype, device, ``batch_size`` (request slots; default 8 on CPU, 64 on CUDA)
        and ``top_k``.
    speculative
        ``None``, or ``{"method": "trace" | "ngram", "num_tokens": k}``.
    backend
        The forward pass: ``"hf"`` (the transformers model with a growing cache, any
        architecture), ``"static"`` (the model's own forward over a static KV cache,
        compiled CUDA graphs on GPU; Llama, Mistral, Qwen2/3, Gemma families) or
        ``"auto"`` (static where the model is supported, on CUDA and for a float32 model
        on the CPU, else hf:
        :func:`~trace_replay.engines.builtin.backends.factory.auto_kind`). With
        ``config.deterministic`` only ``"auto"``: the batch-invariant backend (Llama-family).
    float32_matmul
        ``"3xtf32"`` (default) or ``"ieee"``: how the static backend multiplies a float32
        model on CUDA (see :class:`~trace_replay.engines.builtin.backends.static.StaticCacheBackend`;
        ``engine_path`` ends ``+3xtf32]`` when tensor cores ran). Ignored elsewhere.
    batch1_fusions
        Whether the static backend runs a bfloat16 or float16 model's one-row steps on CUDA
        with the batch-1 fusions (default; ``settings()["batch1_fusions"]`` is False where
        they were turned off and would have run). Ignored elsewhere.
    deterministic_attention
        ``"tiles"`` (default) or ``"rows"``: the Triton attention of deterministic mode on
        CUDA (``settings()["arithmetic"]["attention"]`` says which ran). Ignored elsewhere.
    """

    name = "torch"
    # BatchHooks: set by a caller watching the forwards (layer attribution)
    on_batch: Callable[[Sequence[ReplayRequest]], None] | None = None

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        speculative: dict | None = None,
        backend: str = "auto",
        float32_matmul: str = "3xtf32",
        batch1_fusions: bool = True,
        deterministic_attention: str = "tiles",
    ) -> None:
        config = config or EngineConfig()
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown torch engine backend {backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if config.deterministic and backend != "auto":
            raise ValueError(
                f"deterministic mode runs its own backend; backend={backend!r} "
                "cannot be combined with it"
            )
        self.speculative = parse_speculative(speculative)
        # checked before the model loads, whichever backend runs
        options = BackendOptions(
            max_query_len=1 if self.speculative is None else self.speculative[1] + 1,
            float32_matmul=float32_matmul,
            batch1_fusions=batch1_fusions,
            deterministic_attention=deterministic_attention,
        )
        self.lm, self.model_label, self.tokenizer_source = model_for_engine(
            config.model, dtype=config.dtype, device=config.device
        )
        weight = next(self.lm.parameters())
        self.torch_device, self.torch_dtype = weight.device, weight.dtype
        self.device = str(weight.device)
        self.dtype = str(weight.dtype).replace("torch.", "")
        self.batch_size = config.batch_size or (64 if weight.device.type == "cuda" else 8)
        self.top_k = config.top_k
        self.threads = engine_threads() if weight.device.type == "cpu" else None
        self.deterministic = config.deterministic
        self.max_model_len = getattr(self.lm.config, "max_position_embeddings", None)
        pad = self.lm.config.pad_token_id
        self.pad_id = 0 if pad is None else int(pad)
        self.backend = make_backend(
            "deterministic" if self.deterministic else backend, self.lm, self.pad_id, options
        )
        self.score = self.backend.score  # one object: a captured step keys on it
        self._backend_settings = self.backend.settings()  # fixed once built, kept after close
        self.slots = SlotTable(self.batch_size, weight.device)
        self.engine_path = f"torch-decode[{self.backend.name}]"
        if self.speculative is not None:
            self.engine_path += "+verify({}, k={})".format(*self.speculative)
        self._drafted = self._accepted = 0
        self._captured: dict = {}  # the last forced-step graph, for the next wave

    def settings(self) -> dict[str, Any]:
        settings = super().settings()
        if self.speculative is not None:
            method, k = self.speculative
            settings["speculative"] = {"method": method, "num_tokens": k}
        settings.update(self._backend_settings)
        return settings

    def stats(self) -> dict[str, Any]:
        """Forwards run so far and, for verify, the draft acceptance rate."""
        stats: dict[str, Any] = {"forwards": self.backend.forwards}
        if self.threads is not None:
            stats["threads"] = self.threads
        if self.speculative is not None:
            stats["acceptance_rate"] = (
                self._accepted / self._drafted if self._drafted else float("nan")
            )
        return stats

    def close(self) -> None:
        # released; every method that reads them refuses a closed engine (EngineClosed)
        self.backend = self.lm = None  # type: ignore[assignment]
        self._captured.clear()

    def activations(self) -> Activations:
        """The backend's: ``lm``'s own modules (hf), the row-wise model's rows
        (deterministic); the static backend's view of the model gives none (layer
        attribution builds ``backend="hf"``)."""
        return self.backend.activations()

    @property
    def routing_layout(self) -> str | None:
        """How forwards lay out a batch's rows for MoE routing
        (:class:`~trace_replay.engines.routing.RoutingSource`): ``"decode"`` where they run
        the model's own modules (the hf backend), else None."""
        return "decode" if self.backend is not None and self.backend.name == "hf" else None

    def step_logits(self, requests: Sequence[ReplayRequest]):
        """Each replay step's full logits, one step at a time
        (:class:`~trace_replay.engines.distributions.StepLogits`)."""
        from trace_replay.engines.builtin.step_logits import decode_step_logits

        return decode_step_logits(self, requests)

    @torch.inference_mode()
    def run(
        self, requests: Sequence[ReplayRequest], *, on_tokens: Callable[[int], None] | None = None
    ) -> list[TraceResult]:
        """Replay ``requests``; results come back in the order given."""
        results: dict[int, TraceResult] = {}
        with intra_op_threads(self.threads):
            for indices in waves(requests, self.batch_size):
                wave = [requests[i] for i in indices]
                progress = _WaveProgress(wave, on_tokens)
                results.update(zip(indices, self._run_wave(wave, progress)))
                progress.finish()
        return [results[i] for i in range(len(requests))]

    def _run_wave(
        self, wave: Sequence[ReplayRequest], progress: _WaveProgress
    ) -> list[TraceResult]:
        if self.on_batch is not None:
            self.on_batch(wave)
        idx_mapping = self.slots.admit(wave)
        longest = max(r.trace_len for r in wave)
        logits = self.backend.prefill([r.prompt_token_ids for r in wave], longest)
        if self.speculative is None:
            # a backend whose decode returns one static logits tensor gets the steps captured
            steps, counts = replay_steps(
                self.backend,
                self.slots,
                idx_mapping,
                logits,
                longest,
                self.top_k,
                self.score,
                progress.forward(1),
                cache=self._captured,
                graph=self.backend.static_logits,
            )
        else:
            method, k = self.speculative
            # trace drafts are all accepted (k + 1 per forward); n-gram ones at least 1
            verified = verify_steps(
                self.backend,
                self.slots,
                idx_mapping,
                logits,
                wave,
                method=method,
                k=k,
                top_k=self.top_k,
                score=self.score,
                on_forward=progress.forward(k + 1 if method == "trace" else 1),
            )
            steps, counts = verified.steps, verified.counts
            self._drafted += verified.drafted
            self._accepted += verified.accepted
        return wave_results(wave, steps, counts)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id: int | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """Free generation (no trace) for recording: ``(token_ids, raw logprobs)`` per prompt.

        Greedy at ``temperature == 0``, else seeded sampling; each logprob is the chosen
        token's under the unmodified distribution. A row stops after emitting EOS.
        """
        generator = torch.Generator(device=self.torch_device).manual_seed(seed)
        outputs = []
        with intra_op_threads(self.threads):
            for start in range(0, len(prompts), self.batch_size):
                wave = [
                    ReplayRequest(str(i), tuple(p), ())
                    for i, p in enumerate(prompts[start : start + self.batch_size])
                ]
                idx_mapping = self.slots.admit(wave)
                logits = self.backend.prefill([r.prompt_token_ids for r in wave], max_tokens)
                tokens, logprobs = generate_steps(
                    self.backend,
                    self.slots,
                    idx_mapping,
                    logits,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    generator=generator,
                    eos_token_id=eos_token_id,
                    score=self.score,
                )
                for row_ids, row_lps in zip(
                    tokens.cpu().tolist(), logprobs.double().cpu().tolist()
                ):
                    end = (
                        row_ids.index(eos_token_id) + 1 if eos_token_id in row_ids else len(row_ids)
                    )
                    outputs.append((row_ids[:end], row_lps[:end]))
        return outputs


class _WaveProgress:
    """Tokens committed by a wave so far, from its trace lengths alone (no device reads).

    Forward ``i`` brings every row to ``min(1 + i * per_forward, trace_len)`` tokens; a
    lower bound for n-gram verify, whose remainder :meth:`finish` reports.
    """

    def __init__(
        self, wave: Sequence[ReplayRequest], on_tokens: Callable[[int], None] | None
    ) -> None:
        self.lengths = np.array([r.trace_len for r in wave])
        self.on_tokens = on_tokens
        self.reported = 0

    def _report(self, done: int) -> None:
        if self.on_tokens is not None and done > self.reported:
            self.on_tokens(done - self.reported)
            self.reported = done

    def forward(self, per_forward: int) -> Callable[[int], None] | None:
        if self.on_tokens is None:
            return None
        return lambda i: self._report(int(np.minimum(1 + i * per_forward, self.lengths).sum()))

    def finish(self) -> None:
        self._report(int(self.lengths.sum()))
