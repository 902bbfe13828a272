"""The transformers model's own forward over a static KV cache, compiled and graph-captured on GPU.

A :class:`~trace_replay.engines.builtin.backends.base.Backend`, like
:class:`~trace_replay.engines.builtin.backends.hf.HFBackend`. The forward is the model's own
code (embedding, its decoder layers, norms, rotary, soft-capping, lm_head) run on a *view* of
the model (:mod:`~trace_replay.engines.builtin.backends.static_view`): shallow copies down to
the attention modules, sharing every weight, whose config selects
:func:`~trace_replay.engines.builtin.backends.static_cache.grouped_attention` and whose
layers read and write a
:class:`~trace_replay.engines.builtin.backends.static_cache.StaticKVCache`. The model itself
is never modified, so other backends can keep using it.

On CUDA a decode step is captured once per (rows, cache length, tokens per row) in a CUDA
graph and launched: no host synchronization in ``decode`` or ``keep``. Inside the capture the
decoder layers run compiled by ``torch.compile`` — one compiled region that all layers of a
kind share (the layers differ only in their weights), so start-up compiles one layer per
shape rather than the whole model. A float32 model's view multiplies on tensor cores with
the 3xTF32 split (``float32_matmul``); a bfloat16 or float16 model's, at one row (batch-1
decode steps), through :func:`~trace_replay.kernels.gemv.gemv`, with the batch-1 fusions
unless turned off (:mod:`~trace_replay.engines.builtin.passes.batch1_fusions`); the compiler
puts the linears that read the same input (q/k/v, gate/up) in one launch each
(:mod:`~trace_replay.engines.builtin.passes.linear_groups`). On CPU everything runs eagerly;
a float32 model's linears there multiply through oneDNN over weights packed once
(:mod:`~trace_replay.engines.builtin.backends.packed_linear`, as vLLM's CPU build does;
``name`` ends ``+onednn``), q/k/v and gate/up each as one product
(:func:`~trace_replay.engines.builtin.backends.static_view.group_linears`), where the
packed copy fits in half the available memory, else through ``F.linear``. A float32 model
on the CPU runs this backend by default (:func:`~trace_replay.engines.builtin.backends.factory.auto_kind`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from trace_replay.engines.base import Activations
from trace_replay.engines.builtin.backends.base import check_float32_matmul
from trace_replay.engines.builtin.backends.captured_step import StepGraph, capture, capture_step
from trace_replay.engines.builtin.backends.packed_linear import (
    PackedLinears,
    packed_copy_fits,
    packed_linears_available,
)
from trace_replay.engines.builtin.backends.static_cache import StaticKVCache, register_attention
from trace_replay.engines.builtin.backends.static_view import layer_forward, model_view
from trace_replay.engines.builtin.passes.compiling import compile_function, layer_passes
from trace_replay.engines.builtin.scoring import scorer_for
from trace_replay.kernels.fp32_linear import fp32_linear
from trace_replay.kernels.gemv import gemv

__all__ = ["StaticCacheBackend", "supports"]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# prefills of up to this many tokens (rows × padded width) are captured in CUDA graphs
PREFILL_GRAPH_TOKENS = 16384
# these rope types recompute inv_freq from the positions seen (data-dependent, host-synced)
_DYNAMIC_ROPE = ("dynamic", "longrope")


def supports(lm) -> bool:
    """Whether :class:`StaticCacheBackend` runs ``lm``.

    True for causal LMs of ``MODEL_TYPES`` (Llama, Mistral, Qwen2/3, Gemma 1/2/3 text) with
    full or sliding-window causal attention and a static RoPE.
    """
    config = getattr(lm, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES or config is None:
        return False
    if config.sub_configs:
        return False
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not layers or not all(hasattr(layer, "self_attn") for layer in layers):
        return False
    if not set(getattr(config, "layer_types", None) or ()) <= set(_LAYER_TYPES):
        return False
    if getattr(config, "use_bidirectional_attention", False):
        return False
    return not _rope_types(getattr(config, "rope_parameters", None)) & set(_DYNAMIC_ROPE)


def _rope_types(params) -> set[str]:
    """Every ``rope_type`` in a (possibly per-layer-type) ``rope_parameters`` dict."""
    if not isinstance(params, dict):
        return set()
    found = {params["rope_type"]} if "rope_type" in params else set()
    for value in params.values():
        found |= _rope_types(value)
    return found


def _windows(config) -> dict[str, int | None]:
    """Sliding window per layer type (``None``: full attention); the one type ``""`` where
    the model's layers do not name theirs."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "layer_types", None):
        return {t: window if t == "sliding_attention" else None for t in set(config.layer_types)}
    if not getattr(config, "use_sliding_window", True):
        window = None
    return {"": window}


