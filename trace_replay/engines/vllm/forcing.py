"""vLLM's forcing path: a logits processor that makes each trace token the argmax.

vLLM has two model runners, each with its own logits-processor interface: V1 (the CPU
build, ``VLLM_USE_V2_MODEL_RUNNER=0``, configs Model Runner V2 does not take) and Model
Runner V2 (the GPU default). vLLM is given one name, :class:`TraceForcingProcessor`; the
loader of the runner in use checks it against that runner's interface and builds it with
that runner's arguments, and it becomes :class:`V1TraceForcing` or :class:`V2TraceForcing`.
Nothing has to guess the runner before the engine starts.

This module imports vllm (it subclasses vLLM's two interfaces) and is imported only by
:mod:`~trace_replay.engines.vllm.engine`, the package's vLLM engine: it is that module's
half that vLLM's worker loads by name, kept apart to keep each file readable.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsProcessor as V2LogitsProcessor,
)

from trace_replay.engines.replay_state import RequestState, TraceReplayState
from trace_replay.engines.vllm_contract import TRACE_KEY

__all__ = [
    "FORCED_LOGIT",
    "ForcingWorkerExtension",
    "TraceForcingProcessor",
    "V1TraceForcing",
    "V2TraceForcing",
    "WORKER_EXTENSION",
    "model_runner",
    "read_lengths_only",
]

# what a forced token's logit becomes (see V1TraceForcing)
FORCED_LOGIT = 1e30

_NO_OUTPUT: tuple = ()


def _trace(params: SamplingParams) -> list[int] | None:
    return (params.extra_args or {}).get(TRACE_KEY)


def validate_trace(params: SamplingParams) -> None:
    """Refuse a request whose trace is empty or holds something other than token ids."""
    trace = _trace(params)
    if trace is None:
        return
    if not trace or not all(isinstance(t, int) and t >= 0 for t in trace):
        raise ValueError(f"{TRACE_KEY} must be a non-empty list of non-negative token ids")


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


def read_lengths_only(llm) -> bool:
    """Tell ``llm``'s V1 workers that its custom logits processors never read output tokens.

    vLLM V1 hands logits processors each request's output-token list and, not knowing what
    a custom processor reads, fills those lists in before every sampling step; under async
    scheduling that means waiting for the previous step's token copy and a Python loop
    over the batch, every step. :class:`V1TraceForcing` reads only their lengths, which
    vLLM keeps right either way (a placeholder per step under async scheduling). ``llm``
    must have been started with ``worker_extension_cls=WORKER_EXTENSION``; call this only
    where the forcing processor is the sole custom one (the flag is global to the batch).
    Returns whether every worker took it (False where the extension is missing, or the
    runner has no such lists: Model Runner V2 never builds them).
    """
    try:
        return all(llm.collective_rpc("trace_replay_read_lengths_only"))
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def model_runner(llm) -> str:
    """``"v2"`` when ``llm`` runs Model Runner V2, else ``"v1"``.

    vLLM's own choice, from the engine's configuration and the environment it started in
    (which the engine leaves as it was).
    """
    return "v2" if getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False) else "v1"


class V1TraceForcing(V1LogitsProcessor):
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
        validate_trace(params)

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
            self._place(index, _trace(params), len(prompt_ids or ()), output_ids)
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
        self.trace_state.force_logits(logits, self._rows[:rows], value=FORCED_LOGIT, advance=True)
        return logits

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """``values`` as int32 on the device, sent from pinned memory without waiting."""
        host = torch.tensor(values, dtype=torch.int32, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=True)


class _RunnerLengths:
    """Model Runner V2's per-slot lengths, seen as the package's ``RequestState``.

    Read at each use, never kept: MRV2 swaps the tensor behind ``prompt_len.gpu`` (a pool
    of host-mapped buffers) whenever it writes it.
    """

    def __init__(self, req_states) -> None:
        self._runner = req_states
        self.max_num_reqs = req_states.max_num_reqs
        self.device = torch.device(req_states.device)

    @property
    def prompt_len(self) -> torch.Tensor:
        return self._runner.prompt_len.gpu

    @property
    def total_len(self) -> torch.Tensor:
        return self._runner.total_len.gpu


class V2TraceForcing(V2LogitsProcessor):
    """Force each request's trace through Model Runner V2's sampler by raising its token's
    logit to ``FORCED_LOGIT``: as :class:`V1TraceForcing`, with MRV2's own state.

    Design contract: MRV2 keeps every slot's ``prompt_len`` and ``total_len`` on the device
    and advances ``total_len`` itself after each step (chunked prefill and preemption
    included), so the replay step ``total_len - prompt_len`` is read there: per step the
    host sends nothing and reads nothing, and the one kernel only writes each traced row's
    trace-token logit. Traces are staged in ``add_request`` and sent in
    ``apply_staged_writes`` (one copy, only when requests arrived). MRV2 runs custom
    processors on a float32 copy of the logits and, with ``logprobs_mode="raw_logprobs"``,
    computes logprobs from the logits before that copy, so forcing never changes them.
    Speculative decoding (several logits rows per request) is refused at start: a row's
    step would need its draft offset.
    """

    def __init__(self, vllm_config, req_states) -> None:
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError(
                "trace forcing on Model Runner V2 does not support speculative "
                "decoding; use VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self.trace_state = TraceReplayState(_RunnerLengths(req_states))

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        validate_trace(params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        trace = _trace(sampling_params)
        self.trace_state.add_request(req_idx, trace)  # None clears the slot's last trace
        return trace is not None

    def apply_staged_writes(self) -> None:
        self.trace_state.apply_staged_writes()

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        self.trace_state.force_logits(logits, ctx.expanded_idx_mapping, value=FORCED_LOGIT)
        return logits


# the two runners' bases declare apply() differently; no instance of this class is made
# (__new__ returns one runner's processor), so the clash is never called through
class TraceForcingProcessor(V1LogitsProcessor, V2LogitsProcessor):  # type: ignore[misc]
    """The forcing processor as vLLM is given it (``logits_processors=[...]``, ``vllm serve
    --logits-processors``), for either model runner.

    It passes both runners' class checks; built with V1's arguments ``(vllm_config,
    device, is_pin_memory)`` it returns a :class:`V1TraceForcing`, with V2's
    ``(vllm_config, req_states)`` a :class:`V2TraceForcing`.
    """

    def __new__(cls, vllm_config, *args):
        if len(args) == 1:
            return V2TraceForcing(vllm_config, *args)
        return V1TraceForcing(vllm_config, *args)

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        validate_trace(params)
