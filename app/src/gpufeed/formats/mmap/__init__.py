"""Memory-mapped tensors: plain .npy files (or one .pt) that index without being read whole
(reader.py, writer.py; the .pt container in pt.py).

Files in the dataset folder (N samples):
  samples.npy   [N, *shape] dtype, opened with np.load(mmap_mode="r")      (container "npy")
  samples.pt    one tensor [N, *shape], opened with torch.load(mmap=True)   (container "pt")
  encoded.npy   [total] uint8 and offsets.npy [N + 1] int64 for encoded samples
  labels.npy    [N] int64
  crc32.npy     [N] uint32
"""

CONTAINERS = ("npy", "pt")


def data_name(kind: str, container: str = "npy") -> str:
    """The file that holds the samples of a sample spec of ``kind`` (above)."""
    if kind != "array":
        return "encoded.npy"
    return "samples.pt" if container == "pt" else "samples.npy"
