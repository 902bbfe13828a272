"""Models: the embedded default and user models resolved with nothing fetched (``load``),
(models loaded once per setting are :mod:`trace_replay.engines.cache`). ``load_model`` and ``load_tokenizer`` are
also reached here, where they lived before the package had subfolders."""

from trace_replay.models.load import load_model, load_tokenizer

__all__ = ["load_model", "load_tokenizer"]
