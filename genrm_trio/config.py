"""Configuration: frozen msgspec structs, units in the names (``*_s``, ``*_bytes``).

Pure core: no I/O besides reading the YAML file handed to :func:`load_config`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

DEFAULT_PRINCIPLE = (
    "Act as an impartial judge. Compare the two responses to the conversation above and decide "
    "which one better serves the user: first work out your own answer, then check each response "
    "for mistakes, helpfulness, relevance and concision, and note anything important that is "
    "missing. Do not let the order, the length or the names of the responses sway you."
)


def _default_judge_params() -> dict[str, Any]:
    return {"max_output_tokens": 16384, "temperature": 0.6, "top_p": 0.95}


class JudgeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where and how the judge is called. Empty ``base_urls`` and no plugin: built-in judge."""

    base_urls: tuple[str, ...] = ()
    api: Literal["responses", "chat"] = "responses"
    api_key_env: str | None = None
    model: str | None = None
    plugin: str | None = None
    plugin_flavor: Literal["trio", "asyncio"] = "trio"
    max_connections_per_client: int = 16
    endpoint_failure_threshold: int = 3
    endpoint_cooldown_s: float = 5.0


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration. NeMo Gym ``genrm_compare`` keys first, then ours."""

    # NeMo Gym genrm_compare keys (same names, same defaults).
    num_rollouts_per_prompt: int = 1
    cohort_collection_timeout_s: float = 1800.0
    cohort_evaluation_timeout_s: float = 1800.0
    judge_request_timeout_s: float = 1800.0
    cohort_result_ttl_s: float | None = 3600.0
    max_terminal_cohorts: int = 4096
    genrm_parse_retries: int = 3
    genrm_parse_retry_sleep_s: float = 0.2
    comparison_strategy: Literal["circular", "all_pairs"] = "circular"
    num_judges_per_comparison: int = 1
    use_principle: bool = False
    default_principle: str = DEFAULT_PRINCIPLE
    aggregator_method: Literal["simple_tiebreaker"] = "simple_tiebreaker"
    reasoning_bonus: float = 0.0
    answer_bonus: float = 0.0
    top_percentile: float = 0.2
    group_reasoning_length_penalty_coeff: float = 0.0
    group_answer_length_penalty_coeff: float = 0.0
    group_style_penalty_coeff: float = 0.0
    default_score: float = 3.0
    default_ranking: float = 3.5
    debug_logging: bool = False
    genrm_responses_create_params: dict[str, Any] = msgspec.field(
        default_factory=_default_judge_params
    )

    # Ours [ext].
    host: str = "127.0.0.1"
    port: int = 8000
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    judge_max_concurrency: int = 1024
    judge_retry_backoff_max_s: float = 10.0
    judge_schedule: Literal["wait_for_all", "eager"] = "wait_for_all"
    max_request_bytes: int = 16 * 1024 * 1024
    shutdown_grace_s: float = 5.0
    state_dir: str | None = None
    max_active_cohorts: int | None = None
    max_active_bytes: int | None = None
    log_level: str = "INFO"
