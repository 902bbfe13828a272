"""Engines that ``replay`` builds from a name, kept for the process: started once, reused.

``replay(traces, engine="vllm")`` starts an engine the first time and keeps it; a later call
with the same name, model and engine settings replays on it instead of starting another
(vLLM takes 10-80 s to start, a model 20 s to load on CPU). A warning says so the first
time per process. Every kept engine is closed when the interpreter exits, or by
:func:`close_engines` (``tr.close_engines()``) at any time; until then it holds its model
(and vLLM its GPU memory).

What is kept, and when an entry is started again:

* The key is the name, the model's folder (the embedded model's converted one, a local
  folder, a cached model's snapshot) and every setting that configures an engine (dtype,
  device, batch size, top-k, speculative, deterministic, ``engine_args``); ``verbose`` only
  shows start-up logging, so it is not part of it.
* The folder's weight files as they are now (name, size, modification time) are checked at
  every call: a model rewritten in place is loaded again and the old engine closed.
* An error other than a ``ValueError`` (bad traces, arguments or checkpoint folder, which
  leave the engine as it was) closes and forgets the engine: the next call starts afresh.
* Not kept, built for the call and closed after it: an engine whose registry entry says
  so (``kept=False``: ``vllm-server``, a client of a server that may change between calls,
  with nothing to start), a model passed as an ``nn.Module``
  (nothing to load, and keeping it would keep the caller's module alive), a model that
  cannot be found (``make_engine`` then names the problem), and an engine in use by another
  thread.

An engine object passed to ``replay`` is the caller's: it is never kept nor closed there.
Kept engines are never handed out, so nothing else can close one behind the cache's back.
"""

from __future__ import annotations

import atexit
import json
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["KeptEngineWarning", "close_engines", "kept_engine"]


class KeptEngineWarning(UserWarning):
    """``replay`` keeps an engine it started for later calls (said once per process)."""


@dataclass
class _Kept:
    weights: str  # the model folder's digest the engine was loaded from
    engine: Any = None  # None while it is being built
    busy: bool = False  # a replay runs on it


_kept: dict[tuple, _Kept] = {}
_lock = threading.Lock()
_said = False  # KeptEngineWarning given in this process
_registered = False  # close_engines registered with atexit


@contextmanager
def kept_engine(
    name: str, model: Any = None, *, verbose: bool = False, **config: Any
) -> Iterator[Any]:
    """The engine ``make_engine(name, model, verbose=verbose, **config)`` would build: the
    one kept from an earlier call with the same key, else a new one (kept when its key
    allows, see the module docstring).

    Yields
    ------
    Engine
        Ready to run; the caller must not close it.
    """
    from trace_replay.engines import make_engine

    key = _key(name, model, config)
    entry, stale = _claim(key) if key is not None else (None, None)
    _close(stale)
    if entry is None:  # not kept: this call's own engine
        with make_engine(name, model, verbose=verbose, **config) as engine:
            yield engine
        return
    assert key is not None  # only a keyed engine is kept
    try:
        if entry.engine is None:
            entry.engine = make_engine(name, model, verbose=verbose, **config)
            _say_kept(name)
        yield entry.engine
    except ValueError:  # bad input: the engine is as it was (if it was built at all)
        if entry.engine is None:
            _forget(key[0], entry)
        entry.busy = False
        raise
    except BaseException:
        _forget(key[0], entry)
        raise
    entry.busy = False


def close_engines() -> int:
    """Close every engine ``replay`` keeps (see :mod:`trace_replay.runs.kept_engines`);
    the next ``replay(..., engine=<name>)`` starts a new one. Runs at interpreter exit.

    Do not call it while a replay runs on a kept engine in another thread.

    Returns
    -------
    int
        How many engines were closed.

    Examples
    --------
    >>> import trace_replay as tr
    >>> closed = tr.close_engines()  # frees their models (and vLLM's GPU memory) now
    """
    with _lock:
        engines = [entry.engine for entry in _kept.values() if entry.engine is not None]
        _kept.clear()
    for engine in engines:
        _close(engine)
    return len(engines)


def _key(name: str, model: Any, config: dict[str, Any]) -> tuple[tuple, str] | None:
    """``(identity, weights)``: which engine, and the digest of its folder's weight files
    now; None when the engine is not kept."""
    import torch

    from trace_replay.engines.registry import ENGINES, engine_spec
    from trace_replay.models.load import folder_digest, hf_folder, resolve_dtype

    if name not in ENGINES or not engine_spec(name).kept or isinstance(model, torch.nn.Module):
        return None
    try:
        folder = hf_folder(model).resolve()
        dtype, device = config.get("dtype"), config.get("device")
        config = {
            **config,
            "dtype": None if dtype is None else str(resolve_dtype(dtype)),
            "device": None if device is None else str(torch.device(device)),
        }
        settings = json.dumps(config, sort_keys=True, default=repr)
    except Exception:  # noqa: BLE001 - make_engine names what is wrong with them
        return None
    return (name, str(folder), settings), folder_digest(folder)


def _claim(key: tuple[tuple, str]) -> tuple[_Kept | None, Any]:
    """The entry of ``key`` marked busy (new when there is none, or when its weights
    changed: then the old engine is returned to be closed), or None while another thread
    uses it."""
    global _registered
    identity, weights = key
    with _lock:
        entry, stale = _kept.get(identity), None
        if entry is not None and entry.weights != weights and not entry.busy:
            stale, entry = entry.engine, None
        if entry is None:
            entry = _kept[identity] = _Kept(weights)
        if entry.busy or entry.weights != weights:
            return None, stale
        entry.busy = True
        if not _registered:
            atexit.register(close_engines)
            _registered = True
    return entry, stale


def _forget(identity: tuple, entry: _Kept) -> None:
    """Drop ``entry`` and close its engine (after a failure: it may be broken)."""
    with _lock:
        if _kept.get(identity) is entry:
            del _kept[identity]
    _close(entry.engine)


def _close(engine: Any) -> None:
    if engine is None:
        return
    try:
        engine.close()
    except Exception as error:  # noqa: BLE001 - a failing close must not hide what went on
        warnings.warn(
            f"closing the kept {engine.name} engine failed: {type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=3,
        )


def _say_kept(name: str) -> None:
    global _said
    if _said:
        return
    _said = True
    warnings.warn(
        f"replay keeps the {name} engine it started for later replay(engine="
        f"{name!r}) calls with the same model and settings in this process, and "
        "closes it at exit; trace_replay.close_engines() releases it (and any other "
        "kept engine) now. Said once per process.",
        KeptEngineWarning,
        stacklevel=5,
    )
