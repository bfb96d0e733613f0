"""server/process_memory.py: the allocator's view, the periodic trim, tracemalloc growth, and
the memory block of GET /status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import httpx2
import pytest
import trio

from genrm_trio import wire
from genrm_trio.config import Config
from genrm_trio.server.process_memory import (
    MMAP_THRESHOLD_BYTES,
    Allocator,
    ProcessMemory,
    TraceGrowth,
)
from tests.lifecycle_helpers import body
from tests.server_helpers import running_server


class _FakeAllocator(Allocator):
    """malloc as the test says: ``free`` bytes held free and resident (in ``rss``); each trim
    gives them back."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.in_use = 50_000
        self.trim_calls = 0

    def rss(self) -> int:
        return self.in_use + self.free

    def stats(self) -> dict[str, int]:
        return {"heap_bytes": 2 * self.free, "in_use_bytes": self.free,
                "free_bytes": self.free, "mmapped_bytes": 0, "mmapped_blocks": 0,
                "free_chunks": 1, "top_pad_bytes": 0}

    def trim(self) -> bool:
        self.trim_calls += 1
        self.free = 0
        return True


def test_trim_only_when_enough_is_free() -> None:
    fake = _FakeAllocator(free=1000)
    memory = ProcessMemory(fake, interval_s=30.0, min_free_bytes=4096, rss=fake.rss)
    assert memory.trim_if_worth_it() is False and fake.trim_calls == 0
    fake.free = 10_000
    assert memory.trim_if_worth_it() is True and fake.trim_calls == 1
    assert memory.status()["trim"]["trimmed_bytes"] == 10_000
    # A burst's work finished after that trim: in use fell, free grew, RSS stayed where the
    # burst left it. Trimmed again.
    fake.free, fake.in_use = 30_000, 30_000
    assert memory.trim_if_worth_it() is True and fake.trim_calls == 2
    status = memory.status()["trim"]
    assert status["trims"] == 2 and status["trimmed_bytes"] == 40_000
    assert status["interval_s"] == 30.0
    assert status["min_free_bytes"] == 4096 and status["max_ms"] >= 0


async def test_trim_runs_every_interval_until_cancelled(autojump_clock: trio.abc.Clock) -> None:
    fake = _FakeAllocator(free=10_000)
    memory = ProcessMemory(fake, interval_s=30.0, min_free_bytes=4096, rss=fake.rss)
    with trio.move_on_after(95.0):  # looks at 30, 60 and 90 s
        async with trio.open_nursery() as nursery:
            nursery.start_soon(memory.trim_periodically)
            await trio.sleep(31.0)
            assert fake.trim_calls == 1
            fake.free = 10_000
            await trio.sleep(60.0)  # 60 s: free again, trimmed; 90 s: nothing free
            assert fake.trim_calls == 2
    off = ProcessMemory(_FakeAllocator(free=10_000), interval_s=None)
    with trio.move_on_after(3600.0):
        await off.trim_periodically()
    assert off.trims == 0 and off.status()["trim"]["interval_s"] is None


def test_glibc_allocator_reports_and_trims() -> None:
    allocator = Allocator.open()
    if allocator is None:
        pytest.skip("not glibc")
    stats = allocator.stats()
    assert set(stats) == {"heap_bytes", "in_use_bytes", "free_bytes", "mmapped_bytes",
                          "mmapped_blocks", "free_chunks", "top_pad_bytes"}
    assert stats["heap_bytes"] >= stats["in_use_bytes"] > 0
    assert isinstance(allocator.trim(), bool)


_LARGE_BLOCKS = """
import json, sys
from genrm_trio.server.process_memory import Allocator, ProcessMemory
memory = ProcessMemory.open()
allocator = memory.allocator
before = allocator.stats()
first = bytearray(8_000_000)  # mapped (glibc starts at 128 KiB) ...
del first  # ... and freed: glibc's own threshold would now slide up to 8 MB
held = [bytearray(3_000_000) for _ in range(2)] + [bytearray(100_000) for _ in range(2)]
after = allocator.stats()
del held
freed = allocator.stats()
print(json.dumps({"mapped": after["mmapped_blocks"] - before["mmapped_blocks"],
                  "heap_growth": after["heap_bytes"] - before["heap_bytes"],
                  "mapped_after_free": freed["mmapped_bytes"] - before["mmapped_bytes"],
                  "threshold": memory.status()["allocator"]["mmap_threshold_bytes"]}))
"""


def test_large_blocks_are_mapped_one_by_one_and_given_back_when_freed() -> None:
    """The process's large blocks (bodies, answers) stay out of malloc's heap, whose freed
    pages would stay resident (issue 26, slow readers: RSS 257-293 MB after the load, 13 MB in
    use): without the fixed threshold glibc maps the first 8 MB block, then raises its
    threshold to 8 MB and serves the 3 MB ones from the heap; and it never maps a 100 KB one
    (a body's 64 KiB reads are copied into blocks like these)."""
    if Allocator.open() is None:
        pytest.skip("not glibc")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", _LARGE_BLOCKS], env=env, check=True,
                          capture_output=True, text=True, timeout=60)
    seen = json.loads(done.stdout)
    assert seen["threshold"] == MMAP_THRESHOLD_BYTES
    assert seen["mapped"] >= 2  # the 3 MB blocks a mapping each (the 100 KB ones too, unless
    assert seen["heap_growth"] < 2**20  # the heap had room for them: it does not grow for them)
    assert seen["mapped_after_free"] <= 0  # and unmapped once freed


def test_a_large_answer_holds_its_length_not_msgspecs_buffer() -> None:
    """An encoded answer counts in max_active_bytes by its length while a slow client takes
    it; msgspec's own result of an 8 MB body held 12 MB (its buffer's spare capacity)."""
    allocator = Allocator.open()
    if allocator is None:
        pytest.skip("not glibc")
    member = {"response": {"output": [{"type": "output_text", "text": "x" * 8_000_000}]}}

    def held() -> int:
        stats = allocator.stats()
        return stats["in_use_bytes"] + stats["mmapped_bytes"]

    before = held()
    answer = wire.encode_answer(member)
    grew = held() - before
    assert wire.JSON_DECODER.decode(answer) == member
    assert grew < 1.05 * len(answer)
    small = wire.encode_answer({"reward": 1.0})
    assert small == b'{"reward":1.0}'


async def test_trace_growth_names_what_grew() -> None:
    trace = TraceGrowth()
    assert (await trace.report()) == {"tracing": False}
    tracemalloc.start(4)
    try:
        first = await trace.report()
        assert first["tracing"] is True and first["since_baseline"] == []
        grown = [bytes(1000 + i) for i in range(2000)]  # about 2 MB from this line
        report = await trace.report(top=3)
        top = report["since_baseline"][0]
        assert top["size_diff_bytes"] >= 2_000_000 and top["count_diff"] >= 2000
        assert any("test_process_memory.py" in frame for frame in top["traceback"])
        assert report["since_previous"][0]["size_diff_bytes"] >= 2_000_000
        reset = await trace.report(reset=True)
        assert reset["since_baseline"] == [] and reset["since_previous"] == []
        del grown
    finally:
        tracemalloc.stop()


async def test_status_shows_memory_and_every_growing_structure_with_its_bound() -> None:
    cfg = Config(num_rollouts_per_prompt=2, port=0, max_terminal_cohorts=50,
                 cohort_result_ttl_s=60.0, malloc_trim_interval_s=30.0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        statuses: list[int] = []

        async def member(slot: int) -> None:
            statuses.append((await client.post("/verify", json=body(slot, group="m"))).status_code)

        async with trio.open_nursery() as nursery:
            for slot in (0, 1):
                nursery.start_soon(member, slot)
        assert statuses == [200, 200]
        memory = (await client.get("/status")).json()["memory"]
        assert memory["rss_bytes"] > 0 and memory["python_blocks"] > 0
        assert memory["tracemalloc"] is None
        if memory["allocator"] is not None:
            assert memory["allocator"]["heap_bytes"] > 0
            assert memory["trim"]["interval_s"] == 30.0
        structures = memory["structures"]
        assert structures["records"] == {"count": 1, "cap": 50, "ttl_s": 60.0}
        assert structures["idle_watermarks"] == {"count": 1, "cap": 100, "ttl_s": 120.0}
        assert structures["active_cohorts"]["count"] == 0
        for name in ("active_groups", "watch_queue", "counters", "judge_connections",
                     "judge_limiter_waiting", "metrics_series"):
            assert set(structures[name]) == {"count", "cap", "ttl_s"}, name
        assert structures["metrics_series"]["count"] >= 1
        assert (await client.get("/debug/memory")).json() == {"tracing": False}


def test_status_counts_the_frozen_objects_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the frozen objects walks all of them (5 ms of the event loop in a server):
    a /status polled every 250 ms must not pay it each time."""
    import gc
    import time

    calls: list[int] = []
    now = [1000.0]
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or 7)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    memory = ProcessMemory(None, interval_s=None)
    assert [memory.status()["gc"]["frozen"] for _ in range(5)] == [7] * 5
    assert len(calls) == 1
    now[0] += 61.0
    assert memory.status()["gc"]["frozen"] == 7 and len(calls) == 2
