"""Side by side in one run: several ``genrm-trio serve`` arms (this checkout with different
``--set`` values, or an earlier commit) against one mock judge, in alternating rounds, with
medians and ratios to the first arm (``genrm-trio bench --baseline COMMIT``, bench/README.md
"Side by side: the regression guard").

Every arm's server starts once and stays up for the whole run; each round drives the same
closed-loop load (K cohorts of N in flight for ``duration_s``) through every arm in turn, the
order rotating per round so no arm always goes first. Per round and arm: verifies/s, server CPU
per cohort (``/proc`` of the server's pid), cohort p50/p99 (last send to last answer). An
earlier commit runs from a ``git archive`` of it unpacked under /tmp (read-only on the
repository: no worktree is registered), with ``PYTHONPATH`` pointing there and started
there (``python -m`` puts the working directory first on sys.path); its ``--set``
values are its own (an old commit may not know a newer key).

``py_spy``: a folder; each arm's server is then sampled by ``py-spy record`` (raw folded
stacks, ``<label>.txt``) during its rounds after the first.

``nemo``: NeMo Gym's venv; its ``genrm_compare`` then runs as one more arm against the same
mock judge (:mod:`genrm_trio.bench.nemo_gym`; its ``--set`` values do not apply).

``steps``: count each of our servers' trio task steps (:mod:`genrm_trio.bench.step_counter`,
put first on its ``PYTHONPATH`` as ``sitecustomize``, so an earlier commit is counted too) and
report ``steps_per_verify`` per round: a figure the machine's noise does not move.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from genrm_trio.bench import loadgen, step_counter
from genrm_trio.bench.loadgen import BodyFactory, H11Client, LoadPlan, median, percentile
from genrm_trio.bench.nemo_gym import nemo_config
from genrm_trio.bench.processes import Proc, free_port, launch_process
from genrm_trio.bench.records import ServerSettings
from genrm_trio.bench.rig import READY_MOCK, READY_OURS

#: Metrics per round and arm, in table order.
METRICS = ("verifies_per_s", "cpu_ms_per_cohort", "p50_ms", "p99_ms", "failed_members")
#: With ``--side steps=1``, per round and arm of ours: trio task steps per verify.
STEPS = "steps_per_verify"


@dataclass(frozen=True)
class Arm:
    """One server under test: ``label``, where its code is (``None``: this checkout, as
    installed or on ``PYTHONPATH``), and its ``--set`` values; or, with ``nemo`` (its
    ``genrm_compare`` folder), NeMo Gym's server."""

    label: str
    code: Path | None = None
    sets: tuple[tuple[str, str], ...] = ()
    nemo: Path | None = None


@dataclass(frozen=True)
class SideBySide:
    """The load and the judge of a side-by-side run (bounded: ``rounds`` x arms x
    ``duration_s`` plus start-up)."""

    n: int = 16
    k: int = 16
    judge_ms: float = 50.0
    duration_s: float = 6.0
    rounds: int = 3
    mock_sets: tuple[tuple[str, str], ...] = ()
    py_spy: Path | None = None
    nemo: Path | None = None
    steps: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.n <= 256:
            raise ValueError(f"n must be in 2..256, got {self.n}")
        if not 1 <= self.k <= 1024:
            raise ValueError(f"k must be in 1..1024, got {self.k}")
        if not 0.0 <= self.judge_ms <= 10_000.0:
            raise ValueError(f"judge_ms must be in 0..10000, got {self.judge_ms}")
        if not 0.5 <= self.duration_s <= 600.0:
            raise ValueError(f"duration_s must be in 0.5..600, got {self.duration_s}")
        if not 1 <= self.rounds <= 50:
            raise ValueError(f"rounds must be in 1..50, got {self.rounds}")


@dataclass
class ArmResult:
    """Each round's metrics of one arm."""

    arm: Arm
    rounds: list[dict[str, float]] = field(default_factory=list)

    def median(self, metric: str) -> float:
        values = [r[metric] for r in self.rounds
                  if metric in r and not math.isnan(r[metric])]
        return median(values) if values else math.nan


