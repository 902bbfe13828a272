"""Models loaded once per (model, dtype, device) and engines built on them from settings dicts.

:func:`~trace_replay.locate_divergence` and :func:`~trace_replay.analysis.sweep` describe each run as
a dict of ``replay`` settings; a :class:`ModelCache` turns such a dict into an engine without
loading the same weights twice.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import torch

from trace_replay.engines import make_engine
from trace_replay.engines.base import Engine, EngineConfig
from trace_replay.engines.registry import engine_spec
from trace_replay.models.load import load_model, resolve_dtype

__all__ = ["ModelCache", "check_settings", "split_settings"]


def split_settings(settings: Mapping[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """``(engine name, model, the rest)`` of a settings dict; the engine defaults to torch."""
    rest = dict(settings)
    return rest.pop("engine", "torch"), rest.pop("model", None), rest


def check_settings(settings: Mapping[str, Any], where: str) -> None:
    """Refuse a settings dict naming an unknown engine or a setting its engine does not take.

    The error starts with ``where`` (which dict), names the bad key, the closest valid one,
    and every setting the engine takes: ``engine``, ``model``, the
    :class:`~trace_replay.engines.base.EngineConfig` fields, ``verbose`` and its own options.
    """
    name = settings.get("engine", "torch")
    try:
        own = engine_spec(name).takes()  # "auto": every engine's (it passes them on)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    common = [field.name for field in dataclasses.fields(EngineConfig)]
    valid = list(dict.fromkeys(["engine", *common, "verbose", *own]))
    for key in settings:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where}: unknown setting {key!r}{hint}; engine {name!r} takes {', '.join(valid)}"
            )


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class ModelCache:
    """Loaded transformers models keyed by (model, dtype, device).

    A path or name (``None``: the embedded model) is loaded with
    :func:`~trace_replay.models.load.load_model`. A model already in memory is used as it is when
    dtype and device match (or are not given), else a cast copy is made once; the cache
    holds a reference to the original, so its key stays valid.

    Examples
    --------
    >>> import trace_replay as tr
    >>> cache = ModelCache()
    >>> with cache.engine({"engine": "prefill", "dtype": "bfloat16"}) as engine:
    ...     df = tr.replay([{"id": "t", "prompt": "Hi", "completion": " there"}],
    ...                    engine=engine, progress=False)
    >>> len(cache), df.attrs["dtype"]  # the bfloat16 model stays loaded for the next engine
    (1, 'bfloat16')
    """

    def __init__(self) -> None:
        self._models: dict[tuple, tuple[Any, torch.nn.Module]] = {}

    def __len__(self) -> int:
        return len(self._models)

    def get(
        self,
        model: Any = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> torch.nn.Module:
        """The model ``model`` in ``dtype`` on ``device``, loaded or cast at most once."""
        key: tuple[str, int | str | None, torch.dtype, torch.device]  # kind, identity, want
        if isinstance(model, torch.nn.Module):
            weight = next(model.parameters())
            want = (
                resolve_dtype(dtype) if dtype is not None else weight.dtype,
                torch.device(device) if device is not None else weight.device,
            )
            if (want[0], want[1].type) == (weight.dtype, weight.device.type):
                return model
            key = ("module", id(model), *want)
        else:
            want = (resolve_dtype(dtype), _device(device))
            key = ("path", None if model is None else str(model), *want)
        if key not in self._models:
            if isinstance(model, torch.nn.Module):
                loaded = copy.deepcopy(model).to(device=want[1], dtype=want[0]).eval()
            else:
                loaded = load_model(model, dtype=want[0], device=want[1])
            self._models[key] = (model, loaded)
        return self._models[key][1]

    def engine(self, settings: Mapping[str, Any]) -> Engine:
        """An engine for ``settings`` (``replay`` keyword names plus ``engine`` and ``model``).

        Everything but ``engine`` and ``model`` goes to
        :func:`~trace_replay.engines.make_engine` unchanged, so engine options (``backend``,
        ``deterministic``, ...) pass straight through.
        """
        name, model, rest = split_settings(settings)
        if not engine_spec(name).loaded_model and not isinstance(model, torch.nn.Module):
            return make_engine(name, model, **rest)
        module = self.get(model, dtype=rest.get("dtype"), device=rest.get("device"))
        return make_engine(name, module, **rest)

    def clear(self) -> None:
        """Drop every cached model."""
        self._models.clear()
