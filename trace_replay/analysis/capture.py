"""Forward hooks that read a model's internals per replay step, on the engines' real forwards.

A *site* is one place in the forward: the embedding lookup (layer -1); per decoder layer its
input norm, attention output, MLP output and the residual stream after the layer; the final
norm and the logits (layer ``num_layers``). :func:`model_sites` finds them in a transformers
causal LM with the Llama layout (``model.layers[i].input_layernorm / self_attn / mlp``,
``model.norm``, ``lm_head``), which Mistral, Qwen, Gemma and most decoder-only models share.

The value of a site at replay step ``s`` is its activation at position ``prompt_len - 1 + s``:
the input position whose logits score trace token ``s``. Decode and prefill compute exactly
these positions, so their values pair up one to one. :class:`SiteCapture` learns each batch's
requests from the engine's ``on_batch`` hook, reads every forward's positions and padding
mask from the model's own arguments, and hands the sink, per site and forward, the rows that
are replay steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trace_replay.engines.base import Engine, ReplayRequest

__all__ = ["SITES", "LAYER_SITES", "Site", "ForwardRows", "SiteCapture", "model_sites"]

SITES = ("embeddings", "input_norm", "attention", "mlp", "residual", "final_norm", "logits")
LAYER_SITES = ("input_norm", "attention", "mlp", "residual")
_LAYER_MODULES = {"input_norm": "input_layernorm", "attention": "self_attn", "mlp": "mlp"}


@dataclass(frozen=True)
class Site:
    """One hooked place: its index in forward order, decoder layer, name, module and width."""

    index: int
    layer: int  # -1 for embeddings, num_layers for final_norm and logits
    name: str
    module: torch.nn.Module
    width: int  # hidden size, or vocabulary size for logits


@dataclass(frozen=True)
class ForwardRows:
    """Which rows of one forward are replay steps, and of which trace.

    ``batch_rows``/``columns`` index the forward's ``[B, W, ...]`` outputs; ``trace_index``
    and ``step`` name each gathered row; ``forward_id`` is unique per forward.
    """

    forward_id: int
    batch_rows: torch.Tensor  # [N] int64, on the model's device
    columns: torch.Tensor  # [N] int64, on the model's device
    trace_index: np.ndarray  # [N] int64, index into the requests given to SiteCapture
    step: np.ndarray  # [N] int64, replay step


def model_sites(lm: torch.nn.Module) -> list[Site]:
    """Every site of ``lm`` in forward order.

    Raises
    ------
    ValueError
        When ``lm`` does not have the Llama module layout; the message names what is missing.
    """
    try:
        decoder, config = _decoder(lm), lm.config
        layers = decoder.layers
        embed, norm, head = decoder.embed_tokens, decoder.norm, lm.get_output_embeddings()
        modules = [
            {site: getattr(layer, name) for site, name in _LAYER_MODULES.items()}
            for layer in layers
        ]
    except AttributeError as exc:
        raise ValueError(
            f"{type(lm).__name__} does not have the Llama module layout "
            f"(model.layers[i].input_layernorm/self_attn/mlp, model.norm, "
            f"lm_head) that layer attribution hooks: {exc}"
        ) from None
    hidden, vocab, num_layers = config.hidden_size, config.vocab_size, len(layers)
    entries = [(-1, "embeddings", embed, hidden)]
    for i, (layer, parts) in enumerate(zip(layers, modules)):
        entries += [(i, site, parts[site], hidden) for site in ("input_norm", "attention", "mlp")]
        entries.append((i, "residual", layer, hidden))
    entries += [(num_layers, "final_norm", norm, hidden), (num_layers, "logits", head, vocab)]
    return [Site(i, *entry) for i, entry in enumerate(entries)]


def _decoder(lm: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (``LlamaModel`` inside ``LlamaForCausalLM``)."""
    return lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model


# sink(site, rows, values): values [N, width] are the site's activations at rows' steps
Sink = Callable[[Site, ForwardRows, torch.Tensor], None]


