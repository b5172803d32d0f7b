"""FFCV: a row when ``ffcv`` imports (it builds from source against libopencv-dev and
libturbojpeg0-dev; see docs/benchmarks.md for what happened here)."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path


def unavailable() -> str | None:
    try:
        import ffcv  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken build raises anything at import
        return f"ffcv does not import: {type(exc).__name__}: {exc}"
    return None


class _Source:
    """The case's samples as FFCV's writer wants them: (HWC uint8 array, label). Module-level,
    since the writer pickles it to its worker processes."""

    def __init__(self, kind: str, files: list[str], labels):
        self.kind, self.files, self.labels = kind, files, labels

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import numpy as np

        from bench.data import load_raw

        if self.kind == "raw":
            return load_raw(self.files[i]), int(self.labels[i])
        from PIL import Image

        return np.asarray(Image.open(self.files[i]).convert("RGB")), int(self.labels[i])


def write(case, out: Path) -> None:
    import numpy as np
    from ffcv.fields import IntField, NDArrayField, RGBImageField
    from ffcv.writer import DatasetWriter

    out.mkdir(parents=True, exist_ok=True)
    x = (
        NDArrayField(np.dtype("uint8"), case.shape)
        if case.kind == "raw"
        else RGBImageField(write_mode="jpg", jpeg_quality=90)
    )
    source = _Source(case.kind, case.files(), case.labels())
    DatasetWriter(str(out / "data.beton"), {"x": x, "y": IntField()}).from_indexed_dataset(source)


def batches(case, out: Path, *, shuffle: bool, workers: int, batch_size: int, seed: int = 0):
    from ffcv.fields.decoders import IntDecoder, NDArrayDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor

    if case.kind == "raw":
        x = [NDArrayDecoder(), ToTensor()]
    else:
        x = [
            RandomResizedCropRGBImageDecoder((case.crop, case.crop)),
            RandomHorizontalFlip(),
            ToTensor(),
        ]
    return Passes(
        Loader(
            str(out / "data.beton"),
            batch_size=batch_size,
            # FFCV's workers are numba threads: more than the usable CPUs is a ValueError
            num_workers=max(1, min(workers, len(os.sched_getaffinity(0)))),
            order=OrderOption.QUASI_RANDOM if shuffle else OrderOption.SEQUENTIAL,
            pipelines={"x": x, "y": [IntDecoder(), ToTensor()]},
            seed=seed,
        )
    )


class Passes:
    """An FFCV Loader whose passes can be stopped. A pass cut short (the suite's time cap)
    leaves FFCV's epoch thread reading ahead, and its memory map of the .beton open for the
    life of the process (FFCV closes neither): mapped pages survive posix_fadvise(DONTNEED),
    so the next "cold" pass found most of the file cached (92% in a jpeg run, 2026-12-05).
    ``close`` stops the threads and drops the map."""

    def __init__(self, loader):
        self.loader = loader
        self._epochs: list = []

    def __iter__(self):
        epoch = iter(self.loader)
        self._epochs.append(epoch)
        return epoch

    def __len__(self) -> int:
        return len(self.loader)

    def close(self, wait_s: float = 10.0) -> None:
        for epoch in self._epochs:
            epoch.close()  # sets its stop event: the thread returns at its next hand-off
            deadline = time.monotonic() + wait_s
            while epoch.is_alive() and time.monotonic() < deadline:
                try:  # a thread that ran to the end waits to hand over its last item
                    epoch.output_queue.get_nowait()
                except queue.Empty:
                    pass
                epoch.join(0.05)
            epoch.storage_state = None
        self._epochs.clear()
        context = getattr(self.loader.memory_manager, "context", None)
        if context is not None and getattr(context, "mmap", None) is not None:
            context.mmap = None
