"""Token packs: the narrowest dtype that holds a vocabulary's ids, and the schema of a
pack of token documents (what ``open_dataset(path, block_size=B)`` reads as windows).

The Writer stores a value only where the schema's dtype holds it (formats/schema.py
fit_array): an id past the declared dtype is refused naming the field and the value."""

from __future__ import annotations

import operator

import numpy as np

from gpufeed.errors import UsageError

__all__ = ["MANIFEST_KEY", "token_dtype", "token_schema"]

# the manifest key under which pack_tokens records what shaped a pack's tokens (its field,
# the eos already ending each document, the vocabulary...): gpufeed.write.token_pack writes
# it, token windows read it (here, not there: reading it needs no writer imported)
MANIFEST_KEY = "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for a vocabulary of at most 65,536 ids (0..65,535), else uint32."""
    try:
        size = operator.index(vocab_size)
    except TypeError:
        size = None
    if size is None or isinstance(vocab_size, bool) or not 1 <= size <= 1 << 32:
        raise UsageError(f"vocab_size must be an integer from 1 to 2**32, got {vocab_size!r}")
    return np.dtype(np.uint16 if size <= 1 << 16 else np.uint32)


def token_schema(vocab_size: int, field: str = "tokens") -> dict[str, str]:
    """The schema of a token pack: ``{field: 'uint16[-1]'}`` (or uint32 by the vocabulary)."""
    return {field: f"{token_dtype(vocab_size).name}[-1]"}
