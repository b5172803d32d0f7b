"""storage/store.py without its extra: object storage used while obstore is not installed is
a gpufeed error naming the extra to install, for reading (open_dataset) and packing (the CLI),
never a traceback ending in "No module named 'obstore'"."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

NO_OBSTORE = "import sys; sys.modules['obstore'] = None  # as if gpufeed[s3] were not installed\n"


def _child(code: str, python_env, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, **python_env, "GPUFEED_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-c", NO_OBSTORE + textwrap.dedent(code)],
        capture_output=True, text=True, env=env, timeout=100,
    )  # fmt: skip


@pytest.mark.slow
def test_open_dataset_of_a_url_without_obstore_says_which_extra(python_env, tmp_path):
    out = _child(
        """
        from gpufeed.data.open import open_dataset
        from gpufeed.errors import StorageError
        try:
            open_dataset("s3://bucket/train")
        except StorageError as e:
            print("ERROR", e)
        """,
        python_env,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "ERROR s3://bucket/train" in out.stdout
    assert "pip install 'gpufeed[s3]'" in out.stdout


def test_the_cli_packing_into_a_url_without_obstore_says_which_extra(
    python_env, tmp_path, array_folder
):
    out = _child(
        f"""
        from gpufeed.cli import main
        sys.exit(main(["pack", {str(array_folder)!r}, "s3://bucket/p", "-f", "tar"]))
        """,
        python_env,
        tmp_path,
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "No module named" not in out.stderr
    assert "s3://bucket/p" in out.stderr and "pip install 'gpufeed[s3]'" in out.stderr
