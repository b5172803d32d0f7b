"""gpufeed bench --compare-plain (gpufeed/tools/compare_plain.py): gpufeed's loader beside a
plain DataLoader over the same pack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpufeed
from gpufeed import cli
from gpufeed.tools import bench

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mmap_pack(pack_factory):
    return pack_factory("mmap")


@pytest.mark.slow
def test_compare_plain_reads_both_loaders_side_by_side(mmap_pack, capsys):
    """The measuring harness behind README's ratio (the numbers themselves are not checked:
    speed is judged by running it, not by a test)."""
    code = cli.main(["bench", str(mmap_pack), "-b", "4", "--compare-plain", "--seconds", "0.05"])
    assert code == 0
    out = capsys.readouterr().out
    assert "DataLoader" in out and "make_loader" in out and "ratio" in out
    assert "DataLoader, in memory" in out and "samples held in a list" in out
    result = bench.compare_plain(mmap_pack, batch_size=4, workers=(0,), seconds=0.05, rounds=2)
    row = result["workers"][0]
    assert row["plain_samples_per_s"] > 0 and row["make_loader_samples_per_s"] > 0
    assert row["in_memory_samples_per_s"] > 0
    assert row["make_loader_vs_plain"] == pytest.approx(
        row["make_loader_samples_per_s"] / row["plain_samples_per_s"]
    )
    assert result["in_memory_samples"] == len(gpufeed.open_dataset(mmap_pack))  # all fit


def test_compare_plain_holds_samples_up_to_its_byte_budget(mmap_pack):
    from gpufeed.tools import compare_plain

    ds = gpufeed.open_dataset(mmap_pack)
    one = ds[0][0].numel() + 8  # the image's bytes and the label's
    held = compare_plain._held_samples(ds, 3 * one)
    assert len(held) == 3
    for i in range(3):  # as dataset[i] gives them
        assert torch.equal(held[i][0], ds[i][0]) and held[i][1] == ds[i][1]
    assert len(compare_plain._held_samples(ds, 1)) == 1  # at least one


def test_compare_plain_holds_nothing_for_a_stream(tmp_path, array_folder):
    pack = tmp_path / "p.tar"
    gpufeed.pack(array_folder, pack, format="tar", workers=1, quiet=True)
    result = bench.compare_plain(
        pack,
        batch_size=4,
        workers=(0,),
        seconds=0.05,
        rounds=1,
        dataset_options={"map_style": False},
    )
    assert result["in_memory_samples"] is None
    assert result["workers"][0]["in_memory_samples_per_s"] is None
    assert "in memory" not in bench.format_compare(result)
