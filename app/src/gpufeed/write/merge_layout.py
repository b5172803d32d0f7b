"""What a merged pack is, wherever it is made (gpufeed.write.merge on a file system,
gpufeed.write.merge_remote in a bucket): which parts may be merged, the merged manifest's
fields, and a merged tar pack's index and layout."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpufeed._version import __version__
from gpufeed.errors import UsageError
from gpufeed.formats.manifest import MANIFEST_SCHEMA
from gpufeed.formats.tar.members import KEY_FORMAT
from gpufeed.formats.tar.writer import SHARD_FORMAT, shard_pattern
from gpufeed.write.tokens import MANIFEST_KEY

__all__ = [
    "PART_DIR",
    "check_agree",
    "common_fields",
    "index_bytes",
    "renumbered_shards",
    "tar_layout",
]

PART_DIR = "parts/{:06d}"  # where a multi-part pack keeps part k
INDEX_COPIED = ("offset", "size", "labels", "crc32")  # a tar part's index arrays, as they are
# what every part must share with the first, as the manifest says it
AGREE = ("format", "format_version", "sample", "classes", "created_by")
# what shaped a token pack's stream (pack_tokens' record: its eos ends every document), which
# every part must share to be one stream; the rest of the record (its source) is per part
TOKENS_AGREE = ("field", "eos", "vocab_size", "dtype", "tokenizer")


def check_agree(paths: Sequence[Any], manifests: list[dict[str, Any]]) -> None:
    """Every part as the first in format, layout version, sample spec, classes and the
    gpufeed version that wrote it: a UsageError naming the first part that differs."""
    first = manifests[0]
    for path, manifest in zip(paths[1:], manifests[1:], strict=True):
        for key in AGREE:
            if manifest.get(key) != first.get(key):
                raise UsageError(
                    f"{path}: its {key} is {str(manifest.get(key))[:100]}, the first part's "
                    f"({paths[0]}) is {str(first.get(key))[:100]}; parts of one pack must "
                    "share format, sample spec (schema), classes and gpufeed version: "
                    "re-pack this part like the others"
                )
        if token_record(manifest) != token_record(first):
            raise UsageError(
                f"{path}: its token settings ({MANIFEST_KEY}: {token_record(manifest)}) are "
                f"not the first part's ({paths[0]}: {token_record(first)}); parts of one "
                "token stream must be packed with the same tokenizer, vocabulary and eos"
            )


def token_record(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """What of a part's token record (pack_tokens) the parts must share; None without one."""
    record = manifest.get(MANIFEST_KEY)
    if not isinstance(record, dict):
        return None
    return {key: record.get(key) for key in TOKENS_AGREE}


def common_fields(manifests: list[dict[str, Any]], merged_from: list[dict[str, Any]]) -> dict:
    """The merged manifest's fields every format shares."""
    first = manifests[0]
    skipped = [
        {**entry, "part": k}
        for k, m in enumerate(manifests)
        for entry in m.get("skipped") or []
        if isinstance(entry, dict)
    ]
    digest = hashlib.sha256(json.dumps(merged_from, sort_keys=True).encode()).hexdigest()
    items = sum(int((m.get("source") or {}).get("items") or m["count"]) for m in manifests)
    return {
        "gpufeed_manifest": MANIFEST_SCHEMA,
        "format": first["format"],
        "format_version": first.get("format_version"),
        "count": sum(m["count"] for m in manifests),
        "classes": first.get("classes"),
        "sample": first["sample"],
        "source": {"path": None, "kind": "merge", "items": items, "digest": digest},
        "options": first.get("options") or {},
        "skipped": skipped,
        "created_by": f"gpufeed {__version__}",
        "merged_from": merged_from,
        **({MANIFEST_KEY: token_record(first)} if token_record(first) else {}),
    }


def renumbered_shards(readers: list) -> list[str]:
    """The merged tar pack's shard names: the parts' shards in order, numbered on."""
    total = sum(len(r.shards) for r in readers)
    return [SHARD_FORMAT.format(n) for n in range(total)]


def index_bytes(readers: list) -> bytes:
    """index.npz of the merged tar pack: each part's index (read and checked by its
    TarReader) with its shard numbers shifted past the earlier parts' shards."""
    index: dict[str, list[np.ndarray]] = {k: [] for k in ("shard", *INDEX_COPIED)}
    shards = 0
    for reader in readers:
        index["shard"].append(reader.shard.astype(np.int64) + shards)
        for key in INDEX_COPIED:
            index[key].append(getattr(reader, key))
        shards += len(reader.shards)
    arrays = {k: np.concatenate(v) for k, v in index.items()}
    arrays["shard"] = arrays["shard"].astype(np.int32)
    arrays["crc32"] = arrays["crc32"].astype(np.uint32)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def tar_layout(manifests: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The merged tar pack's layout: its shards, each one's count as its part said."""
    layouts = [m["layout"] for m in manifests]
    return {
        "pattern": shard_pattern(len(names)),
        "shards": names,
        "shard_counts": [int(c) for lay in layouts for c in lay["shard_counts"]],
        "key_format": layouts[0].get("key_format", KEY_FORMAT),
        "shard_size": max(int(lay.get("shard_size") or 0) for lay in layouts),
        "shard_bytes": max(int(lay.get("shard_bytes") or 0) for lay in layouts),
    }
