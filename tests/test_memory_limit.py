"""``max_active_bytes: auto``: the memory this process may use, read from fake cgroup files
(server/memory_limit.py), and its resolution into the budget (config.resolve_memory)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from genrm_trio.config import (
    AUTO_ACTIVE_BYTES_DIVISOR,
    Config,
    MemoryLimit,
    ResolvedConfig,
    config_summary,
    load_config,
    resolve_memory,
)
from genrm_trio.errors import ConfigError
from genrm_trio.server import memory_limit
from genrm_trio.server.memory_limit import detect_memory_limit

GIB = 2**30
PHYSICAL = 24 * GIB
V1_NO_LIMIT = "9223372036854771712\n"  # cgroup v1's "no limit": PAGE_COUNTER_MAX pages


def detect(proc_cgroup: str | None, files: dict[str, str],
           physical: int | None = PHYSICAL) -> MemoryLimit | None:
    """detect_memory_limit over ``files`` alone (nothing of the real machine is read)."""
    table = dict(files)
    if proc_cgroup is not None:
        table["/proc/self/cgroup"] = proc_cgroup
    return detect_memory_limit(read=table.get, physical=lambda: physical)


def test_cgroup_v2_limit_of_the_process_cgroup() -> None:
    found = detect("0::/kubepods/pod1/ctr\n",
                   {"/sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "2147483648\n"})
    assert found == MemoryLimit(
        2 * GIB, "cgroup v2 memory.max of /sys/fs/cgroup/kubepods/pod1/ctr")


def test_cgroup_v2_max_means_no_limit_and_a_parent_limit_binds() -> None:
    files = {"/sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
             "/sys/fs/cgroup/kubepods/pod1/memory.max": "3221225472\n",
             "/sys/fs/cgroup/kubepods/memory.max": "max\n"}
    found = detect("0::/kubepods/pod1/ctr\n", files)
    assert found == MemoryLimit(3 * GIB, "cgroup v2 memory.max of /sys/fs/cgroup/kubepods/pod1")
    files["/sys/fs/cgroup/kubepods/pod1/memory.max"] = "max\n"
    assert detect("0::/kubepods/pod1/ctr\n", files) == MemoryLimit(PHYSICAL, "physical memory")


def test_cgroup_v2_in_a_container_with_its_own_cgroup_namespace() -> None:
    found = detect("0::/\n", {"/sys/fs/cgroup/memory.max": "1073741824\n"})
    assert found == MemoryLimit(GIB, "cgroup v2 memory.max of /sys/fs/cgroup")


def test_host_path_in_proc_but_the_container_cgroup_mounted_at_the_root() -> None:
    # No cgroup namespace: /proc/self/cgroup names the host's path, which does not exist in
    # the container's /sys/fs/cgroup; the walk up reaches the mount's root, the container's.
    found = detect("0::/system.slice/docker-abc.scope\n",
                   {"/sys/fs/cgroup/memory.max": "1073741824\n"})
    assert found is not None and found.limit_bytes == GIB


def test_cgroup_v1_no_limit_is_undercut_by_physical_memory() -> None:
    # This machine's shape: hybrid, a v1 memory controller without a limit.
    proc = "4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
    files = {"/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": V1_NO_LIMIT,
             "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes": V1_NO_LIMIT,
             "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT}
    assert detect(proc, files) == MemoryLimit(PHYSICAL, "physical memory")


def test_cgroup_v1_limit_with_controllers_mounted_together() -> None:
    proc = "9:cpu,memory:/slurm/job7\n0::/\n"
    files = {"/sys/fs/cgroup/memory/slurm/job7/memory.limit_in_bytes": "536870912\n",
             "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT}
    assert detect(proc, files) == MemoryLimit(
        512 * 2**20, "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/slurm/job7")


def test_hybrid_v2_unified_limit_is_read_too() -> None:
    proc = "4:memory:/\n0::/app\n"
    files = {"/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT,
             "/sys/fs/cgroup/unified/app/memory.max": "4294967296\n"}
    assert detect(proc, files) == MemoryLimit(
        4 * GIB, "cgroup v2 memory.max of /sys/fs/cgroup/unified/app")


def test_physical_memory_below_the_cgroup_limit_wins() -> None:
    found = detect("0::/big\n", {"/sys/fs/cgroup/big/memory.max": str(64 * GIB)})
    assert found == MemoryLimit(PHYSICAL, "physical memory")


@pytest.mark.parametrize("content", ["", "garbage\n", "-1\n", "0\n", "max\n"])
def test_unusable_limit_files_are_ignored(content: str) -> None:
    assert detect("0::/x\n", {"/sys/fs/cgroup/x/memory.max": content}) == MemoryLimit(
        PHYSICAL, "physical memory")


def test_no_cgroup_file_no_limit_files() -> None:
    assert detect(None, {}) == MemoryLimit(PHYSICAL, "physical memory")
    assert detect("garbage without colons\n", {}) == MemoryLimit(PHYSICAL, "physical memory")


def test_nothing_readable_is_a_config_error_for_auto_only() -> None:
    assert detect(None, {}, physical=None) is None
    with pytest.raises(ConfigError) as info:
        memory_limit.resolved(Config(), detect=lambda: None)
    assert info.value.key == "memory_limit_bytes"
    assert "memory_limit_bytes" in str(info.value) and "\n" not in str(info.value)


def test_this_machine_has_a_limit() -> None:
    found = detect_memory_limit()
    assert found is not None and found.limit_bytes > 0


# --------------------------------------------------------------------------- resolution


def never() -> MemoryLimit | None:
    raise AssertionError("the machine must not be read when memory_limit_bytes is a number")


def test_auto_is_a_quarter_of_the_limit_found() -> None:
    assert AUTO_ACTIVE_BYTES_DIVISOR == 4
    found = MemoryLimit(8 * GIB, "cgroup v2 memory.max of /sys/fs/cgroup")
    cfg = memory_limit.resolved(Config(), detect=lambda: found)
    assert isinstance(cfg, ResolvedConfig)
    assert (cfg.memory_limit_bytes, cfg.max_active_bytes) == (8 * GIB, 2 * GIB)
    assert cfg.memory_limit_source == "cgroup v2 memory.max of /sys/fs/cgroup"
    assert cfg.max_active_bytes_source == (
        "auto: a quarter of memory_limit_bytes (8.0 GiB, cgroup v2 memory.max of "
        "/sys/fs/cgroup)")


def test_a_configured_limit_is_not_read_from_the_machine() -> None:
    cfg = memory_limit.resolved(load_config(overrides=["memory_limit_bytes=2147483648"], env={}),
                          detect=never)
    assert (cfg.memory_limit_bytes, cfg.max_active_bytes) == (2 * GIB, GIB // 2)
    assert cfg.memory_limit_source == "configured"
    assert cfg.max_active_bytes_source.startswith("auto: a quarter of memory_limit_bytes (2.0")


@pytest.mark.parametrize(("value", "budget", "source"), [
    ("null", None, "null: unlimited"),
    ("12345", 12345, "configured"),
])
def test_null_and_numbers_stay_as_configured(value: str, budget: int | None,
                                            source: str) -> None:
    cfg = memory_limit.resolved(load_config(overrides=[f"max_active_bytes={value}"], env={}),
                          detect=lambda: MemoryLimit(8 * GIB, "physical memory"))
    assert (cfg.max_active_bytes, cfg.max_active_bytes_source) == (budget, source)
    assert cfg.memory_limit_bytes == 8 * GIB  # still shown, for /status


def test_a_resolved_config_is_kept_as_is() -> None:
    cfg = memory_limit.resolved(Config(), detect=lambda: MemoryLimit(4 * GIB, "physical memory"))
    assert memory_limit.resolved(cfg, detect=never) is cfg
    assert resolve_memory(cfg, None) is cfg


def test_the_summary_shows_the_resolved_numbers_and_their_sources() -> None:
    unresolved = config_summary(Config())
    assert (unresolved["max_active_bytes"], unresolved["memory_limit_bytes"]) == ("auto", "auto")
    detected: Callable[[], MemoryLimit | None] = lambda: MemoryLimit(  # noqa: E731
        4 * GIB, "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/job")
    summary = config_summary(memory_limit.resolved(Config(), detect=detected))
    assert summary["max_active_bytes"] == GIB
    assert summary["memory_limit_bytes"] == 4 * GIB
    assert summary["memory_limit_source"] == (
        "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/job")
    assert summary["max_active_bytes_source"].startswith("auto: a quarter of")


def test_the_sources_are_not_keys() -> None:
    for key in ("memory_limit_source", "max_active_bytes_source"):
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[f"{key}=x"], env={})
        assert info.value.key == key and info.value.problem.startswith("unknown key")