class SiteCapture:
    """Hooks on ``lm`` feeding ``sink`` the replay-step rows of chosen sites, per forward.

    Use as a context manager around ``engine.run(requests)``; ``lm`` is the model of the
    engine's ``activations()`` (with ``rows`` None), whose forwards announce each batch
    through ``on_batch`` (:class:`~trace_replay.engines.base.Engine`). Rows past a trace's end (a finished row decoding
    on with its wave), prompt positions and padding are left out. Nothing is kept between
    calls: memory is the sink's business.

    Parameters
    ----------
    lm
        The model whose modules the engine's forwards call.
    engine
        The engine; its ``on_batch`` is set while the capture is active.
    requests
        Every request the engine will be given; ``ForwardRows.trace_index`` indexes this.
    sites
        The sites to hook (from :func:`model_sites`).
    sink
        Called once per hooked site and forward that holds at least one replay step.
    """

    _ids = itertools.count()

    def __init__(
        self,
        lm: torch.nn.Module,
        engine: Engine,
        requests: Sequence[ReplayRequest],
        sites: Sequence[Site],
        sink: Sink,
    ) -> None:
        self.lm, self.engine, self.sites, self.sink = lm, engine, list(sites), sink
        self.index = {r.trace_id: i for i, r in enumerate(requests)}
        self.decoder = _decoder(lm)
        self._batch: Sequence[ReplayRequest] | None = None
        self._rows: ForwardRows | None = None
        self._keep = None  # the logits_to_keep of the current forward
        self._width = 0  # the sequence width of the current forward
        self._handles: list = []

    def __enter__(self) -> SiteCapture:
        self.engine.on_batch = self._on_batch
        self._handles = [
            self.lm.register_forward_pre_hook(self._on_lm, with_kwargs=True),
            self.decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True),
            *(site.module.register_forward_hook(self._hook(site)) for site in self.sites),
        ]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.engine.on_batch = None

    def _on_batch(self, batch: Sequence[ReplayRequest]) -> None:
        self._batch = list(batch)

    def _on_lm(self, module, args, kwargs) -> None:
        self._keep = kwargs.get("logits_to_keep", 0)

    def _on_decoder(self, module, args, kwargs) -> None:
        if self._batch is None:
            raise RuntimeError("a forward ran before the engine announced its batch")
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs["inputs_embeds"]
        rows, width = inputs.shape[:2]
        positions = self._positions(kwargs, width)
        mask = kwargs.get("attention_mask")
        real = (
            torch.ones((rows, width), dtype=torch.bool)
            if mask is None
            else mask[:, -width:].bool().cpu()
        )
        n = min(rows, len(self._batch))  # engines may pad a batch with idle rows
        prompt_len = torch.tensor([r.prompt_len for r in self._batch[:n]])[:, None]
        trace_len = torch.tensor([r.trace_len for r in self._batch[:n]])[:, None]
        step = positions.expand(rows, width)[:n] - (prompt_len - 1)
        batch_row, column = torch.nonzero(
            real[:n] & (step >= 0) & (step < trace_len), as_tuple=True
        )
        trace_index = np.array(
            [self.index[self._batch[r].trace_id] for r in batch_row.tolist()], dtype=np.int64
        )
        device = inputs.device
        self._rows = ForwardRows(
            next(self._ids),
            batch_row.to(device),
            column.to(device),
            trace_index,
            step[batch_row, column].numpy(),
        )
        self._width = width

    def _positions(self, kwargs, width: int) -> torch.Tensor:
        """Absolute positions ``[rows or 1, W]`` of this forward's inputs, as the model uses them."""
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs.get("cache_position")
        if positions is None:
            cache = kwargs.get("past_key_values")
            start = cache.get_seq_length() if cache is not None else 0
            positions = torch.arange(start, start + width)
        positions = positions.cpu().long()
        return positions if positions.dim() == 2 else positions[None]

    def _logit_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns of the lm_head output (``logits_to_keep`` may have sliced the input)."""
        keep = self._keep
        if isinstance(keep, int):
            return columns if keep == 0 else columns - (self._width - keep)
        inverse = torch.full((self._width,), -1, dtype=torch.long, device=columns.device)
        inverse[keep.to(columns.device).long()] = torch.arange(len(keep), device=columns.device)
        return inverse[columns]

    def _hook(self, site: Site):
        def hook(module, args, output) -> None:
            rows = self._rows
            if rows is None or not len(rows.step):
                return
            values = output[0] if isinstance(output, tuple) else output
            columns = rows.columns
            if site.name == "logits":
                columns = self._logit_columns(columns)
                if bool((columns < 0).any()):
                    raise RuntimeError("the engine did not compute logits at every replay step")
            self.sink(site, rows, values.detach()[rows.batch_rows, columns])

        return hook
