"""gpufeed.loading.settings: LoaderSettings is the one declaration of every tunable setting
(its default, its check), make_loader's signature takes its defaults from it, and an argument
you pass wins over the settings file even when it equals the default."""

from __future__ import annotations

import inspect
import json
import warnings
from dataclasses import fields

import pytest
import torch
from torch.utils.data import Dataset

from gpufeed.errors import TunedBatchSizeWarning
from gpufeed.loading.make import make_loader
from gpufeed.loading.settings import (
    SETTINGS_ENV,
    SETTINGS_KEYS,
    LoaderSettings,
    load_settings,
    with_given_arguments,
)


class Tiny(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([i]), i


def test_one_declaration_of_every_setting():
    defaults = LoaderSettings()
    assert SETTINGS_KEYS == tuple(f.name for f in fields(LoaderSettings))
    params = inspect.signature(make_loader).parameters
    for key in SETTINGS_KEYS:  # make_loader's defaults are LoaderSettings' own
        assert params[key].default == getattr(defaults, key), key
    assert "given" not in params


@pytest.mark.parametrize(
    "bad,word",
    [
        ({"num_workers": -1}, "num_workers must be 'auto' or an int >= 0, got -1"),
        ({"num_workers": True}, "num_workers"),
        ({"prefetch_factor": 0}, "prefetch_factor must be None or an int >= 1"),
        ({"multiprocessing_context": "thread"}, "'fork', 'spawn' or 'forkserver'"),
        ({"block_size": 0}, "block_size must be 'auto' or an int >= 1"),
        ({"buffer_blocks": "many"}, "buffer_blocks must be an int >= 1"),
        ({"pin_memory": "off"}, "pin_memory must be 'auto', True or False"),
        ({"sorted_batches": "yes"}, "sorted_batches"),
    ],
)
def test_each_setting_is_checked_where_it_comes_from(tmp_path, bad, word):
    with pytest.raises(ValueError, match=word):
        LoaderSettings(**bad)
    with pytest.raises(ValueError, match=word):
        make_loader(Tiny(), 4, **bad)
    f = tmp_path / "loader.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=rf"{word}.*\(in {f}\)"):
        load_settings(f)


def test_an_argument_passed_wins_even_at_its_default():
    settings = {"block_size": 5, "buffer_blocks": 3, "num_workers": 0}
    dl = make_loader(Tiny(), 4, settings=settings)
    assert (dl.sampler.block_size, dl.sampler.buffer_blocks) == (5, 3)
    assert set(dl.plan.from_settings) == {"block_size", "buffer_blocks", "num_workers"}
    # block_size="auto" said out loud: the file does not override it (before, an argument
    # equal to its default was taken for one left out)
    dl = make_loader(Tiny(), 4, block_size="auto", buffer_blocks=16, settings=settings)
    assert (dl.sampler.block_size, dl.sampler.buffer_blocks) == (256, 16)
    assert dl.plan.from_settings == ("num_workers",)


def test_with_given_arguments_reports_what_the_caller_passed():
    seen = []

    @with_given_arguments
    def f(a, b=1, *, c=2, given=frozenset()):
        seen.append(given)
        return a + b + c

    assert str(inspect.signature(f)) == "(a, b=1, *, c=2)"
    assert f(1) == 4 and f(1, 1) == 4 and f(a=1, c=2) == 4
    assert seen == [frozenset({"a"}), frozenset({"a", "b"}), frozenset({"a", "c"})]
    with pytest.raises(TypeError):
        f(1, d=3)


def test_a_file_tuned_at_another_batch_size_warns_naming_it_and_both_sizes(tmp_path, monkeypatch):
    f = tmp_path / "loader.json"
    f.write_text(json.dumps({"num_workers": 0, "block_size": 8, "_batch_size": 256}))
    with pytest.warns(TunedBatchSizeWarning) as caught:
        dl = make_loader(Tiny(), 32, settings=f)
    message = str(caught[0].message)
    assert str(f) in message and "batch_size=256" in message and "batch_size=32" in message
    assert "gpufeed tune" in message and caught[0].filename == __file__
    assert dl.plan.num_workers == 0 and dl.sampler.block_size == 8  # still applied
    monkeypatch.setenv(SETTINGS_ENV, str(f))
    with pytest.warns(TunedBatchSizeWarning, match=f"{SETTINGS_ENV}={f}"):
        make_loader(Tiny(), 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_loader(Tiny(), 256, settings=f)  # the batch size it was tuned at
        make_loader(Tiny(), 32, num_workers=0, block_size=8, settings=f)  # nothing from it
        make_loader(Tiny(), 32, settings={"num_workers": 0})  # no batch size noted


@pytest.mark.parametrize("bad", [0, -4, "256", 2.5, True])
def test_a_settings_files_batch_size_note_is_checked(tmp_path, bad):
    f = tmp_path / "loader.json"
    f.write_text(json.dumps({"num_workers": 0, "_batch_size": bad}))
    with pytest.raises(ValueError, match=rf"_batch_size must be an int >= 1.*\(in {f}\)"):
        make_loader(Tiny(), 4, settings=f)
