from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch

from gpufeed.errors import UsageError
from gpufeed.loading.make import make_loader
from gpufeed.loading.prefetch import DevicePrefetcher


class Batch(NamedTuple):
    samples: torch.Tensor
    labels: torch.Tensor


class Pair(NamedTuple):
    image: torch.Tensor
    target: torch.Tensor


MEAN, STD = (0.5, 0.25, 0.1), (0.2, 0.5, 1.0)


def images(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, 5, 6), dtype=torch.uint8, generator=g)


def expected(x, mean=MEAN, std=STD):
    ref = x.double() / 255.0
    ref = (ref - torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        std, dtype=torch.float64
    ).view(1, 3, 1, 1)
    return ref


def test_cpu_passthrough_without_conversion_keeps_objects():
    batches = [Batch(images(), torch.arange(4)), {"a": torch.ones(2)}, ["text", 3]]
    got = list(DevicePrefetcher(batches, "cpu", dtype=None))
    assert got[0].samples is batches[0].samples and got[0].labels is batches[0].labels
    assert got[1]["a"] is batches[1]["a"]
    assert got[2] == ["text", 3]


@pytest.mark.parametrize("device", [None, "auto"])
def test_auto_device_is_cuda_when_there_else_a_cpu_passthrough(device):
    p = DevicePrefetcher([Batch(images(), torch.arange(4))], device, dtype=None)
    assert p.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    (out,) = list(p)
    assert out.samples.device.type == p.device.type


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda")])
def test_an_explicit_device_that_is_not_there_is_a_clear_error(device):
    with pytest.raises(UsageError, match="torch sees no CUDA device.*device=None or 'auto'"):
        DevicePrefetcher([Batch(images(), torch.arange(4))], device)


def test_an_unknown_or_missing_gpu_is_named():
    with pytest.raises(UsageError, match="'bogus' is not a device torch knows"):
        DevicePrefetcher([], "bogus")
    with pytest.raises(UsageError, match="cuda:99"):
        DevicePrefetcher([], "cuda:99")


def test_batch_uint8_scaled_normalized_labels_untouched():
    x = images()
    (out,) = DevicePrefetcher([Batch(x, torch.arange(4))], "cpu", normalize=(MEAN, STD))
    assert isinstance(out, Batch) and out.samples.dtype == torch.float32
    assert torch.allclose(out.samples.double(), expected(x), atol=1e-5)
    assert out.labels.dtype == torch.int64 and out.labels.tolist() == [0, 1, 2, 3]


def test_scale_off_and_float16_and_channels_last():
    x = images()
    (out,) = DevicePrefetcher(
        [Batch(x, torch.zeros(4, dtype=torch.int64))],
        "cpu",
        dtype=torch.float16,
        scale=False,
        channels_last=True,
    )
    assert out.samples.dtype == torch.float16
    assert torch.equal(out.samples.float(), x.float())
    assert out.samples.is_contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous(memory_format=torch.channels_last)


def test_containers_convert_uint8_only():
    x, y = images(), torch.arange(4)
    mask = torch.ones(4, 5, 6, dtype=torch.uint8)
    batches = [
        (x, y),
        [x, y],
        Pair(x, y),
        OrderedDict(image=x, label=y, meta={"mask": mask}, name="n"),
    ]
    out = list(DevicePrefetcher(batches, "cpu"))
    assert type(out[0]) is tuple and type(out[1]) is list and type(out[2]) is Pair
    assert type(out[3]) is OrderedDict and out[3]["name"] == "n"
    for o in (out[0][0], out[1][0], out[2].image, out[3]["image"]):
        assert o.dtype == torch.float32 and torch.allclose(o, x.float() / 255)
    for o in (out[0][1], out[1][1], out[2].target, out[3]["label"]):
        assert o.dtype == torch.int64 and torch.equal(o, y)
    assert out[3]["meta"]["mask"].dtype == torch.float32


