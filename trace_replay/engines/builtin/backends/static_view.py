"""The static backend's model view: shallow copies of the model whose modules read its cache
and run the package's kernels.

The view (:func:`model_view`, built by :mod:`~trace_replay.engines.builtin.backends.static`)
shares every weight with the model and replaces modules only in shallow copies, so the model
itself is never modified:

* its attention modules select
  :func:`~trace_replay.engines.builtin.backends.static_cache.grouped_attention` and each
  decoder layer reads its own slice of the backend's cache, compiled or not
  (:class:`LayerRunner`);
* each ``nn.Linear`` becomes a :class:`KernelLinear`, whose product is
  :func:`~trace_replay.kernels.fp32_linear.fp32_linear` (float32, 3xTF32 on tensor cores)
  or :func:`~trace_replay.kernels.gemv.gemv` (half precision, one row);
* with the GEMV, the batch-1 fusions unless turned off
  (:mod:`~trace_replay.engines.builtin.passes.batch1_fusions`);
* with the CPU's packed product
  (:class:`~trace_replay.engines.builtin.backends.packed_linear.PackedLinears`), the linears
  that read the same input (q/k/v, gate/up) as one product each (:func:`group_linears`)
  and the RMSNorms as one operator each (:func:`fuse_norms`).

The CPU groups: at decode sizes each oneDNN product streams its weight once and pays a fixed
cost besides; one product over the members' concatenated packed weight pays it once per
group (4 products a layer instead of 7), as vLLM's CPU build does with its merged linears
(``QKVParallelLinear``, ``MergedColumnParallelLinear``). The model's code is not touched:
a group member's first call computes the whole group's product and returns its own columns;
the other members, called with the same input, return theirs from it (:class:`LinearGroup`).
Only short inputs (decode steps, at most ``GROUP_ROWS`` rows) run grouped; a prompt's
rows run each member's own product, which was faster there.
The CUDA path groups in the compiler instead
(:mod:`~trace_replay.engines.builtin.passes.linear_groups`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from trace_replay.engines.builtin.backends.packed_linear import GROUP_ROWS, GROUPS, PackedLinears
from trace_replay.engines.builtin.backends.static_cache import ATTENTION
from trace_replay.engines.builtin.passes import batch1_fusions
from trace_replay.engines.builtin.passes.batch1_fusions import RMS_NORMS
from trace_replay.kernels.gemv import gemv

__all__ = [
    "FusedRMSNorm",
    "GroupMember",
    "KernelLinear",
    "LinearGroup",
    "LayerRunner",
    "fuse_norms",
    "group_linears",
    "kernel_layer",
    "kernel_modules",
    "layer_forward",
    "model_view",
    "shallow",
]


def shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy sharing parameters and buffers, whose submodules can be replaced."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


class KernelLinear(torch.nn.Module):
    """An ``nn.Linear`` (sharing its weights) whose product is one of the package's kernels."""

    def __init__(self, linear: torch.nn.Linear, product) -> None:
        super().__init__()
        self.linear, self.product = linear, product

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.linear.weight, self.linear.bias)


def kernel_modules(module: torch.nn.Module, product) -> torch.nn.Module:
    """``module``, or a shallow copy of it whose ``nn.Linear`` descendants are
    :class:`KernelLinear` of ``product`` (copies along the way; the model is untouched)."""
    if isinstance(module, torch.nn.Linear):
        return KernelLinear(module, product)
    children = {
        name: kernel_modules(child, product)
        for name, child in module._modules.items()
        if child is not None
    }
    if all(children[name] is module._modules[name] for name in children):
        clone = module
    else:
        clone = shallow(module)
        clone._modules.update(children)
    return clone


