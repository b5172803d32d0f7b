"""How one Arrow column becomes a sample's fields, and a batch of its rows their stored
bytes: the column's own field (arrow_columns), then ``<column>_rate`` for a decoded Hugging
Face ``Audio`` column, then ``<column>_valid`` under ``nulls="mask"``.

A Hub ``Audio`` column (``struct<bytes, path>``, the feature in the schema's ``huggingface``
metadata) reads as its waveform, float32 ``[channels, samples]`` (a ragged field), and its
sampling rate, as ``datasets`` hands out ``{"array", "sampling_rate"}``; ``audio="bytes"`` (or
the feature's ``decode: false``) keeps the encoded file's bytes instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpufeed.formats.inplace.arrow_columns import (
    null_rows,
    parse_field,
    stored_masked,
    valid_field,
)
from gpufeed.formats.inplace.audio import decode_audio
from gpufeed.formats.schema import Field

__all__ = ["AUDIO", "ColumnRows", "RowError", "audio_feature"]

AUDIO = ("decode", "bytes")  # the reader's audio= choices
VALID = {True: b"\x01", False: b"\x00"}  # a <col>_valid value as stored (a bool array)
_INT64 = np.dtype("<i8")


class RowError(ValueError):
    """A value of row `row` (of the rows given) does not read."""

    def __init__(self, row: int, problem: str):
        super().__init__(problem)
        self.row = row


def audio_feature(feature) -> bool:
    """Whether a Hugging Face feature is an Audio column to decode (its decode not off)."""
    return (
        isinstance(feature, dict)
        and feature.get("_type") == "Audio"
        and feature.get("decode", True) is not False
    )


@dataclass(frozen=True)
class ColumnRows:
    """Column `field.name` read as its fields: `field` (what the column holds as stored; a
    decoded audio column's bytes field), `audio` (decoded to a waveform and a rate),
    `masked` (nulls become empty values and a <col>_valid field)."""

    field: Field
    audio: bool = False
    masked: bool = False

    @property
    def name(self) -> str:
        return self.field.name

    def fields(self) -> list[Field]:
        """The sample's fields this column gives, in their order."""
        out = [self.field]
        if self.audio:
            out = [
                parse_field(self.name, {"type": "ragged", "dtype": "<f4", "shape": [-1, -1]}),
                parse_field(f"{self.name}_rate", "int"),
            ]
        return out + ([valid_field(self.name)] if self.masked else [])

    def nulls(self, column) -> np.ndarray | None:
        """Per row, whether it is null (null_rows), or None when none is."""
        return null_rows(self.field, column)

    def values(self, column, nulls: np.ndarray | None) -> list[list]:
        """Each field's stored bytes per row (fields' order); a row that does not decode is
        a RowError (ValueError and TypeError from Arrow propagate)."""
        stored = stored_masked(self.field, column, nulls)
        out = _decoded(self.name, stored, nulls) if self.audio else [stored]
        if self.masked:
            valid = np.ones(len(column), bool) if nulls is None else ~nulls
            out.append([VALID[v] for v in valid.tolist()])
        return out


def _decoded(name: str, stored: list, nulls: np.ndarray | None) -> list[list]:
    """[waveforms as ragged stored bytes, rates as int64 bytes] of an audio column's files."""
    waves, rates = [], []
    for j, data in enumerate(stored):
        if nulls is not None and nulls[j]:
            wave, rate = np.zeros((0, 0), np.float32), 0  # nulls="mask": empty
        else:
            try:
                wave, rate = decode_audio(data)
            except ValueError as e:
                raise RowError(j, f"column {name!r}: the audio file does not decode: {e}") from None
        waves.append(np.asarray(wave.shape, _INT64).tobytes() + wave.tobytes())
        rates.append(np.asarray(rate, _INT64).tobytes())
    return [waves, rates]
