"""What the GPU tests share: a tokenizer that needs no embedded model on the GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest


def save_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (256 ids, no merges) saved in ``folder``: text traces tokenize
    without the embedded model's files, which a GPU machine does not have."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


@pytest.fixture(scope="session")
def byte_tokenizer():
    """:func:`save_byte_tokenizer`, for fixtures that save a model folder."""
    return save_byte_tokenizer
