"""vLLM replay: with its forcing half (forcing.py), the only module that imports vllm.

Two paths, chosen at start-up and recorded in ``settings()["engine_path"]``:

* **native** — vLLM builds with Model Runner V2 and ``enable_trace_replay`` (GPU): the
  sampler itself overwrites each sampled token with ``trace_decode_token_ids[step]``.
* **forcing** — everything else (the CPU build, older vLLM, configs MRV2's trace replay
  rejects, ``native=False``): the logits processor
  :class:`~trace_replay.engines.vllm.forcing.TraceForcingProcessor`, for whichever model
  runner vLLM uses, raises the trace token's logit to 1e30. ``logprobs_mode="raw_logprobs"``
  makes vLLM compute the reported logprobs *before* logits processors run, so logprob,
  rank and top-k are those of the unmodified distribution. ``settings()`` says why native
  was not used (``native_unavailable``) and which runner ran (``model_runner``).

The engine core runs in this process, started quietly and leaving the process as it was
(:mod:`~trace_replay.engines.vllm.inprocess`); a line on stderr says an engine is starting and
when it is ready. On the CPU its KV cache is sized to the work it can be given
(``max_num_seqs x max_model_len``, at most 30% of memory), so engines coexist. Entropy is
not reported by vLLM; the column is NaN for this engine.

Tensor and pipeline parallelism (``engine_args={"tensor_parallel_size": 2}``) are vLLM's:
its executor starts one worker process per device (forked, or spawned where the caller has
already initialized CUDA, and a spawned worker re-imports ``__main__``, so such scripts need
the ``if __name__ == "__main__":`` guard), also with the engine core in this process. Every
rank samples from the gathered logits with its own copy of the sampler state, so the native
path and the forcing processor (one instance per rank, fed the same requests) force the same
token on every rank. Sizes are checked before vLLM starts (positive integers; on CUDA no more
devices than are visible; vLLM's CPU build runs them over gloo, one NUMA node or
``VLLM_CPU_OMP_THREADS_BIND`` CPU list per rank) and recorded in
``settings()``; with several GPUs, NVLink multicast is kept off for the engine's processes
(:func:`~trace_replay.engines.vllm.inprocess.multicast_off`).

``deterministic=True`` turns on vLLM's own batch-invariant mode (``VLLM_BATCH_INVARIANT=1``
for the engine's processes) where vLLM supports it — NVIDIA GPUs of compute capability
>= 8.0, AMD Instinct, Intel XPU. Elsewhere (the CPU build) vLLM has no such mode: the run
goes ahead with a warning, and ``settings()["deterministic_active"]`` is False.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from vllm import LLM, SamplingParams
from vllm import envs as vllm_envs
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from trace_replay.engines.base import EngineBase, EngineConfig, ReplayRequest, TraceResult
from trace_replay.engines.distributions import tail_from_top
from trace_replay.engines.threads import engine_threads, intra_op_threads
from trace_replay.engines.vllm.deterministic import deterministic_env, deterministic_unavailable
from trace_replay.engines.vllm.forcing import (
    FORCED_LOGIT,
    WORKER_EXTENSION,
    ForcingWorkerExtension,
    TraceForcingProcessor,
    model_runner,
    read_lengths_only,
)
from trace_replay.engines.vllm.inprocess import (
    QuietLogs,
    engine_core_mode,
    hosted_startup,
    multicast_off,
)
from trace_replay.engines.vllm_contract import TRACE_KEY
from trace_replay.models.load import (
    check_weight_files,
    folder_digest,
    hf_folder,
    model_label,
    resolve_dtype,
)
from trace_replay.traces.trace import TraceError

__all__ = [
    "FORCED_LOGIT",
    "PARALLEL_OPTIONS",
    "VLLMEngine",
    "TraceForcingProcessor",
    "ForcingWorkerExtension",
    "WORKER_EXTENSION",
    "parallel_sizes",
    "read_lengths_only",
    "supports_native_trace_replay",
]


def _has_param(name: str) -> bool:
    return name in inspect.signature(SamplingParams.__init__).parameters or name in getattr(
        SamplingParams, "__struct_fields__", ()
    )


# vLLM deep-copies every request's SamplingParams unless told not to (older releases cannot)
_NO_COPY: dict[str, Any] = {"skip_clone": True} if _has_param("skip_clone") else {}
# logprobs as a few flat lists per request instead of a dict and a Logprob object per entry
# (older releases cannot; _Logprobs reads both forms alike)
_FLAT: dict[str, Any] = {"flat_logprobs": True} if _has_param("flat_logprobs") else {}


def supports_native_trace_replay() -> bool:
    """Whether this vLLM knows ``SamplingParams.trace_decode_token_ids``."""
    return _has_param("trace_decode_token_ids")


def native_unavailable(native: bool | None) -> str | None:
    """Why the native path is not tried here (None when it is)."""
    if native is False:
        return "native=False"
    if not supports_native_trace_replay():
        import vllm

        return (
            f"vLLM {vllm.__version__} has no SamplingParams.trace_decode_token_ids "
            "(native trace replay needs vLLM >= 0.29 with Model Runner V2)"
        )
    if native is None and not torch.cuda.is_available():
        return "no CUDA device: native trace replay needs Model Runner V2, which vLLM runs on GPUs"
    return None


PARALLEL_OPTIONS = ("tensor_parallel_size", "pipeline_parallel_size")
# the attention backend a float32 engine on CUDA starts with, unless engine_args name one: the
# CUDA backends that accept float32 are TRITON_ATTN (TF32 dot products) and FLEX_ATTENTION
FLOAT32_ATTENTION = "FLEX_ATTENTION"
_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM CPU: "auto" binds each rank to a NUMA node


def parallel_sizes(args: dict, cuda_devices: int | None) -> dict[str, int]:
    """The tensor and pipeline parallel sizes of vLLM arguments ``args``, checked.

    Each must be a positive integer (absent: 1). ``cuda_devices`` is the number of CUDA
    devices visible; their product, one device per rank, must not exceed it. ``None``: no
    CUDA, vLLM's CPU build, which runs ranks as processes over gloo, each bound to a NUMA node
    of its own unless ``VLLM_CPU_OMP_THREADS_BIND`` gives each rank its CPUs: too few nodes
    are refused here, not deep in vLLM's start-up.
    Returns ``{"tensor_parallel_size": ..., "pipeline_parallel_size": ...}``.
    """
    sizes = {}
    for option in PARALLEL_OPTIONS:
        value = args.get(option, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"engine_args[{option!r}] must be a positive integer, got {value!r}")
        sizes[option] = value
    ranks = sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"]
    if cuda_devices is not None and ranks > cuda_devices:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"tensor_parallel_size {sizes['tensor_parallel_size']} x pipeline_parallel_size "
            f"{sizes['pipeline_parallel_size']} needs {ranks} CUDA devices, one per rank, but "
            f"{cuda_devices} {'is' if cuda_devices == 1 else 'are'} visible"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
        )
    if cuda_devices is None and ranks > 1 and os.environ.get(_CPU_BIND, "auto") == "auto":
        from vllm.utils.cpu_resource_utils import get_visible_memory_node

        nodes = len(get_visible_memory_node())
        if nodes < ranks and os.environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") == "0":
            raise ValueError(
                f"tensor_parallel_size {sizes['tensor_parallel_size']} x pipeline_parallel_size "
                f"{sizes['pipeline_parallel_size']} on vLLM's CPU build binds each of the {ranks} "
                f"ranks to a NUMA node of its own, and {nodes} {'is' if nodes == 1 else 'are'} "
                f"visible: set {_CPU_BIND} to one CPU list per rank, e.g. "
                f"{'|'.join(str(i) for i in range(ranks))!r}"
            )
    return sizes


# vLLM's KV cache block, in tokens: a request holds whole blocks
_BLOCK = 16


def kv_cache_bytes(
    folder: str | os.PathLike,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_model_len: int | None,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> int:
    """KV cache bytes one rank holds for ``max_num_seqs`` requests of ``max_model_len``
    tokens each.

    Reads the layer, key-value head and head sizes from the folder's ``config.json``;
    ``max_model_len`` None means the model's ``max_position_embeddings``. A rank holds its
    share of the key-value heads (at least one: vLLM replicates heads when there are fewer
    than ``tensor_parallel_size``) and of the layers.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    heads = max(1, heads // tensor_parallel_size)
    layers = -(-config["num_hidden_layers"] // pipeline_parallel_size)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * layers * heads * head_dim * dtype.itemsize
    tokens = max_model_len or config["max_position_embeddings"]
    blocks = -(-tokens // _BLOCK) + 1  # a block of slack per request
    return max_num_seqs * blocks * _BLOCK * per_token


def _cpu_kv_cache_bytes(args: dict, dtype: torch.dtype, sizes: dict[str, int]) -> int:
    """The CPU build's KV cache per rank (vLLM's ``kv_cache_memory_bytes`` is per worker):
    the work the engine can be given, all ranks together at most 30% of memory (vLLM's own
    default there is 30% of memory, whatever the work: a second engine in the same process
    then finds too little left)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    work = kv_cache_bytes(
        args["model"],
        dtype,
        args.get("max_num_seqs", _CPU_MAX_NUM_SEQS),
        args.get("max_model_len"),
        **sizes,
    )
    return min(work, int(0.3 * memory) // math.prod(sizes.values()))


# vLLM's max_num_seqs on the CPU when none is given (its LLM-class default there)
_CPU_MAX_NUM_SEQS = 256


class _Logprobs:
    """One request's logprobs, kept flat: for each position, the emitted token's entry
    first, then the top-k in rank order.

    vLLM gives, per position, the emitted token with its own rank, then the top-k with
    their places 1..k. Where the emitted token is among those k, the rank reported is its
    top-k place: vLLM's dict form merges the two entries that way (so a token tied with a
    better one is rank 1 when vLLM listed it first, as greedy output says), and the flat
    form (``flat_logprobs``, asked for where vLLM has it: no dict and no ``Logprob`` object
    per entry, which cost more host time than the rest of a replay step's output at batch
    256) is read with the same rule, so both forms give the same arrays.
    """

    __slots__ = ("token_ids", "logprobs", "ranks", "counts", "routed")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.counts: list[int] = []  # entries per position
        self.routed = None  # vLLM's routed experts [positions, layers, top-k], when asked

    def extend(self, positions) -> None:
        """Append vLLM's ``CompletionOutput.logprobs``: a ``FlatLogprobs``, or one
        ``{token_id: Logprob}`` per position (emitted token first)."""
        if hasattr(positions, "start_indices"):  # FlatLogprobs, its entries in vLLM's order
            self.token_ids += positions.token_ids
            self.logprobs += positions.logprobs
            self.ranks += positions.ranks
            self.counts += map(int.__sub__, positions.end_indices, positions.start_indices)
            return
        for entries in positions:
            token, first = next(iter(entries.items()))
            top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None)
            flat = [(first.rank, token, first.logprob), *top]
            for rank, token_id, logprob in flat:
                self.token_ids.append(token_id)
                self.logprobs.append(logprob)
                self.ranks.append(rank)
            self.counts.append(len(flat))

    def arrays(self, top_k: int) -> tuple[np.ndarray, ...]:
        """``(emitted, logprob, rank, top_ids, top_logprobs)`` per position; the top-k are
        the entries of rank <= ``top_k``, and slots left empty hold id 0 and NaN."""
        counts = np.asarray(self.counts, dtype=np.int64)
        first = np.cumsum(counts) - counts
        token_ids = np.asarray(self.token_ids, dtype=np.int64)
        logprobs = np.asarray(self.logprobs, dtype=np.float64)
        ranks = np.asarray(self.ranks, dtype=np.int64)
        slot = np.arange(1, top_k + 1)
        at = np.where(slot < counts[:, None], first[:, None] + slot, 0)
        filled = (slot < counts[:, None]) & (ranks[at] <= top_k)  # entries come in rank order
        emitted, rank = token_ids[first], ranks[first]
        if top_k:  # the emitted token's top-k place, where it is listed there
            listed = filled & (token_ids[at] == emitted[:, None])
            place = np.take_along_axis(ranks[at], listed.argmax(axis=1)[:, None], axis=1)[:, 0]
            rank = np.where(listed.any(axis=1), place, rank)
        return (
            emitted,
            logprobs[first],
            rank,
            np.where(filled, token_ids[at], 0),
            np.where(filled, logprobs[at], np.nan),
        )


class _StepProgress:
    """Tokens decoded so far, for progress reports while vLLM's outputs come only as
    requests finish.

    Each engine step decodes one token for every request still running (a batch fits the
    engine's ``max_num_seqs``, so its requests run together), so an unfinished request
    counts one token per step so far, held one short of its length; a finished request
    counts the tokens it emitted. A request that waited (a prompt split over steps, a KV
    cache too small for the batch) is counted ahead while it runs and set right when it
    finishes. The count is exact once all have finished and never goes back.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.done = np.zeros(len(self.lengths), dtype=bool)
        self.steps = self.reported = 0

    def step(self, finished: Sequence[tuple[int, int]]) -> int:
        """One engine step, ``finished`` ``(index, tokens emitted)`` pairs: the tokens to
        report now."""
        self.steps += 1
        for index, emitted in finished:
            self.done[index], self.lengths[index] = True, emitted
        running = np.minimum(self.steps, np.maximum(self.lengths - 1, 0))
        total = int(np.where(self.done, self.lengths, running).sum())
        new = max(total - self.reported, 0)
        self.reported += new
        return new


class VLLMEngine(EngineBase):
    """Replay through ``vllm.LLM`` (native trace replay when available, else forcing).

    The engine core runs in this process (:mod:`~trace_replay.engines.vllm.inprocess`), so a
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
        ``max_model_len``…); they override the defaults chosen here. ``tensor_parallel_size``
        and ``pipeline_parallel_size`` are checked first (:func:`parallel_sizes`) and recorded
        in ``settings()``.
    native
        ``None`` tries the native path first where the platform can run it; ``False`` forces
        the logits-processor path; ``True`` requires the native path.
    verbose
        Show vLLM's start-up logging and warnings; by default only errors are shown.
    """

    name = "vllm"

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine_args: dict | None = None,
        native: bool | None = None,
        verbose: bool = False,
    ) -> None:
        config = config or EngineConfig()
        if isinstance(config.model, torch.nn.Module):
            raise TypeError(
                "the vllm engine loads its model itself: pass a folder or a "
                "model name, not a loaded module"
            )
        self.model_label = model_label(config.model)
        self.tokenizer_source = config.model
        self.top_k = config.top_k
        self.dtype = str(resolve_dtype(config.dtype)).replace("torch.", "")
        self.folder = hf_folder(config.model)
        check_weight_files(self.folder)  # a cut file is named here, not deep in vLLM's load
        args = {
            "model": str(self.folder),
            "dtype": self.dtype,
            "seed": 0,
            "max_logprobs": max(config.top_k, 20),
            "logprobs_mode": "raw_logprobs",
            "enable_prefix_caching": False,
            "use_tqdm_on_load": verbose,
        }
        if config.batch_size:
            args["max_num_seqs"] = config.batch_size
        args.update(engine_args or {})
        cuda = torch.cuda.is_available()
        # MoE routing per step (R3): vLLM returns it from Model Runner V2, on GPUs only
        self.returns_routing = bool(args.get("enable_return_routed_experts"))
        if self.returns_routing and "enable_prefix_caching" not in (engine_args or {}):
            # vLLM hands routed experts out through a connector that requires prefix caching
            # ("AuxOutput Connector requires prefix caching", 0.32, H100); the recorded rows
            # start at the last prompt token, which a prefix hit always recomputes
            args["enable_prefix_caching"] = True
        if self.returns_routing and not cuda:
            raise ValueError(
                "engine_args enable_return_routed_experts needs vLLM's Model "
                "Runner V2, which runs on GPUs only: the CPU build refuses it at "
                "start-up. Record routing on the CPU with the prefill engine "
                "(trace_replay.analysis.routing.record_routing)"
            )
        self.routed: dict[str, np.ndarray] = {}  # trace id -> [T, layers, top-k] experts
        if cuda and self.dtype == "float32":
            # vLLM's default float32 backend on CUDA (TRITON_ATTN) multiplies in TF32 (Triton's
            # tl.dot default): max |d logprob| 0.21 against IEEE float32; FlexAttention's is 1.7e-4
            args.setdefault("attention_backend", FLOAT32_ATTENTION)
        self.parallel = parallel_sizes(args, torch.cuda.device_count() if cuda else None)
        ranks = math.prod(self.parallel.values())
        if not cuda:
            # the CPU build compiles the model with inductor at start-up (minutes on 2 cores)
            args.setdefault("enforce_eager", True)
            if "kv_cache_memory_bytes" not in args and "gpu_memory_utilization" not in args:
                args["kv_cache_memory_bytes"] = _cpu_kv_cache_bytes(
                    args, resolve_dtype(config.dtype), self.parallel
                )
        self.llm_args = dict(args)  # what vllm.LLM is given (besides the path's own)
        self.deterministic = config.deterministic
        self.deterministic_note = (
            deterministic_unavailable(config.device) if self.deterministic else None
        )
        self.deterministic_active = self.deterministic and self.deterministic_note is None
        if self.deterministic_note:
            warnings.warn(
                f"deterministic=True: {self.deterministic_note}; this vLLM run is "
                "NOT batch-invariant (use engine='torch' or 'prefill' for that)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._logs = QuietLogs(verbose)
        self.engine_core = engine_core_mode()
        self._request_ids = itertools.count()
        started = time.monotonic()
        print(
            f"trace_replay: starting vLLM on {self.model_label} (loading and warming up the "
            "model takes a while; make_engine once and reuse the engine)",
            file=sys.stderr,
            flush=True,
        )
        try:
            # VLLM_BATCH_INVARIANT is read as LLM(...) starts; worker processes (ranks > 1)
            # and an engine core of its own outlive start-up with its environment
            workers = ranks > 1 or self.engine_core != "in-process"
            with (
                deterministic_env(self.deterministic_active),
                multicast_off(cuda and ranks > 1),
                hosted_startup(verbose, workers=workers),
            ):
                # an earlier engine's start-up cached the environment this one reads
                getattr(vllm_envs, "disable_envs_cache", lambda: None)()
                self._start(args, native)
        except BaseException:
            self._logs.restore()
            raise
        print(
            f"trace_replay: vLLM ready in {time.monotonic() - started:.0f} s "
            f"({self.engine_path}, model runner {self.model_runner})",
            file=sys.stderr,
            flush=True,
        )
        assert self.llm is not None  # _start made it
        model_config = self.llm.llm_engine.model_config
        self.max_model_len = model_config.max_model_len
        # what vLLM runs: engine_args' method, or one the checkpoint declares (None: unquantized)
        self.quantization = str(model_config.quantization or "none")
        self.batch_size = self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # in-process on CPU with one rank, vLLM's forward runs on this process's threads
        self.threads = (
            engine_threads()
            if self.device == "cpu" and ranks == 1 and self.engine_core == "in-process"
            else None
        )

    def stats(self) -> dict:
        return {"threads": self.threads} if self.threads is not None else {}

    def _start(self, args: dict, native: bool | None) -> None:
        self.native_error = native_unavailable(native)
        self.llm = None
        self.lengths_only = False
        if self.native_error is None:
            try:
                self.llm = LLM(**args, enable_trace_replay=True)
                self.engine_path = "vllm-native-trace-replay"
            except (ValueError, TypeError) as exc:
                if native:
                    raise
                self.native_error = f"{type(exc).__name__}: {exc}"
        elif native:
            raise ValueError(f"native=True, but {self.native_error}")
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
        self.model_runner = model_runner(self.llm)

    @property
    def vocab_size(self) -> int | None:
        """Logits per step: the served model's vocabulary (``None`` once closed)."""
        return None if self.llm is None else int(self.llm.llm_engine.model_config.get_vocab_size())

    def weights_digest(self) -> str:
        """The model folder's weight files as they are now (:func:`~trace_replay.models.load.
        folder_digest`)."""
        return folder_digest(self.folder)

    def settings(self) -> dict:
        import vllm

        settings = {
            **super().settings(),
            "vllm_version": vllm.__version__,
            "logprobs_mode": "raw_logprobs",
            "engine_core": self.engine_core,
            **self.parallel,
        }
        settings["model_runner"] = self.model_runner
        settings["attention_backend"] = str(
            self.llm_args.get("attention_backend") or "vllm default"
        )
        settings["quantization"] = self.quantization
        if self.native_error:
            settings["native_unavailable"] = self.native_error
        if self.engine_path == "vllm-logits-processor-forcing":
            # whether vLLM still completes output-token lists each step (read_lengths_only);
            # Model Runner V2 never builds them
            settings["output_tokens_to_processors"] = (
                self.model_runner == "v1" and not self.lengths_only
            )
        if self.deterministic:
            settings["deterministic_active"] = self.deterministic_active
            if self.deterministic_note:
                settings["deterministic_unavailable"] = self.deterministic_note
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
        # FINAL_ONLY: one output per request, when it is done (see _generate).
        # _NO_COPY: these params are built for this one request and never reused, so vLLM's
        # defensive deep copy (of the whole trace, per request) is not needed
        common: dict[str, Any] = dict(
            temperature=0.0,
            max_tokens=len(trace),
            logprobs=self.top_k,
            ignore_eos=True,
            stop=[],
            stop_token_ids=[],
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **_NO_COPY,
            **_FLAT,
        )
        if self.returns_routing:  # rows from the last prompt token: row s routes step s
            common["routed_experts_prompt_start"] = request.prompt_len - 1
        if self.engine_path == "vllm-native-trace-replay":
            return SamplingParams(**common, trace_decode_token_ids=trace)
        return SamplingParams(**common, extra_args={TRACE_KEY: trace})

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        on_tokens: Callable[[int], None] | None,
    ) -> list[tuple[list[int], _Logprobs]]:
        """Step the engine until every prompt is done: ``(token ids, logprobs)`` per prompt.

        Requests give vLLM's ``FINAL_ONLY`` output (one per request, when it finishes): a
        ``DELTA`` output per request and step cost the front end ~8 µs each, which at batch
        256 is more host time than the rest of a step's output (measured, HISTORY.md). Progress
        in between is :class:`_StepProgress`'s count.
        """
        assert self.llm is not None, "a closed engine runs nothing (EngineClosed first)"
        engine = self.llm.llm_engine
        slots = {}
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            request_id = str(next(self._request_ids))
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), param)
            slots[request_id] = index
        outputs: list = [None] * len(prompts)
        progress = _StepProgress([p.max_tokens or 0 for p in params]) if on_tokens else None
        try:
            with intra_op_threads(self.threads):
                while engine.has_unfinished_requests():
                    finished = []
                    for out in engine.step():
                        out = cast(RequestOutput, out)  # a generating model's outputs
                        index = slots[out.request_id]
                        completion = out.outputs[0]
                        logprobs = _Logprobs()
                        logprobs.extend(completion.logprobs or ())
                        logprobs.routed = getattr(completion, "routed_experts", None)
                        outputs[index] = (list(completion.token_ids), logprobs)
                        finished.append((index, len(completion.token_ids)))
                    if on_tokens and progress is not None and (new := progress.step(finished)):
                        on_tokens(new)
        except BaseException:
            # an interrupted run must not leave its requests to the next one
            engine.abort_request(list(slots))
            raise
        return outputs

    def run(
        self, requests: Sequence[ReplayRequest], *, on_tokens: Callable[[int], None] | None = None
    ) -> list[TraceResult]:
        """Replay ``requests`` in one batch; results in the order given.

        A request whose prompt and trace exceed ``max_model_len`` is refused, naming its
        trace, before any is started (vLLM would silently cut a native trace).
        """
        for r in requests:
            if self.max_model_len is not None and r.prompt_len + r.trace_len > self.max_model_len:
                raise TraceError(
                    f"prompt ({r.prompt_len}) + trace ({r.trace_len}) tokens "
                    f"exceed the engine's max_model_len {self.max_model_len}",
                    trace_id=r.trace_id,
                )
        outputs = self._generate(
            [r.prompt_token_ids for r in requests], [self._params(r) for r in requests], on_tokens
        )
        return [self._result(r, *out) for r, out in zip(requests, outputs)]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id: int | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """Free generation for recording: ``(token_ids, raw logprobs)`` per prompt."""
        params = SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=max_tokens,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **_FLAT,
        )
        outputs = self._generate(prompts, [params] * len(prompts), None)
        return [(ids, logprobs.arrays(0)[1].tolist()) for ids, logprobs in outputs]

    def _result(
        self, request: ReplayRequest, emitted: list[int], logprobs: _Logprobs
    ) -> TraceResult:
        if emitted != list(request.trace_token_ids):
            first = next(
                (i for i, (a, b) in enumerate(zip(emitted, request.trace_token_ids)) if a != b),
                min(len(emitted), request.trace_len),
            )
            raise RuntimeError(
                f"trace {request.trace_id!r}: vLLM ({self.engine_path}) emitted {len(emitted)} tokens "
                f"that leave the trace at step {first}; replay cannot be trusted"
            )
        token_ids, logprob, rank, top_ids, top_lps = logprobs.arrays(self.top_k)
        if self.returns_routing:
            if logprobs.routed is None:
                raise RuntimeError(
                    f"trace {request.trace_id!r}: vLLM returned no routed "
                    "experts (is the model a mixture of experts?)"
                )
            self.routed[request.trace_id] = np.asarray(logprobs.routed)[: request.trace_len]
        return TraceResult(
            trace_id=request.trace_id,
            prompt_len=request.prompt_len,
            token_ids=token_ids,
            logprob=logprob,
            rank=rank,
            top_token_ids=top_ids,
            top_logprobs=top_lps,
            entropy=np.full(request.trace_len, np.nan),
            # raw logprobs: the unmodified distribution's top-k
            tail_logmass=tail_from_top(top_lps),
        )
