"""Every registered engine against the :class:`~trace_replay.engines.protocol.Engine`
protocol, checked statically: mypy reads this module (pyproject.toml's ``[tool.mypy]``
files) and fails where a factory below does not build an ``Engine`` (a member missing, or
of another type). A class is checked itself; a factory function through its return
annotation. ``tests/engines/test_registry.py`` holds that this table names exactly the
registry's engines, each by the factory its spec names, so a new engine is added here too.

Nothing runs at import: the engines (vllm's among them) are imported for the checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from trace_replay.engines import _make_auto
    from trace_replay.engines.builtin.engine import TorchEngine
    from trace_replay.engines.builtin.prefill import PrefillEngine
    from trace_replay.engines.protocol import Engine
    from trace_replay.engines.server.engine import ServerEngine
    from trace_replay.engines.vllm import start_engine

    FACTORIES: dict[str, Callable[..., Engine]] = {
        "auto": _make_auto,
        "torch": TorchEngine,
        "prefill": PrefillEngine,
        "vllm": start_engine,
        "vllm-server": ServerEngine,
    }
