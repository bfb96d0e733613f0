"""wrk, a load generator written in C, sending ``/verify`` cohorts: the ``scaleout`` bench's load.

Why not the Python load generator (:mod:`genrm_trio.bench.loadgen`): on this 2-core machine the
load generator shares the cores with the servers it measures. The Python one spends about
0.35 ms of CPU per request (h11, a task per member), a third of what a replica spends, so the
two-replica setup could never show its cores; wrk spends about 0.05 ms. wrk is the Debian
package (installed when missing, like HAProxy); its Lua hooks build each request.

The Lua script numbers requests in the order wrk asks for them: request ``r`` is member
``r mod N`` of cohort ``r div N``. Each of wrk's connections sends its next request when its
previous answer came, so the first ``connections`` requests open ``connections / N`` cohorts
whole, and every later cohort fills as answers free connections: the cohorts in flight stay
about ``connections / N``, like K cohorts of N in :mod:`loadgen`. Bodies are
:class:`~genrm_trio.bench.loadgen.BodyFactory` members (one template per rollout index, the
cohort number filled in), so group ids and prompts are unique per run and per cohort.

An answer counts as good when it is a 200 with ``"mask_sample":false`` (a real reward); every
other answer is bad. Requests still in flight when the duration ends are dropped (their
connections closed): the servers see client disconnects. The measurement is a window of whole
seconds inside the run (wall-clock seconds, which the Lua side reads with ``os.time()``): it
leaves out the opening of the connections at the start (HAProxy opens its own to the replicas
then) and the dropped requests at the end, so what it measures is the steady state, as with a
caller's long-lived connection pool.

::

    result = await run_wrk(url, bodies, n, connections=256, window_s=8, workdir=path,
                           watch=server_pids)
      +-- cohort_script(bodies, n, window)                   the Lua text
      +-- wrk -t1 -cC -dD --timeout T -s script URL/verify   until it exits by itself
      +-- CPU of wrk and the watched pids at the window's start and end (/proc)
      +-- WrkResult(window_good, window_bad, wrk_cpu_s, cpu_s, good, bad)
"""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from genrm_trio.bench.loadgen import BodyFactory, LoadgenError, read_proc_stats
from genrm_trio.bench.processes import MissingProgram, ensure_program

__all__ = ["WrkResult", "cohort_script", "ensure_wrk", "member_templates", "run_wrk"]

_COHORT_SENTINEL = 987654321012345
"""A cohort number no run reaches: where the template's cohort number goes."""
_ANSWER_TIMEOUT_S = 60
_RESULT_PREFIX = "GENRM-WRK "


@dataclass(frozen=True)
class WrkResult:
    """What one wrk run saw. In the measuring window (``window_s`` whole seconds, after at least
    one second of load): good and bad answers, and the CPU seconds of wrk and of each watched
    process. Over the whole run: good and bad answers."""

    window_s: float
    window_good: int
    window_bad: int
    wrk_cpu_s: float
    cpu_s: dict[int, float]
    good: int
    bad: int

    @property
    def good_per_s(self) -> float:
        return self.window_good / self.window_s if self.window_s > 0 else math.nan


def ensure_wrk() -> str:
    """The ``wrk`` executable, installing the Debian package when missing. Blocks (run it in a
    thread from async code). Raises :class:`LoadgenError` when it cannot be had."""
    try:
        return ensure_program("wrk", "wrk")
    except MissingProgram as exc:
        raise LoadgenError(str(exc)) from exc


def _lua_string(text: str) -> str:
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    return f"[{eq}[{text}]{eq}]"


def member_templates(bodies: BodyFactory, n: int) -> list[list[str]]:
    """Per rollout index, the pieces of its body around the cohort number: joined with
    ``str(cohort)`` they give member ``index`` of that cohort (its group id, prompt and ids are
    the cohort's, as in ``bodies.member(cohort, index)``; its answer text is one per index).
    Pure."""
    if n < 1:
        raise ValueError("n must be at least 1")
    return [bodies.member(_COHORT_SENTINEL, index).decode().split(str(_COHORT_SENTINEL))
            for index in range(n)]


