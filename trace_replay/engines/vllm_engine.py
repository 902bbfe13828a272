"""vLLM replay: the only module that imports vllm.

Two paths, chosen at start-up and recorded in ``settings()["engine_path"]``:

* **native** — vLLM builds with Model Runner V2 and ``enable_trace_replay`` (GPU): the
  sampler itself overwrites each sampled token with ``trace_decode_token_ids[step]``.
* **forcing** — everything else (the CPU build, older vLLM, configs MRV2 rejects): the V1
  logits processor :class:`TraceForcingProcessor` raises the trace token's logit to 1e30.
  ``logprobs_mode="raw_logprobs"`` makes vLLM compute the reported logprobs *before* logits
  processors run, so logprob, rank and top-k are those of the unmodified distribution.

The engine core runs in this process, started quietly and leaving the process as it was
(:mod:`~trace_replay.engines.inprocess`). Entropy is not reported by vLLM; the column is NaN
for this engine.

``deterministic=True`` turns on vLLM's own batch-invariant mode (``VLLM_BATCH_INVARIANT=1``
for the engine's processes) where vLLM supports it — NVIDIA GPUs of compute capability
>= 8.0, AMD Instinct, Intel XPU. Elsewhere (the CPU build) vLLM has no such mode: the run
goes ahead with a warning, and ``settings()["batch_invariant"]`` is False.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from vllm import LLM, SamplingParams
from vllm import envs as vllm_envs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from trace_replay.engines.base import EngineBase, EngineConfig, ReplayRequest, TraceResult
from trace_replay.engines.inprocess import QuietLogs, engine_core_mode, hosted_startup
from trace_replay.engines.threads import engine_threads, intra_op_threads
from trace_replay.engines.vllm_invariance import batch_invariance_unavailable, batch_invariant_env
from trace_replay.models import hf_folder, model_label, resolve_dtype
from trace_replay.serve import TRACE_KEY
from trace_replay.state import RequestState, TraceReplayState

__all__ = ["VLLMEngine", "TraceForcingProcessor", "ForcingWorkerExtension", "WORKER_EXTENSION",
           "read_lengths_only", "supports_native_trace_replay"]

_NO_OUTPUT: tuple = ()


def _has_param(name: str) -> bool:
    return name in inspect.signature(SamplingParams.__init__).parameters or \
        name in getattr(SamplingParams, "__struct_fields__", ())


# vLLM deep-copies every request's SamplingParams unless told not to (older releases cannot)
_NO_COPY = {"skip_clone": True} if _has_param("skip_clone") else {}


def supports_native_trace_replay() -> bool:
    """Whether this vLLM knows ``SamplingParams.trace_decode_token_ids``."""
    return _has_param("trace_decode_token_ids")


# what a forced token's logit becomes (see TraceForcingProcessor)
FORCED_LOGIT = 1e30


class ForcingWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): what the forcing path
    asks of a worker, by name through ``collective_rpc``, whether the engine core runs in
    this process or its own."""

    def trace_replay_read_lengths_only(self) -> bool:
        """Custom logits processors need no output tokens (see :func:`read_lengths_only`)."""
        batch = getattr(getattr(self, "model_runner", None), "input_batch", None)
        if batch is None or not hasattr(batch, "logitsprocs_need_output_token_ids"):
            return False
        batch.logitsprocs_need_output_token_ids = False
        return True


WORKER_EXTENSION = f"{__name__}.{ForcingWorkerExtension.__qualname__}"


def read_lengths_only(llm: LLM) -> bool:
    """Tell ``llm``'s workers that its custom logits processors never read output tokens.

    vLLM V1 hands logits processors each request's output-token list and, not knowing what
    a custom processor reads, fills those lists in before every sampling step; under async
    scheduling that means waiting for the previous step's token copy and a Python loop
    over the batch, every step. :class:`TraceForcingProcessor` reads only their lengths,
    which vLLM keeps right either way (a placeholder per step under async scheduling).
    ``llm`` must have been started with ``worker_extension_cls=WORKER_EXTENSION``; call
    this only where the forcing processor is the sole custom one (the flag is global to
    the batch). Returns whether every worker took it (False where the extension is
    missing or this vLLM has no such flag).
    """
    try:
        return all(llm.collective_rpc("trace_replay_read_lengths_only"))
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