class FusedRMSNorm(torch.nn.Module):
    """An RMSNorm of :data:`~trace_replay.engines.builtin.passes.batch1_fusions.RMS_NORMS`
    without a weight offset (Llama, Mistral, Qwen2/3; shared, not copied) as one operator on
    float32 inputs: ``F.rms_norm``, the same float32 arithmetic as transformers' six
    operators, summed in its own order (equal to float32 rounding)."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.norm(x)
        norm: Any = self.norm
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def fuse_norms(modules: list[torch.nn.Module]) -> None:
    """Each child of ``modules`` (the view's own copies) that is an RMSNorm without weight
    offset made a :class:`FusedRMSNorm`, in place."""
    plain = {name for name, offset in RMS_NORMS.items() if offset == 0.0}
    for parent in modules:
        for name, child in parent._modules.items():
            if (
                child is not None
                and type(child).__name__ in plain
                and hasattr(child, "variance_epsilon")
            ):
                parent._modules[name] = FusedRMSNorm(child)


class LinearGroup:
    """The product of linears that read the same input, computed once per input.

    Design contract: a member's call returns exactly what a product over the whole group
    computed from the input it was given. The group's output is reused only for a member
    that has not read it yet, called with the same tensor object holding the same values
    (compared with a copy taken when it was computed: decode runs in inference mode, whose
    tensors have no version counter); anything else computes the product again. Once every
    member has read it, the input, its copy and the output are dropped.

    Parameters
    ----------
    linears
        The members' ``nn.Linear`` modules (the model's own; shared, not copied): one input
        width, one dtype, all with a bias or none.
    packed
        The backend's packed product (:meth:`PackedLinears.group`).
    """

    def __init__(self, linears: list[torch.nn.Linear], packed: PackedLinears) -> None:
        self.linears, self.packed = tuple(linears), packed
        ends = torch.tensor([m.out_features for m in self.linears]).cumsum(0).tolist()
        self.columns = [slice(end - m.out_features, end) for m, end in zip(self.linears, ends)]
        self._input: torch.Tensor | None = None
        self._copy: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._unread: set[int] = set()

    def read(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s output for ``x``: its columns of the group's product where
        ``x`` has at most :data:`GROUP_ROWS` rows, else its own product."""
        if x.numel() > GROUP_ROWS * x.shape[-1]:
            linear = self.linears[member]
            return self.packed(x, linear.weight, linear.bias)
        kept, output = self._copy, self._output
        fresh = (
            x is self._input
            and member in self._unread
            and kept is not None
            and torch.equal(x, kept)
        )
        if output is None or not fresh:
            weights = tuple(m.weight for m in self.linears)
            biases = tuple(m.bias for m in self.linears if m.bias is not None)
            output = self._output = self.packed.group(x, weights, biases)
            self._input, self._copy = x, x.clone()
            self._unread = set(range(len(self.linears)))
        self._unread.discard(member)
        if not self._unread:
            self._input = self._copy = self._output = None
        return output[..., self.columns[member]]


class GroupMember(KernelLinear):
    """A view's linear (sharing the model's weights) whose output is its columns of its
    :class:`LinearGroup`'s product."""

    def __init__(self, linear: torch.nn.Linear, group: LinearGroup, member: int) -> None:
        super().__init__(linear, group.packed)
        self.group, self.member = group, member

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.read(self.member, x)


def group_linears(module: torch.nn.Module, packed: PackedLinears) -> torch.nn.Module:
    """``module`` (a view, or a part of one, its linears :class:`KernelLinear` of ``packed``)
    with every group of :data:`GROUPS` it holds made
    :class:`GroupMember` of one :class:`LinearGroup`, in place.

    A group is made only where all its members are there, are ``KernelLinear`` of
    ``packed`` over ``nn.Linear`` of one input width, dtype and device, and all have a bias
    or none; otherwise those linears stay as they are (separate products). A module holding
    ``KernelLinear`` children is the view's own copy (``kernel_modules`` made it when it
    replaced them), so the model's modules are never changed.
    """
    for parent in list(module.modules()):
        for names in GROUPS:
            linears = _members(parent, names, packed)
            if linears is None:
                continue
            group = LinearGroup(linears, packed)
            for member, name in enumerate(names):
                parent._modules[name] = GroupMember(linears[member], group, member)
    return module


