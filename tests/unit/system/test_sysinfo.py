import os
from pathlib import Path

import pytest

from gpufeed.errors import SysinfoWarning
from gpufeed.system import sysinfo

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "cgroup"


def case(name):
    return {"root": FIX / name / "root", "self_cgroup": FIX / name / "self_cgroup"}


@pytest.mark.parametrize(
    "name,version,quota,memory",
    [
        ("v2_quota", 2, 2.5, 4 << 30),
        ("v2_max", 2, None, None),
        ("v2_nested", 2, 1.5, 2 << 30),  # tightest ancestor wins for each limit
        (
            "v1_quota",
            1,
            1.5,
            2 << 30,
        ),  # host path /docker/abc absent: the mount's own limit
        ("v1_unlimited", 1, None, None),
        ("none", None, None, None),
    ],
)
def test_cgroup_limits(name, version, quota, memory):
    c = case(name)
    assert sysinfo.cgroup_version(c["root"]) == version
    assert sysinfo.cgroup_cpu_quota(**c) == quota
    assert sysinfo.cgroup_memory_limit(**c) == memory


@pytest.mark.parametrize("name", ["v2_malformed", "v1_malformed"])
def test_malformed_files_warn_name_the_file_and_are_ignored(name):
    c = case(name)
    with pytest.warns(SysinfoWarning, match=r"cpu\.(max|cfs_quota_us) contains"):
        assert sysinfo.cgroup_cpu_quota(**c) is None
    with pytest.warns(SysinfoWarning, match=r"memory\.(max|limit_in_bytes) contains"):
        assert sysinfo.cgroup_memory_limit(**c) is None


def test_usable_cpus_takes_the_smaller_of_affinity_and_quota():
    b = sysinfo.usable_cpus(**case("v2_quota"), affinity=8)
    assert (b.count, b.quota, b.affinity) == (2, 2.5, 8)
    assert b.source == "cgroup v2 quota"
    b = sysinfo.usable_cpus(**case("v2_quota"), affinity=2)
    assert (b.count, b.source) == (2, "affinity")
    b = sysinfo.usable_cpus(**case("v1_quota"), affinity=64)
    assert (b.count, b.source) == (1, "cgroup v1 quota")
    b = sysinfo.usable_cpus(**case("v2_max"), affinity=3)
    assert (b.count, b.quota) == (3, None)


def test_tiny_quota_still_gives_one_cpu(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu\n")
    (tmp_path / "cpu.max").write_text("20000 100000\n")
    b = sysinfo.usable_cpus(tmp_path, tmp_path / "missing", affinity=4)
    assert b.count == 1 and b.quota == pytest.approx(0.2)


def test_real_affinity_is_not_cpu_count():
    assert sysinfo.cpu_affinity() == len(os.sched_getaffinity(0))
    assert 1 <= sysinfo.usable_cpus().count <= sysinfo.cpu_affinity()


def test_shm(tmp_path):
    info = sysinfo.shm_info(tmp_path)
    st = os.statvfs(tmp_path)
    assert info.total_bytes == st.f_blocks * st.f_frsize
    assert 0 <= info.free_bytes <= info.total_bytes
    assert sysinfo.shm_size_bytes(tmp_path) == info.total_bytes
    assert sysinfo.shm_info(tmp_path / "nope") is None
    assert sysinfo.shm_size_bytes(tmp_path / "nope") is None


def test_describe_collects_the_limits(tmp_path):
    d = sysinfo.describe(**case("v2_nested"), shm_path=tmp_path)
    assert d["cgroup_version"] == 2 and d["cpu_quota"] == 1.5
    assert d["usable_cpus"] == 1  # floor(1.5), whatever the affinity
    assert d["memory_limit_bytes"] == 2 << 30
    assert d["shm_total_bytes"] == sysinfo.shm_size_bytes(tmp_path)
    assert sysinfo.describe(**case("none"), shm_path=tmp_path / "x")["shm_free_bytes"] is None


@pytest.mark.parametrize("partition", [False, True])
def test_read_ahead_kb_of_the_device_holding_a_path(tmp_path, partition):
    dev = os.stat(tmp_path).st_dev
    disk = tmp_path / "sys" / "devices" / "disk"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "read_ahead_kb").write_text("8192\n")
    target = disk / "part1" if partition else disk
    target.mkdir(exist_ok=True)
    links = tmp_path / "sys" / "dev" / "block"
    links.mkdir(parents=True)
    (links / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(target)
    assert sysinfo.read_ahead_kb(tmp_path, sys_root=tmp_path / "sys") == 8192
    (disk / "queue" / "read_ahead_kb").write_text("none\n")
    assert sysinfo.read_ahead_kb(tmp_path, sys_root=tmp_path / "sys") is None


def test_read_ahead_kb_is_none_without_a_block_device(tmp_path):
    assert sysinfo.read_ahead_kb(tmp_path, sys_root=tmp_path / "no-sys") is None
