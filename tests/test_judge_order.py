"""The order of judge work under the capacity limit (server/judge/order.py), on the autojump
clock: who gets a free slot first, per ``judge_order``, as the registry ranks its cohorts."""

from __future__ import annotations

from dataclasses import dataclass

import httpx2
import pytest
import trio
import trio.testing

from genrm_trio import scoring
from genrm_trio.config import Config
from genrm_trio.server.judge import GroupProgress, JudgeRequest, OrderedLimiter, open_judge
from tests.lifecycle_helpers import Outcomes, answer, heuristic_verdict, member, open_registry
from tests.test_judge import REQUEST, make_cfg, responses_ok, transport


@dataclass
class Group:
    opened_at: float
    comparisons_left: int
    collected_at: float | None = None


async def _serve_in_order(limiter: OrderedLimiter,
                          waiters: list[tuple[str, GroupProgress | None]]) -> list[str]:
    """A holder takes the only token; the waiters queue in list order; each served one holds
    the token for 1 s. Returns the labels in the order they were served."""
    served: list[str] = []

    async def one(label: str, group: GroupProgress | None) -> None:
        async with limiter.slot(group):
            served.append(label)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "holder", None)
        await trio.testing.wait_all_tasks_blocked()
        for label, group in waiters:
            nursery.start_soon(one, label, group)
            await trio.testing.wait_all_tasks_blocked()  # queued in list order
        assert limiter.waiting == len(waiters)
        assert limiter.borrowed_tokens == 1
    assert limiter.waiting == 0 and limiter.borrowed_tokens == 0
    return served[1:]


BIG_OLD = Group(opened_at=0.0, comparisons_left=5, collected_at=5.0)
SMALL_NEW = Group(opened_at=2.0, comparisons_left=1)  # still collecting
SMALL_OLD = Group(opened_at=1.0, comparisons_left=1, collected_at=4.0)
QUEUE: list[tuple[str, GroupProgress | None]] = [
    ("big-1", BIG_OLD), ("small-new", SMALL_NEW), ("big-2", BIG_OLD), ("compare", None),
    ("small-old", SMALL_OLD),
]


@pytest.mark.parametrize(("order", "expected"), [
    ("complete_group", ["compare", "small-old", "big-1", "big-2", "small-new"]),
    ("closest_group", ["compare", "small-old", "small-new", "big-1", "big-2"]),
    ("oldest_group", ["compare", "big-1", "big-2", "small-old", "small-new"]),
    ("arrival", ["big-1", "small-new", "big-2", "compare", "small-old"]),
])
async def test_a_free_slot_goes_to_the_first_ranked_waiter(
    autojump_clock: trio.abc.Clock, order: str, expected: list[str],
) -> None:
    limiter = OrderedLimiter(1, order)  # type: ignore[arg-type]
    start = trio.current_time()
    assert await _serve_in_order(limiter, QUEUE) == expected
    assert trio.current_time() - start == 6.0  # one at a time, never idle


async def test_the_rank_is_read_when_the_slot_is_handed_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    limiter = OrderedLimiter(1, "closest_group")
    a, b = Group(0.0, 3), Group(1.0, 2)
    served: list[str] = []

    async def one(label: str, group: Group) -> None:
        async with limiter.slot(group):
            served.append(label)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for label, group in (("b-1", b), ("a-1", a), ("b-2", b), ("a-2", a)):
            nursery.start_soon(one, label, group)
            await trio.testing.wait_all_tasks_blocked()
        a.comparisons_left = 1  # a made progress elsewhere while its calls waited
    assert served == ["b-1", "a-1", "a-2", "b-2"]


async def test_capacity_is_respected_and_a_cancelled_waiter_leaves_the_queue(
    autojump_clock: trio.abc.Clock,
) -> None:
    limiter = OrderedLimiter(3, "closest_group")
    peak = running = 0
    group = Group(0.0, 10)

    async def one() -> None:
        nonlocal peak, running
        async with limiter.slot(group):
            running += 1
            peak = max(peak, running)
            await trio.sleep(1.0)
            running -= 1

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(one)
        with trio.CancelScope() as gone:
            gone.cancel()
            await limiter.acquire(group)  # cancelled before it waits: takes nothing
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.waiting == 7
        with trio.move_on_after(0.5):
            await limiter.acquire(Group(0.0, 0))  # ranks first, then leaves at 0.5 s
        assert limiter.waiting == 7 and limiter.borrowed_tokens == 3
    assert peak == 3
    assert trio.current_time() - start == 4.0  # ceil(10 / 3) waves of 1 s
    assert limiter.borrowed_tokens == 0
    with pytest.raises(RuntimeError):
        limiter.release()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="total_tokens"):
        OrderedLimiter(0)
    with pytest.raises(ValueError, match="judge order"):
        OrderedLimiter(1, "fifo")  # type: ignore[arg-type]


