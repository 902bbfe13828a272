"""Moved: the replay state is :mod:`trace_replay.engines.replay_state` (issue 44).

Kept only because ``trace_replay/engines/vllm/forcing.py`` still imports it from here; delete
this module once that import names ``trace_replay.engines.replay_state``.
"""

from trace_replay.engines.replay_state import RequestState, TraceReplayState

__all__ = ["RequestState", "TraceReplayState"]
