"""The tracing bench's no-extra arm (issue 20): a server started under its ``PYTHONPATH``
cannot import ``opentelemetry``, and still imports (and serves) everything else."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from genrm_trio.bench.cases.tracing import no_otel_pythonpath
from genrm_trio.bench.loadgen import children_cpu_s

_PROBE = """
import genrm_trio.cli, genrm_trio.server.serve
try:
    import opentelemetry.sdk.trace
except ModuleNotFoundError as exc:
    print("blocked", exc.name)
else:
    print("imported")
"""


def _installed(name: str) -> bool:
    try:  # an import hook like the bench's raises here rather than answering None
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def test_no_otel_pythonpath_makes_opentelemetry_unimportable() -> None:
    with no_otel_pythonpath() as path:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["blocked", "opentelemetry"]
    # Without it the same probe imports the SDK, where the extra is installed.
    if _installed("opentelemetry.sdk"):
        plain = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                               timeout=60)
        assert plain.stdout.split() == ["imported"], plain.stderr


def test_children_cpu_counts_the_cpu_of_live_children_only() -> None:
    # The tracing case reads the server's export process this way: here, a child that
    # spends CPU and then waits on its stdin (no sleep); it has no children of its own.
    spin = "sum(range(3 * 10**7)); print('spent', flush=True); import sys; sys.stdin.read()"
    others = children_cpu_s(os.getpid())  # whatever else this process runs (nothing, alone)
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spent\n"
        assert children_cpu_s(os.getpid()) >= others + 0.05
        assert children_cpu_s(child.pid) == 0.0
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        child.stdout.close()
    assert children_cpu_s(os.getpid()) < others + 0.05  # reaped: no longer counted