def _members(
    parent: torch.nn.Module, names: tuple[str, ...], packed: PackedLinears
) -> list[torch.nn.Linear] | None:
    """The ``nn.Linear`` of ``parent``'s children ``names`` where they form a group."""
    children = [parent._modules.get(name) for name in names]
    kernels = [c for c in children if type(c) is KernelLinear and c.product is packed]
    if len(kernels) != len(names):  # a member missing, or not a plain KernelLinear
        return None
    linears = [k.linear for k in kernels]
    if not all(isinstance(m, torch.nn.Linear) for m in linears):
        return None
    first = linears[0].weight
    if not all(
        m.in_features == linears[0].in_features
        and m.weight.dtype == first.dtype
        and m.weight.device == first.device
        and (m.bias is None) == (linears[0].bias is None)
        for m in linears
    ):
        return None
    return linears


def kernel_layer(layer: torch.nn.Module, product, *, fusions: bool = True) -> torch.nn.Module:
    """A decoder layer's view: :func:`kernel_modules`, and with the GEMV and ``fusions`` the
    batch-1 fusions (:mod:`~trace_replay.engines.builtin.passes.batch1_fusions`)."""
    view = kernel_modules(layer, product)
    if product is not gemv or not fusions:
        return view
    return batch1_fusions.fuse_layer(view if view is not layer else shallow(layer), layer)


def layer_forward(layer: torch.nn.Module, hidden_states, *args, **kwargs):
    """``layer``'s class forward (what the compiled layer compiles: one code object for all)."""
    return type(layer).forward(layer, hidden_states, *args, **kwargs)


class LayerRunner:
    """A decoder layer's ``forward`` in the view: its own slice of the cache, maybe compiled.

    The cache is the one the model's forward was given (``past_key_values``, a
    :class:`~trace_replay.engines.builtin.backends.static_cache.StaticKVCache`: the
    backend's, or the rows of a smaller wave), else the backend's ``cache``. ``backend`` (a
    :class:`~trace_replay.engines.builtin.backends.static.StaticCacheBackend`) is read at
    each call: its ``cache``, whether it is ``compiling`` and its ``compiled_layer``.
    """

    def __init__(self, layer: torch.nn.Module, index: int, backend: Any) -> None:
        self.layer, self.index, self.backend = layer, index, backend

    def __call__(self, hidden_states, *args, past_key_values=None, **kwargs):
        cache = (past_key_values or self.backend.cache).layer(self.index)
        run = self.backend.compiled_layer if self.backend.compiling else layer_forward
        return run(self.layer, hidden_states, *args, past_key_values=cache, **kwargs)


def model_view(lm: torch.nn.Module, backend: Any) -> torch.nn.Module:
    """The view of ``lm`` that ``backend`` runs: per its ``tensor_cores``, ``product`` (the
    CPU's packed product with its groups) and ``batch1_fusions`` (see the module
    docstring)."""
    # transformers' modules, read and patched duck-typed (attention, layers, their forward)
    config: Any = copy.copy(lm.config)
    config._attn_implementation = ATTENTION
    view: Any = shallow(lm)
    decoder: Any = lm.model
    view.model = shallow(decoder)
    layers = []
    for index, original in enumerate(decoder.layers):
        layer: Any = shallow(original)
        layer.self_attn = shallow(layer.self_attn)
        layer.self_attn.config = config
        if backend.tensor_cores:
            layer.self_attn.float32_dots = "tf32x3"  # read by grouped_attention
        if backend.product is not None:
            layer = kernel_layer(layer, backend.product, fusions=backend.batch1_fusions)
        layer.forward = LayerRunner(layer, index, backend)
        layers.append(layer)
    view.model.layers = torch.nn.ModuleList(layers)
    if backend.product is not None and isinstance(lm.lm_head, torch.nn.Linear):
        view.lm_head = KernelLinear(lm.lm_head, backend.product)
    if isinstance(backend.product, PackedLinears):
        group_linears(view, backend.product)
        fuse_norms([view.model, *layers, *(layer.self_attn for layer in layers)])
    return view
