"""An HDF5 file of someone else's, read in place given ``datasets=``: every named dataset holds
one row per sample (the first dimension); each becomes a field."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gpufeed.errors import DataError, UnsafePathError, UsageError
from gpufeed.formats.base import Reader
from gpufeed.formats.hdf5 import plain_dataset
from gpufeed.formats.inplace import DATASETS_EXAMPLE, dataset_names
from gpufeed.formats.record import encode_value, join_record
from gpufeed.formats.schema import Field, Schema

__all__ = ["HDF5FileReader"]


def _field(name: str, ds: h5py.Dataset) -> Field:
    string = h5py.check_string_dtype(ds.dtype)
    if string is not None:
        return Field(name, "str")
    vlen = h5py.check_vlen_dtype(ds.dtype)
    if vlen is not None:
        if vlen == np.uint8 or vlen.kind in "SV":
            return Field(name, "bytes")
        return Field(name, "ragged", dtype=np.dtype(vlen).str, shape=(-1,) * max(1, ds.ndim))
    if ds.dtype.kind == "V" or ds.dtype.kind == "S":
        return Field(name, "bytes")
    if ds.ndim == 1 and ds.dtype.kind in "iub":
        return Field(name, "int")
    if ds.ndim == 1 and ds.dtype.kind == "f":
        return Field(name, "float")
    return Field(name, "array", dtype=ds.dtype.str, shape=tuple(ds.shape[1:]))


def _datasets(datasets) -> dict[str, str]:
    """{field name: dataset path}, from a dict or a list of dataset paths (named by their
    last component)."""
    if isinstance(datasets, Mapping):
        return {str(k): str(v) for k, v in datasets.items()}
    if isinstance(datasets, str) or not isinstance(datasets, Sequence) or not datasets:
        raise UsageError(
            f"datasets={datasets!r}: name the HDF5 datasets, e.g. {DATASETS_EXAMPLE} or "
            "['/images', '/labels']"
        )
    return {str(d).rstrip("/").rsplit("/", 1)[-1]: str(d) for d in datasets}


class HDF5FileReader(Reader):
    """Rows of named datasets in any HDF5 file, as multi-field samples (a field named
    ``label`` of integers gives the labels)."""

    format_name = "hdf5-file"
    checksums = False

    def __init__(self, path: str | os.PathLike, *, datasets):
        self.path = Path(path)
        self.names = _datasets(datasets)
        try:
            with h5py.File(self.path, "r") as f:
                found, missing = {}, []
                for n, p in self.names.items():
                    try:  # its bytes this file's own: no link out, no external storage
                        found[n] = plain_dataset(f, p, self.path)
                    except UnsafePathError:
                        raise
                    except DataError:
                        missing.append(p)
                if missing:
                    have = dataset_names(f)[:20]
                    raise DataError(f"{self.path}: no dataset {missing}; it has {have}")
                fields = tuple(_field(n, d) for n, d in found.items())
                counts = {n: d.shape[0] if d.ndim else None for n, d in found.items()}
                labels = (
                    found["label"][...]
                    if "label" in found and fields[list(found).index("label")].type == "int"
                    else None
                )
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{self.path}: not a readable HDF5 file: {e}") from None
        if len(set(counts.values())) != 1 or None in counts.values():
            raise DataError(f"{self.path}: the datasets hold different numbers of rows: {counts}")
        count = next(iter(counts.values()))
        schema = Schema(fields)
        manifest = {
            "format": "hdf5-file",
            "format_version": 2,
            "count": count,
            "classes": None,
            "sample": {"kind": "fields", "fields": schema.to_json()},
            "files": {},
            "layout": {"file": str(self.path), "datasets": self.names},
        }
        super().__init__(self.path.parent, manifest)
        self.labels = (
            np.asarray(labels, dtype=np.int64) if labels is not None else np.full(count, -1)
        )
        self.crc32 = np.zeros(count, dtype=np.uint32)

    def _open(self):
        return h5py.File(self.path, "r")

    def location(self, index: int) -> str:
        return str(self.path)

    def data_files(self) -> list[str]:
        return [str(self.path)]

    def read_batch(self, indices: np.ndarray):
        f = self.handle
        uniq, inverse = np.unique(indices, return_inverse=True)
        columns = []
        for field in self.spec.schema.fields:
            rows = f[self.names[field.name]][uniq]  # h5py takes increasing indices
            columns.append([_value(field, rows[k]) for k in inverse.reshape(-1).tolist()])
        return [
            join_record(
                [
                    encode_value(field, col[j])
                    for field, col in zip(self.spec.schema.fields, columns, strict=True)
                ]
            )
            for j in range(len(indices))
        ]


def _value(field: Field, row: Any) -> Any:
    if field.type == "str":
        return row.decode("utf-8") if isinstance(row, bytes) else str(row)
    if field.type == "bytes":
        return row.tobytes() if isinstance(row, np.ndarray) else bytes(row)
    if field.type == "int":
        return int(row)
    if field.type == "float":
        return float(row)
    return row