class StaticCacheBackend:
    """A transformers model's own forward over a static KV cache; compiled CUDA graphs on GPU.

    Design contract:

    * The cache (:class:`~trace_replay.engines.builtin.backends.static_cache.StaticKVCache`) has a per-row
      write cursor, so rows of one wave advance by different amounts (verify) and ``keep``
      takes dropped drafts back. Positions come from the caller (rotary uses them) and are
      independent of cache slots.
    * The cache length is bucketed (powers of two to 256, then multiples of 256) and a
      wave no larger than the allocated rows reuses cache and graphs (with graphs its rows
      are padded, so a run of waves captures and compiles once; eager, it computes its own
      rows only: :meth:`StaticKVCache.head`).
    * ``decode`` returns a view of the graph's static output: valid until the next
      ``decode``.
    * ``compile_seconds`` sums the time spent compiling and capturing (start-up cost).
    * A bfloat16 or float16 model on CUDA multiplies one-row inputs (batch-1 decode steps,
      a batch-1 prefill's last position) with :func:`~trace_replay.kernels.gemv.gemv` and
      everything else with cuBLAS; both accumulate in float32 and round once, in different
      orders, so they agree to the dtype's rounding. With the batch-1 fusions, at one row
      the RMSNorms, the gated activation and the residual adds after a GEMV are float32
      inside the GEMV launches, rounded once where the model rounds each step: closer to
      the float32 result, equal to the model's to the dtype's rounding. ``name`` does not
      change with them; ``settings()`` says when they were turned off where they run.

    Parameters
    ----------
    lm
        A transformers causal LM for which :func:`supports` is true.
    pad_id
        Token fed at left padding.
    max_query_len
        Most tokens per row a ``decode`` will feed (``k + 1`` for verify); sizes the slack.
    cuda_graphs
        Compile the decoder layers and capture decode steps (default: on CUDA).
    float32_matmul
        How a float32 model multiplies on CUDA: ``"3xtf32"`` (default) on tensor cores with
        the 3xTF32 split — the linear layers through :mod:`~trace_replay.kernels.fp32_linear`,
        attention's products inside :mod:`~trace_replay.kernels.cache_attention` — as close
        to the float64 product as float32 FMAs are; or ``"ieee"``: cuBLAS and the attention
        kernel without tensor cores. Other dtypes and the CPU ignore it. The backend's
        ``name`` says which ran (``+3xtf32``).
    batch1_fusions
        Whether a bfloat16 or float16 model on CUDA runs the batch-1 fusions at one row
        (default: yes). Other dtypes and the CPU ignore it.
    """

    def __init__(
        self,
        lm,
        pad_id: int,
        *,
        max_query_len: int = 1,
        cuda_graphs: bool | None = None,
        float32_matmul: str = "3xtf32",
        batch1_fusions: bool = True,
    ) -> None:
        if not supports(lm):
            raise ValueError(f"{type(lm).__name__} is not a model the static backend supports")
        param = next(lm.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        check_float32_matmul(float32_matmul)
        register_attention()
        self.lm = lm
        self.pad_id = pad_id
        self.max_query_len = max_query_len
        # the 3xTF32 linears are the kernel's on CUDA only (the CPU reference is F.linear)
        self.tensor_cores = (
            float32_matmul == "3xtf32"
            and self.dtype == torch.float32
            and self.device.type == "cuda"
        )
        # the linears' product in the view: 3xTF32, the one-row GEMV (half precision on
        # CUDA; more rows go on to cuBLAS), or None: the model's own nn.Linear
        self.product = None
        if self.tensor_cores:
            self.product = fp32_linear
        elif self.dtype in (torch.bfloat16, torch.float16) and self.device.type == "cuda":
            self.product = gemv
        elif (
            self.device.type == "cpu"
            and packed_linears_available(self.dtype)
            and packed_copy_fits(lm)
        ):
            self.product = PackedLinears()
        self.batch1_fusions = batch1_fusions
        # the CPU runs each prompt of a wave as its own unpadded forward (_prefill_rows);
        # False runs the left-padded batch, as CUDA does (tests compare the two)
        self.unpadded_prefill = True
        self.name = (
            ("static+compiled" if self.cuda_graphs else "static")
            + ("+3xtf32" if self.tensor_cores else "")
            + ("+onednn" if isinstance(self.product, PackedLinears) else "")
        )
        self.score = scorer_for(self.device)
        self.forwards = 0
        self.compile_seconds = 0.0
        self.compiling = False
        self.compiled_layer = _compile_layer(batch1_fusions) if self.cuda_graphs else None
        self.windows = _windows(lm.config)
        self.view = model_view(lm, self)
        self.cache: StaticKVCache | None = None
        self._graphs: dict[int, StepGraph] = {}
        self._prefill_shapes: set[tuple[int, int]] = set()  # compiled, not captured
        self._prefills: dict[int, _PrefillGraph] = {}  # captured, by prompt width
        self._pool: Any = None  # CUDA graph memory pools (torch's handle), set per cache
        self._prefill_pool: Any = None

    @property
    def static_logits(self) -> bool:
        """Whether ``decode`` returns the same tensor every step (its graph's output)."""
        return self.cuda_graphs

    def settings(self) -> dict:
        """``{"batch1_fusions": False}`` where they were turned off and would have run (they
        change numbers); else nothing: ``name`` says which product ran (``+3xtf32``)."""
        turned_off = self.product is gemv and not self.batch1_fusions
        return {"batch1_fusions": False} if turned_off else {}

    def activations(self) -> Activations:
        """None to give: the steps run a view of the model (compiled, graph-captured on
        CUDA; packed linears and 4-D cache masks on the CPU), not the modules hooks watch."""
        raise NotImplementedError(
            "the static backend runs a view of the model (compiled and graph-captured "
            "on CUDA, packed linears on the CPU) whose steps the model's forward hooks "
            "do not see; build the engine with backend='hf' (layer attribution does)"
        )

    def _kv(self) -> StaticKVCache:
        """The allocated cache; a RuntimeError before the first prefill."""
        if self.cache is None:
            raise RuntimeError("the static backend has no cache before its first prefill")
        return self.cache

    @property
    def shape(self) -> tuple[int, int] | None:
        """``(rows, length)`` of the allocated cache."""
        return None if self.cache is None else self.cache.shape

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
        """Start a wave: left-pad ``prompts``, run them, return ``[B, V]`` next-token logits.
        On the CPU (``unpadded_prefill``) each prompt runs alone, unpadded
        (:meth:`_prefill_rows`).

        With ``cuda_graphs`` the prompt width is padded up to a bucket of :func:`_bucket`
        and the decoder layers run compiled (one compile per rows × bucket, counted in
        ``compile_seconds``). Up to :data:`PREFILL_GRAPH_TOKENS` tokens (rows × width) the
        prefill is also captured in a CUDA graph per width, launched by later waves: a
        short prefill is host-bound (launches through Python) and a capture's memory (its
        own pool) is small at that size. Longer prefills keep the GPU busy on their own and
        hold no memory after they return.
        """
        batch, width = len(prompts), max(len(p) for p in prompts)
        if self.cuda_graphs:
            width = _bucket(width)
        self._allocate(batch, width + max_new_tokens + self.max_query_len)
        if self.device.type == "cpu" and batch > 1 and self.unpadded_prefill:
            return self._prefill_rows(prompts)
        # eager, a wave computes its own rows only; a captured graph has the cache's rows
        rows = self._kv().shape[0] if self.cuda_graphs else batch
        tokens = torch.full((rows, width), self.pad_id, dtype=torch.long)
        present = torch.zeros((rows, width), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt) :] = torch.tensor(prompt)
            present[row, width - len(prompt) :] = True
        tokens, present = tokens.to(self.device), present.to(self.device)
        positions = (present.long().cumsum(1) - 1).clamp(min=0)
        if not self.cuda_graphs:
            self._kv().reset()
            logits = self._forward(
                tokens, positions, present=present, logits_to_keep=1, cache=self._kv().head(rows)
            )
        elif rows * width <= PREFILL_GRAPH_TOKENS:
            graph = self._prefills.get(width) or self._capture_prefill(width)
            logits = graph.launch(tokens, positions, present)
        else:  # long prompts keep the GPU busy: compiled layers, no graph (no memory held)
            self._kv().reset()
            with self._compiled(startup=(rows, width) not in self._prefill_shapes):
                logits = self._forward(tokens, positions, present=present, logits_to_keep=1)
            self._prefill_shapes.add((rows, width))
        self.forwards += 1
        return logits[:batch, -1]

    def _prefill_rows(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The CPU's prefill: each prompt its own forward, unpadded, written from slot 0 of
        its row (the rows' cursors then differ, as after dropped drafts). Left padding
        would compute the batch's longest width for every row (23% more tokens than the
        prompts hold over make bench's traces); one row's products are still wide enough
        for oneDNN's blocked kernels."""
        cache = self._kv()
        cache.reset()
        logits = []
        for row, prompt in enumerate(prompts):
            tokens = torch.tensor([list(prompt)], device=self.device)
            positions = torch.arange(len(prompt), device=self.device)[None]
            rows = cache.row(row, len(prompt))
            logits.append(self._forward(tokens, positions, logits_to_keep=1, cache=rows)[:, -1])
        self.forwards += 1
        return torch.cat(logits)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[B, q]`` at ``positions`` ``[B, q]``; return ``[B, q, V]`` logits."""
        batch, q = tokens.shape
        if q > self.max_query_len:
            raise ValueError(
                f"decode of {q} tokens per row; the cache was sized for "
                f"max_query_len={self.max_query_len}"
            )
        self.forwards += 1
        if not self.cuda_graphs:
            cache = self._kv()
            # on the CPU, attention reads only the slots some row has reached (the cursors
            # are host memory there: no synchronization)
            reached = None
            if self.device.type == "cpu":
                reached = min(int(cache.cursor[:batch].max()) + q, cache.shape[1])
            return self._forward(tokens, positions, cache=cache.head(batch, reached))
        graph = self._graphs.get(q) or self._capture(q)
        return graph.launch(tokens, positions)[:batch]

    @torch.inference_mode()
    def keep(self, keep: torch.Tensor) -> None:
        """``keep`` ``[B, q]`` bool: which tokens of the last ``decode`` stay in context."""
        self._kv().keep(keep)

    def _allocate(self, batch: int, length: int) -> None:
        """Cache for ``batch`` rows of ``length`` slots; reuse the current one when it fits."""
        length = _bucket(length)
        shape = None if self.cache is None else self.cache.shape
        if shape is not None and shape[1] == length and batch <= shape[0]:
            return
        self._graphs.clear()
        self._prefills.clear()
        self.cache = None  # free before allocating the new one
        config = self.lm.config
        attn = self.lm.model.layers[0].self_attn
        head_dim = (
            getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.cache = StaticKVCache(
            len(self.lm.model.layers),
            batch,
            config.num_key_value_heads,
            length,
            head_dim,
            self.dtype,
            self.device,
        )
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        # prefill graphs apart: a decode graph must never write where a prefill's
        # output, still to be read, lives (and the other way round)
        self._prefill_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        present: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        cache: StaticKVCache | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, q or logits_to_keep, V]`` of a forward over the rows of ``cache``
        (default: all the backend's cache rows).

        ``present`` (prefill) marks left padding, which stays out of context. Capturable
        when ``present`` is None.
        """
        cache = cache or self._kv()
        cache.begin(positions)
        if present is not None:
            cache.valid[:, : present.shape[1]] = present
        masks = {kind: cache.mask(positions, window) for kind, window in self.windows.items()}
        out = self.view(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=masks.get("", masks),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        cache.finish()
        return out.logits

    @contextlib.contextmanager
    def _compiled(self, *, startup: bool = True):
        """Run the layers compiled inside; with ``startup`` the time counts in
        ``compile_seconds`` (a first shape: compiling, warming up, capturing)."""
        start = time.perf_counter()
        self.compiling = True
        try:
            yield
        finally:
            self.compiling = False
        if startup:
            torch.cuda.synchronize(self.device)
            self.compile_seconds += time.perf_counter() - start

    def _capture_prefill(self, width: int) -> _PrefillGraph:
        with self._compiled():  # the warm-up inside compiles the layers for this width
            self._prefills[width] = graph = _capture_prefill_of(self, width)
        return graph

    def _capture(self, q: int) -> StepGraph:
        cache = self._kv()
        with self._compiled():  # the warm-up inside compiles the layers
            self._graphs[q] = graph = capture_step(
                self._forward,
                cache.shape[0],
                q,
                (cache.cursor, cache.valid, cache.slot_pos),
                pad_id=self.pad_id,
                pool=self._pool,
            )
        return graph


def _capture_prefill_of(backend: StaticCacheBackend, width: int) -> _PrefillGraph:
    """Capture ``backend``'s prefill of ``width`` tokens per row (warm-ups included)."""
    cache = backend._kv()
    rows, device = cache.shape[0], backend.device
    tokens = torch.full((rows, width), backend.pad_id, dtype=torch.long, device=device)
    positions = torch.arange(width, device=device).expand(rows, width).contiguous()
    present = torch.ones((rows, width), dtype=torch.bool, device=device)

    def prefill() -> torch.Tensor:  # a new wave: the cache's reset is captured too
        cache.reset()
        return backend._forward(tokens, positions, present=present, logits_to_keep=1)

    graph, logits = capture(
        prefill, (cache.cursor, cache.valid, cache.slot_pos), pool=backend._prefill_pool
    )
    return _PrefillGraph(graph, tokens, positions, present, logits)


class _PrefillGraph(NamedTuple):
    """A captured prefill: its graph, static inputs ``[rows, width]`` and static output."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    present: torch.Tensor
    logits: torch.Tensor

    def launch(
        self, tokens: torch.Tensor, positions: torch.Tensor, present: torch.Tensor
    ) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.present.copy_(present)
        self.graph.replay()
        return self.logits


@functools.cache
def _compile_layer(fusions: bool):
    """``torch.compile`` of a decoder layer's forward, shared by every layer and backend
    (one with the batch-1 fusions' passes, one without).

    A declared per-process cache: dynamo keeps graphs per code object and backend, so a
    compile per backend would compile every shape again (start-up of each engine).
    """
    return compile_function(
        layer_forward, fullgraph=True, dynamic=False, options=layer_passes(fusions)
    )


def _bucket(length: int) -> int:
    """Cache length: a power of two from 16 up to 256, then a multiple of 256."""
    if length <= 256:
        return max(16, 1 << (length - 1).bit_length())
    return -(-length // 256) * 256