def parse_sets(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` strings as pairs; a string without ``=`` raises ValueError. Pure."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        out.append((key, value))
    return tuple(out)


def parse_arm(text: str) -> Arm:
    """``LABEL`` or ``LABEL:KEY=VALUE,KEY=VALUE`` (this checkout with those ``--set`` values).
    Raises ValueError on an empty label or a bad item. Pure."""
    label, _, rest = text.partition(":")
    if not label:
        raise ValueError(f"an arm needs a label: {text!r}")
    return Arm(label, None, parse_sets([s for s in rest.split(",") if s]))


def export_commit(repo: Path, commit: str, into: Path) -> Path:
    """Unpack ``commit`` of the git repository at ``repo`` into a new folder under ``into``
    (``git archive``: nothing in the repository changes) and return it. Raises
    ValueError when git does not know the commit."""
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                         capture_output=True, text=True, check=False)
    if sha.returncode != 0:
        raise ValueError(f"unknown commit {commit!r}: {sha.stderr.strip()}")
    full = sha.stdout.strip()
    target = into / f"genrm-baseline-{full[:12]}"
    if (target / "genrm_trio" / "__init__.py").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix="genrm-baseline-", dir=into))
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", full],
                       stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(staging, filter="data")
    if target.exists():  # a concurrent export won: keep it
        shutil.rmtree(staging)
    else:
        staging.rename(target)
    return target


def serve_command(arm: Arm, judge_url: str, n: int) -> list[str]:
    sets = {
        "num_rollouts_per_prompt": str(n),
        "judge_max_concurrency": "4096",
        "log_level": "WARNING",
        **dict(arm.sets),
    }
    cmd = [sys.executable, "-m", "genrm_trio.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--judge-url", judge_url]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def _launch(arm: Arm, judge_url: str, n: int, logs: Path, counted: Path | None) -> Any:
    """The process context of one arm (ours, or NeMo Gym's app.py in its venv); ``counted``:
    the folder of the step counter's ``sitecustomize.py`` (``--side steps=1``)."""
    if arm.nemo is None:
        # In the arm's folder: ``python -m`` puts the working directory first on sys.path, so
        # started from a checkout an earlier commit's arm would import the checkout's code.
        env = arm_env(arm)
        if counted is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(counted), env.get("PYTHONPATH", "")) if p)
            env[step_counter.COUNT_FILE_ENV] = str(steps_file(logs, arm))
        return launch_process(serve_command(arm, judge_url, n), log_path=logs / f"{arm.label}.log",
                              ready_prefix=READY_OURS, env=env,
                              cwd=None if arm.code is None else str(arm.code))
    port = free_port()
    env = dict(os.environ)
    env["NEMO_GYM_CONFIG_DICT"] = nemo_config(port, judge_url, ServerSettings(n=n))
    env["NEMO_GYM_CONFIG_PATH"] = "genrm_compare_bench"
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    python = str(arm.nemo.parents[4] / "bin" / "python")
    return launch_process([python, "app.py"], log_path=logs / f"{arm.label}.log",
                          base_url=f"http://127.0.0.1:{port}", env=env, cwd=str(arm.nemo))


def write_step_counter(folder: Path) -> Path:
    """``folder`` with :mod:`genrm_trio.bench.step_counter` in it as ``sitecustomize.py``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(Path(step_counter.__file__).read_text())
    return folder


def steps_file(logs: Path, arm: Arm) -> Path:
    """Where an arm's server writes its step count (``--side steps=1``)."""
    return logs / f"{arm.label}.steps"


async def read_steps(pid: int, path: Path, timeout_s: float = 10.0) -> int:
    """The task steps the server ``pid`` has run so far: asked for with ``SIGUSR2``, read from
    ``path`` once the server has written it. Raises ``TimeoutError`` past ``timeout_s``."""
    count = trio.Path(path)
    await count.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    with trio.move_on_after(timeout_s):
        while not await count.exists():  # noqa: ASYNC110 (another process writes it)
            await trio.sleep(0.01)
        return int(await count.read_text())
    raise TimeoutError(f"no step count from pid {pid} in {timeout_s:g} s ({path})")


def arm_env(arm: Arm) -> dict[str, str]:
    env = dict(os.environ)
    if arm.code is not None:
        env["PYTHONPATH"] = str(arm.code)
    return env


@asynccontextmanager
async def _py_spy(pid: int, out: Path, duration_s: float) -> AsyncIterator[None]:
    exe = shutil.which("py-spy")
    if exe is None:
        raise ValueError("py_spy needs the py-spy executable (the bench extra)")
    proc = await trio.lowlevel.open_process(
        [exe, "record", "--pid", str(pid), "--duration", str(max(1, math.ceil(duration_s))),
         "--format", "raw", "--rate", "200", "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        with trio.move_on_after(duration_s + 10.0):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _round(client: H11Client, server: Proc, bodies: BodyFactory, cfg: SideBySide,
                 first_cohort: int, count: Path | None = None) -> dict[str, float]:
    steps_before = await read_steps(server.pid, count) if count is not None else 0
    before = loadgen.read_proc_stats(server.pid)
    plan = LoadPlan(n=cfg.n, k=cfg.k, max_cohorts=1_000_000, duration_s=cfg.duration_s,
                    first_cohort=first_cohort)
    result = await loadgen.drive_load(client, bodies, plan)
    cpu_s = loadgen.read_proc_stats(server.pid).cpu_s - before.cpu_s
    ok = sum(1 for c in result.cohorts if c.ok)
    lat = [s * 1000.0 for s in result.latencies_s()]
    steps: dict[str, float] = {}
    if count is not None:
        taken = await read_steps(server.pid, count) - steps_before
        steps["steps_per_verify"] = taken / result.verifies if result.verifies else math.nan
    return steps | {
        "verifies_per_s": result.verifies / result.wall_s if result.wall_s else math.nan,
        "cpu_ms_per_cohort": 1000.0 * cpu_s / ok if ok else math.nan,
        "p50_ms": percentile(lat, 0.5),
        "p99_ms": percentile(lat, 0.99),
        "failed_members": float(sum(result.failures.values())),
    }


async def run_side_by_side(arms: Sequence[Arm], cfg: SideBySide, logs: Path,
                           echo: Callable[[str], None] = lambda s: None) -> list[ArmResult]:
    """Run ``cfg``'s load through every arm in alternating rounds (module docstring); returns
    each arm's rounds. Raises ``BenchError`` when a process does not start."""
    if len({a.label for a in arms}) != len(arms) or not arms:
        raise ValueError("arms need distinct labels")
    results = [ArmResult(a) for a in arms]
    mock = [sys.executable, "-m", "genrm_trio.mock.cli", "--port", "0",
            "--latency-ms", repr(cfg.judge_ms)]
    for key, value in cfg.mock_sets:
        mock += ["--set", f"{key}={value}"]
    tag = f"sbs-{int(time.time())}"
    counted = None
    if cfg.steps:
        counted = write_step_counter(logs / "step_counter")
    async with AsyncExitStack() as stack:
        judge = await stack.enter_async_context(launch_process(
            mock, log_path=logs / "judge.log", ready_prefix=READY_MOCK))
        servers: list[tuple[Proc, H11Client]] = []
        for arm in arms:
            proc = await stack.enter_async_context(
                _launch(arm, judge.base_url, cfg.n, logs, counted))
            host, port = proc.host_port
            client = H11Client(host, port)
            stack.push_async_callback(client.aclose)
            servers.append((proc, client))
        bodies = BodyFactory(seed=7, run_tag=tag)
        cohort = 0
        for _proc, client in servers:  # warm-up: imports, connections, first cohorts
            await loadgen.drive_load(client, bodies, LoadPlan(
                n=cfg.n, k=cfg.k, max_cohorts=2 * cfg.k, duration_s=30.0, first_cohort=cohort))
            cohort += 10_000
        for r in range(cfg.rounds):
            order = list(range(len(arms)))
            order = order[r % len(order):] + order[:r % len(order)]
            for at in order:
                proc, client = servers[at]
                cohort += 100_000
                async with AsyncExitStack() as spy:
                    if cfg.py_spy is not None and (r > 0 or cfg.rounds == 1):
                        cfg.py_spy.mkdir(parents=True, exist_ok=True)
                        await spy.enter_async_context(_py_spy(
                            proc.pid, cfg.py_spy / f"{arms[at].label}.r{r}.txt", cfg.duration_s))
                    count = (steps_file(logs, arms[at])
                             if counted is not None and arms[at].nemo is None else None)
                    row = await _round(client, proc, bodies, cfg, cohort, count)
                results[at].rounds.append(row)
                echo(f"round {r + 1} {arms[at].label}: " + "  ".join(
                    f"{m} {row[m]:.1f}" for m in (*METRICS, STEPS) if m in row))
    return results


def render(results: Sequence[ArmResult], cfg: SideBySide) -> str:
    """The table of medians, each arm's ratio to the first arm, and the load. Pure."""
    lines = [f"side by side: N={cfg.n} K={cfg.k} judge {cfg.judge_ms:g} ms, {cfg.rounds} "
             f"alternating rounds of {cfg.duration_s:g} s, medians",
             "",
             "| arm | verifies/s | ratio | CPU ms/cohort | p50 ms | p99 ms | p99 ratio | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ref = results[0]
    counted = any(STEPS in r for res in results for r in res.rounds)
    if counted:  # trio task steps per verify, and their ratio to the first arm's
        lines[2] += " steps/verify | steps ratio |"
        lines[3] += " --- | --- |"
    for res in results:
        v, p99 = res.median("verifies_per_s"), res.median("p99_ms")
        line = (
            f"| {res.arm.label} | {v:,.0f} | {v / ref.median('verifies_per_s'):.3f} | "
            f"{res.median('cpu_ms_per_cohort'):.2f} | {res.median('p50_ms'):.1f} | {p99:.1f} | "
            f"{p99 / ref.median('p99_ms'):.3f} | {res.median('failed_members'):.0f} |")
        if counted:
            steps = res.median(STEPS)
            line += (" - | - |" if math.isnan(steps) else
                     f" {steps:.2f} | {steps / ref.median(STEPS):.3f} |")
        lines.append(line)
    return "\n".join(lines)


def to_json(results: Sequence[ArmResult], cfg: SideBySide) -> bytes:
    doc: dict[str, Any] = {
        "load": {"n": cfg.n, "k": cfg.k, "judge_ms": cfg.judge_ms, "duration_s": cfg.duration_s,
                 "rounds": cfg.rounds},
        "arms": [{"label": r.arm.label, "code": str(r.arm.code) if r.arm.code else None,
                  "nemo": str(r.arm.nemo) if r.arm.nemo else None,
                  "sets": dict(r.arm.sets), "rounds": r.rounds,
                  "median": {m: r.median(m) for m in (*METRICS, STEPS)}} for r in results],
    }
    return msgspec.json.encode(doc)


def parse_side(items: Sequence[str]) -> SideBySide:
    """``--side`` items: ``n``, ``k``, ``judge_ms``, ``duration_s``, ``rounds``,
    ``mock=KEY=VALUE`` (repeatable), ``py_spy=DIR``, ``nemo=VENV``, ``steps=1``. Raises
    ValueError naming the item. Pure."""
    kw: dict[str, Any] = {}
    mock: list[str] = []
    for key, value in parse_sets(items):
        try:
            if key in ("n", "k", "rounds"):
                kw[key] = int(value)
            elif key in ("judge_ms", "duration_s"):
                kw[key] = float(value)
            elif key == "mock":
                mock.append(value)
            elif key in ("py_spy", "nemo"):
                kw[key] = Path(value)
            elif key == "steps":
                if value not in ("0", "1"):
                    raise ValueError(f"expected 0 or 1, got {value!r}")
                kw[key] = value == "1"
            else:
                raise ValueError(f"unknown --side key {key!r}")
        except ValueError as exc:
            raise ValueError(f"--side {key}: {exc}") from None
    return SideBySide(mock_sets=parse_sets(mock), **kw)
