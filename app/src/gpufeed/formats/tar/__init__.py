"""Tar shards in the WebDataset layout (reader.py, writer.py; members.py builds and parses the
ustar headers, index.py checks index.npz, rows.py and fields.py read rows and fields).

Each sample is a group of members sharing a key, the zero-padded sample index:
  000000123.npy   the sample: a .npy file (fixed-shape arrays) or the encoded image bytes
                  under its own extension (.jpg, .png, ...)
  000000123.cls   the label as decimal text (-1 when the source had none)
A multi-field pack (manifest sample kind "fields") has one member per field instead,
000000123.NAME.EXT, in schema order (gpufeed.formats.record: .npy, .txt, .cls, .json, .bin,
.jpg/.png/.webp, .zst for a zstd field), and no .cls member of its own.
Shards are named shard-000000.tar, shard-000001.tar, ...; the manifest records the
brace-expandable pattern (shard-{000000..000012}.tar) that `webdataset.WebDataset` accepts.
Members are plain ustar entries with fixed owner, mode and mtime, so packs are reproducible.

index.npz beside the shards gives every sample's shard, data offset and size (for .npy members
the offset points past the .npy header; for a multi-field sample, offset is its first member's
header and size spans to the end of its last member's data), label and crc32: it enables
random access, per-sample verification and splitting shards without opening them.
"""
