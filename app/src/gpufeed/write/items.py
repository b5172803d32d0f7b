"""Reading one source item: a file becomes a sample's stored bytes, its spec and crc32.

Runs in pack worker processes too (gpufeed.write.pool): no exception escapes
:func:`load_item`, so one bad file cannot take the pool down.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

from gpufeed.formats.checksums import crc32
from gpufeed.formats.inplace.tree import IMAGE_EXTS, suffix
from gpufeed.pixels import to_8bit
from gpufeed.system.native import jpeg_module

__all__ = [
    "STAMP_FIELDS",
    "LoadOptions",
    "encoded_image",
    "jpeg_decodes",
    "load_item",
    "load_pt_array",
    "stamp",
    "stamp_changed",
]


# --------------------------------------------------------------------------- reading items
@dataclass(frozen=True)
class LoadOptions:
    encode: str = "keep"
    resize: tuple[int, int] | None = None  # (height, width)


# what a resume compares to notice a source file changed since its part was committed:
# ctime moves on any write or utime, so a rewrite that restores size and mtime (cp -p,
# rsync -t, os.utime) is still seen; the inode changes when the file is replaced
STAMP_FIELDS = ("size", "mtime_ns", "ctime_ns", "inode")


def stamp(path: str) -> tuple[int, ...]:
    """(size, mtime_ns, ctime_ns, inode) of a source file, all -1 when it cannot be
    stat'ed (each an int64: an inode past 2**63 is stored as its two's complement)."""
    try:
        st = os.stat(path)
    except OSError:
        return (-1,) * len(STAMP_FIELDS)
    ino = st.st_ino - (1 << 64) if st.st_ino >= 1 << 63 else st.st_ino
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, ino)


def stamp_changed(path: str, was) -> bool:
    """Whether the file differs from its recorded stamp (a part an older gpufeed committed
    recorded (size, mtime_ns) only: those are compared)."""
    was = tuple(int(x) for x in was)
    return stamp(path)[: len(was)] != was


def load_item(path: str, opts: LoadOptions) -> tuple:
    """Read one source file. Returns ("ok", stamp, payload, spec_json, ext, crc, size) or
    ("error", stamp, msg); stamp is the file's stamp() before it was read, size the
    (height, width) of an image kept encoded (its sizes may vary: pack says so), else None.

    Runs in pack worker processes: no exception escapes, so one bad file cannot take the
    pool down, and the parent decides whether it stops the pack or is skipped.
    """
    before = stamp(path)
    size = None
    try:
        ext = suffix(path)
        if ext in IMAGE_EXTS:
            payload, spec, ext, size = _load_image(path, ext, opts)
        elif ext == ".npy":
            payload, spec = _load_npy(path)
        elif ext == ".pt":
            payload, spec = _array_payload(load_pt_array(path))
            ext = ".npy"
        else:
            return ("error", before, f"unsupported file type {ext!r}")
        return ("ok", before, payload, spec, ext.lstrip("."), crc32(payload), size)
    except Exception as e:  # noqa: BLE001 - reported with the file name by the parent
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return ("error", before, f"{type(e).__name__}: {msg}" if msg else type(e).__name__)


def jpeg_decodes(data: bytes) -> bool:
    """Whether libjpeg-turbo decodes the JPEG without a complaint, at 1/8 scale (the IDCT's
    DCT scaling: every coefficient is still read, so a truncated or corrupt stream fails as
    in a full decode, at a fraction of its cost: docs/performance/conversion.md). False too
    where the native decoder is not installed."""
    return _jpeg_size(data) is not None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a JPEG that jpeg_decodes, else None."""
    native = jpeg_module()[0]
    if native is None:
        return None
    sizes, bad = native.image_sizes([data])
    if bad:
        return None
    h, w = sizes[0].tolist()
    out = np.empty((1, max(1, h // 8), max(1, w // 8), 3), np.uint8)
    box = np.array([[0, 0, h, w]], np.int64)
    if native.decode_crops([data], box, np.zeros(1, bool), out, 1, True):
        return None
    return (h, w)


def encoded_image(path: str) -> bytes:
    """An image file's bytes, checked as a pack that keeps them checks them (a file that
    does not decode raises)."""
    return _load_image(path, suffix(path), LoadOptions())[0]


def _load_image(path: str, ext: str, opts: LoadOptions):
    """(payload, spec, ext, (height, width) when kept encoded, else None) of an image."""
    from PIL import Image

    with open(path, "rb") as f:
        data = f.read()
    # kept as they are, JPEGs are checked by a scaled native decode; what it complains of
    # (or anything else) gets PIL's full decode, whose verdict stands (the native decoder is
    # stricter: libjpeg's warnings are its errors)
    size = _jpeg_size(data) if opts.encode == "keep" and ext in (".jpg", ".jpeg") else None
    if size is not None:
        return data, {"kind": "encoded"}, ext, size
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # a full decode: truncated or corrupt files fail here, not at train time
        if opts.encode == "keep":
            return data, {"kind": "encoded"}, ext, (img.height, img.width)
        rgb = to_8bit(img).convert("RGB")  # 16-bit scaled, never clipped (gpufeed.pixels)
        if opts.resize is not None:
            h, w = opts.resize
            rgb = rgb.resize((w, h), Image.BILINEAR)
        arr = np.asarray(rgb).transpose(2, 0, 1)  # HWC -> CHW, like torchvision.io
    payload, spec = _array_payload(arr)
    return payload, spec, ".npy", None


# .npy headers seen (the header's bytes: its spec and data bytes, or None where np.load must
# read the file: Fortran order, object arrays); a folder's arrays mostly share one header
_NPY_HEADERS: dict[bytes, tuple[dict, int] | None] = {}
_NPY_MAGIC = b"\x93NUMPY"


def _load_npy(path: str) -> tuple[bytes, dict]:
    """A .npy file's payload and spec, as _array_payload(np.load(path)) gives them: its
    data bytes as they are when its header is one seen before (np.load parses each header
    with ast: three quarters of the read of a 12 KiB array)."""
    with open(path, "rb") as f:
        raw = f.read()
    end = _npy_header_end(raw)
    known = _NPY_HEADERS.get(raw[:end]) if end else None
    if known is None and end and raw[:end] not in _NPY_HEADERS and len(_NPY_HEADERS) < 64:
        known = _NPY_HEADERS[raw[:end]] = _npy_header(raw[:end])
    if known is not None and len(raw) - end >= known[1]:
        return raw[end : end + known[1]], known[0]
    return _array_payload(np.load(path, allow_pickle=False))  # and its errors, as they were


def _npy_header_end(raw: bytes) -> int:
    """Where a .npy file's data starts (0 when it does not start like a .npy of version
    1, 2 or 3)."""
    if len(raw) < 12 or not raw.startswith(_NPY_MAGIC):
        return 0
    if raw[6] == 1:
        return 10 + int.from_bytes(raw[8:10], "little")
    if raw[6] in (2, 3):
        return 12 + int.from_bytes(raw[8:12], "little")
    return 0


def _npy_header(header: bytes) -> tuple[dict, int] | None:
    """(spec, data bytes) of a C-order, non-object .npy header, else None."""
    from numpy.lib import format as npy_format

    f = io.BytesIO(header)
    read = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}
    try:
        shape, fortran, dtype = read[npy_format.read_magic(f)](f)
    except Exception:  # noqa: BLE001 - np.load reads the file (version 3 too), says what is wrong
        return None
    # np.load's own way for the rest: a sub-array dtype widens the shape
    if fortran or dtype.hasobject or dtype.subdtype is not None:
        return None
    spec = {"kind": "array", "dtype": dtype.str, "shape": list(shape)}
    return spec, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def load_pt_array(path: str) -> np.ndarray:
    """The one tensor a .pt file holds, as a numpy array (anything else is that file's error)."""
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, torch.Tensor):
        raise ValueError(
            f"holds a {type(obj).__name__}, expected one tensor (the folder's first .pt held "
            "one; a folder of .pt dicts is packed as fields: pack each kind separately)"
        )
    return obj.detach().contiguous().numpy()


def _array_payload(arr: np.ndarray):
    if arr.dtype.hasobject:
        raise ValueError("object arrays cannot be packed")
    arr = np.require(arr, requirements="C")  # np.ascontiguousarray makes 0-d 1-d
    spec = {"kind": "array", "dtype": arr.dtype.str, "shape": list(arr.shape)}
    return arr.tobytes(), spec
