"""LMDB: one record per sample, readable with plain `lmdb` (reader.py, writer.py; the keys in
keys.py).

The environment is the dataset folder itself (DEST/data.mdb). Keys are zero-padded sample
indices, b"%010d"; values are the sample's stored bytes: raw C-order array bytes for
fixed-shape samples (dtype and shape in the manifest and in the `__gpufeed__` key) or the
encoded file's bytes. Index keys sort after every sample key:
  __gpufeed__   JSON: count, sample spec, classes, format_version
  __labels__    .npy bytes, int64 [N]
  __crc32__     .npy bytes, uint32 [N]
"""
