"""``judge.routing``: least_loaded against cohort_affinity, with fake endpoints (an httpx2 mock
transport that answers per host) and the autojump clock: where each group's calls go, when they
spill, how retries, cooling and ``judge.max_concurrency_per_endpoint`` still hold."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from genrm_trio.config import Config, JudgeConfig
from genrm_trio.errors import ConfigError
from genrm_trio.server.judge import Affinity, Crowd, JudgeRequest, open_judge
from genrm_trio.server.judge.endpoints import EVIDENCE_CALLS as EVIDENCE
from genrm_trio.server.judge.endpoints import Sharing
from tests.test_judge import MaxRng, responses_ok, transport

URL_A = "http://judge-a.test"
URL_B = "http://judge-b.test"


class Group:
    """What the judge reads of a cohort: its rank fields and its home endpoint slot (with the
    registry's count of active cohorts, ``crowd``, when given)."""

    def __init__(self, crowd: Crowd | None = None) -> None:
        self.opened_at = 0.0
        self.comparisons_left = 1
        self.collected_at: float | None = 0.0
        self.judge_affinity = Affinity(crowd)


def crowd(cohorts: int) -> Crowd:
    made = Crowd()
    made.cohorts = cohorts
    return made


class Endpoints:
    """Fake judge servers: every call takes ``service_s`` (times listed per host), with a
    count of calls at once per host, and optional failures of a host's first calls."""

    def __init__(self, service_s: float = 1.0, fail_first: dict[str, int] | None = None) -> None:
        self.service_s = service_s
        self.fail_first = dict(fail_first or {})
        self.hosts: list[str] = []
        self.by_history: dict[str, list[str]] = defaultdict(list)
        self.now: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.started: dict[str, list[float]] = defaultdict(list)
        # (start time, host, response_1, response_2) of every call that reached a judge
        self.calls: list[tuple[float, str, str, str]] = []
        self.histories: list[tuple[float, str, str]] = []  # (start time, host, conversation)

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        host = request.url.host
        self.hosts.append(host)
        body = httpx2.Response(200, content=request.content).json()
        self.by_history[body["input"][0]["content"]].append(host)
        if self.fail_first.get(host, 0) > 0:
            self.fail_first[host] -= 1
            return httpx2.Response(503)
        self.now[host] += 1
        self.peak[host] = max(self.peak[host], self.now[host])
        self.started[host].append(trio.current_time())
        roles = {m["role"]: m["content"] for m in body["input"]}
        roles.update(body.get("metadata") or {})  # where genrm_roles puts them for Responses
        self.histories.append((trio.current_time(), host, body["input"][0]["content"]))
        self.calls.append((trio.current_time(), host, roles.get("response_1", ""),
                           roles.get("response_2", "")))
        try:
            await trio.sleep(self.service_s)
        finally:
            self.now[host] -= 1
        return responses_ok()


def cfg(routing: str, **judge: Any) -> Config:
    top = judge.pop("top", {})
    return Config(judge=JudgeConfig(base_urls=(URL_A, URL_B), routing=routing, **judge),  # type: ignore[arg-type]
                  genrm_parse_retry_sleep_s=0.0, **top)


def request(group: int, k: int) -> JudgeRequest:
    history = [{"role": "user", "content": f"conversation of group {group} " * 20}]
    return JudgeRequest(history=history, response_1=f"answer {k}", response_2=f"answer {k + 1}")


async def judge_groups(config: Config, fakes: Endpoints, groups: int, calls: int,
                       stagger_s: float = 0.0) -> tuple[list[Group], dict[str, Any]]:
    made = [Group() for _ in range(groups)]
    async with open_judge(config, transport=transport(fakes), rng=MaxRng()) as judge:
        async with trio.open_nursery() as nursery:
            for g, group in enumerate(made):
                for k in range(calls):
                    nursery.start_soon(judge.judge_pair, request(g, k), group)
                if stagger_s:
                    await trio.sleep(stagger_s)
        status = judge.status()
    return made, status


def history_of(group: int) -> str:
    return request(group, 0).history[0]["content"]


async def test_least_loaded_scatters_a_cohort_over_every_endpoint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One cohort's four calls at once: least-loaded puts two on each endpoint whatever order
    # trio starts them in (with two cohorts, trio's scheduling order could pair them up).
    fakes = Endpoints()
    await judge_groups(cfg("least_loaded"), fakes, groups=1, calls=4)
    assert [sorted(Counter(hosts).values()) for hosts in fakes.by_history.values()] == [[2, 2]]


async def test_affinity_keeps_each_cohort_on_one_endpoint_chosen_by_outstanding_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fakes = Endpoints()
    groups, status = await judge_groups(cfg("cohort_affinity", affinity_spill_factor=16.0),
                                        fakes, groups=2, calls=4)
    homes = [set(fakes.by_history[history_of(g)]) for g in range(2)]
    # the first group to issue went to an empty endpoint; the other then found it holding the
    # first group's calls' tokens and went to the other one
    assert sorted(map(sorted, homes)) == [["judge-a.test"], ["judge-b.test"]]
    assert groups[0].judge_affinity.endpoint is not groups[1].judge_affinity.endpoint
    assert status["routing"] == "cohort_affinity"
    assert all(e["outstanding_tokens"] == 0 and e["waiting"] == 0 for e in status["endpoints"])


@pytest.mark.parametrize(("factor", "hosts", "makespan"), [
    # never past 16 x the mean: every call waits for judge-a's two slots (4 rounds of 1 s)
    (16.0, {"judge-a.test"}, 4.0),
    # past the mean: call 3 spills to judge-b, which computes the conversation once while the
    # rest wait at judge-a (another cohort would take judge-b's second slot meanwhile); then
    # judge-b's freed slots take two of judge-a's queue (still over the mean): 3 rounds
    (1.0, {"judge-a.test", "judge-b.test"}, 3.0),
])
async def test_with_many_cohorts_a_full_home_spills_past_the_factor_and_idle_slots_take_its_queue(
    autojump_clock: trio.testing.MockClock, factor: float, hosts: set[str],
    makespan: float,
) -> None:
    fakes = Endpoints()
    config = cfg("cohort_affinity", affinity_spill_factor=factor,
                 max_concurrency_per_endpoint=2, engine="llama_cpp")
    group = Group(crowd(4))  # two cohorts per endpoint: the spill factor bounds affinity
    async with open_judge(config, transport=transport(fakes), rng=MaxRng()) as judge:
        await judge.judge_pair(request(0, 100), group)  # its conversation is warm at judge-a
        fakes.hosts.clear()
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for k in range(8):  # each with its own response_1: nothing computed twice
                nursery.start_soon(judge.judge_pair, request(0, k), group)
        assert trio.current_time() - started == makespan
        status = judge.status()
    assert set(fakes.hosts) == hosts
    assert max(fakes.peak.values()) <= 2  # max_concurrency_per_endpoint holds
    assert all(e["outstanding_tokens"] == 0 and e["waiting"] == 0 for e in status["endpoints"])


async def test_with_few_cohorts_a_full_home_spills_to_any_free_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One cohort (no registry crowd): no other cohort would take judge-b's slots, so calls
    # that find judge-a full go there, and its freed slots take judge-a's queue, whatever
    # the factor: 2 rounds of 1 s, as least_loaded would take.
    fakes = Endpoints()
    config = cfg("cohort_affinity", affinity_spill_factor=16.0,
                 max_concurrency_per_endpoint=2)
    started = trio.current_time()
    _, status = await judge_groups(config, fakes, groups=1, calls=8)
    assert trio.current_time() - started == 2.0
    assert Counter(fakes.hosts) == {"judge-a.test": 4, "judge-b.test": 4}
    assert max(fakes.peak.values()) <= 2
    assert all(e["outstanding_tokens"] == 0 and e["waiting"] == 0 for e in status["endpoints"])


@pytest.mark.parametrize(("factor", "split"), [
    # past the factor a home with free slots still spills: the home takes calls while it
    # holds at most 1.5 x the mean outstanding tokens, i.e. at most 3 x the other's (6 of 8)
    (1.5, [2, 6]),
    (16.0, [8]),  # a factor no load reaches: every call stays home
])
async def test_with_few_cohorts_a_home_with_free_slots_spills_past_the_factor(
    autojump_clock: trio.testing.MockClock, factor: float, split: list[int],
) -> None:
    # One cohort, 12 slots per endpoint: its home never runs out of slots, so only the load
    # bound moves calls (an engine shares its compute between the calls it runs: 8 calls
    # on one engine and none on the other is slower than least_loaded).
    fakes = Endpoints()
    config = cfg("cohort_affinity", affinity_spill_factor=factor,
                 max_concurrency_per_endpoint=12)
    _, status = await judge_groups(config, fakes, groups=1, calls=8)
    # (the home is whichever endpoint the first call found lightest: compare the counts)
    assert sorted(Counter(fakes.hosts).values()) == split
    assert all(e["outstanding_tokens"] == 0 and e["waiting"] == 0 for e in status["endpoints"])


def pair(group: int, i: int, j: int) -> JudgeRequest:
    history = [{"role": "user", "content": f"conversation of group {group} " * 20}]
    return JudgeRequest(history=history, response_1=f"answer {i}", response_2=f"answer {j}")


@pytest.mark.parametrize("slots", [5, None])  # None: no per-endpoint limit (the default)
@pytest.mark.parametrize(("engine", "cohorts", "starts"), [
    # two cohorts per endpoint active: (0, 2), (0, 3) wait for (0, 1) to compute the
    # conversation and answer 0, (1, 3) for (1, 2) to compute answer 1; slots stay free
    # meanwhile (other cohorts' calls would take them)
    ("llama_cpp", 4, [0.0, 1.0, 1.0, 1.0, 2.0]),
    # one cohort: nothing else would use the free slots, so every call goes at once
    ("llama_cpp", 1, [0.0, 0.0, 0.0, 0.0, 0.0]),
    # an engine that shares a prefix between the calls it runs: waiting would only add a
    # round trip, so every call goes at once however crowded
    ("vllm", 4, [0.0, 0.0, 0.0, 0.0, 0.0]),
    # unknown / sglang: until the endpoint's first answer nothing is known of it, so the
    # duplicates of (0, 1) wait for it as with llama_cpp; from then on nothing shows that it
    # does not share (these fakes report no cached tokens), so (1, 3) no longer waits
    ("sglang", 4, [0.0, 1.0, 1.0, 1.0, 1.0]),
    ("unknown", 4, [0.0, 1.0, 1.0, 1.0, 1.0]),
    # the same with one cohort: nothing else would use the free slots
    ("unknown", 1, [0.0, 0.0, 0.0, 0.0, 0.0]),
])
async def test_with_many_cohorts_a_shared_prefix_is_computed_once_before_its_other_calls_go(
    autojump_clock: trio.testing.MockClock, engine: str, cohorts: int, starts: list[float],
    slots: int | None,
) -> None:
    fakes = Endpoints()
    config = cfg("cohort_affinity", affinity_spill_factor=16.0,
                 max_concurrency_per_endpoint=slots, engine=engine)
    group = Group(crowd(cohorts))
    # A call left waiting with nothing to wake it fails here (the clock jumps to the
    # deadline) instead of hanging the suite.
    with trio.fail_after(60):
        async with open_judge(config, transport=transport(fakes), rng=MaxRng()) as judge:
            async with trio.open_nursery() as nursery:
                for i, j in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3)):
                    nursery.start_soon(judge.judge_pair, pair(0, i, j), group)
                    await trio.testing.wait_all_tasks_blocked()  # issued in this order
            status = judge.status()
    by_pair = {(r1, r2): t for t, _, r1, r2 in fakes.calls}
    assert [by_pair[f"answer {i}", f"answer {j}"] for i, j in
            ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3))] == starts
    assert set(fakes.hosts) == {"judge-a.test"}
    assert all(e["outstanding_tokens"] == 0 and e["waiting"] == 0 and e["in_flight"] == 0
               for e in status["endpoints"])


