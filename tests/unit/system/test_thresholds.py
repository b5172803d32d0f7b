import os
import subprocess
from pathlib import Path

import pytest

from gpufeed.system import thresholds

PREFLIGHT = Path(__file__).resolve().parents[3] / "entrypoints" / "preflight.sh"
FILES = sorted(thresholds.HERE.glob("thresholds-cuda*.env"))
# the files an image can be built with: the preflight reads them whole
IMAGE_FILES = [f for f in FILES if "GPUFEED_MIN_DRIVER" in thresholds.read(f, {})]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_packaged_file_parses_and_matches_what_sh_sources(path):
    values = thresholds.read(path, environ={})
    assert "GPUFEED_COMPAT_DRIVER" in values
    script = f". '{path}' && " + " && ".join(f'printf "%s=%s\\n" {k} "${k}"' for k in values)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env={}, check=True)
    assert dict(line.split("=", 1) for line in out.stdout.splitlines()) == values


def _preflight_reads(env: dict[str, str]) -> dict[str, str]:
    """What pf_load_thresholds (entrypoints/preflight.sh) resolves in ``env``."""
    keys = (*thresholds.PREFLIGHT_KEYS, "GPUFEED_SHM_FIX")
    script = (
        'set -- --lib; . "$PREFLIGHT"; pf_load_thresholds /nowhere; '
        + "; ".join(f'printf "%s=%s\\n" {k} "${{{k}:-}}"' for k in keys)
        + '; exit "$pf_status"'
    )
    env = {"PATH": os.environ["PATH"], "PREFLIGHT": str(PREFLIGHT), **env}
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, check=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


@pytest.mark.parametrize("path", IMAGE_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "extra",
    [{}, {"GPUFEED_CUDA_FULL_DRIVER": "999.1"}, {"GPUFEED_MIN_SHM_MB": "64"}],
    ids=["file", "env-full-driver", "env-shm"],
)
def test_preflight_and_gpufeed_read_each_file_alike(path, extra):
    """File to file: the shell preflight and gpufeed.system.thresholds.load resolve the same
    values from each image's thresholds file (the full-support driver from its table row),
    and an environment variable overrides both the same way."""
    env = {"GPUFEED_THRESHOLDS": str(path), **extra}
    python = thresholds.load(env)
    shell = _preflight_reads(env)
    assert shell == {k: python.get(k, "") for k in shell}
    assert python["GPUFEED_CUDA_FULL_DRIVER"] == extra.get(
        "GPUFEED_CUDA_FULL_DRIVER", shell["GPUFEED_CUDA_FULL_DRIVER"]
    )
    # doctor's table (what torch's build needs) is the same file's rows
    floor, full = thresholds.cuda_requirements(python["GPUFEED_CUDA_RELEASE"])
    assert floor == python["GPUFEED_COMPAT_DRIVER"]
    if not extra:
        assert full == python["GPUFEED_CUDA_FULL_DRIVER"]


def test_non_cuda_settings_agree_across_files():
    # the /dev/shm floor and its fix are the same for every CUDA major: each file is whole
    shm = {
        (thresholds.read(f, {})["GPUFEED_MIN_SHM_MB"], thresholds.read(f, {})["GPUFEED_SHM_FIX"])
        for f in IMAGE_FILES
    }
    assert len(shm) == 1


def test_cuda_requirements_by_major_and_release():
    floor12, full128 = thresholds.cuda_requirements("12.8")
    assert thresholds.version_cmp(floor12, full128) < 0
    assert thresholds.cuda_requirements("12.7")[1] is None  # no such release in the table
    assert thresholds.cuda_requirements("99.0") == (None, None)
    assert thresholds.cuda_requirements("11.8")[0] is not None  # torch's CUDA 11 builds too


def test_selection_and_errors(tmp_path):
    default = thresholds.file_for(thresholds.DEFAULT_CUDA_MAJOR)
    if not thresholds.INSTALLED_FILE.exists():
        assert thresholds.thresholds_file({}) == default
    assert thresholds.thresholds_file({"GPUFEED_THRESHOLDS": "/x"}) == Path("/x")
    with pytest.raises(thresholds.ThresholdsError, match="is not a readable file") as e:
        thresholds.load({"GPUFEED_THRESHOLDS": str(tmp_path / "nope")})
    assert "unset it" in e.value.fix
    with pytest.raises(thresholds.ThresholdsError, match="GPUFEED_MIN_DRIVER='latest'"):
        thresholds.load({"GPUFEED_THRESHOLDS": str(default), "GPUFEED_MIN_DRIVER": "latest"})
    bad = tmp_path / "t.env"
    bad.write_text("GPUFEED_MIN_DRIVER=525\nGPUFEED_CUDA_FULL_DRIVER=570\nGPUFEED_MIN_SHM_MB=1.5\n")
    with pytest.raises(thresholds.ThresholdsError, match="whole number of MiB"):
        thresholds.load({"GPUFEED_THRESHOLDS": str(bad)})


def test_env_overrides_file(tmp_path):
    f = tmp_path / "t.env"
    f.write_text('# comment\nA=1\nexport B="two"\n\nC=3.5\n')
    assert thresholds.read(f, environ={}) == {"A": "1", "B": "two", "C": "3.5"}
    assert thresholds.read(f, environ={"A": "9", "B": ""})["A"] == "9"
    assert thresholds.read(f, environ={"A": "9", "B": ""})["B"] == "two"
    assert thresholds.get_int("A", f, {"A": "7"}) == 7
    assert thresholds.get_float("C", f, {}) == 3.5
    with pytest.raises(ValueError, match="A='x' is not a valid int"):
        thresholds.get_int("A", f, {"A": "x"})
    with pytest.raises(KeyError, match="known: A, B, C"):
        thresholds.get("Z", f, {})


def test_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "t.env"
    f.write_text("A=1\nnot a pair\n")
    with pytest.raises(ValueError, match=r"t\.env:2: expected KEY=VALUE"):
        thresholds.read(f)


def test_min_shm_bytes():
    assert thresholds.min_shm_bytes(environ={"GPUFEED_MIN_SHM_MB": "64"}) == 64 << 20
