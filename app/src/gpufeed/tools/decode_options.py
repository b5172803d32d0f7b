"""Where ``gpufeed bench`` and ``gpufeed tune`` decode encoded images: ``--crop N`` (decode
with gpufeed.RandomResizedCrop(N)) and ``--decode-on`` (in the loader's workers, or on the GPU
in DevicePrefetcher, as users choose with ``DevicePrefetcher(decode=crop, decode_on=...)``)."""

from __future__ import annotations

from typing import Any

from gpufeed import cliargs

__all__ = ["add_crop_argument", "add_decode_on_argument", "crop_options", "split_decode"]


def add_crop_argument(p) -> None:
    p.add_argument(
        "--crop",
        type=cliargs.integer(1, 4096, "--crop"),
        metavar="N",
        help="encoded images: decode with gpufeed.RandomResizedCrop(N) (decode, crop, resize, "
        "flip: ImageNet's training augmentation) instead of the plain decode",
    )


def crop_options(crop: int | None) -> dict[str, Any]:
    """open_dataset options for ``--crop``."""
    if not crop:
        return {}
    from gpufeed.data.decoders import RandomResizedCrop

    return {"decode": RandomResizedCrop(crop)}


def add_decode_on_argument(p) -> None:
    from gpufeed.loading.device_decode import DECODE_ON

    p.add_argument(
        "--decode-on",
        choices=DECODE_ON,
        default="auto",
        help="with --crop: where JPEGs are decoded, cropped and flipped. auto (default): on "
        "the GPU (nvJPEG, in DevicePrefetcher) when --device is CUDA, else in the loader's "
        "workers; cuda insists (an error saying why it cannot); cpu keeps the workers",
    )


def split_decode(dataset_options, device: str, decode_on: str):
    """(open_dataset's options, the crop DevicePrefetcher decodes with or None, where images
    are decoded: None when nothing is). A RandomResizedCrop decoded on the GPU
    (``decode_on`` "auto" with a CUDA device, or "cuda": nvJPEG, as
    ``DevicePrefetcher(decode=crop)`` does for users) makes the dataset ship encoded bytes;
    on the CPU the dataset's workers decode, as ``open_dataset(decode=crop)`` does."""
    import torch

    from gpufeed.data.decoders import RandomResizedCrop
    from gpufeed.loading.device_decode import decode_device

    options = dict(dataset_options or {})
    crop = options.get("decode")
    if not isinstance(crop, RandomResizedCrop):
        return options, None, None
    if decode_device(torch.device(device), decode_on).type != "cuda":
        return options, None, "cpu (the loader's workers)"
    return options | {"decode": False}, crop, f"{device} (nvJPEG, DevicePrefetcher)"