async def test_the_judge_takes_its_order_and_capacity_from_the_config(
    autojump_clock: trio.abc.Clock,
) -> None:
    served: list[str] = []

    async def slow(request: httpx2.Request) -> httpx2.Response:
        served.append(request.read().decode())
        await trio.sleep(1.0)
        return responses_ok()

    cfg = make_cfg(judge_max_concurrency=1, judge_order="closest_group")
    requests = {name: JudgeRequest(history=REQUEST.history, response_1=name, response_2="x",
                                   principle=None) for name in ("first", "big", "small")}
    async with open_judge(cfg, transport=transport(slow)) as judge:
        assert judge.status()["limiter"]["order"] == "closest_group"
        async with trio.open_nursery() as nursery:
            for name, group in (("first", None), ("big", Group(0.0, 9)),
                                ("small", Group(5.0, 1))):
                nursery.start_soon(judge.judge_pair, requests[name], group)
                await trio.testing.wait_all_tasks_blocked()
    assert [next(n for n in requests if f'"response_1":"{n}"' in body) for body in served] == [
        "first", "small", "big"]


class LimitedJudge:
    """A judge of one slot that serves comparisons in the registry's ranking, 1 s each."""

    def __init__(self, order: str) -> None:
        self.limiter = OrderedLimiter(1, order)  # type: ignore[arg-type]
        self.served: list[tuple[float, str, tuple[int, int]]] = []

    async def judge_pair(self, request: JudgeRequest, group: GroupProgress | None = None,
                         trace: object = None) -> scoring.Verdict:
        async with self.limiter.slot(group):
            prompt = request.history[0]["content"]
            pair = (SLOT_OF[request.response_1], SLOT_OF[request.response_2])
            self.served.append((trio.current_time(), prompt[-1], pair))
            await trio.sleep(1.0)
        return heuristic_verdict(request)


SLOT_OF = {answer(s): s for s in range(3)}


@pytest.mark.parametrize(("order", "a_done", "b_done"), [
    # at t=1 the queue is: c (0, 1) [c still collecting], b x3 [b complete at 0.25],
    # a x2 [a complete at 0.5, one of its three comparisons done]
    ("complete_group", 6.0, 4.0),  # b, then a, then c's early pair
    ("arrival", 7.0, 5.0),  # c, b, a
    ("closest_group", 3.0, 7.0),  # a (2 left), c (3 left, older than b), b
])
async def test_the_registry_ranks_its_cohorts_by_their_progress(
    autojump_clock: trio.abc.Clock, order: str, a_done: float, b_done: float,
) -> None:
    cfg = Config(num_rollouts_per_prompt=3, judge_schedule="eager",
                 cohort_collection_timeout_s=60.0, cohort_evaluation_timeout_s=60.0)
    judge = LimitedJudge(order)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()

        def send(group: str, *slots: int) -> None:
            for slot in slots:
                out.send(f"{group}{slot}", member(cfg, slot, group=group,
                                                  prompt=f"prompt {group}"))

        send("a", 0, 1)  # a's pair (0, 1) takes the free slot at once
        await trio.sleep(0.1)
        send("c", 0, 1)  # an early pair of a group still collecting
        await trio.sleep(0.15)
        send("b", 0, 1, 2)  # b complete: three comparisons
        await trio.sleep(0.25)
        send("a", 2)  # a complete: two more
        await trio.sleep(9.5)
        send("c", 2)
    assert judge.served[0] == (t0, "a", (0, 1))
    assert out.results["a0"][0] - t0 == a_done
    assert out.results["b0"][0] - t0 == b_done
    assert out.results["c0"][0] - t0 == 12.0  # c's last two comparisons, after t=10
