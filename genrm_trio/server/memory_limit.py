"""How much memory this process may use: its cgroup's limit where there is one, else the
machine's physical memory. Read once, at server start, to resolve ``memory_limit_bytes: auto``
and with it ``max_active_bytes: auto`` (:func:`genrm_trio.config.resolve_memory`).

Where the limit is read (the smallest found wins, physical memory included):

* cgroup v2: the ``0::<path>`` line of ``/proc/self/cgroup`` names the process's cgroup;
  ``memory.max`` (a byte count, or ``max`` for none) is read in that directory and in each of
  its ancestors, under ``/sys/fs/cgroup`` (a pure v2 machine) and ``/sys/fs/cgroup/unified``
  (a hybrid one). A parent's limit binds its children, hence the walk up.
* cgroup v1: the line whose controllers include ``memory``; ``memory.limit_in_bytes`` under
  ``/sys/fs/cgroup/memory``, walking up the same way. Its "no limit" is a huge number
  (9223372036854771712), which physical memory then undercuts.

The walk also covers a container whose ``/proc/self/cgroup`` shows the host's path while its
own cgroup is mounted at the root of ``/sys/fs/cgroup``: the deeper directories do not exist
there, and the root's file is the container's limit. ``memory.high`` (v2 throttling) and swap
limits are not read: exceeding ``memory.max`` is what gets a process killed.

Every reader is a parameter, so tests feed fake files. Blocks only on these small procfs and
sysfs reads (no trio: called before the server's event loop does anything else).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable

from genrm_trio.config import Config, MemoryLimit, ResolvedConfig, resolve_memory

PROC_SELF_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"

TextReader = Callable[[str], str | None]


def read_text(path: str) -> str | None:
    """The file's text, or None when it cannot be read (missing, no permission)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return None


def physical_memory_bytes() -> int | None:
    """Physical memory from ``os.sysconf``; None where the platform does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def _limit_in(text: str | None) -> int | None:
    """A limit file's value: bytes, or None for ``max``, an unreadable or a malformed file."""
    if text is None:
        return None
    value = text.strip()
    if value.isdigit():
        return int(value) if int(value) > 0 else None
    return None


def _walk_up(root: str, cgroup_path: str) -> list[str]:
    """The directories from the process's cgroup up to the hierarchy's root, deepest first."""
    parts = [p for p in cgroup_path.split("/") if p and p not in (".", "..")]
    return [posixpath.join(root, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def cgroup_limits(proc_cgroup: str | None, cgroup_root: str = CGROUP_ROOT,
                  read: TextReader = read_text) -> list[MemoryLimit]:
    """Every memory limit that binds this process, from ``proc_cgroup`` (the text of
    ``/proc/self/cgroup``) and the limit files under ``cgroup_root``. Empty when there is no
    cgroup or no limit."""
    found: list[MemoryLimit] = []
    for line in (proc_cgroup or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep:
            continue
        if hierarchy == "0" and controllers == "":
            places = [(cgroup_root, "memory.max", "v2"),
                      (posixpath.join(cgroup_root, "unified"), "memory.max", "v2")]
        elif "memory" in controllers.split(","):
            places = [(posixpath.join(cgroup_root, "memory"), "memory.limit_in_bytes", "v1")]
        else:
            continue
        for root, name, version in places:
            for directory in _walk_up(root, path):
                file = posixpath.join(directory, name)
                limit = _limit_in(read(file))
                if limit is not None:
                    found.append(MemoryLimit(limit, f"cgroup {version} {name} of {directory}"))
    return found


def detect_memory_limit(
    *,
    proc_cgroup: str = PROC_SELF_CGROUP,
    cgroup_root: str = CGROUP_ROOT,
    read: TextReader = read_text,
    physical: Callable[[], int | None] = physical_memory_bytes,
) -> MemoryLimit | None:
    """The smallest of this process's cgroup limits and physical memory, with where it was
    found; None when neither can be read. Blocks on a few small file reads."""
    candidates = cgroup_limits(read(proc_cgroup), cgroup_root, read)
    machine = physical()
    if machine is not None:
        candidates.append(MemoryLimit(machine, "physical memory"))
    return min(candidates, key=lambda m: m.limit_bytes, default=None)


def resolved(cfg: Config, detect: Callable[[], MemoryLimit | None] = detect_memory_limit,
             ) -> ResolvedConfig:
    """``cfg`` with ``memory_limit_bytes`` and ``max_active_bytes`` resolved (reading the
    machine only when ``memory_limit_bytes`` is ``auto``); a :class:`ResolvedConfig` is
    returned as is. Raises :class:`~genrm_trio.errors.ConfigError` when ``auto`` finds
    nothing to read."""
    if isinstance(cfg, ResolvedConfig):
        return cfg
    found = detect() if cfg.memory_limit_bytes == "auto" else None
    return resolve_memory(cfg, found)


__all__ = ["cgroup_limits", "detect_memory_limit", "physical_memory_bytes", "read_text",
           "resolved"]
