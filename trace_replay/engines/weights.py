"""Which weights an engine scores with: their digest, and the identity results carry.

A checkpoint keys on :func:`engine_identity`, so rows computed with other weights under the
same model name are never served; every replay records it in ``df.attrs``.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trace_replay.engines.protocol import Engine

__all__ = ["engine_identity", "glance", "read_weights"]


def glance(lm: torch.nn.Module) -> bytes:
    """A cheap look at ``lm``'s weights: per parameter its storage, its count of in-place
    edits (``Tensor._version``, which autograd keeps: an optimizer step, ``load_state_dict``,
    an edit under ``torch.no_grad``) and a strided sample of its values. While it stays the
    same, :func:`read_weights`' digest stands; an edit through ``.data`` counts no edit and
    is seen when it changes a sampled element (a rescale, a reload, a training step do)."""
    digest = hashlib.sha256()
    for name, weight in lm.named_parameters():
        digest.update(f"{name}:{weight.data_ptr()}:{weight._version}".encode())
        digest.update(_sample(weight))
    return digest.digest()


def read_weights(lm: torch.nn.Module) -> str:
    """A digest of ``lm``'s weights: per parameter, its name, shape, dtype, float64 sum and
    sum of squares, and the exact bytes of a strided sample of 1,024 elements — one pass
    over the weights on their device (seconds on a CPU for 135M float32 weights), changed by
    any edit short of a contrived one."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, weight in lm.named_parameters():
            flat = weight.detach().reshape(-1)
            sums = torch.stack([flat.sum(dtype=torch.float64),
                                flat.double().square().sum()]).cpu().numpy()
            digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype}".encode())
            digest.update(sums.tobytes())
            digest.update(_sample(weight))
    return digest.hexdigest()[:32]


def _sample(weight: torch.Tensor) -> bytes:
    """The exact bytes of 1,024 elements of ``weight``, strided over all of it."""
    with torch.no_grad():
        flat = weight.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // 1024)][:1024]
        return sample.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def engine_identity(engine: Engine) -> dict:
    """What ``engine``'s results are labelled with (``df.attrs``) and a checkpoint folder is
    keyed on: its settings and, where the engine reads its weights (``weights_digest()``),
    their digest, read now. A model edited or retrained in place under the same name is then
    refused by a folder and by ``merge`` as other settings, never served the rows of its old
    weights; so is another server, or another model behind the same server address (a
    server engine digests its address and its scores of a fixed probe)."""
    settings = engine.settings()
    weights = engine.weights_digest()
    return settings if weights is None else {**settings, "weights_digest": weights}