class TraceForcingProcessor(LogitsProcessor):
    """Force each request's trace through vLLM's V1 sampler by raising its token's logit.

    Requests carry their trace in ``SamplingParams.extra_args["trace_replay_token_ids"]``;
    others pass through untouched. Slots are vLLM's persistent-batch indices, which are also
    the logits rows. The replay step of a row is ``total_len - prompt_len``, where
    ``total_len`` (prompt plus committed tokens) lives on the device and advances by one
    after every step.

    Design contract (the per-step work is device-side; nothing waits for the GPU):

    * Each step the host checks, with one C-level pass over the live output lists vLLM
      hands to logits processors, that every row committed exactly one token since the
      last step. Only when that fails (the batch changed, a chunked prefill discarded its
      sample, a preemption) are the lengths sent again, from pinned memory, asynchronously.
      With speculative decoding they are sent every step.
    * On the device, one kernel (:func:`~trace_replay.kernels.force_trace_logits`, through
      the package's ``TraceReplayState``) reads every row's trace token at its step, sets
      that token's logit to ``FORCED_LOGIT`` (1e30) and advances the step. The token is
      then the argmax, and under any temperature vLLM allows (≥ 1e-5) softmax gives it
      probability 1 in float32 (every other logit is ~1e30 below; 1e30 / 1e-5 stays
      finite), so sampling, top-k/top-p and min-p keep it too. The row is otherwise left
      as it is: one write per row, no pass over the vocabulary. Logprobs are vLLM's raw
      ones, taken before logits processors run, so forcing never changes them. A row
      whose logits hold NaN, or whose trace token is outside the vocabulary, could still
      emit another token; the engine checks every emitted token against the trace and
      names the trace if one differs.
    * Only the *lengths* of the output lists are read, never their tokens. vLLM cannot know
      that of a custom processor, and by default completes every list from the GPU before
      each sampling step (under async scheduling: a wait on the previous step's copy and a
      Python loop over the batch); :func:`read_lengths_only` tells it, where this processor
      is the only custom one.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.req_states = RequestState(max_num_reqs, device)
        self.trace_state = TraceReplayState(self.req_states)
        self.device = device
        self.pin_memory = is_pin_memory
        self.traces: list[list[int] | None] = [None] * max_num_reqs
        self.outputs: list = [_NO_OUTPUT] * max_num_reqs
        self.prompt_lens = [0] * max_num_reqs
        self.num_traced = 0
        self.num_length_uploads = 0  # for tests and benchmarks
        self._rows = torch.arange(max_num_reqs, device=device)  # idx_mapping: row b is slot b
        # several tokens per step per row would defeat the one-token-per-step check
        self._check_lengths = getattr(vllm_config, "speculative_config", None) is None
        self._committed: tuple[int, int] | None = None  # (rows, sum of output lengths)

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        trace = (params.extra_args or {}).get(TRACE_KEY)
        if trace is None:
            return
        if not trace or not all(isinstance(t, int) and t >= 0 for t in trace):
            raise ValueError(f"{TRACE_KEY} must be a non-empty list of non-negative token ids")

    def is_argmax_invariant(self) -> bool:
        return False

    def _place(self, index: int, trace, prompt_len: int, output) -> None:
        if (self.traces[index] is not None) != (trace is not None):
            self.num_traced += 1 if trace is not None else -1
        self.traces[index] = trace
        self.prompt_lens[index] = prompt_len
        self.outputs[index] = output
        self.trace_state.add_request(index, trace)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._place(index, None, 0, _NO_OUTPUT)
        for index, params, prompt_ids, output_ids in batch_update.added:
            trace = (params.extra_args or {}).get(TRACE_KEY)
            self._place(index, trace, len(prompt_ids or ()), output_ids)
        for a, b, direction in batch_update.moved:
            moved_a = (self.traces[a], self.prompt_lens[a], self.outputs[a])
            moved_b = (self.traces[b], self.prompt_lens[b], self.outputs[b])
            self._place(b, *moved_a)
            if direction == MoveDirectionality.SWAP:
                self._place(a, *moved_b)
            else:
                self._place(a, None, 0, _NO_OUTPUT)
        self.trace_state.apply_staged_writes()
        self.req_states.prompt_len.copy_(self._to_device(self.prompt_lens), non_blocking=True)
        self._committed = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.num_traced == 0:
            return logits
        rows = logits.shape[0]
        outputs = self.outputs[:rows]
        committed = (rows, sum(map(len, outputs)))
        expected = None if self._committed is None else (rows, self._committed[1] + rows)
        if committed != expected or not self._check_lengths:
            total_len = self.req_states.total_len[:rows]
            total_len.copy_(self._to_device(list(map(len, outputs))), non_blocking=True)
            total_len += self.req_states.prompt_len[:rows]
            self.num_length_uploads += 1
        self._committed = committed
        # one launch: each traced row's trace-token logit becomes FORCED_LOGIT (no pass over
        # the vocabulary), and every row moves a step (the token sampled now is committed
        # before the next call)
        self.trace_state.force_logits(logits, self._rows[:rows], value=FORCED_LOGIT,
                                      advance=True)
        return logits

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """``values`` as int32 on the device, sent from pinned memory without waiting."""
        host = torch.tensor(values, dtype=torch.int32, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=True)


class VLLMEngine(EngineBase):
    """Replay through ``vllm.LLM`` (native trace replay when available, else forcing).

    The engine core runs in this process (:mod:`~trace_replay.engines.inprocess`), so a
    script needs no ``if __name__ == "__main__":`` guard and no idle engine process competes
    with the torch engine for cores; ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, set by the user,
    gives vLLM its own process back (then scripts need the guard). ``settings()`` records
    which (``engine_core``).

    Parameters
    ----------
    config
        Model (``None``, a folder or a cached name; vLLM loads it itself, so not a module),
        ``dtype`` (default float32, the embedded weights' own), ``batch_size``
        (``max_num_seqs``) and ``top_k`` (``SamplingParams.logprobs``).
    engine_args
        Passed to ``vllm.LLM`` as they are (``tensor_parallel_size``, ``gpu_memory_utilization``,
        ``max_model_len``…); they override the defaults chosen here.
    native
        ``None`` tries the native path first where the platform can run it; ``False`` forces
        the logits-processor path; ``True`` requires the native path.
    verbose
        Show vLLM's start-up logging and warnings; by default only errors are shown.
    """

    name = "vllm"

    def __init__(self, config: EngineConfig | None = None, *, engine_args: dict | None = None,
                 native: bool | None = None, verbose: bool = False) -> None:
        config = config or EngineConfig()
        if isinstance(config.model, torch.nn.Module):
            raise TypeError("the vllm engine loads its model itself: pass a folder or a "
                            "model name, not a loaded module")
        self.model_label = model_label(config.model)
        self.tokenizer_source = config.model
        self.top_k = config.top_k
        self.dtype = str(resolve_dtype(config.dtype)).replace("torch.", "")
        args = {"model": str(hf_folder(config.model)), "dtype": self.dtype, "seed": 0,
                "max_logprobs": max(config.top_k, 20), "logprobs_mode": "raw_logprobs",
                "enable_prefix_caching": False, "use_tqdm_on_load": verbose}
        if config.batch_size:
            args["max_num_seqs"] = config.batch_size
        if not torch.cuda.is_available():
            # the CPU build compiles the model with inductor at start-up (minutes on 2 cores)
            args.update(gpu_memory_utilization=0.3, enforce_eager=True)
        args.update(engine_args or {})
        self.deterministic = config.deterministic
        self.batch_invariant_note = (batch_invariance_unavailable(config.device)
                                     if self.deterministic else None)
        self.batch_invariant = self.deterministic and self.batch_invariant_note is None
        if self.batch_invariant_note:
            warnings.warn(f"deterministic=True: {self.batch_invariant_note}; this vLLM run is "
                          "NOT batch-invariant (use engine='torch' or 'prefill' for that)",
                          RuntimeWarning, stacklevel=3)
        self._logs = QuietLogs(verbose)
        self.engine_core = engine_core_mode()
        self._request_ids = itertools.count()
        try:
            # VLLM_BATCH_INVARIANT is read as LLM(...) starts
            with batch_invariant_env(self.batch_invariant), hosted_startup(verbose):
                # an earlier engine's start-up cached the environment this one reads
                getattr(vllm_envs, "disable_envs_cache", lambda: None)()
                self._start(args, native)
        except BaseException:
            self._logs.restore()
            raise
        config = self.llm.llm_engine.model_config
        self.max_model_len = config.max_model_len
        self.batch_size = self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # in-process on CPU, vLLM's forward runs on this process's threads
        self.threads = (engine_threads() if self.device == "cpu"
                        and self.engine_core == "in-process" else None)

    def stats(self) -> dict:
        return {"threads": self.threads} if self.threads is not None else {}

    def _start(self, args: dict, native: bool | None) -> None:
        self.native_error = None
        if native is None:
            native = torch.cuda.is_available() and supports_native_trace_replay()
            required = False
        else:
            required = native
        self.llm = None
        self.lengths_only = False
        if native:
            try:
                self.llm = LLM(**args, enable_trace_replay=True)
                self.engine_path = "vllm-native-trace-replay"
            except (ValueError, TypeError) as exc:
                if required:
                    raise
                self.native_error = f"{type(exc).__name__}: {exc}"
        if self.llm is None:
            processors = list(args.pop("logits_processors", None) or [])
            processors.append(f"{__name__}:TraceForcingProcessor")
            # the user's own processors may read output tokens: then vLLM keeps filling them
            alone = len(processors) == 1 and not args.get("worker_extension_cls")
            if alone:
                args["worker_extension_cls"] = WORKER_EXTENSION
            self.llm = LLM(**args, logits_processors=processors)
            self.engine_path = "vllm-logits-processor-forcing"
            self.lengths_only = alone and read_lengths_only(self.llm)

    def settings(self) -> dict:
        import vllm

        settings = {**super().settings(), "vllm_version": vllm.__version__,
                    "logprobs_mode": "raw_logprobs", "engine_core": self.engine_core}
        if self.native_error:
            settings["native_unavailable"] = self.native_error
        if self.engine_path == "vllm-logits-processor-forcing":
            # whether vLLM still completes output-token lists each step (read_lengths_only)
            settings["output_tokens_to_processors"] = not self.lengths_only
        if self.deterministic:
            settings["batch_invariant"] = self.batch_invariant
            if self.batch_invariant_note:
                settings["batch_invariant_unavailable"] = self.batch_invariant_note
        return settings

    def close(self) -> None:
        """Shut the engine core down and release its model and KV cache."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            self._logs.restore()
            gc.collect()  # in-process, the KV cache is freed only with the engine's cycles

    def _params(self, request: ReplayRequest) -> SamplingParams:
        trace = list(request.trace_token_ids)
        # max_tokens always set: it defaults to 16 and would cut traces (vLLM bug #56730).
        # No min_tokens: it masks EOS to -inf, which would erase a forced EOS.
        # DELTA: each engine step hands back only its new tokens (progress, no re-copying).
        # _NO_COPY: these params are built for this one request and never reused, so vLLM's
        # defensive deep copy (of the whole trace, per request) is not needed
        common = dict(temperature=0.0, max_tokens=len(trace),
                      logprobs=self.top_k, ignore_eos=True, stop=[], stop_token_ids=[],
                      detokenize=False, output_kind=RequestOutputKind.DELTA, **_NO_COPY)
        if self.engine_path == "vllm-native-trace-replay":
            return SamplingParams(**common, trace_decode_token_ids=trace)
        return SamplingParams(**common, extra_args={TRACE_KEY: trace})

    def _generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                  on_tokens: Callable[[int], None] | None) -> list[tuple[list[int], list]]:
        """Step the engine until every prompt is done: ``(token ids, logprobs)`` per prompt.

        ``LLM.generate`` reports only finished requests; stepping ``llm_engine`` (the loop it
        runs) with DELTA outputs counts every token as it is decoded.
        """
        engine = self.llm.llm_engine
        slots = {}
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            request_id = str(next(self._request_ids))
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), param)
            slots[request_id] = index
        outputs: list[tuple[list[int], list]] = [([], []) for _ in prompts]
        try:
            with intra_op_threads(self.threads):
                while engine.has_unfinished_requests():
                    new = 0
                    for out in engine.step():
                        ids, logprobs = outputs[slots[out.request_id]]
                        completion = out.outputs[0]
                        ids.extend(completion.token_ids)
                        logprobs.extend(completion.logprobs or ())
                        new += len(completion.token_ids)
                    if on_tokens is not None and new:
                        on_tokens(new)
        except BaseException:
            # an interrupted run must not leave its requests to the next one
            engine.abort_request(list(slots))
            raise
        return outputs

    def run(self, requests: Sequence[ReplayRequest], *,
            on_tokens: Callable[[int], None] | None = None) -> list[TraceResult]:
        """Replay ``requests`` in one batch; results in the order given."""
        outputs = self._generate([r.prompt_token_ids for r in requests],
                                 [self._params(r) for r in requests], on_tokens)
        return [self._result(r, *out) for r, out in zip(requests, outputs)]

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                 temperature: float = 0.0, seed: int = 0,
                 eos_token_id: int | None = None) -> list[tuple[list[int], list[float]]]:
        """Free generation for recording: ``(token_ids, raw logprobs)`` per prompt."""
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        outputs = self._generate(prompts, [params] * len(prompts), None)
        return [(ids, [entries[t].logprob for t, entries in zip(ids, logprobs)])
                for ids, logprobs in outputs]

    def _result(self, request: ReplayRequest, emitted: list[int], logprobs: list) -> TraceResult:
        if emitted != list(request.trace_token_ids):
            first = next((i for i, (a, b) in enumerate(zip(emitted, request.trace_token_ids))
                          if a != b), min(len(emitted), request.trace_len))
            raise RuntimeError(
                f"trace {request.trace_id!r}: vLLM ({self.engine_path}) emitted {len(emitted)} tokens "
                f"that leave the trace at step {first}; replay cannot be trusted")
        steps = request.trace_len
        logprob = np.empty(steps)
        rank = np.empty(steps, dtype=np.int64)
        top_ids = np.zeros((steps, self.top_k), dtype=np.int64)
        top_lps = np.full((steps, self.top_k), np.nan)
        for step, token in enumerate(emitted):
            entries = logprobs[step]
            logprob[step] = entries[token].logprob
            rank[step] = entries[token].rank
            ordered = sorted(((e.rank, tid, e.logprob) for tid, e in entries.items()
                              if e.rank is not None and e.rank <= self.top_k))
            for j, (_, tid, lp) in enumerate(ordered[: self.top_k]):
                top_ids[step, j], top_lps[step, j] = tid, lp
        return TraceResult(trace_id=request.trace_id, prompt_len=request.prompt_len,
                           token_ids=np.asarray(emitted, dtype=np.int64), logprob=logprob,
                           rank=rank, top_token_ids=top_ids, top_logprobs=top_lps,
                           entropy=np.full(steps, np.nan))
