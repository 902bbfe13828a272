"""Resumable replays: finished traces go to Parquet part files as they finish."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pandas as pd

from trace_replay._io import write_atomic

__all__ = ["Checkpoint"]


class Checkpoint:
    """A folder of Parquet parts, each written atomically (temporary file, then rename).

    A run killed mid-way loses at most the traces of the chunk in flight; a rerun with the
    same folder skips every trace id already written. ``settings`` (model, engine, dtype,
    top_k…) are stored on first use, and a rerun with different settings is refused rather
    than mixing two runs in one result.
    """

    def __init__(self, path: str | os.PathLike, settings: dict) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"checkpoint {self.path} exists and is not a folder")
        self.path.mkdir(parents=True, exist_ok=True)
        settings_file = self.path / "settings.json"
        settings = json.loads(json.dumps(settings, default=str))
        if settings_file.exists():
            stored = json.loads(settings_file.read_text())
            if stored != settings:
                changed = sorted(k for k in set(stored) | set(settings)
                                 if stored.get(k) != settings.get(k))
                raise ValueError(f"checkpoint {self.path} was written with other settings "
                                 f"({', '.join(changed)}); use a new folder")
        else:
            write_atomic(settings_file, lambda p: p.write_text(json.dumps(settings, indent=1)))

    def parts(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet"))

    def read(self) -> pd.DataFrame:
        parts = [pd.read_parquet(p) for p in self.parts()]
        if not parts:
            return pd.DataFrame()
        # a trace written twice (a crash between rename and bookkeeping) keeps its first copy
        frame = pd.concat(parts, ignore_index=True)
        return frame.drop_duplicates(subset=["trace_id", "step"], keep="first",
                                     ignore_index=True)

    def finished_ids(self) -> set[str]:
        ids: set[str] = set()
        for part in self.parts():
            ids.update(pd.read_parquet(part, columns=["trace_id"])["trace_id"].unique())
        return ids

    def write(self, frame: pd.DataFrame) -> None:
        if frame.empty:
            return
        name = f"part-{len(self.parts()):06d}-{uuid.uuid4().hex[:8]}.parquet"
        write_atomic(self.path / name, lambda p: frame.to_parquet(p, index=False))
