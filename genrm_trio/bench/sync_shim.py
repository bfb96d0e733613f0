"""A slow disk for one process: an ``LD_PRELOAD`` library that delays every sync call.

:func:`build_sync_shim` compiles it (``cc``) into a directory; a process started with
:func:`shim_env` then waits ``delay_ms`` before each ``fsync``, ``fdatasync``, ``syncfs``,
``msync`` and ``sync_file_range`` it makes (SQLite's unix VFS syncs with ``fdatasync`` on
Linux: the WAL on each commit under ``synchronous=FULL``, the WAL and the database at each
checkpoint), as a degraded disk or a busy network volume would. With ``count_path`` set, each
delayed call appends one byte to that file, so a caller can check the shim was in effect.

Used by the ``slow_disk`` bench preset (bench/README.md) and tests/test_journal_slow_disk.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static long delay_ns = -1;
static const char *count_path;

static void slow_sync(void) {
    int saved = errno;
    if (delay_ns < 0) {
        const char *ms = getenv("GENRM_SLOW_SYNC_MS");
        delay_ns = ms ? (long)(atof(ms) * 1e6) : 0;
        count_path = getenv("GENRM_SLOW_SYNC_COUNT");
    }
    if (count_path) {
        int fd = open(count_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0) {
            (void)!write(fd, "s", 1);
            close(fd);
        }
    }
    if (delay_ns > 0) {
        struct timespec left = {delay_ns / 1000000000L, delay_ns % 1000000000L};
        while (nanosleep(&left, &left) != 0 && errno == EINTR) {
        }
    }
    errno = saved;
}

#define WRAP(ret, name, params, args)                                  \
    ret name params {                                                  \
        static ret (*real) params;                                     \
        if (!real) *(void **)(&real) = dlsym(RTLD_NEXT, #name);        \
        slow_sync();                                                   \
        return real args;                                              \
    }

WRAP(int, fsync, (int fd), (fd))
WRAP(int, fdatasync, (int fd), (fd))
WRAP(int, syncfs, (int fd), (fd))
WRAP(int, msync, (void *addr, size_t length, int flags), (addr, length, flags))
WRAP(int, sync_file_range, (int fd, off_t offset, off_t nbytes, unsigned int flags),
     (fd, offset, nbytes, flags))
"""


class ShimUnavailable(Exception):
    """No C compiler, or the shim did not compile."""


def build_sync_shim(directory: Path) -> Path:
    """Compile the shim into ``directory``; returns the library's path. Blocks (well under a
    second). Raises :class:`ShimUnavailable` without ``cc`` or when compiling fails."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ShimUnavailable("no C compiler (cc) to build the slow-sync shim")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "slow_sync.c"
    library = directory / "slow_sync.so"
    source.write_text(SOURCE)
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(library), str(source),
                           "-ldl"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ShimUnavailable(f"cc failed: {done.stderr.strip()[-500:]}")
    return library


def shim_env(library: Path, delay_ms: float, count_path: Path | None = None
             ) -> dict[str, str]:
    """The environment variables that load the shim with ``delay_ms`` per sync call."""
    env = {"LD_PRELOAD": str(library), "GENRM_SLOW_SYNC_MS": repr(float(delay_ms))}
    if count_path is not None:
        env["GENRM_SLOW_SYNC_COUNT"] = str(count_path)
    return env