FIVE_PAIRS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3))


def one_url(engine: str) -> Config:
    """One judge URL under cohort_affinity with ``judge.engine`` (its evidence is its own)."""
    return Config(judge=JudgeConfig(base_urls=(URL_A,), routing="cohort_affinity",
                                    engine=engine),  # type: ignore[arg-type]
                  genrm_parse_retry_sleep_s=0.0)


async def five_at_once(judge: Any, fakes: Endpoints, g: int, group: Group) -> list[float]:
    """Issue group ``g``'s :data:`FIVE_PAIRS` at once (in this order) and wait for them; each
    call's start relative to the first."""
    begun = len(fakes.calls)
    async with trio.open_nursery() as nursery:
        for i, j in FIVE_PAIRS:
            nursery.start_soon(judge.judge_pair, pair(g, i, j), group)
            await trio.testing.wait_all_tasks_blocked()
    first = min(t for t, *_ in fakes.calls[begun:])
    return [t - first for t, *_ in fakes.calls[begun:]]


class CachingEndpoints(Endpoints):
    """Fake judges with a prefix cache per host that report ``cached_tokens``: a call finds its
    conversation cached (80 of its 100 prompt tokens) once a call with it has ended there
    (``shared=False``: concurrent calls compute it again, like llama.cpp's slots) or started
    there (``shared=True``: the engine shares it between the calls it runs, like vLLM)."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.shared = shared
        self.cached: set[tuple[str, str]] = set()

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = httpx2.Response(200, content=request.content).json()
        key = (request.url.host, body["input"][0]["content"])
        hit = key in self.cached
        if self.shared:
            self.cached.add(key)
        answer = await super().__call__(request)
        self.cached.add(key)
        reply = answer.json()
        reply["usage"] = {"input_tokens": 100, "output_tokens": 5,
                          "input_tokens_details": {"cached_tokens": 80 if hit else 0}}
        return httpx2.Response(200, json=reply)


@pytest.mark.parametrize(("shared", "later"), [
    # shown not to share: later cohorts' duplicates wait for the call computing their prefix
    (False, [0.0, 1.0, 1.0, 1.0, 2.0]),
    # shares (its concurrent calls find the conversation cached): never waits
    (True, [0.0, 0.0, 0.0, 0.0, 0.0]),
])
@pytest.mark.parametrize("engine", ["unknown", "sglang"])  # sglang: as its --schedule-policy
async def test_unknown_engine_waits_only_once_its_cached_tokens_show_concurrent_calls_do_not_share(
    autojump_clock: trio.testing.MockClock, shared: bool, later: list[float], engine: str,
) -> None:
    fakes = CachingEndpoints(shared)
    shared_crowd = crowd(4)
    starts: list[list[float]] = []
    with trio.fail_after(600):
        async with open_judge(one_url(engine), transport=transport(fakes),
                              rng=MaxRng()) as judge:
            # Each cohort: its five calls at once (four start while the first computes the
            # conversation), then one more that finds it warm.
            for g in range(EVIDENCE + 1):
                group = Group(shared_crowd)
                starts.append(await five_at_once(judge, fakes, g, group))
                await judge.judge_pair(pair(g, 2, 3), group)
    assert set(fakes.hosts) == {"judge-a.test"}
    # Before its first answer the endpoint is not known: the first call went alone, then (the
    # first answer told nothing) the rest at once, each finding the conversation warm.
    assert starts[0] == [0.0] + [1.0] * 4
    # Evidence from cohorts 0..7 (4 concurrent calls and 1 warm each): cohort 8 follows it.
    assert sorted(starts[EVIDENCE]) == later
    assert shared_crowd.waits is not shared


class LlamaCppEndpoints(Endpoints):
    """Fake judges that answer in llama.cpp's server's shape: a ``timings`` object beside
    ``usage`` (``prompt_n`` computed, ``cache_n`` reused)."""

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        reply = (await super().__call__(request)).json()
        reply["timings"] = {"prompt_n": 100, "cache_n": 0, "prompt_ms": 50.0,
                            "predicted_n": 5, "predicted_ms": 10.0}
        return httpx2.Response(200, json=reply)


@pytest.mark.parametrize(("engine", "later", "identified"), [
    # unknown: the first answer shows llama.cpp's server; later cohorts' duplicates wait
    ("unknown", [0.0, 1.0, 1.0, 1.0, 2.0], "llama_cpp"),
    # a configured engine is never overridden by what the answers look like
    ("vllm", [0.0, 0.0, 0.0, 0.0, 0.0], "vllm"),
])
async def test_an_unknown_endpoint_that_answers_as_llama_cpp_takes_its_rule_at_once(
    autojump_clock: trio.testing.MockClock, engine: str, later: list[float], identified: str,
) -> None:
    fakes = LlamaCppEndpoints()
    shared_crowd = crowd(4)
    starts: list[list[float]] = []
    statuses = []
    with trio.fail_after(600):
        async with open_judge(one_url(engine), transport=transport(fakes),
                              rng=MaxRng()) as judge:
            statuses.append(judge.status()["endpoints"][0])
            for g in range(2):
                starts.append(await five_at_once(judge, fakes, g, Group(shared_crowd)))
            statuses.append(judge.status()["endpoints"][0])
    # Before any answer nothing is known: an unknown endpoint waits as llama_cpp does until
    # then, and from its first answer on because that answer showed llama.cpp's server.
    assert sorted(starts[0]) == later
    assert sorted(starts[1]) == later
    assert statuses[0]["engine"] == engine
    assert statuses[0]["prefix_waits"] is (engine == "unknown")
    assert statuses[1]["engine"] == identified
    assert statuses[1]["prefix_waits"] is (identified == "llama_cpp")
    assert shared_crowd.waits is (identified == "llama_cpp")


def one_endpoint(slots: int) -> Config:
    return Config(judge=JudgeConfig(base_urls=(URL_A,), routing="cohort_affinity",
                                    max_concurrency_per_endpoint=slots),
                  genrm_parse_retry_sleep_s=0.0)


async def test_a_freed_slot_goes_to_warm_prefixes_first_then_the_older_cohort(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One endpoint, one slot, two cohorts active. Each cohort's conversation and answer 0 are
    # warm (one call each first); then, behind a call in flight, the queue holds cohort 0's
    # (5, 6) (a new response_1), (0, 2), (0, 3) and cohort 1's (0, 2), in that order.
    fakes = Endpoints()
    config = one_endpoint(1)
    shared = crowd(2)
    groups = [Group(shared), Group(shared)]
    async with open_judge(config, transport=transport(fakes), rng=MaxRng()) as judge:
        for g in (0, 1):
            await judge.judge_pair(pair(g, 0, 1), groups[g])
        fakes.calls.clear()
        fakes.histories.clear()
        async with trio.open_nursery() as nursery:
            for g, i, j in ((0, 0, 7), (0, 5, 6), (0, 0, 2), (0, 0, 3), (1, 0, 2)):
                nursery.start_soon(judge.judge_pair, pair(g, i, j), groups[g])
                await trio.testing.wait_all_tasks_blocked()
    order = [(history[22], r1, r2) for (_, _, r1, r2), (_, _, history)
             in zip(fakes.calls, fakes.histories, strict=True)]
    # warm before cold, in queue order: cohort 0's warm calls, cohort 1's, and last cohort
    # 0's new answer 5 (issued before them all)
    assert order == [("0", "answer 0", "answer 7"), ("0", "answer 0", "answer 2"),
                     ("0", "answer 0", "answer 3"), ("1", "answer 0", "answer 2"),
                     ("0", "answer 5", "answer 6")]
    assert [t for t, *_ in fakes.calls] == [2.0, 3.0, 4.0, 5.0, 6.0]


async def test_a_cohort_left_waiting_past_the_starved_grants_goes_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One slot. Cohort 1 is warm (served at grant 1), then cohort 0 (grant 2) runs one call
    # and queues ten warm ones ahead of cohort 1's: after 8 more grants cohort 1 has waited
    # past STARVED_GRANTS and goes next, before cohort 0's last three.
    fakes = Endpoints()
    config = one_endpoint(1)
    shared = crowd(2)
    groups = [Group(shared), Group(shared)]
    async with open_judge(config, transport=transport(fakes), rng=MaxRng()) as judge:
        for g in (1, 0):
            await judge.judge_pair(pair(g, 0, 1), groups[g])
        fakes.histories.clear()
        async with trio.open_nursery() as nursery:
            for g, j in [(0, 20)] + [(0, j) for j in range(2, 12)] + [(1, 2)]:
                nursery.start_soon(judge.judge_pair, pair(g, 0, j), groups[g])
                await trio.testing.wait_all_tasks_blocked()
    cohorts = [history_of(1) == history for _, _, history in fakes.histories]
    assert cohorts.index(True) == 8 and cohorts.count(True) == 1


async def test_max_concurrency_per_endpoint_holds_under_affinity(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fakes = Endpoints()
    config = cfg("cohort_affinity", affinity_spill_factor=1.0, max_concurrency_per_endpoint=3)
    await judge_groups(config, fakes, groups=5, calls=7, stagger_s=0.25)
    assert len(fakes.hosts) == 35
    assert max(fakes.peak.values()) == 3


async def test_a_retry_goes_to_another_endpoint_and_the_home_is_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fakes = Endpoints(fail_first={"judge-a.test": 1})
    group = Group()
    async with open_judge(cfg("cohort_affinity"), transport=transport(fakes),
                          rng=MaxRng()) as judge:
        await judge.judge_pair(request(0, 0), group)
        home = group.judge_affinity.endpoint
        await judge.judge_pair(request(0, 1), group)
    # first attempt at judge-a (503), its retry at judge-b; the next comparison is home again
    assert fakes.hosts == ["judge-a.test", "judge-b.test", "judge-a.test"]
    assert home is not None and home.url.startswith(URL_A)


async def test_a_cooling_home_is_replaced(autojump_clock: trio.testing.MockClock) -> None:
    fakes = Endpoints(fail_first={"judge-a.test": 1})
    group = Group()
    config = cfg("cohort_affinity", endpoint_failure_threshold=1, endpoint_cooldown_s=60.0)
    async with open_judge(config, transport=transport(fakes), rng=MaxRng()) as judge:
        for k in range(3):
            await judge.judge_pair(request(0, k), group)
    assert fakes.hosts == ["judge-a.test", "judge-b.test", "judge-b.test", "judge-b.test"]
    assert group.judge_affinity.endpoint is not None
    assert group.judge_affinity.endpoint.url.startswith(URL_B)


async def test_a_cancelled_waiter_leaves_no_outstanding_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fakes = Endpoints(service_s=10.0)
    config = cfg("cohort_affinity", max_concurrency_per_endpoint=1, affinity_spill_factor=16.0)
    group = Group(crowd(4))  # crowded: the spill factor keeps every call at judge-a
    async with open_judge(config, transport=transport(fakes), rng=MaxRng()) as judge:
        with trio.move_on_after(1.0):
            async with trio.open_nursery() as nursery:
                for k in range(4):
                    nursery.start_soon(judge.judge_pair, request(0, k), group)
                await trio.testing.wait_all_tasks_blocked()
                waiting = judge.status()["endpoints"][0]
        status = judge.status()
    assert (waiting["in_flight"], waiting["waiting"]) == (1, 3)
    assert all(e["outstanding_tokens"] == 0 and e["waiting"] == 0 and e["in_flight"] == 0
               for e in status["endpoints"])


async def test_compare_calls_without_a_group_are_least_loaded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fakes = Endpoints()
    async with open_judge(cfg("cohort_affinity"), transport=transport(fakes),
                          rng=MaxRng()) as judge:
        async with trio.open_nursery() as nursery:
            for k in range(4):
                nursery.start_soon(judge.judge_pair, request(0, k))
    assert Counter(fakes.hosts) == {"judge-a.test": 2, "judge-b.test": 2}


@pytest.mark.parametrize(("key", "value"), [
    ("routing", "round_robin"), ("affinity_spill_factor", 0.5),
    ("affinity_spill_factor", 16.5), ("affinity_spill_factor", math.nan),
    ("engine", "trt_llm"), ("engine", ""),
])
def test_bad_routing_settings_name_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        JudgeConfig(**{key: value})
    assert info.value.key == f"judge.{key}"


@pytest.mark.parametrize(("concurrent", "warm", "calls", "unshared"), [
    (0.0, 0.8, EVIDENCE, True),  # concurrent calls find nothing of what warm ones find
    (0.39, 0.8, EVIDENCE, True),  # under half
    (0.41, 0.8, EVIDENCE, False),  # over half: it shares
    (0.8, 0.8, EVIDENCE, False),
    (0.0, 0.0, EVIDENCE, False),  # no cache, or nothing reported: never shown
    (0.0, 0.8, EVIDENCE - 1, False),  # too few calls yet
])
def test_sharing_is_judged_from_cached_shares_of_concurrent_and_warm_calls(
    concurrent: float, warm: float, calls: int, unshared: bool,
) -> None:
    sharing = Sharing()
    for _ in range(calls):
        sharing.add(True, round(concurrent * 100), 100)
        sharing.add(False, round(warm * 100), 100)
    assert sharing.unshared() is unshared
