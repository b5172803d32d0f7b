"""Folder and list-file sources whose samples are not one image or one array: packed as
multi-field samples through ``gpufeed.pack(fn, inputs)`` (gpufeed.write.convert).

  source files                      fields of a sample
  .txt                              text: str (UTF-8)
  .wav (PCM)                        audio: ragged [frames, channels] in the file's sample type
                                    (uint8, int16, int32; 24-bit widened to int32, same
                                    values), sample_rate: int
  .pt holding a dict                its keys (tensors become arrays)
  images/arrays, list-file numbers  image: the encoded bytes, or x: the array
  + class folders / list labels     label: int
  + list-file numbers (not ints)    target: float

The listing is scan_source's (its classes, labels, problems and symlink policy); a source
of one image or one array a sample with int labels stays the classic (image, label) pack
(gpufeed.write.pack). The route is decided here, in the parent, before anything is written:
.txt or .wav files; else the first .pt that loads holding a dict; else number targets.
"""

from __future__ import annotations

import wave
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.errors import UsageError
from gpufeed.formats.inplace.tree import (
    IMAGE_EXTS,
    Source,
    file_kind,
    first_of_each_kind,
    mixed_kinds_message,
    suffix,
)
from gpufeed.formats.schema import Schema, infer_schema, parse_schema
from gpufeed.write.items import encoded_image, load_pt_array

__all__ = ["FileSamples", "plan_fields", "read_wav"]

# what a file's bytes per sample become (24-bit: widened to int32, the same values)
WAV_DTYPES = {1: "|u1", 2: "<i2", 3: "<i4", 4: "<i4"}
WAV_SUPPORTED = "PCM WAV with 8, 16, 24 or 32-bit integer samples (Python's wave module)"
# image extensions whose bytes an image field of one format holds
IMAGE_FIELD_FORMATS = {".jpg": "jpeg", ".jpeg": "jpeg", ".png": "png", ".webp": "webp"}


# --------------------------------------------------------------------------- reading files
def read_text(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8"
        ) from None


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """(samples [frames, channels] in the file's sample type, sample rate) of a PCM WAV."""
    try:
        with wave.open(path, "rb") as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.getnframes()
            raw = w.readframes(frames)
    except (wave.Error, EOFError) as e:
        why = str(e) or "the file ends early"
        msg = f"not a WAV file gpufeed reads ({why}); supported: {WAV_SUPPORTED}"
        raise ValueError(msg) from None
    if width not in WAV_DTYPES or channels < 1:
        raise ValueError(f"{width * 8}-bit samples; supported: {WAV_SUPPORTED}")
    if len(raw) != frames * width * channels:
        raise ValueError(
            f"truncated: its header says {frames} frames, it holds {len(raw) // (width * channels)}"
        )
    if width == 3:  # little-endian 24-bit, sign-extended into int32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        samples = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8) >> 8
    else:
        samples = np.frombuffer(raw, WAV_DTYPES[width])
    return samples.reshape(-1, channels), rate


