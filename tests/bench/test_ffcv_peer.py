"""The FFCV peer of the comparison suite (bench/peers/ffcv_peer.py): closing its passes."""

from __future__ import annotations

import queue
import threading
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class _FakeEpoch(threading.Thread):
    """FFCV's EpochIterator as far as Passes uses it: a thread filling a bounded queue,
    polling its stop event between puts, and a last blocking put(None) at the end."""

    def __init__(self, batches: int):
        super().__init__(daemon=True)
        self.output_queue = queue.Queue(1)
        self.terminate_event = threading.Event()
        self.storage_state = ("map",)
        self.batches = batches
        self.start()

    def run(self):
        for b in range(self.batches):
            while True:
                try:
                    self.output_queue.put(b, timeout=0.05)
                    break
                except queue.Full:
                    if self.terminate_event.is_set():
                        return
        self.output_queue.put(None)

    def __next__(self):
        item = self.output_queue.get()
        if item is None:
            raise StopIteration
        return item

    def close(self):
        self.terminate_event.set()


class _FakeLoader:
    def __init__(self, batches: int):
        self.batches = batches
        self.memory_manager = types.SimpleNamespace(context=types.SimpleNamespace(mmap="map"))

    def __iter__(self):
        return _FakeEpoch(self.batches)

    def __len__(self):
        return self.batches


@pytest.mark.parametrize("cut_short", [True, False])
def test_ffcv_passes_close_stops_the_epoch_threads_and_drops_the_map(cut_short):
    from bench.peers.ffcv_peer import Passes

    passes = Passes(_FakeLoader(batches=50 if cut_short else 2))
    epoch = iter(passes)
    if cut_short:
        assert next(epoch) == 0  # the suite's cap stops here; the thread keeps reading ahead
    else:
        time.sleep(0.2)  # ran to its end: its last put(None) waits on a full queue
    assert epoch.is_alive()
    t = time.perf_counter()
    passes.close(wait_s=5.0)
    assert time.perf_counter() - t < 2.0
    assert not epoch.is_alive()
    assert epoch.storage_state is None
    assert passes.loader.memory_manager.context.mmap is None
    assert len(passes) == (50 if cut_short else 2)