def test_list_of_differently_shaped_samples():
    a, b = images(1)[0], torch.randint(0, 256, (3, 2, 2), dtype=torch.uint8)
    (out,) = DevicePrefetcher([Batch([a, b], torch.tensor([0, 1]))], "cpu", normalize=(MEAN, STD))
    assert isinstance(out.samples, list) and len(out.samples) == 2
    assert torch.allclose(out.samples[1].double(), expected(b[None])[0], atol=1e-5)


def test_bad_normalize_is_a_clear_error():
    with pytest.raises(ValueError, match="non-zero"):
        DevicePrefetcher([], "cpu", normalize=((0, 0, 0), (1, 0, 1)))
    with pytest.raises(ValueError, match="3 values, std 2"):
        DevicePrefetcher([], "cpu", normalize=((0, 0, 0), (1, 1)))
    p = DevicePrefetcher(
        [Batch(torch.zeros(2, 4, 3, 3, dtype=torch.uint8), torch.arange(2))],
        "cpu",
        normalize=(MEAN, STD),
    )
    with pytest.raises(ValueError, match="3 channel values but the samples are"):
        list(p)


class Filled(torch.utils.data.Dataset):
    """40 samples, each filled with its index; at module level so that spawned workers can
    unpickle it (make_loader spawns once CUDA is initialised)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((3, 2, 2), i, dtype=torch.uint8), i


def _loader_batches():
    return make_loader(Filled(), 8, num_workers=0, seed=3)


def test_wraps_a_loader_len_epoch_and_state():
    p = DevicePrefetcher(_loader_batches(), "cpu")
    assert len(p) == 5
    first = [int(i) for b in p for i in b[1]]
    p.set_epoch(0)
    it = iter(p)
    seen = [int(i) for i in next(it)[1]]
    state = p.state_dict()
    assert state["samples_seen"] == 8
    rest = DevicePrefetcher(_loader_batches(), "cpu")
    rest.load_state_dict(state)
    assert seen + [int(i) for b in rest for i in b[1]] == first


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_copy_convert_and_order():
    xs = [images(8, seed=s).pin_memory() for s in range(6)]
    batches = [Batch(x, torch.arange(8).pin_memory() + 8 * k) for k, x in enumerate(xs)]
    p = DevicePrefetcher(batches, "cuda", normalize=(MEAN, STD), channels_last=True)
    out = []
    for b in p:
        assert b.samples.is_cuda and b.labels.is_cuda
        assert b.samples.is_contiguous(memory_format=torch.channels_last)
        # work on the compute stream, as a model would, before the next copy lands
        out.append((b.samples * 1.0).cpu())
        assert p._pending == (len(out) < len(batches))
    for x, o in zip(xs, out, strict=True):
        assert torch.allclose(o.double(), expected(x), atol=1e-5)


@needs_cuda
def test_cuda_state_excludes_the_batch_in_lookahead():
    p = DevicePrefetcher(_loader_batches(), "cuda")
    it = iter(p)
    next(it)
    assert p.loader.state_dict()["samples_seen"] == 16  # one batch copied ahead
    assert p.state_dict()["samples_seen"] == 8


@needs_cuda
def test_cuda_warns_once_about_unpinned_batches():
    batches = [Batch(images(), torch.arange(4)) for _ in range(3)]
    with pytest.warns(UserWarning, match="not in pinned memory") as rec:
        out = list(DevicePrefetcher(batches, "cuda"))
    assert len([w for w in rec if "pinned" in str(w.message)]) == 1
    assert all(b.samples.is_cuda for b in out)


@needs_cuda
def test_cuda_through_make_loader_with_workers_pins_and_converts():
    dl = make_loader(_loader_batches().dataset, 8, num_workers=2, seed=3)
    assert dl.plan.pin_memory
    p = DevicePrefetcher(dl, normalize=((0.5,) * 3, (0.5,) * 3))
    seen = []
    for b in p:
        assert b[0].is_cuda and b[0].dtype == torch.float32
        seen += b[1].tolist()
    assert sorted(seen) == list(range(40))
