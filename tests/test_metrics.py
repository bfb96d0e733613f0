"""The one metrics function: NeMo Gym 0.7.0 reward-profile names, masking, exactness."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from genrm_trio.metrics import aggregate_metrics, describe, encode_metrics


def row(task: int, rollout: int, reward: Any, **extra: Any) -> dict[str, Any]:
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "reward": reward,
        "mask_sample": False,
        "failure_kind": None,
        **extra,
    }


def masked(task: int, rollout: int) -> dict[str, Any]:
    return {**row(task, rollout, 0.0), "mask_sample": True, "_ng_failure_class": "judge_failed"}


def test_names_and_values_follow_the_reward_profile() -> None:
    rows = [row(0, 0, 1.0), row(0, 1, 3.0), row(1, 0, 2.0), row(1, 1, 6.0)]
    m = aggregate_metrics(rows)
    assert set(m) == {"group_level_metrics", "agent_metrics", "key_metrics"}
    agent = m["agent_metrics"]
    assert agent["mean/reward"] == 3.0
    assert agent["max/reward"] == 6.0
    assert agent["min/reward"] == 1.0
    assert agent["median/reward"] == 2.5
    assert agent["std/reward"] == statistics.stdev([1.0, 3.0, 2.0, 6.0])
    assert agent["num_repeats"] == 2
    assert agent["rollouts/scored"] == 4
    assert agent["rollouts/masked"] == 0
    assert not any(k.startswith("coverage/") for k in agent)
    assert m["key_metrics"] == {"mean/reward": 3.0}
    groups = m["group_level_metrics"]
    assert [g["_ng_task_index"] for g in groups] == [0, 1]
    assert groups[1]["mean/reward"] == 4.0
    assert groups[1]["std/reward"] == statistics.stdev([2.0, 6.0])
    assert groups[0]["num_rollouts"] == 2
    assert groups[0]["expected_num_rollouts"] == 2
    assert groups[0]["missing_num_rollouts"] == 0
    assert groups[0]["reward_profile_completion_pct"] == 100.0
    assert [i["rollout_id"] for i in groups[0]["rollout_infos"]] == ["0:0", "0:1"]
    assert groups[0]["rollout_infos"][1]["reward"] == 3.0


def test_numeric_fields_usage_and_flags() -> None:
    rows = [
        row(0, 0, 1.0, response={"usage": {"output_tokens": 10, "details": {"x": 1}}},
            correct=True, _private=5, prompt_id="p"),
        row(0, 1, 2.0, response={"usage": {"output_tokens": 30}}, correct=False),
    ]
    agent = aggregate_metrics(rows)["agent_metrics"]
    assert agent["mean/output_tokens"] == 20.0
    assert agent["mean/correct"] == 0.5
    assert "mean/_private" not in agent
    assert "mean/mask_sample" not in agent
    assert "mean/prompt_id" not in agent
    assert "mean/details" not in agent


def test_single_value_has_zero_std() -> None:
    m = aggregate_metrics([row(7, 0, 2.5)])
    assert m["agent_metrics"]["std/reward"] == 0.0
    assert m["group_level_metrics"][0]["std/reward"] == 0.0


def test_masked_rows_leave_quality_and_show_as_coverage() -> None:
    rows = [row(0, 0, 1.0), row(0, 1, 3.0), masked(0, 2), masked(1, 0), masked(1, 1)]
    m = aggregate_metrics(rows)
    agent = m["agent_metrics"]
    assert agent["mean/reward"] == 2.0
    assert agent["coverage/measured_rollouts"] == 2
    assert agent["coverage/masked_rollouts"] == 3
    assert agent["coverage/measured_tasks"] == 1
    assert agent["coverage/fully_masked_tasks"] == 1
    assert agent["rollouts/masked"] == 3
    assert agent["num_repeats"] == 3
    assert m["key_metrics"]["coverage/masked_rollouts"] == 3
    assert m["key_metrics"]["mean/reward"] == 2.0
    [group] = m["group_level_metrics"]
    assert group["_ng_task_index"] == 0
    assert group["num_rollouts"] == 2
    assert group["expected_num_rollouts"] == 3
    assert group["missing_num_rollouts"] == 1


def test_all_masked_publishes_no_quality_number() -> None:
    m = aggregate_metrics([masked(0, 0), masked(0, 1)])
    assert m["group_level_metrics"] == []
    assert not any(k.startswith("mean/") for k in m["agent_metrics"])
    assert m["key_metrics"] == {
        "coverage/measured_rollouts": 0,
        "coverage/masked_rollouts": 2,
        "coverage/measured_tasks": 0,
        "coverage/fully_masked_tasks": 1,
    }


def test_empty_input() -> None:
    m = aggregate_metrics([], failed_rollouts=3)
    assert m["group_level_metrics"] == []
    assert m["key_metrics"] == {}
    assert m["agent_metrics"] == {
        "rollouts/scored": 0, "rollouts/masked": 0, "rollouts/failed": 3, "rollouts/dropped": 0,
    }


def test_rows_without_a_usable_reward_are_dropped_and_counted() -> None:
    rows = [row(0, 0, 1.0), row(0, 1, None), row(0, 2, "3"), row(0, 3, math.inf), row(0, 4, True)]
    rows.append({"_ng_task_index": 0, "_ng_rollout_index": 5})
    m = aggregate_metrics(rows)
    assert m["agent_metrics"]["rollouts/dropped"] == 5
    assert m["agent_metrics"]["rollouts/scored"] == 1
    assert m["agent_metrics"]["mean/reward"] == 1.0


def test_missing_coordinates_default_to_zero() -> None:
    m = aggregate_metrics([{"reward": 1.0}, {"reward": 0.0, "_ng_task_index": 2}])
    assert [g["_ng_task_index"] for g in m["group_level_metrics"]] == [0, 2]


def test_mean_is_exactly_rounded() -> None:
    values = [0.1] * 10 + [1e16, -1e16]
    m = aggregate_metrics([row(0, i, v) for i, v in enumerate(values)])
    assert m["agent_metrics"]["mean/reward"] == math.fsum(values) / len(values)


def test_encode_is_canonical_json() -> None:
    m = aggregate_metrics([row(1, 0, 0.5), row(0, 0, 1.5)])
    data = encode_metrics(m)
    assert data.endswith(b"}\n")
    assert json.loads(data) == m
    keys = list(json.loads(data)["agent_metrics"])
    assert keys == sorted(keys)


def test_describe_rejects_empty() -> None:
    try:
        describe([])
    except ValueError:
        return
    raise AssertionError("describe([]) must raise")


rewards = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 3), rewards, st.booleans()), max_size=20
    ),
    st.randoms(use_true_random=False),
)
def test_same_rows_in_any_order_give_identical_bytes(
    spec: list[tuple[int, int, float, bool]], rnd: Any
) -> None:
    # Duplicate coordinates and signed zeros included: the bytes depend on the multiset only.
    rows = [
        masked(task, rollout) if is_masked else row(task, rollout, reward)
        for task, rollout, reward, is_masked in spec
    ]
    shuffled = list(rows)
    rnd.shuffle(shuffled)
    first = encode_metrics(aggregate_metrics(rows))
    assert first == encode_metrics(aggregate_metrics(shuffled))
    # JSON round trip (what offline aggregation reads back) changes nothing either.
    assert first == encode_metrics(aggregate_metrics(json.loads(json.dumps(rows))))
