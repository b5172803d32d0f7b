"""What a Writer's manifest records of where its samples came from: their names
(sources.txt), the listed files a pack of a folder reads (Listing) and the class names."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpufeed.errors import UsageError

__all__ = ["Listing", "WrittenSource", "check_classes", "check_label", "item_name", "names_of"]

WRITER_KIND = "python"


class _Names:
    """sources.txt for written samples: what the writer was told, else '#index'."""

    def __init__(self, names: list[str] | None):
        self.names = names

    def __getitem__(self, i: int) -> str:
        return item_name(self.names, i)


def names_of(names: Sequence[str] | _Names, items: np.ndarray) -> Iterable[str] | None:
    """What sources.txt says of each sample: the name of the input it came from (``names``:
    a source's listed names, or a Writer's), '#i' for an unnamed input i; None where that
    says nothing more than the sample's place (a Writer given no names, every sample from
    the input of its own number: no sources.txt, and none of a million '#i' lines)."""
    if isinstance(names, _Names) and not names.names:  # none given, or none came
        if np.array_equal(items, np.arange(len(items))):
            return None
        return map("#{}".format, items.tolist())
    return map(names.__getitem__, items.tolist())


def item_name(names: list[str] | None, i: int) -> str:
    """What input i is called: its name where one was given (a path), else '#i'."""
    if names is not None and i < len(names):
        return names[i]
    return f"#{i}"


@dataclass
class WrittenSource:
    """What assemble needs to know of a source, for samples written from Python."""

    count: int
    names: list[str] | None = None
    problems: list = field(default_factory=list)
    path: str | None = None
    kind: str = WRITER_KIND
    classes: list[str] | None = None

    def __len__(self) -> int:
        return self.count

    @property
    def rel(self) -> _Names:
        return _Names(self.names)

    def real_dirs(self) -> set[str]:
        return set()


@dataclass(frozen=True)
class Listing:
    """The listed files a Writer's samples come from (gpufeed.pack of a folder or list file
    as multi-field samples, gpufeed.write.fields): the manifest records it as `gpufeed pack`
    records its source (path, kind, classes, digest; its problems as skipped), and a resume
    with another listing is refused."""

    path: str
    kind: str
    classes: list[str] | None
    digest: str
    problems: list[tuple[str, str]] = field(default_factory=list)
    # the listed files, input i the i-th: a committed part records their (size, mtime_ns),
    # and a resume reads again from the first part whose files changed since
    paths: list[str] | None = None


def check_classes(classes: Sequence[str] | None, listing: Listing | None) -> list[str] | None:
    """The pack's class names (label i is classes[i], as the manifest records them): those
    given (distinct strings, e.g. HF ClassLabel.names), else the listing's folder names."""
    if classes is None:
        return listing.classes if listing is not None else None
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Sequence):
        raise UsageError(f"classes= takes a list of class names, got {type(classes).__name__}")
    names = list(classes)
    odd = next((c for c in names if not isinstance(c, str)), None)
    if odd is not None or not names:
        found = f"{type(odd).__name__} {odd!r}" if names else "an empty list"
        raise UsageError(f"classes= takes a non-empty list of class names (strings), got {found}")
    seen: set[str] = set()
    twice = next((c for c in names if c in seen or seen.add(c)), None)
    if twice is not None:
        raise UsageError(f"classes= names {twice!r} twice; each label needs its own class name")
    if listing is not None and listing.classes is not None and listing.classes != names:
        raise UsageError(
            f"classes= {names[:5]} differs from the class folders of {listing.path} "
            f"({listing.classes[:5]}); leave classes= out to use the folder names"
        )
    return [str(c) for c in names]


def check_label(classes: list[str] | None, label: int, where: str) -> None:
    """A label written into a pack with class names is one of them (or -1: none)."""
    if classes is not None and not -1 <= label < len(classes):
        raise UsageError(
            f"{where}: label {label} is not one of the {len(classes)} classes (0 to "
            f"{len(classes) - 1}, or -1 for none); pass every class name in classes="
        )
