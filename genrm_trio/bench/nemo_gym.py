"""NeMo Gym 0.7.0 for the side-by-side runs: its venv (created on demand from a Python 3.13
under pyenv) and the resolved config that starts its ``genrm_compare`` against the mock judge.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from genrm_trio.bench.processes import free_port
from genrm_trio.bench.records import ServerSettings

NEMO_VERSION = "0.7.0"


def default_nemo_venv() -> Path:
    """Where NeMo Gym's venv lives: ``$GENRM_NEMO_VENV`` or the cache folder."""
    env = os.environ.get("GENRM_NEMO_VENV")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "genrm-trio" / f"nemo-gym-{NEMO_VERSION}"


def _pyenv_313() -> Path | None:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(root.glob("3.13*"), reverse=True):
        python = candidate / "bin" / "python"
        if python.exists():
            return python
    return None


def ensure_nemo_venv(venv: Path) -> Path | str:
    """Return NeMo Gym's ``genrm_compare`` folder, creating the venv if needed (blocking, minutes).

    Returns a one-line reason instead when it cannot (no Python 3.13, install failed).
    """
    python = venv / "bin" / "python"
    if not python.exists():
        base = _pyenv_313()
        if base is None:
            return "NeMo Gym skipped: no Python 3.13 under pyenv (nemo-gym 0.7.0 needs 3.13)"
        venv.parent.mkdir(parents=True, exist_ok=True)
        steps = [
            [str(base), "-m", "venv", str(venv)],
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--ignore-requires-python",
                f"nemo-gym=={NEMO_VERSION}",
                # NeMo Gym's `gym env start` builds the venv of every server it launches with
                # uv (tests/test_nemo_gym.py launches genrm-trio's folder through it).
                "uv",
            ],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
                return f"NeMo Gym skipped: {' '.join(step[:3])} failed: {' '.join(tail)}"
    found = sorted(venv.glob("lib/python3*/site-packages/resources_servers/genrm_compare/app.py"))
    if not found:
        return f"NeMo Gym skipped: no resources_servers/genrm_compare in {venv}"
    return found[0].parent


def nemo_config(port: int, judge_url: str, server: ServerSettings) -> str:
    """The resolved NeMo Gym config (YAML) for ``genrm_compare`` with the mock judge as model."""
    judge_host, _, judge_port = judge_url.split("://", 1)[1].rpartition(":")
    config = {
        "head_server": {"host": "127.0.0.1", "port": free_port()},  # never contacted
        "dry_run": False,
        "genrm_compare_bench": {
            "resources_servers": {
                "genrm_compare": {
                    "entrypoint": "app.py",
                    "host": "127.0.0.1",
                    "port": port,
                    "domain": "rlhf",
                    "genrm_model_server": {"type": "responses_api_models", "name": "genrm_model"},
                    "genrm_responses_create_params": {
                        "input": [],
                        "max_output_tokens": 16384,
                        "temperature": 0.6,
                        "top_p": 0.95,
                    },
                    "num_rollouts_per_prompt": server.n,
                    "cohort_collection_timeout_s": server.collection_timeout_s,
                    "cohort_result_ttl_s": server.result_ttl_s,
                    "max_terminal_cohorts": server.max_terminal_cohorts,
                }
            }
        },
        "genrm_model": {
            "responses_api_models": {
                "genrm_model": {
                    "entrypoint": "app.py",
                    "host": judge_host.strip("[]"),
                    "port": int(judge_port),
                }
            }
        },
    }
    return yaml.safe_dump(config, sort_keys=False)