def cohort_script(bodies: BodyFactory, n: int, window: tuple[int, int] = (0, 0)) -> str:
    """The wrk Lua script sending cohorts of ``n`` ``/verify`` members made by ``bodies``
    (module docstring). Answers whose arrival falls in ``window`` (whole Unix seconds, start
    included, end not) are also counted apart: the steady state, without the connections'
    opening and the requests dropped at the end. Pure."""
    table = ",\n".join("  {" + ", ".join(_lua_string(p) for p in parts) + "}"
                        for parts in member_templates(bodies, n))
    return f"""-- generated by genrm_trio.bench.wrk: cohorts of {n} /verify members
local templates = {{
{table}
}}
local n = {n}
local window_start, window_end = {window[0]}, {window[1]}
local counter = 0
local threads = {{}}
local headers = {{["Content-Type"] = "application/json"}}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  good = 0
  bad = 0
  window_good = 0
  window_bad = 0
end

function request()
  local r = counter
  counter = counter + 1
  local body = table.concat(templates[(r % n) + 1], tostring(math.floor(r / n)))
  return wrk.format("POST", "/verify", headers, body)
end

function response(status, headers, body)
  local ok = status == 200 and string.find(body, '"mask_sample":false', 1, true)
  local now = os.time()
  local inside = now >= window_start and now < window_end
  if ok then
    good = good + 1
    if inside then window_good = window_good + 1 end
  else
    bad = bad + 1
    if inside then window_bad = window_bad + 1 end
  end
end

function done(summary, latency, requests)
  local g, b, wg, wb = 0, 0, 0, 0
  for _, t in ipairs(threads) do
    g = g + t:get("good")
    b = b + t:get("bad")
    wg = wg + t:get("window_good")
    wb = wb + t:get("window_bad")
  end
  io.write(string.format("{_RESULT_PREFIX}good=%d bad=%d window_good=%d window_bad=%d\\n",
                         g, b, wg, wb))
end
"""


async def run_wrk(url: str, bodies: BodyFactory, n: int, *, connections: int, window_s: int,
                  workdir: Path, watch: Sequence[int] = (),
                  window_start: int | None = None) -> WrkResult:
    """Run wrk (one thread, ``connections`` keep-alive connections) against ``url/verify``
    with :func:`cohort_script` cohorts of ``n`` from ``bodies`` (the script is written into
    ``workdir``), and measure a window of ``window_s`` whole seconds that starts once the load
    has run for at least one second and ends a second before wrk stops: the answers in it, and
    the CPU time of wrk and of the ``watch`` processes (pids) spent in it. ``window_start``
    (a Unix second, at least one second ahead; by default the one two seconds after the next
    full second) lets runs started together measure the same window.

    Blocks for about ``window_s + 3`` seconds (plus installing wrk on first use). Raises
    :class:`LoadgenError` when wrk is missing, fails or reports nothing, and ``ValueError`` when
    ``window_start`` is less than a second away.
    """
    exe = await trio.to_thread.run_sync(ensure_wrk)
    now = time.time()
    start = math.ceil(now) + 2 if window_start is None else window_start
    if start < now + 1:
        raise ValueError("window_start must leave at least one second of load before it")
    end = start + max(1, window_s)
    path = workdir / f"wrk-{time.time_ns()}.lua"
    path.write_text(cohort_script(bodies, n, (start, end)))
    command = [exe, "-t1", f"-c{connections}", f"-d{math.ceil(end + 1 - now)}s",
               "--timeout", f"{_ANSWER_TIMEOUT_S}s", "-s", str(path),
               url.rstrip("/") + "/verify"]
    done: list[subprocess.CompletedProcess[bytes]] = []

    async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
        # trio reads both pipes and, if cancelled, kills wrk and waits for it.
        done.append(await trio.run_process(command, capture_stdout=True, capture_stderr=True,
                                           check=False, task_status=task_status))

    def cpu(pids: list[int]) -> dict[int, float] | None:
        try:
            return {pid: read_proc_stats(pid).cpu_s for pid in pids}
        except OSError:  # wrk (or a watched process) ended early: reported below
            return None

    before = after = None
    try:
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(run)
            pids = [process.pid, *watch]
            await trio.sleep(max(0.0, start - time.time()))
            before = cpu(pids)
            await trio.sleep(max(0.0, end - time.time()))
            after = cpu(pids)
    finally:
        path.unlink(missing_ok=True)
    out, err, returncode = done[0].stdout, done[0].stderr, done[0].returncode
    text = out.decode(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith(_RESULT_PREFIX)), None)
    if returncode != 0 or line is None or before is None or after is None:
        tail = (err.decode(errors="replace") or text).strip().splitlines()[-3:]
        raise LoadgenError(f"wrk exited {returncode}: {' / '.join(tail)}")
    spent = {pid: after[pid] - before[pid] for pid in before}
    fields = {k: int(v) for k, v in
              (item.split("=", 1) for item in line[len(_RESULT_PREFIX):].split())}
    return WrkResult(
        window_s=float(end - start), window_good=fields["window_good"],
        window_bad=fields["window_bad"], wrk_cpu_s=spent.pop(process.pid),
        cpu_s=spent, good=fields["good"], bad=fields["bad"])

