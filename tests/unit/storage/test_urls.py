"""Local path or URL: the one rule (gpufeed.storage.urls), sizes, and pack's refusal of a URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufeed import cli
from gpufeed.errors import UsageError
from gpufeed.storage import RemoteURL, is_remote, parse_location, parse_size, require_local
from gpufeed.write.pack import pack


@pytest.mark.parametrize(
    "text, scheme, bucket, prefix",
    [
        ("s3://bucket/train", "s3", "bucket", "train"),
        ("s3://bucket/a/b/", "s3", "bucket", "a/b"),
        ("s3://bucket", "s3", "bucket", ""),
        ("S3://bucket//x", "s3", "bucket", "x"),
        ("gs://b/p", "gs", "b", "p"),
        ("az://account/container/p", "az", "account", "container/p"),
        ("https://host.example/data/train", "https", "host.example", "data/train"),
    ],
)
def test_urls_are_remote(text, scheme, bucket, prefix):
    loc = parse_location(text)
    assert loc == RemoteURL(scheme, bucket, prefix)
    assert is_remote(text)
    assert loc.child("manifest.json") == f"{loc.url}/manifest.json"


@pytest.mark.parametrize(
    "text, path",
    [
        ("/data/train", "/data/train"),
        ("relative/dir", "relative/dir"),
        ("file:///data/train", "/data/train"),
        ("name:with:colons", "name:with:colons"),
        ("C:/x", "C:/x"),
    ],
)
def test_paths_are_local(text, path):
    assert parse_location(text) == Path(path)
    assert not is_remote(text)
    assert parse_location(Path(text)) == Path(text) or text.startswith("file:")


@pytest.mark.parametrize(
    "text, says",
    [
        ("s3:/bucket/train", "lost a slash"),  # what Path("s3://bucket/train") becomes
        (Path("s3://bucket/train"), "lost a slash"),
        ("gs:bucket", "lost a slash"),
        ("ftp://host/x", "unsupported URL scheme ftp://"),
        ("s3://", "no bucket"),
        ("s3:///train", "no bucket"),
        ("s3://b/x?versionId=1", "no ?query"),
        ("file://otherhost/x", "this machine's files"),
    ],
)
def test_bad_urls_are_errors_never_folders(text, says):
    with pytest.raises(UsageError, match=says.replace("?", r"\?")):
        parse_location(text)


def test_require_local_refuses_a_url_with_the_hint():
    assert require_local("/x") == Path("/x")
    with pytest.raises(UsageError, match=r"s3://b/x: needs a local path here; do this"):
        require_local("s3://b/x", "do this")


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        (0, 0),
        (1234, 1234),
        ("1234", 1234),
        ("50GB", 50 * 10**9),
        ("50 gb", 50 * 10**9),
        ("50G", 50 * 10**9),
        ("50GiB", 50 * 2**30),
        ("1.5MiB", 3 * 2**19),
        ("500MB", 500 * 10**6),
        ("2k", 2000),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value, "cache_limit") == expected


@pytest.mark.parametrize("value", ["lots", "50XB", "-1", "GB", "5 i", -5, "1iB"])
def test_parse_size_names_the_setting(value):
    with pytest.raises(UsageError, match=r"cache_limit="):
        parse_size(value, "cache_limit")


def test_pack_refuses_a_url_it_cannot_serve_and_writes_no_local_folder(
    array_folder, tmp_path, monkeypatch
):
    """(A URL it can serve is packed and uploaded: test_storage_datasets.)"""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"unsupported URL scheme ftp://"):
        pack(array_folder, "ftp://bucket/train", "tar", quiet=True)
    for dest in ("ftp://bucket/train", "gs:/bucket/train", "s3://"):
        assert cli.main(["pack", str(array_folder), dest, "--format", "tar", "--quiet"]) == 2
    assert list(tmp_path.iterdir()) == []  # no folder named ftp:, gs: or s3:
