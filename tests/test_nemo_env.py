"""The block NeMo Gym's `gym env start` hands a launched server (genrm_trio/nemo_env.py), and the
entries that read it: `genrm-trio serve --from-nemo-gym-env` (resources_servers/genrm_trio/app.py)
and `genrm-trio nemo-gym-external` (external.py). Bad variables stop them with exit code 2 and one
line naming the variable; a good block is served on its own host and port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from genrm_trio.config import JudgeConfig, load_config, load_config_block
from genrm_trio.errors import ConfigError
from genrm_trio.nemo_env import (
    CONFIG_DICT_VAR,
    CONFIG_PATH_VAR,
    check_external_block,
    check_served_address,
    read_nemo_env,
)
from tests.process_helpers import wait_for_line

REPO = Path(__file__).resolve().parent.parent
ENTRY_DIR = REPO / "resources_servers" / "genrm_trio"


def nemo_config(block: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A resolved NeMo Gym config with ``block`` as the genrm_trio resources server."""
    return {
        "head_server": {"host": "127.0.0.1", "port": 11000},
        "genrm_rs": {"resources_servers": {"genrm_trio": block}},
        "policy_model": {"responses_api_models": {"openai_model": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": 12001}}},
        "agent": {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py", "host": "127.0.0.1", "port": 12002,
            "resources_server": {"type": "resources_servers", "name": "genrm_rs"}}}},
        **extra,
    }


def env_for(config: dict[str, Any], path: str = "genrm_rs", **more: str) -> dict[str, str]:
    """The two variables as `gym env start` sets them (YAML, as OmegaConf.to_yaml writes it)."""
    return {CONFIG_DICT_VAR: yaml.safe_dump(config, sort_keys=False), CONFIG_PATH_VAR: path,
            **more}


BLOCK: dict[str, Any] = {"entrypoint": "app.py", "domain": "rlhf", "host": "127.0.0.1",
                         "port": 16661, "num_rollouts_per_prompt": 8}


def error_for(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        read_nemo_env(env)
    assert "\n" not in str(info.value)
    return info.value


# --------------------------------------------------------------------------- the pure function


def test_host_port_and_keys_of_the_block() -> None:
    found = read_nemo_env(env_for(nemo_config(BLOCK)))
    assert (found.top_level_key, found.server_name) == ("genrm_rs", "genrm_trio")
    assert (found.host, found.port, found.url) == ("127.0.0.1", 16661, "http://127.0.0.1:16661")
    assert found.where == "genrm_rs.resources_servers.genrm_trio"
    assert found.judge_server is None
    cfg = load_config_block(found.config_block(), found.where, env={})
    assert (cfg.host, cfg.port, cfg.num_rollouts_per_prompt) == ("127.0.0.1", 16661, 8)


def test_the_config_dict_may_be_json() -> None:
    env = {CONFIG_DICT_VAR: json.dumps(nemo_config({**BLOCK, "host": "10.0.0.7", "port": 9})),
           CONFIG_PATH_VAR: "genrm_rs"}
    found = read_nemo_env(env)
    assert (found.host, found.port) == ("10.0.0.7", 9)


def test_ipv6_host_is_bracketed_in_the_url() -> None:
    found = read_nemo_env(env_for(nemo_config({**BLOCK, "host": "::1"})))
    assert found.url == "http://[::1]:16661"


def test_a_genrm_compare_block_loads_as_from_the_file() -> None:
    """NeMo Gym's genrm_compare block, launched with host and port filled in, gives the same
    config as the YAML file (configs/genrm_compare.yaml) it comes from."""
    doc = yaml.safe_load((REPO / "configs" / "genrm_compare.yaml").read_text())
    block = {**doc["genrm_compare"]["resources_servers"]["genrm_compare"],
             "host": "127.0.0.1", "port": 18000}
    config = {**doc, "genrm_compare": {"resources_servers": {"genrm_compare": block}}}
    config["genrm_model"]["responses_api_models"]["genrm_model"].update(
        host="127.0.0.1", port=18001, model="some/genrm")
    found = read_nemo_env(env_for(config, "genrm_compare"))
    cfg = load_config_block(found.config_block(), found.where, env={})
    from_file = load_config(REPO / "configs" / "genrm_compare.yaml", env={})
    # Its genrm_model_server reference decides the judge; everything else is as from the file.
    judge = JudgeConfig(base_urls=("http://127.0.0.1:18001",))
    assert found.judge_server == "genrm_model"
    assert cfg == msgspec.structs.replace(from_file, host="127.0.0.1", port=18000, judge=judge)


@pytest.mark.parametrize("missing", [CONFIG_DICT_VAR, CONFIG_PATH_VAR])
@pytest.mark.parametrize("value", [None, "", "  "])
def test_missing_variables(missing: str, value: str | None) -> None:
    env = env_for(nemo_config(BLOCK))
    if value is None:
        del env[missing]
    else:
        env[missing] = value
    err = error_for(env)
    assert err.key == missing
    assert "not set" in err.problem and "gym env start" in err.problem


@pytest.mark.parametrize(("text", "problem"), [
    ('{"genrm_rs": {"resources_servers": [1, 2', "not valid YAML at line 1"),
    ("a: b: c", "not valid YAML"),
    ("- genrm_rs\n- other\n", "must be a mapping of top-level keys, got list"),
    ("just text", "must be a mapping of top-level keys, got str"),
])
def test_malformed_config_dict(text: str, problem: str) -> None:
    err = error_for({CONFIG_DICT_VAR: text, CONFIG_PATH_VAR: "genrm_rs"})
    assert err.key == CONFIG_DICT_VAR
    assert problem in err.problem


def test_path_not_in_the_config_dict() -> None:
    err = error_for(env_for(nemo_config(BLOCK), "genrm_compare_resources_server"))
    assert err.key == CONFIG_PATH_VAR
    assert "'genrm_compare_resources_server' is not a top-level key" in err.problem
    assert "genrm_rs" in err.problem  # the keys it has


@pytest.mark.parametrize(("path", "kind"), [
    ("agent", "responses_api_agents"), ("policy_model", "responses_api_models"),
])
def test_block_that_is_not_a_resources_server(path: str, kind: str) -> None:
    err = error_for(env_for(nemo_config(BLOCK), path))
    assert err.key == f"{CONFIG_DICT_VAR}.{path}"
    assert f"is a {kind} block, not a resources_servers block" in err.problem


@pytest.mark.parametrize("top", ["text", [], {}, {"resources_servers": "x"},
                                 {"resources_servers": {"genrm_trio": [1]}}])
def test_path_that_holds_no_server_mapping(top: Any) -> None:
    config = nemo_config(BLOCK)
    config["genrm_rs"] = top
    err = error_for(env_for(config))
    assert err.key.startswith(f"{CONFIG_DICT_VAR}.genrm_rs")
    assert "expected a" in err.problem


@pytest.mark.parametrize(("change", "key"), [
    ({"host": None}, "host"), ({"port": None}, "port"), ({"port": "8000"}, "port"),
    ({"port": True}, "port"), ({"host": ""}, "host"),
])
def test_host_and_port_must_be_set(change: dict[str, Any], key: str) -> None:
    err = error_for(env_for(nemo_config({**BLOCK, **change})))
    assert err.key == f"{CONFIG_DICT_VAR}.genrm_rs.resources_servers.genrm_trio.{key}"
    assert "not set" in err.problem


def test_unknown_key_in_the_block_names_the_block() -> None:
    found = read_nemo_env(env_for(nemo_config({**BLOCK, "top_percentil": 0.5})))
    with pytest.raises(ConfigError) as info:
        load_config_block(found.config_block(), found.where, env={})
    assert info.value.key == "top_percentil"
    assert "unknown key (in genrm_rs.resources_servers.genrm_trio)" in str(info.value)


def test_environment_and_set_still_override_the_block() -> None:
    found = read_nemo_env(env_for(nemo_config(BLOCK)))
    cfg = load_config_block(found.config_block(), found.where, ["top_percentile=0.5"],
                            env={"GENRM_TRIO_NUM_ROLLOUTS_PER_PROMPT": "4"})
    assert (cfg.num_rollouts_per_prompt, cfg.top_percentile) == (4, 0.5)


# --------------------------------------------------------------------------- interpolations


def test_interpolations_are_resolved_in_our_keys() -> None:
    """`gym env start` passes the config with ${...} unresolved (OmegaConf.to_yaml)."""
    block = {**BLOCK, "num_rollouts_per_prompt": "${rollouts.n}",
             "default_principle": "judge for ${team}, strictly",
             "cohort_collection_timeout_s": "${oc.env:COLLECT_S,90}",
             "judge_request_timeout_s": "${oc.env:JUDGE_S}",
             "genrm_responses_create_params": {"max_output_tokens": "${lists.0}"},
             "port": "${ports.genrm}",
             "description": "${oc.decode:left alone, NeMo-only key}"}
    config = nemo_config(block, rollouts={"n": 16}, team="rl", lists=[512],
                         ports={"genrm": 16662})
    found = read_nemo_env(env_for(config, JUDGE_S="30.5"))
    cfg = load_config_block(found.config_block(), found.where, env={})
    assert cfg.num_rollouts_per_prompt == 16
    assert cfg.default_principle == "judge for rl, strictly"
    assert cfg.cohort_collection_timeout_s == 90
    assert cfg.judge_request_timeout_s == 30.5
    assert cfg.genrm_responses_create_params == {"max_output_tokens": 512}
    assert (found.port, cfg.port) == (16662, 16662)


@pytest.mark.parametrize(("value", "problem"), [
    ("${no.such.key}", "names no key of NEMO_GYM_CONFIG_DICT"),
    ("${oc.env:GENRM_TEST_UNSET_VARIABLE}", "is not set"),
    ("${.sibling}", "only absolute key paths and oc.env"),
    ("${oc.select:a,b}", "only absolute key paths and oc.env"),
    ("${loop}", "nest too deep"),
])
def test_interpolations_that_cannot_be_resolved(value: str, problem: str) -> None:
    config = nemo_config({**BLOCK, "num_rollouts_per_prompt": value}, loop="${loop}")
    err = error_for(env_for(config))
    assert err.key == f"{CONFIG_DICT_VAR}.genrm_rs.resources_servers.genrm_trio" \
        ".num_rollouts_per_prompt"
    assert problem in err.problem


# --------------------------------------------------------------------------- the judge


def test_genrm_model_server_becomes_the_judge() -> None:
    block = {**BLOCK, "genrm_model_server": {"type": "responses_api_models",
                                             "name": "policy_model"},
             "judge": {"api": "responses"}}
    found = read_nemo_env(env_for(nemo_config(block)))
    assert (found.judge_server, found.judge_url) == ("policy_model", "http://127.0.0.1:12001")
    assert "base_urls" not in found.block.get("judge", {})  # the block itself is as given
    cfg = load_config_block(found.config_block(), found.where, env={})
    assert cfg.judge.base_urls == ("http://127.0.0.1:12001",)
    assert cfg.judge.api == "responses"


@pytest.mark.parametrize("judge", [{"base_urls": ["http://judge:9000"]},
                                   {"plugin": "tests.judge_plugins:canned"}])
def test_our_judge_keys_win_over_genrm_model_server(judge: dict[str, Any]) -> None:
    block = {**BLOCK, "judge": judge,
             "genrm_model_server": {"type": "responses_api_models", "name": "policy_model"}}
    found = read_nemo_env(env_for(nemo_config(block)))
    assert found.judge_server is None
    assert found.config_block()["judge"] == judge


@pytest.mark.parametrize(("name", "problem"), [
    ("genrm_model", "not a top-level key"), ("agent", "not a responses_api_models block"),
])
def test_genrm_model_server_that_names_no_model_server(name: str, problem: str) -> None:
    block = {**BLOCK, "genrm_model_server": {"type": "responses_api_models", "name": name}}
    err = error_for(env_for(nemo_config(block)))
    assert err.key.endswith("genrm_trio.genrm_model_server.name")
    assert problem in err.problem


# --------------------------------------------------------------------------- the address checks


def test_an_override_may_not_move_the_server_off_the_block() -> None:
    found = read_nemo_env(env_for(nemo_config(BLOCK)))
    check_served_address(found, "127.0.0.1", 16661)
    with pytest.raises(ConfigError) as info:
        check_served_address(found, "127.0.0.1", 9000)
    assert info.value.key == "port"
    assert "16661" in info.value.problem and "drop the override" in info.value.problem


def test_an_external_block_names_only_the_address() -> None:
    block = {"entrypoint": "external.py", "domain": "rlhf", "description": "d",
             "host": "127.0.0.1", "port": 16661}
    check_external_block(read_nemo_env(env_for(nemo_config(block))))
    with pytest.raises(ConfigError) as info:
        check_external_block(read_nemo_env(env_for(nemo_config({**block, "top_percentile": 1}))))
    assert info.value.key == "genrm_rs.resources_servers.genrm_trio.top_percentile"
    assert "set it there" in info.value.problem


# --------------------------------------------------------------------------- the entries


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_GYM_", "GENRM_TRIO_"))}


def run_entry(args: list[str], env: dict[str, str],
              cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**clean_environ(), **env})


SERVE = [sys.executable, "-m", "genrm_trio.cli", "serve", "--from-nemo-gym-env"]
EXTERNAL = [sys.executable, "-m", "genrm_trio.cli", "nemo-gym-external"]
APP = [sys.executable, "app.py"]


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("genrm-trio: ")
    return lines[0]


ENV_CASES = [
    ({}, CONFIG_DICT_VAR),
    ({CONFIG_DICT_VAR: "a: [1,", CONFIG_PATH_VAR: "genrm_rs"}, "not valid YAML"),
    (env_for(nemo_config(BLOCK), "nope"), "'nope' is not a top-level key"),
    (env_for(nemo_config(BLOCK), "agent"), "not a resources_servers block"),
    (env_for(nemo_config({**BLOCK, "port": None})), "port': not set"),
]


@pytest.mark.parametrize("command", [SERVE, EXTERNAL], ids=["serve", "nemo-gym-external"])
@pytest.mark.parametrize(("env", "needle"), ENV_CASES)
def test_bad_variables_exit_2_with_one_line(command: list[str], env: dict[str, str],
                                            needle: str) -> None:
    line = one_error_line(run_entry(command, env))
    assert line.startswith("genrm-trio: invalid configuration: config key ")
    assert needle in line


@pytest.mark.parametrize("entry", ["app.py", "external.py"])
def test_the_folder_entries_exit_2_with_one_line(entry: str) -> None:
    line = one_error_line(run_entry([sys.executable, entry], {}, cwd=ENTRY_DIR))
    assert CONFIG_DICT_VAR in line


@pytest.mark.parametrize(("args", "needle"), [
    (["--port", "0"], "--port cannot be combined with --from-nemo-gym-env"),
    (["--config", "configs/default.yaml"], "--config cannot be combined"),
    (["--set", "port=9000"], "config key 'port': 9000 differs from 16661"),
    (["--set", "top_percentil=1"], "config key 'top_percentil': unknown key"),
])
def test_serve_flags_that_clash_with_the_block(args: list[str], needle: str) -> None:
    line = one_error_line(run_entry([*SERVE, *args], env_for(nemo_config(BLOCK))))
    assert needle in line


def test_external_block_with_our_keys_exits_2() -> None:
    block = {"entrypoint": "external.py", "host": "127.0.0.1", "port": 1,
             "num_rollouts_per_prompt": 8}
    line = one_error_line(run_entry(EXTERNAL, env_for(nemo_config(block))))
    assert "num_rollouts_per_prompt': has no effect here" in line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port



def start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env={**clean_environ(), **env})


def stop(proc: subprocess.Popen[str], signum: signal.Signals) -> tuple[int, str]:
    try:
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=30)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_app_py_serves_the_block_on_its_address() -> None:
    """NeMo Gym runs `<venv python> app.py` in the folder: the server listens on the block's
    host and port with the block's keys, and NeMo Gym's SIGINT stops it."""
    port = free_port()
    block = {**BLOCK, "port": port, "num_rollouts_per_prompt": 3, "top_percentile": 0.5}
    proc = start(APP, env_for(nemo_config(block), GENRM_TRIO_LOG_FORMAT="json"), ENTRY_DIR)
    assert proc.stdout is not None
    line = wait_for_line(proc.stdout, "listening on")
    assert f"listening on http://127.0.0.1:{port}" in line
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as answer:
        summary = json.load(answer)["config"]
    assert (summary["num_rollouts_per_prompt"], summary["top_percentile"]) == (3, 0.5)
    code, err = stop(proc, signal.SIGINT)
    assert code == 130, err
    assert "config from NeMo Gym block genrm_rs.resources_servers.genrm_trio" in err


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_external_py_waits_until_stopped(signum: signal.Signals, code: int) -> None:
    block = {"entrypoint": "external.py", "domain": "rlhf", "host": "127.0.0.1", "port": 16661}
    proc = start([sys.executable, "external.py"], env_for(nemo_config(block)), ENTRY_DIR)
    assert proc.stderr is not None
    wait_for_line(proc.stderr, "uses the genrm-trio at http://127.0.0.1:16661")
    assert proc.poll() is None
    returncode, _err = stop(proc, signum)
    assert returncode == code
