"""Tests for genrm_trio.identity: canonical JSON, digests and cohort keys."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from genrm_trio.identity import (
    CohortKey,
    canonical_json,
    describe,
    explicit_key,
    legacy_key,
    prompt_digest,
    response_digest,
)


def test_canonical_json_sorts_keys_compacts_and_escapes() -> None:
    obj = {"b": 1, "a": [1, "\u00e9", {"y": None, "x": True}]}
    assert canonical_json(obj) == b'{"a":[1,"\\u00e9",{"x":true,"y":null}],"b":1}'


def test_canonical_json_handles_lone_surrogates_and_astral_characters() -> None:
    assert canonical_json("\ud800") == b'"\\ud800"'
    assert canonical_json("\U0001f600") == b'"\\ud83d\\ude00"'
    # Digests of such responses work and differ from each other.
    assert response_digest({"text": "\ud800"}) != response_digest({"text": "\udc00"})


def test_prompt_digest_is_sha256_of_the_documented_canonical_form() -> None:
    expected = hashlib.sha256(b'{"input":"hi","principle":null}').hexdigest()
    assert prompt_digest("hi", None) == expected
    expected_list = hashlib.sha256(
        b'{"input":[{"content":"hi","role":"user"}],"principle":"be brief"}'
    ).hexdigest()
    assert prompt_digest([{"role": "user", "content": "hi"}], "be brief") == expected_list


def test_digests_are_stable_under_key_order() -> None:
    one = [{"role": "user", "content": "hi", "type": "message"}]
    two = [{"type": "message", "content": "hi", "role": "user"}]
    assert prompt_digest(one, None) == prompt_digest(two, None)
    assert response_digest({"id": "r", "output": []}) == response_digest({"output": [], "id": "r"})


def test_prompt_digest_separates_principles_and_inputs() -> None:
    base = prompt_digest("hi", None)
    assert prompt_digest("hi", "") != base
    assert prompt_digest("hi", "be brief") != base
    assert prompt_digest("hi!", None) != base
    # A string input and the same text as a message list are different prompts on the wire.
    assert prompt_digest([{"role": "user", "content": "hi"}], None) != base


def test_response_digest_is_sha256_of_canonical_json() -> None:
    response = {"output": [{"type": "message"}], "id": "x"}
    assert response_digest(response) == hashlib.sha256(canonical_json(response)).hexdigest()
    assert len(response_digest(response)) == 64


def test_structs_digest_like_their_json() -> None:
    class Message(msgspec.Struct):
        role: str
        content: str

    assert prompt_digest([Message(role="user", content="hi")], None) == prompt_digest(
        [{"role": "user", "content": "hi"}], None
    )


def test_canonical_json_rejects_what_json_cannot_express() -> None:
    with pytest.raises(TypeError):
        canonical_json({"x": object()})


def test_cohort_keys_are_hashable_value_objects() -> None:
    a = explicit_key("g-1", 0)
    b = explicit_key("g-1", 0)
    assert a == b and hash(a) == hash(b)
    table = {a: "cohort"}
    assert table[b] == "cohort"
    assert explicit_key("g-1", 1) != a
    assert explicit_key("g-2", 0) != a
    with pytest.raises(AttributeError):
        a.attempt = 3  # type: ignore[misc]


def test_legacy_key_prefers_task_index_then_prompt_id() -> None:
    digest = "ab" * 32
    assert legacy_key(7, "p", digest, 0) == CohortKey(None, f"task:7:{digest}", 0)
    assert legacy_key(None, "p", digest, 2) == CohortKey(None, f"prompt:p:{digest}", 2)
    assert legacy_key(None, None, digest, 0) == CohortKey(None, f"anon:{digest}", 0)
    # Task index 0 is a real index, not "absent".
    assert legacy_key(0, None, digest, 0).legacy_key == f"task:0:{digest}"


def test_legacy_and_explicit_keys_never_collide() -> None:
    digest = "cd" * 32
    assert legacy_key(None, None, digest, 0) != explicit_key(f"anon:{digest}", 0)
    # Same task, different prompt digests: different cohorts.
    assert legacy_key(1, None, "00" * 32, 0) != legacy_key(1, None, "11" * 32, 0)


def test_describe_is_short_and_safe_for_logs() -> None:
    assert describe(explicit_key("g-1", 2)) == "group 'g-1' attempt 2"
    digest = "0123456789abcdef" * 4
    assert (
        describe(legacy_key(5, None, digest, 1)) == "legacy 'task:5' prompt 0123456789ab attempt 1"
    )
    assert (
        describe(legacy_key(None, None, digest, 0)) == "legacy 'anon' prompt 0123456789ab attempt 0"
    )
    long = describe(explicit_key("x" * 10_000 + "\n forged log line", 0))
    assert len(long) <= 120
    assert "\n" not in long
    sneaky = describe(legacy_key(None, "p\r\nq" * 100, digest, 0))
    assert len(sneaky) <= 120 and "\n" not in sneaky and "\r" not in sneaky
