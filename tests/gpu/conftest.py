"""What the GPU tests share: random Llamas of SmolLM2-135M's widths (the byte-level tokenizer
and the folder writer are tests/conftest.py's)."""

from __future__ import annotations

import pytest

# SmolLM2-135M's widths at 4 layers: a model of the real shapes (the kernels' tiles, the
# vocabulary's scoring cost) that starts in seconds; init 0.3 keeps its distributions far
# from uniform
SMOL_WIDTHS = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="session")
def smol_widths() -> dict:
    """:data:`SMOL_WIDTHS`, a new dict per call site to override from."""
    return dict(SMOL_WIDTHS)


@pytest.fixture(scope="session")
def save_smol_llama(tmp_path_factory, save_random_llama):
    """Factory ``save_smol_llama(name, *, byte_tokenizer=False, **overrides) -> str``: a
    random Llama of :data:`SMOL_WIDTHS` (with ``overrides``) in a new folder."""

    def save(name: str, *, byte_tokenizer: bool = False, **overrides) -> str:
        return save_random_llama(
            tmp_path_factory.mktemp(name),
            byte_tokenizer=byte_tokenizer,
            **{**SMOL_WIDTHS, **overrides},
        )

    return save
