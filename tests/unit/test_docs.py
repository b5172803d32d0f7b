"""Every Python block of the docs runs as it is written.

The blocks of README.md, app/README.md and docs/**/*.md run in order, one namespace a page,
in a scratch folder that holds what the pages call their placeholders: ``images/`` (an image
folder of two classes), ``packs/train.lmdb`` (a pack of it) and ``loader.json`` (what
``gpufeed tune --write`` makes), and one name: ``my_data``, "your own records" of the
multi-field example (jpeg bytes, caption, token ids, boxes, waveform). A page that packs
``packs/train.lmdb`` itself starts without it. A block that cannot run here (a GPU, an
object store, data of yours) carries ``<!-- not run: reason -->`` on the line before it;
those are listed with their reasons.
"""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gpufeed

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "app" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$")


def blocks(page: Path) -> list[tuple[str, str | None]]:
    """(code, reason it is not run or None) for each Python block of a page, in order."""
    text = page.read_text()
    found = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        found.append((match.group(1), reason.group(1) if reason else None))
    return found


RUN = [p for p in PAGES if any(reason is None for _, reason in blocks(p))]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def write_images(root: Path, per_class: int = 20) -> None:
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            buf = io.BytesIO()
            pixels = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(buf, "JPEG", quality=90)
            (root / label / f"{i}.jpg").write_bytes(buf.getvalue())


def my_data(images: Path) -> list[tuple]:
    rng = np.random.default_rng(1)
    return [
        (path.read_bytes(), f"a {path.parent.name}", rng.integers(0, 99, 3 + i % 5, dtype=np.int32),
         rng.random((i % 3, 4), dtype=np.float32), rng.random(100 + i, dtype=np.float32))
        for i, path in enumerate(sorted(images.rglob("*.jpg")))
    ]  # fmt: skip


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """The placeholders the pages use, made once and copied for each page."""
    root = tmp_path_factory.mktemp("docs")
    write_images(root / "images")
    (root / "packs").mkdir()
    gpufeed.pack(root / "images", root / "packs" / "train.lmdb", format="lmdb", quiet=True)
    (root / "loader.json").write_text('{"num_workers": 0}')
    return root


def test_the_pages_have_blocks_that_run():
    assert any(p.name == "getting-started.md" for p in RUN)
    assert len(RUN) >= 7, [name(p) for p in RUN]


def test_every_not_run_block_says_why():
    skipped = [(name(p), reason) for p in PAGES for _, reason in blocks(p) if reason is not None]
    print(f"\n{len(skipped)} doc blocks not run:")
    for page, reason in skipped:
        print(f"  {page}: {reason}")
    assert all(len(reason) > 5 for _, reason in skipped)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", RUN, ids=name)
def test_the_pages_blocks_run(page, scratch, tmp_path, monkeypatch):
    folder = tmp_path / "work"
    shutil.copytree(scratch, folder)
    code = [c for c, reason in blocks(page) if reason is None]
    if any(re.search(r"""pack\(\s*["']images["'],\s*["']packs/train\.lmdb""", c) for c in code):
        shutil.rmtree(folder / "packs" / "train.lmdb")  # the page packs it itself
    monkeypatch.chdir(folder)
    scope: dict = {"__name__": "docs", "my_data": my_data(folder / "images")}
    ran = 0
    for number, block in enumerate(code, 1):
        exec(compile(block, f"{name(page)} block {number}", "exec"), scope)  # noqa: S102
        ran += 1
    assert ran == len(code)
