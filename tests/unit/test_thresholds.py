import subprocess

import pytest

from gpufeed import thresholds


def test_packaged_file_parses_and_matches_what_sh_sources():
    values = thresholds.read(environ={})
    assert {"GPUFEED_MIN_DRIVER", "GPUFEED_MIN_SHM_MB"} <= set(values)
    script = f". '{thresholds.THRESHOLDS_FILE}' && " + " && ".join(
        f'printf "%s=%s\\n" {k} "${k}"' for k in values
    )
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env={}, check=True)
    assert dict(line.split("=", 1) for line in out.stdout.splitlines()) == values


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
