"""Records of a multi-field pack -> sample dicts (the field types: gpufeed.formats.schema).

Arrays become tensors (their dtype and shape, ragged ones their own shape; a big-endian
dtype becomes the native one, same values), images are
decoded like the (image, label) packs' (uint8 CHW; ``decode=False``: the encoded bytes as a
1-D uint8 tensor), int, float, str, bytes and JSON values stay Python values.
"""

from __future__ import annotations

from typing import Any

import torch

from gpufeed.data.decoders import decode_image, raw_bytes_tensor
from gpufeed.formats.record import decode_value, split_record
from gpufeed.formats.schema import Schema

__all__ = ["decode_fields"]


def decode_fields(schema: Schema, record, decode: bool = True) -> dict[str, Any]:
    """One record -> its sample dict. Raises on a record that does not parse or an image
    that does not decode (the dataset turns that into a CorruptSampleError)."""
    sample: dict[str, Any] = {}
    for field, stored in zip(schema.fields, split_record(schema, record), strict=True):
        value = decode_value(field, stored)
        if field.type in ("array", "ragged"):
            if not value.dtype.isnative:  # torch holds native byte order only: same values
                value = value.astype(value.dtype.newbyteorder("="))
            value = torch.from_numpy(value)
        elif field.type == "image":
            value = decode_image(value) if decode else raw_bytes_tensor(value)
        sample[field.name] = value
    return sample
