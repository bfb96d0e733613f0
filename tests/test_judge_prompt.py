"""The plain judge prompt: the template's checks, its rendering, and `serve` refusing a template
that lacks a placeholder (exit 2, one line naming it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from genrm_trio import judge_prompt
from genrm_trio.config import Config, JudgeConfig, load_config
from genrm_trio.errors import ConfigError
from genrm_trio.judge_prompt import (
    DEFAULT_PROMPT,
    DEFAULT_TEMPLATE,
    TemplateError,
    parse_template,
    verdict_schema,
)

HISTORY = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "2+2?"}]
ALL = "${principle} ${conversation} ${response_1} ${response_2}"


def test_default_template_renders_standard_roles_with_everything_in_them() -> None:
    messages = DEFAULT_PROMPT.render(HISTORY, "4", "five", "Judge fairly.")
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert user.startswith("Judge fairly.\n")
    assert "[system]\nbe nice\n\n[user]\n2+2?" in user
    assert "<response_1>\n4\n</response_1>" in user
    assert "<response_2>\nfive\n</response_2>" in user
    assert '{"score_1": <1-5>, "score_2": <1-5>, "ranking": <1-6>}' in user
    assert "$" not in user + messages[0]["content"]


def test_a_template_without_sections_is_one_user_message() -> None:
    prompt = parse_template(f"Compare. {ALL} Costs $$5.")
    messages = prompt.render(HISTORY, "a", "b", "p")
    assert messages == [{"role": "user", "content": (
        "Compare. p [system]\nbe nice\n\n[user]\n2+2? a b Costs $5.")}]


@pytest.mark.parametrize(("text", "problem"), [
    ("${principle} ${conversation} ${response_1}", "missing placeholder ${response_2}"),
    ("${principle} ${conversation} ${response_2}", "missing placeholder ${response_1}"),
    ("${conversation} ${response_1} ${response_2}", "missing placeholder ${principle}"),
    (f"{ALL} ${{reponse_1}}", "unknown placeholder ${reponse_1}"),
    (f"{ALL} costs $5", "invalid '$'"),
    (f"hello\n--- user ---\n{ALL}", "text before the first section line"),
    (f"--- system ---\n{ALL}", "no '--- user ---' section"),
    (f"--- user ---\n{ALL}\n--- user ---\nagain", "appears twice"),
    (f"--- system ---\n{ALL}\n--- user ---\n  \n", "the user message is empty"),
    ("x" * (judge_prompt.MAX_TEMPLATE_CHARS + 1), "over"),
])
def test_bad_templates_are_refused_naming_the_problem(text: str, problem: str) -> None:
    with pytest.raises(TemplateError) as info:
        parse_template(text)
    assert problem in str(info.value)


def test_placeholders_may_sit_in_the_system_message() -> None:
    prompt = parse_template(
        "--- system ---\n${principle}\n--- user ---\n${conversation}|${response_1}|${response_2}")
    messages = prompt.render([{"role": "user", "content": "q"}], "a", "b", "P")
    assert messages == [{"role": "system", "content": "P"},
                        {"role": "user", "content": "[user]\nq|a|b"}]


def test_verdict_schema_requires_the_three_keys_on_their_scales() -> None:
    schema = verdict_schema()
    assert schema["required"] == ["score_1", "score_2", "ranking"]
    assert schema["additionalProperties"] is False
    props = schema["properties"]
    assert isinstance(props, dict)
    assert props["score_1"]["enum"] == [1, 2, 3, 4, 5]
    assert props["ranking"]["enum"] == [1, 2, 3, 4, 5, 6]
    schema["required"] = []  # a fresh copy each time: callers cannot change the next one
    assert verdict_schema()["required"] == ["score_1", "score_2", "ranking"]


def test_template_file_is_checked_at_config_load(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text(DEFAULT_TEMPLATE, encoding="utf-8")
    cfg = load_config(overrides=["judge.prompt=plain", f"judge.prompt_template_file={good}"],
                      env={})
    assert cfg.judge.prompt_template_file == str(good)
    bad = tmp_path / "bad.txt"
    bad.write_text(DEFAULT_TEMPLATE.replace("${response_2}", "(second)"), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["judge.prompt=plain", f"judge.prompt_template_file={bad}"],
                    env={})
    assert info.value.key == "judge.prompt_template_file"
    assert "missing placeholder ${response_2}" in str(info.value)


def test_template_file_needs_the_plain_prompt_and_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only used with judge.prompt: plain"):
        JudgeConfig(prompt_template_file=str(tmp_path / "t.txt"))
    with pytest.raises(ConfigError, match="cannot read"):
        JudgeConfig(prompt="plain", prompt_template_file=str(tmp_path / "missing.txt"))


@pytest.mark.parametrize(("key", "value"), [
    ("judge.prompt", "genrm"), ("judge.structured_output", "grammar"), ("judge.seed", "random"),
    ("judge.max_concurrency_per_endpoint", "0"), ("unparseable_verdict_policy", "skip"),
])
def test_new_keys_reject_bad_values_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}={value}"], env={})
    assert info.value.key == key


def test_new_keys_defaults() -> None:
    cfg = Config()
    assert (cfg.judge.prompt, cfg.judge.prompt_template_file, cfg.judge.structured_output,
            cfg.judge.seed, cfg.judge.max_concurrency_per_endpoint,
            cfg.unparseable_verdict_policy) == ("genrm_roles", None, "none", "none", None,
                                                "default")


def test_serve_refuses_a_template_missing_a_placeholder(tmp_path: Path) -> None:
    bad = tmp_path / "judge.txt"
    bad.write_text("--- user ---\n${principle}\n${conversation}\n${response_1}\n",
                   encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
         "--set", "judge.prompt=plain", "--set", f"judge.prompt_template_file={bad}"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "judge.prompt_template_file" in lines[0]
    assert "${response_2}" in lines[0]
