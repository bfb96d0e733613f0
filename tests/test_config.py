"""Configuration loading: file shapes, overrides, precedence, validation, summary."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from genrm_trio.config import (
    DEFAULT_PRINCIPLE,
    Config,
    JudgeConfig,
    TracingConfig,
    config_summary,
    format_override,
    load_config,
)
from genrm_trio.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def error_for(
    *, text: str | None = None, tmp_path: Path | None = None, **kwargs: Any
) -> ConfigError:
    path = write(tmp_path, text) if text is not None and tmp_path is not None else None
    with pytest.raises(ConfigError) as info:
        load_config(path, env=kwargs.pop("env", {}), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert info.value.key in message
    return info.value


# --------------------------------------------------------------------------- shipped files


def test_default_yaml_is_exactly_the_defaults() -> None:
    assert load_config(CONFIGS / "default.yaml", env={}) == Config()


def test_default_yaml_lists_every_key_with_a_comment() -> None:
    commented: dict[str, bool] = {}
    parent = ""
    for line in (CONFIGS / "default.yaml").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^( *)([a-z_]+):(.*)$", line)
        if match is None:
            continue
        indent, name, rest = match.groups()
        if not indent:
            parent = name
            commented[name] = "#" in rest
        elif parent in ("judge", "tracing") and len(indent) == 2:
            commented[f"{parent}.{name}"] = "#" in rest
    expected = {*Config.__struct_fields__, *(f"judge.{n}" for n in JudgeConfig.__struct_fields__),
                *(f"tracing.{n}" for n in TracingConfig.__struct_fields__)}
    assert set(commented) == expected
    assert [key for key, has in commented.items() if not has] == []


def test_nemo_gym_file_loads_unchanged() -> None:
    cfg = load_config(CONFIGS / "genrm_compare.yaml", env={})
    assert cfg.num_rollouts_per_prompt == 8
    assert cfg.judge_request_timeout_s == 600.0
    assert cfg.comparison_strategy == "circular"
    assert cfg.genrm_parse_retries == 3
    assert cfg.genrm_parse_retry_sleep_s == 0.2
    # The request template's `input: []` is dropped: input is built per comparison.
    assert cfg.genrm_responses_create_params == {
        "max_output_tokens": 16384,
        "temperature": 0.6,
        "top_p": 0.95,
    }
    # NeMo-only keys change nothing else.
    assert cfg == Config(
        num_rollouts_per_prompt=8,
        judge_request_timeout_s=600.0,
    )


# --------------------------------------------------------------------------- file shapes

NEMO_SERVER = """\
      entrypoint: app.py
      genrm_model_server:
        type: responses_api_models
        name: genrm_model
      genrm_responses_create_params:
        input: []
        max_output_tokens: 512
      num_rollouts_per_prompt: 4
      top_percentile: 0.5
      domain: rlhf
      verified: false
      description: d
      value: v
      name: genrm_compare
