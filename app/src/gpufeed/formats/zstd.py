"""zstd frames of compressed fields (formats/record.py), compressed and decompressed with a
bound: a small crafted frame can declare or hold gigabytes (docs/security.md).

A frame is never decompressed past the bytes its field may hold: a fixed-shape array's,
int's or float's size, else MAX_DECOMPRESSED_BYTES (env GPUFEED_MAX_DECOMPRESSED_BYTES sets
another). A frame whose header declares more is refused before anything is allocated.
"""

from __future__ import annotations

import os
import threading

from gpufeed.errors import UsageError

__all__ = ["MAX_DECOMPRESSED_BYTES", "compress", "decompress", "max_decompressed_bytes"]

ZSTD_LEVEL = 3
# the most bytes one compressed field of a sample may decompress to where its schema does
# not fix its size
MAX_DECOMPRESSED_BYTES = 256 << 20
MAX_DECOMPRESSED_ENV = "GPUFEED_MAX_DECOMPRESSED_BYTES"
_CHUNK = 1 << 20

_ZSTD = threading.local()  # one compressor and decompressor per thread: making one per
# value cost more than decompressing a 16 KiB field


def _zstd(kind: str):
    """This thread's zstd compressor ("c") or decompressor ("d")."""
    codec = getattr(_ZSTD, kind, None)
    if codec is None:
        try:
            import zstandard
        except ImportError:
            raise UsageError(
                "zstd field compression needs the zstandard package (pip install 'gpufeed[zstd]')"
            ) from None
        if kind == "c":
            codec = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        else:
            codec = zstandard.ZstdDecompressor()
        setattr(_ZSTD, kind, codec)
    return codec


def compress(data) -> bytes:
    """One zstd frame of ``data`` (its header declares the content size)."""
    return _zstd("c").compress(data)


def max_decompressed_bytes() -> int:
    """MAX_DECOMPRESSED_BYTES, or what env GPUFEED_MAX_DECOMPRESSED_BYTES sets."""
    text = os.environ.get(MAX_DECOMPRESSED_ENV, "").strip()
    if not text:
        return MAX_DECOMPRESSED_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"{MAX_DECOMPRESSED_ENV}={text!r}: expected a number of bytes")
    return value


def decompress(data, limit: int, most: str) -> bytes:
    """One zstd frame's content, at most ``limit`` bytes (``most`` says which, in the
    error). A frame declaring its size (as gpufeed's writer makes them) is checked by its
    header, then decompressed in one call (which allocates what the header declares); one
    that does not is read a chunk at a time up to the limit. Errors are ValueError."""
    import zstandard

    decompressor = _zstd("d")
    try:
        declared = zstandard.frame_content_size(data)
        if declared > limit:
            raise ValueError(f"zstd frame declares {declared:,} bytes, more than {most}")
        if declared >= 0:
            return decompressor.decompress(data)
        return _chunks(decompressor, data, limit, most)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame does not decompress: {e}") from None


def _chunks(decompressor, data, limit: int, most: str) -> bytes:
    chunks, total = [], 0
    with decompressor.stream_reader(data, read_across_frames=False) as reader:
        while chunk := reader.read(_CHUNK):
            total += len(chunk)
            if total > limit:
                raise ValueError(f"zstd frame holds more than {most}")
            chunks.append(chunk)
    return b"".join(chunks)