def _load_pt_fields(path: str) -> Any:
    """torch.load(weights_only=True), numpy arrays and scalars allowed too (their rebuilding
    only: an object array still needs globals weights_only refuses)."""
    import torch

    allow = getattr(torch.serialization, "safe_globals", None)
    if allow is None:
        return torch.load(path, map_location="cpu", weights_only=True)
    with allow(_numpy_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def _numpy_globals() -> list:
    import numpy.dtypes

    core = getattr(np, "_core", None) or np.core
    dtypes = [getattr(numpy.dtypes, n) for n in dir(numpy.dtypes) if n.endswith("DType")]
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def _as_value(value: Any) -> Any:
    """A .pt dict's value as a field takes it: tensors become numpy arrays."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().contiguous().numpy()
    return value


def _pt_fields(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"holds a {type(obj).__name__}, expected a dict of fields (the source's first "
            ".pt held one; a folder of single tensors is packed as arrays: pack each kind "
            "separately)"
        )
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise ValueError(f"holds a dict with key {bad[0]!r}; fields are named by str keys")
    return {k: _as_value(v) for k, v in obj.items()}


def _read_array(path: str) -> np.ndarray:
    if suffix(path) == ".npy":
        return np.load(path, allow_pickle=False)
    return load_pt_array(path)  # one tensor, as the (array, label) pack reads a .pt


# --------------------------------------------------------------------------- the samples
@dataclass(frozen=True, eq=False)
class FileSamples:
    """``fn`` for gpufeed.pack(fn, range(len(source))): item i -> the sample dict of the
    source's i-th file (a plain object: it pickles where workers are spawned)."""

    route: str  # text | audio | ptdict | images | arrays
    paths: list[str]
    labels: np.ndarray | None  # int labels, when the source knows them
    targets: np.ndarray | None  # float targets (a list file's numbers)
    audio_dtype: str | None = None

    def __call__(self, i: int) -> dict[str, Any]:
        path = self.paths[i]
        want = "arrays" if self.route == "ptdict" else self.route
        if file_kind(path) != want:
            raise ValueError(
                f"not one of {want} files, as the source's first is; pack each kind separately"
            )
        sample = self._read(path)
        for key, value in (("label", self.labels), ("target", self.targets)):
            if value is None:
                continue
            if key in sample:
                raise ValueError(f"holds a {key!r} key, and the source gives the {key}")
            sample[key] = int(value[i]) if key == "label" else float(value[i])
        return sample

    def _read(self, path: str) -> dict[str, Any]:
        if self.route == "text":
            return {"text": read_text(path)}
        if self.route == "audio":
            audio, rate = read_wav(path)
            if self.audio_dtype is not None and audio.dtype.str != self.audio_dtype:
                raise ValueError(
                    f"{np.dtype(audio.dtype).name} samples; this pack's audio is "
                    f"{np.dtype(self.audio_dtype).name} (its first file's): pack files of one "
                    "sample type together"
                )
            return {"audio": audio, "sample_rate": rate}
        if self.route == "ptdict":
            if suffix(path) != ".pt":
                raise ValueError("a .npy array among .pt dicts of fields; pack them separately")
            return _pt_fields(_load_pt_fields(path))
        if self.route == "images":
            return {"image": encoded_image(path)}
        return {"x": _read_array(path)}


# --------------------------------------------------------------------------- the plan
def plan_fields(
    src: Source, schema: Schema | Mapping[str, Any] | None = None
) -> tuple[FileSamples, Schema | None] | None:
    """How the source packs as multi-field samples: (fn, its schema: None where no file
    reads, pack_function takes it from the first sample), or None: the classic pack.
    schema: fields whose type replaces the one taken from the first file (an array that
    varies: 'int64[-1]')."""
    first = first_of_each_kind(src.paths)
    if not first:  # every file a problem: nothing to route
        return None
    fields_kinds = {"text", "audio"} & set(first)
    if len(first) > 1 and (fields_kinds or src.targets is not None):
        raise UsageError(mixed_kinds_message(src.path, first, src.path.parent))
    kind = next(iter(first))
    route = kind if kind in fields_kinds else None
    if route is None and kind == "arrays" and _first_pt_dict(src) is not None:
        route = "ptdict"
    if route is None and src.targets is not None:
        if kind is None:
            raise UsageError(
                f"{src.path}: {first[None]}: not an image, array, .txt or .wav file; a list "
                "file with number targets lists images or arrays"
            )
        route = kind
    if route is None:
        if schema is not None:
            raise UsageError(
                "schema= (--schema) applies to sources packed as multi-field samples (.txt, "
                ".wav, .pt dicts, number targets), not to (image, label) or (array, label) packs"
            )
        return None
    labels = src.labels if (src.labels >= 0).any() else None
    fn = FileSamples(route, src.paths, labels, src.targets)
    sample = _first_sample(fn)
    if sample is None:
        return fn, None
    if route == "audio":
        fn = FileSamples(route, src.paths, labels, src.targets, sample["audio"].dtype.str)
    base = {f.name: f for f in infer_schema(sample).fields}
    if route == "audio":
        base["audio"] = parse_schema({"audio": f"{sample['audio'].dtype.str}[-1,-1]"})["audio"]
    if route == "images":
        base["image"] = _image_field(src.paths)
    return fn, _overridden(base, schema)


def _first_pt_dict(src: Source) -> Mapping | None:
    """The dict the first .pt that loads holds; None where it holds anything else (a file
    that does not load is that file's error later, whichever way the source is packed).
    Its keys may not be the fields the listing adds."""
    for path in src.paths:
        if suffix(path) != ".pt":
            continue
        try:
            obj = _load_pt_fields(path)
        except Exception:  # noqa: BLE001, S112 - reported by the pack, naming the file
            continue
        if not isinstance(obj, Mapping):
            return None
        for key, given in (("label", (src.labels >= 0).any()), ("target", src.targets is not None)):
            if key in obj and given:
                raise UsageError(
                    f"{path}: holds a {key!r} key, and the source gives each sample its "
                    f"{key} (class folders or the list file); rename the key"
                )
        return obj
    return None


def _first_sample(fn: FileSamples) -> dict[str, Any] | None:
    """The first file's sample that reads (those that do not are their files' errors when
    the pack reads them)."""
    for i in range(len(fn.paths)):
        try:
            return fn(i)
        except Exception:  # noqa: BLE001, S112 - as above
            continue
    return None


def _image_field(paths: list[str]):
    """jpeg, png or webp when every image's extension says that one (decoded when read),
    else bytes (the encoded files as they are)."""
    formats = {IMAGE_FIELD_FORMATS.get(suffix(p)) for p in paths if suffix(p) in IMAGE_EXTS}
    fmt = formats.pop() if len(formats) == 1 else None
    return parse_schema({"image": fmt or "bytes"})["image"]


def _overridden(base: dict, schema: Schema | Mapping[str, Any] | None) -> Schema:
    if schema is None:
        return Schema(tuple(base.values()))
    given = parse_schema(schema)
    unknown = [n for n in given.names if n not in base]
    if unknown:
        raise UsageError(
            f"schema: {unknown[0]!r} is not a field of these samples ({', '.join(base)})"
        )
    return Schema(tuple(given[n] if n in given.names else f for n, f in base.items()))