"""


def test_nemo_block_under_any_instance_name(tmp_path: Path) -> None:
    text = "my_judge_env:\n  resources_servers:\n    genrm_compare:\n" + NEMO_SERVER
    text += "policy_model:\n  responses_api_models:\n    policy:\n      entrypoint: app.py\n"
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.num_rollouts_per_prompt == 4
    assert cfg.top_percentile == 0.5
    assert cfg.genrm_responses_create_params == {"max_output_tokens": 512}


def test_nemo_block_with_resources_servers_at_top_level(tmp_path: Path) -> None:
    text = "resources_servers:\n  renamed_server:\n" + NEMO_SERVER.replace("      ", "    ")
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.num_rollouts_per_prompt == 4


def test_nemo_server_mapping_as_the_whole_file(tmp_path: Path) -> None:
    text = "\n".join(line[6:] for line in NEMO_SERVER.splitlines())
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.num_rollouts_per_prompt == 4
    assert cfg.top_percentile == 0.5


def test_nemo_host_and_port_map_onto_ours_and_null_keeps_default(tmp_path: Path) -> None:
    text = "g:\n  resources_servers:\n    genrm_compare:\n" + NEMO_SERVER
    cfg = load_config(write(tmp_path, text + "      host: 0.0.0.0\n      port: 9100\n"), env={})
    assert (cfg.host, cfg.port) == ("0.0.0.0", 9100)
    cfg = load_config(write(tmp_path, text + "      host: null\n      port: null\n"), env={})
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8000)


def test_nemo_block_may_carry_our_keys(tmp_path: Path) -> None:
    text = "g:\n  resources_servers:\n    genrm_compare:\n" + NEMO_SERVER
    text += "      judge:\n        base_urls: [http://judge:8000/v1]\n        api: chat\n"
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.judge.base_urls == ("http://judge:8000",)
    assert cfg.judge.api == "chat"


def test_unknown_key_inside_nemo_block(tmp_path: Path) -> None:
    text = (
        "g:\n  resources_servers:\n    genrm_compare:\n" + NEMO_SERVER + "      top_percentil: 1\n"
    )
    err = error_for(text=text, tmp_path=tmp_path)
    assert err.key == "top_percentil"
    assert "unknown key" in str(err)
    assert "g.resources_servers.genrm_compare" in str(err)


def test_two_nemo_blocks_are_ambiguous(tmp_path: Path) -> None:
    text = "a:\n  resources_servers:\n    genrm_compare:\n" + NEMO_SERVER
    text += "b:\n  resources_servers:\n    genrm_compare:\n" + NEMO_SERVER
    err = error_for(text=text, tmp_path=tmp_path)
    assert "more than one" in err.problem


def test_file_without_our_keys_or_a_block(tmp_path: Path) -> None:
    err = error_for(text="num_rollout_per_prompt: 8\n", tmp_path=tmp_path)
    assert err.key == "num_rollout_per_prompt"
    assert "unknown key" in err.problem


def test_flat_file_with_nested_judge(tmp_path: Path) -> None:
    text = "num_rollouts_per_prompt: 16\njudge:\n  base_urls: [http://a:1/, https://b/v1]\n"
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.num_rollouts_per_prompt == 16
    assert cfg.judge.base_urls == ("http://a:1", "https://b")
    assert cfg.judge.api == "responses"


def test_empty_file_and_empty_judge_mean_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == Config()
    assert load_config(write(tmp_path, "judge:\n  # base_urls: []\n"), env={}) == Config()


def test_no_path_means_defaults() -> None:
    assert load_config(None, env={}) == Config()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("port: [1\n", "invalid YAML at line"),
        ("- 1\n- 2\n", "must be a mapping"),
        ("port: 1\nport: 2\n", "duplicate key at line 2"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, needle: str) -> None:
    err = error_for(text=text, tmp_path=tmp_path)
    assert needle in str(err)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing, env={})
    assert str(missing) in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- overrides


def test_set_dotted_key_and_yaml_values() -> None:
    cfg = load_config(
        overrides=[
            "judge.base_urls=[http://a:8000/v1, http://b:8000/]",
            "judge.api=chat",
            "cohort_result_ttl_s=null",
            "num_rollouts_per_prompt=8",
            "use_principle=true",
            "genrm_responses_create_params.temperature=0.1",
            "genrm_responses_create_params.extra_body.top_k=20",
        ],
        env={},
    )
    assert cfg.judge.base_urls == ("http://a:8000", "http://b:8000")
    assert cfg.judge.api == "chat"
    assert cfg.cohort_result_ttl_s is None
    assert cfg.num_rollouts_per_prompt == 8
    assert cfg.use_principle is True
    assert cfg.genrm_responses_create_params == {
        "max_output_tokens": 16384,
        "temperature": 0.1,
        "top_p": 0.95,
        "extra_body": {"top_k": 20},
    }


def test_cli_serve_flags_map_onto_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "judge:\n  api: chat\n")
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002/v1"]
    cfg = load_config(
        path,
        overrides=["host=127.0.0.2", "port=0", format_override("judge.base_urls", urls)],
        env={},
    )
    assert (cfg.host, cfg.port) == ("127.0.0.2", 0)
    assert cfg.judge.base_urls == ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
    assert cfg.judge.api == "chat"  # a dotted override keeps the file's sibling keys


def test_set_whole_judge_mapping_merges_with_file(tmp_path: Path) -> None:
    path = write(tmp_path, "judge:\n  base_urls: [http://x]\n")
    cfg = load_config(path, overrides=["judge={api: chat}"], env={})
    assert cfg.judge.base_urls == ("http://x",)
    assert cfg.judge.api == "chat"


def test_set_whole_params_mapping_replaces() -> None:
    cfg = load_config(overrides=["genrm_responses_create_params={max_output_tokens: 10}"], env={})
    assert cfg.genrm_responses_create_params == {"max_output_tokens": 10}


def test_set_value_that_is_not_yaml_is_a_plain_string() -> None:
    cfg = load_config(overrides=["default_principle=Judge: be fair: always"], env={})
    assert cfg.default_principle == "Judge: be fair: always"


def test_later_set_wins() -> None:
    assert load_config(overrides=["port=1", "port=2"], env={}).port == 2


@pytest.mark.parametrize(
    ("item", "key", "needle"),
    [
        ("port", "port", "expected KEY=VALUE"),
        ("=3", "=3", "expected KEY=VALUE"),
        ("bogus=1", "bogus", "unknown key"),
        ("judge.bogus=1", "judge.bogus", "unknown key"),
        ("judge.api.x=1", "judge.api.x", "unknown key"),
        ("port.x=1", "port.x", "unknown key"),
        ("judge..api=1", "judge..api", "malformed key"),
        ("port=abc", "port", "expected int, got str 'abc'"),
        ("judge.api=soap", "judge.api", "expected one of 'responses', 'chat'"),
    ],
)
def test_bad_set(item: str, key: str, needle: str) -> None:
    err = error_for(overrides=[item])
    assert err.key == key
    assert needle in err.problem


def test_set_error_names_its_source() -> None:
    err = error_for(overrides=["port=70000"])
    assert err.key == "port"
    assert "--set 'port=70000'" in str(err)


# --------------------------------------------------------------------------- environment


def test_env_overrides_with_nesting_and_yaml_values() -> None:
    env = {
        "GENRM_TRIO_JUDGE__API": "chat",
        "GENRM_TRIO_JUDGE__BASE_URLS": "[http://e:1/v1]",
        "GENRM_TRIO_MAX_ACTIVE_COHORTS": "12",
        "GENRM_TRIO_STATE_DIR": "null",
        "UNRELATED": "x",
    }
    cfg = load_config(env=env)
    assert cfg.judge.api == "chat"
    assert cfg.judge.base_urls == ("http://e:1",)
    assert cfg.max_active_cohorts == 12
    assert cfg.state_dir is None


def test_precedence_file_then_env_then_set(tmp_path: Path) -> None:
    path = write(tmp_path, "port: 1\nhost: 10.0.0.1\nlog_level: ERROR\n")
    env = {"GENRM_TRIO_PORT": "2", "GENRM_TRIO_HOST": "10.0.0.2"}
    cfg = load_config(path, overrides=["port=3"], env=env)
    assert (cfg.port, cfg.host, cfg.log_level) == (3, "10.0.0.2", "ERROR")
    assert load_config(path, env=env).port == 2
    assert load_config(path, env={}).port == 1


def test_env_default_is_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENRM_TRIO_NUM_ROLLOUTS_PER_PROMPT", "5")
    assert load_config().num_rollouts_per_prompt == 5


def test_env_errors_name_the_variable() -> None:
    err = error_for(env={"GENRM_TRIO_PORTT": "1"})
    assert err.key == "portt"
    assert "GENRM_TRIO_PORTT" in str(err)
    err = error_for(env={"GENRM_TRIO_JUDGE__MAX_CONNECTIONS_PER_CLIENT": "64"})
    assert err.key == "judge.max_connections_per_client"
    assert "GENRM_TRIO_JUDGE__MAX_CONNECTIONS_PER_CLIENT" in str(err)


# --------------------------------------------------------------------------- validation

FINITE_POSITIVE = [None, 0, -1, ".inf", "-.inf", ".nan"]
DEADLINES = [
    "cohort_collection_timeout_s",
    "cohort_evaluation_timeout_s",
    "judge_request_timeout_s",
]

INVALID: list[tuple[str, Any]] = [
    *[(key, value) for key in DEADLINES for value in FINITE_POSITIVE],
    *[("cohort_result_ttl_s", v) for v in (0, -1, ".inf", ".nan")],
    *[("max_terminal_cohorts", v) for v in (0, -1, 1.5, None)],
    *[("num_rollouts_per_prompt", v) for v in (0, -3, "many", True)],
    ("genrm_parse_retries", -1),
    *[("genrm_parse_retry_sleep_s", v) for v in (-0.1, ".inf", ".nan")],
    ("comparison_strategy", "round_robin"),
    *[("num_judges_per_comparison", v) for v in (0, -1)],
    ("aggregator_method", "mean"),
    *[("top_percentile", v) for v in (0, -0.1, 1.01, ".nan", ".inf")],
    *[
        (key, v)
        for key in (
            "group_reasoning_length_penalty_coeff",
            "group_answer_length_penalty_coeff",
            "group_style_penalty_coeff",
        )
        for v in (-0.5, ".nan")
    ],
    *[
        (key, ".nan")
        for key in ("reasoning_bonus", "answer_bonus", "default_score", "default_ranking")
    ],
    ("use_principle", "maybe"),
    ("genrm_responses_create_params", "[1, 2]"),
    ("host", "''"),
    *[("port", v) for v in (-1, 65536, "http")],
    *[("judge_max_concurrency", v) for v in (0, -1)],
    *[("judge_retry_backoff_max_s", v) for v in (-1, ".inf", ".nan")],
    *[("judge_schedule", v) for v in ("lazy",)],
    *[("judge_order", v) for v in ("fifo", "", 3)],
    *[("max_request_bytes", v) for v in (0, -1)],
    *[("max_json_values", v) for v in (999, 0, -1, 1.5, None, "many")],
    *[("shutdown_grace_s", v) for v in (0, -1, ".inf", ".nan", None)],
    ("state_dir", "''"),
    *[("max_active_cohorts", v) for v in (0, -1)],
    *[("max_active_bytes", v) for v in (0, -1, "lots", "AUTO", 1.5, "[1]")],
    *[("memory_limit_bytes", v) for v in (0, -1, None, "lots", 2.5)],
    *[("probe_port", v) for v in (-1, 65536, "http", 8000)],  # 8000: the default port
    *[("log_level", v) for v in ("TRACE", "CRITICAL", 10)],
    *[("judge.max_connections_per_client", v) for v in (0, 17, -1)],
    ("judge.endpoint_failure_threshold", 0),
    *[("judge.endpoint_cooldown_s", v) for v in (-1, ".nan")],
    ("judge.api", "grpc"),
    ("judge.plugin_flavor", "gevent"),
    ("judge.api_key_env", "''"),
    ("judge.api_key_env", "OPENAI_API_KEY=sk-123"),
    ("judge.base_urls", "http://single-string-not-a-list"),
    *[("verdict_reuse", v) for v in ("always", "", True, None)],
    *[("verdict_cache_max_entries", v) for v in (0, -1, 16_777_217, 1.5, None, "many")],
]


def yaml_text(value: Any) -> str:
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


@pytest.mark.parametrize(("key", "value"), INVALID)
def test_invalid_value_via_set_names_the_key(key: str, value: Any) -> None:
    err = error_for(overrides=[f"{key}={yaml_text(value)}"])
    assert err.key == key
    assert str(err).startswith(f"config key {key!r}: ")


@pytest.mark.parametrize(("key", "value"), [kv for kv in INVALID if "." not in kv[0]])
def test_invalid_value_in_file_names_the_key(tmp_path: Path, key: str, value: Any) -> None:
    err = error_for(text=f"{key}: {yaml_text(value)}\n", tmp_path=tmp_path)
    assert err.key == key


@pytest.mark.parametrize(
    ("url", "key"),
    [
        ("ftp://judge", "judge.base_urls[0]"),
        ("judge:8000", "judge.base_urls[0]"),
        ("http://", "judge.base_urls[0]"),
        ("http://judge:99999", "judge.base_urls[0]"),
        ("http://judge/v1?x=1", "judge.base_urls[0]"),
    ],
)
def test_invalid_base_url_names_its_index(url: str, key: str) -> None:
    err = error_for(overrides=[format_override("judge.base_urls", [url])])
    assert err.key == key
    err = error_for(overrides=[format_override("judge.base_urls", ["http://ok", url])])
    assert err.key == key.replace("[0]", "[1]")


def test_base_url_of_wrong_type_names_its_index() -> None:
    err = error_for(overrides=["judge.base_urls=[http://ok, 3]"])
    assert err.key == "judge.base_urls[1]"


@pytest.mark.parametrize(
    ("url", "normalised"),
    [
        ("http://judge:8000", "http://judge:8000"),
        ("http://judge:8000/", "http://judge:8000"),
        ("http://judge:8000/v1", "http://judge:8000"),
        ("http://judge:8000/v1/", "http://judge:8000"),
        ("https://host/openai/v1", "https://host/openai"),
        ("https://host/v10", "https://host/v10"),
    ],
)
def test_base_urls_are_normalised(url: str, normalised: str) -> None:
    assert JudgeConfig(base_urls=(url,)).base_urls == (normalised,)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cohort_result_ttl_s", None),
        ("cohort_result_ttl_s", 0.5),
        ("top_percentile", 1),
        ("genrm_parse_retries", 0),
        ("genrm_parse_retry_sleep_s", 0),
        ("judge_retry_backoff_max_s", 0),
        ("port", 0),
        ("port", 65535),
        ("max_active_cohorts", 1),
        ("max_active_bytes", None),
        ("max_active_bytes", "auto"),
        ("max_active_bytes", 1),
        ("memory_limit_bytes", "auto"),
        ("memory_limit_bytes", 1),
        ("probe_port", 0),
        ("probe_port", 9000),
        ("probe_port", None),
        ("num_rollouts_per_prompt", 1),
        ("judge.max_connections_per_client", 1),
        ("judge.max_connections_per_client", 16),
        ("reasoning_bonus", -0.5),
        ("verdict_reuse", "off"),
        ("verdict_reuse", "global"),
        ("verdict_cache_max_entries", 1),
        ("verdict_cache_max_entries", 16_777_216),
    ],
)
def test_boundary_values_are_accepted(key: str, value: Any) -> None:
    cfg = load_config(overrides=[f"{key}={yaml_text(value)}"], env={})
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    assert node == value


def test_verdict_reuse_off_reads_as_off_though_yaml_says_false(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "verdict_reuse: off\n"), env={}).verdict_reuse == "off"
    assert load_config(overrides=["verdict_reuse=off"], env={}).verdict_reuse == "off"
    assert load_config(env={"GENRM_TRIO_VERDICT_REUSE": "off"}).verdict_reuse == "off"


def test_ints_are_accepted_for_float_keys() -> None:
    cfg = load_config(overrides=["shutdown_grace_s=7"], env={})
    assert cfg.shutdown_grace_s == 7


def test_log_level_is_case_insensitive() -> None:
    assert load_config(overrides=["log_level=warning"], env={}).log_level == "WARNING"


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError) as info:
        Config(cohort_evaluation_timeout_s=math.nan)
    assert info.value.key == "cohort_evaluation_timeout_s"
    with pytest.raises(ConfigError) as info:
        Config(judge=JudgeConfig(max_connections_per_client=32))
    assert info.value.key == "judge.max_connections_per_client"


def test_unknown_nested_key_in_file(tmp_path: Path) -> None:
    err = error_for(text="judge:\n  base_url: [http://x]\n", tmp_path=tmp_path)
    assert err.key == "judge.base_url"
    assert err.problem == "unknown key"


def test_wrong_type_message_shows_the_value(tmp_path: Path) -> None:
    err = error_for(text="max_active_cohorts: lots\n", tmp_path=tmp_path)
    assert str(err) == "config key 'max_active_cohorts': expected int | null, got str 'lots'"


@pytest.mark.parametrize(("text", "message"), [
    ("max_active_bytes: lots", "expected an integer, 'auto' or null, got str 'lots'"),
    ("max_active_bytes: 1.5", "expected an integer, 'auto' or null, got float 1.5"),
    ("max_active_bytes: [1]", "expected an integer, 'auto' or null, got list [1]"),
    ("memory_limit_bytes: null", "expected an integer or 'auto', got null"),
    ("memory_limit_bytes: true", "expected an integer or 'auto', got bool True"),
])
def test_auto_keys_say_what_they_take(tmp_path: Path, text: str, message: str) -> None:
    key = text.split(":")[0]
    assert str(error_for(text=text + "\n", tmp_path=tmp_path)) == (
        f"config key {key!r}: {message}")


def test_auto_keys_are_checked_on_direct_construction_too() -> None:
    with pytest.raises(ConfigError) as info:
        Config(max_active_bytes="lots")  # type: ignore[arg-type]
    assert str(info.value) == (
        "config key 'max_active_bytes': expected an integer, 'auto' or null, got 'lots'")
    with pytest.raises(ConfigError) as info:
        Config(memory_limit_bytes=0)
    assert info.value.key == "memory_limit_bytes"


def test_probe_port_may_not_be_the_main_port_but_both_may_be_zero() -> None:
    err = error_for(overrides=["port=9100", "probe_port=9100"])
    assert str(err) == ("config key 'probe_port': must differ from port (9100) "
                        "(from --set 'probe_port=9100')")
    assert load_config(overrides=["port=0", "probe_port=0"], env={}).probe_port == 0


def test_defaults_of_the_safe_by_default_keys() -> None:
    cfg = Config()
    assert (cfg.max_active_bytes, cfg.memory_limit_bytes, cfg.probe_port) == (
        "auto", "auto", None)


# --------------------------------------------------------------------------- summary


def test_summary_is_plain_json_without_secrets() -> None:
    cfg = load_config(
        overrides=[
            "judge.api_key_env=JUDGE_TOKEN",
            "judge.base_urls=[http://user:hunter2@judge:8000/v1]",
            "genrm_responses_create_params.extra_headers={Authorization: Bearer sk-live}",
        ],
        env={"JUDGE_TOKEN": "sk-very-secret"},
    )
    summary = config_summary(cfg)
    text = json.dumps(summary)
    assert "sk-very-secret" not in text
    assert "hunter2" not in text
    assert "sk-live" not in text
    assert summary["judge"]["api_key_env"] == "JUDGE_TOKEN"
    assert summary["judge"]["base_urls"] == ["http://user:***@judge:8000"]
    assert summary["num_rollouts_per_prompt"] == 1
    assert summary["cohort_result_ttl_s"] == 3600.0
    assert summary["default_principle"] == DEFAULT_PRINCIPLE
    assert set(summary) == set(Config.__struct_fields__)
    assert json.loads(text) == summary


# --------------------------------------------------------------------------- partial cohorts


@pytest.mark.parametrize(("overrides", "key", "needle"), [
    (["incomplete_cohort_policy=judge_all"], "incomplete_cohort_policy", "'judge_present'"),
    (["incomplete_cohort_policy=judge_present", "num_rollouts_per_prompt=2"],
     "incomplete_cohort_policy", "needs num_rollouts_per_prompt >= 3, got 2"),
    (["num_rollouts_per_prompt=8", "min_cohort_members=1"], "min_cohort_members",
     "must be >= 2, got 1"),
    (["num_rollouts_per_prompt=8", "min_cohort_members=8"], "min_cohort_members",
     "must be <= num_rollouts_per_prompt - 1 (7), got 8"),
    (["num_rollouts_per_prompt=8", "min_cohort_members=2.5"], "min_cohort_members",
     "expected int | null"),
    (["num_rollouts_per_prompt=8", "min_cohort_members=true"], "min_cohort_members",
     "expected int | null"),
    # Checked against N whatever the policy: a bound that depends on the policy would let a
    # bad value through until someone turned the policy on.
    (["num_rollouts_per_prompt=2", "min_cohort_members=2"], "min_cohort_members",
     "must be <= num_rollouts_per_prompt - 1 (1), got 2"),
])
def test_partial_cohort_keys_are_validated_against_the_cohort_size(
        overrides: list[str], key: str, needle: str) -> None:
    err = error_for(overrides=overrides)
    assert err.key == key
    assert needle in str(err), str(err)


@pytest.mark.parametrize(("overrides", "minimum"), [
    (["num_rollouts_per_prompt=3", "incomplete_cohort_policy=judge_present"], 2),
    (["num_rollouts_per_prompt=8", "incomplete_cohort_policy=judge_present"], 7),
    (["num_rollouts_per_prompt=8", "incomplete_cohort_policy=judge_present",
      "min_cohort_members=2"], 2),
    (["num_rollouts_per_prompt=8", "min_cohort_members=7"], 7),
])
def test_partial_cohort_boundaries_are_accepted(overrides: list[str], minimum: int) -> None:
    from genrm_trio.config import min_members_present

    cfg = load_config(overrides=overrides, env={})
    assert min_members_present(cfg) == minimum


def test_the_partial_cohort_policy_is_off_by_default_and_shown_in_the_summary() -> None:
    from genrm_trio.config import config_summary

    cfg = Config()
    assert (cfg.incomplete_cohort_policy, cfg.min_cohort_members) == ("fail", None)
    summary = config_summary(load_config(overrides=[
        "num_rollouts_per_prompt=4", "incomplete_cohort_policy=judge_present",
        "min_cohort_members=3"], env={}))
    assert summary["incomplete_cohort_policy"] == "judge_present"
    assert summary["min_cohort_members"] == 3
