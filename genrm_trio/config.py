"""Configuration: frozen msgspec structs, units in the names (``*_s``, ``*_bytes``).

Pure core: no I/O besides reading the YAML file handed to :func:`load_config` and the judge's
prompt template file (``judge.prompt_template_file``, checked here so a bad one stops start-up).

Sources, lowest precedence first:

1. the struct defaults below;
2. a YAML file, in one of two shapes:

   * our flat format: the keys of :class:`Config` at the top level, ``judge`` as a nested
     mapping (see ``configs/default.yaml``). A file with any of our keys (or a NeMo-only key)
     at the top level is read this way, and every other top-level key is then unknown;
   * a NeMo Gym ``genrm_compare`` block, loaded unchanged: the server mapping is found under
     ``<anything>.resources_servers.<name>`` (the one holding ``genrm_model_server`` or
     ``genrm_responses_create_params``, or named ``genrm_compare``), or a
     ``resources_servers:`` mapping at the top level (see ``configs/genrm_compare.yaml``).
     Other top-level blocks of the file (``genrm_model:`` and so on) are not ours and are skipped;

3. environment variables ``GENRM_TRIO_<KEY>`` (``__`` between nested keys:
   ``GENRM_TRIO_JUDGE__API=chat``), each value parsed as YAML;
4. ``KEY=VALUE`` overrides (the CLI's repeatable ``--set``; ``KEY`` dotted for nested keys,
   ``VALUE`` parsed as YAML), applied in order.

NeMo Gym-only keys (:data:`NEMO_IGNORED_KEYS`: ``entrypoint``, ``domain``, ``name``,
``genrm_model_server``, ``verified``, ``description``, ``value``, ``num_workers``, ``datasets``,
``expose_tools_over_mcp``) are accepted in a file and ignored: they describe how NeMo Gym wires
its servers together, which has no meaning for a standalone server. ``host`` and ``port`` in a
block map onto ours; there, as in NeMo Gym, ``null`` means "not set" (the default is kept).
``genrm_responses_create_params.input`` is dropped wherever it comes from: the judge input is
built per comparison (NeMo Gym replaces it too), so the template's ``input: []`` means nothing.

Machine-dependent defaults stay symbolic here: ``memory_limit_bytes: auto`` (the memory this
process may use: its cgroup's limit, else physical memory) and ``max_active_bytes: auto`` (a
quarter of it). The server resolves both once, at start (``genrm_trio.server.memory_limit``
reads the machine; :func:`resolve_memory` does the arithmetic), into a :class:`ResolvedConfig`
that also says where each number came from, which ``GET /status`` shows.

Every problem raises :class:`~genrm_trio.errors.ConfigError` whose ``str()`` is one line naming
the dotted key (``judge.base_urls[1]``) and the problem.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

import msgspec
import yaml

from genrm_trio import judge_prompt
from genrm_trio.errors import ConfigError
from genrm_trio.wire import DEFAULT_MAX_JSON_VALUES

DEFAULT_PRINCIPLE = (
    "Act as an impartial judge. Compare the two responses to the conversation above and decide "
    "which one better serves the user: first work out your own answer, then check each response "
    "for mistakes, helpfulness, relevance and concision, and note anything important that is "
    "missing. Do not let the order, the length or the names of the responses sway you."
)

ENV_PREFIX = "GENRM_TRIO_"
"""Environment variables with this prefix override config keys (``__`` separates nesting)."""

NEMO_IGNORED_KEYS: frozenset[str] = frozenset(
    {
        "entrypoint",
        "domain",
        "name",
        "genrm_model_server",
        "verified",
        "description",
        "value",
        "num_workers",
        "datasets",
        "expose_tools_over_mcp",
    }
)
"""Keys of a NeMo Gym server block that only matter inside NeMo Gym: accepted, ignored."""

LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Hard ceiling of ``verdict_cache_max_entries`` (2**24; an entry holds about 300 bytes).
MAX_VERDICT_CACHE_ENTRIES = 16_777_216
#: Floor of ``max_json_values``: a real /verify body (prompt, tools, one answer) holds a few
#: hundred values; fewer would refuse ordinary requests.
MIN_JSON_VALUES = 1000
#: Hard ceiling of ``max_compare_responses``: all_pairs over 4096 responses is 8.4 M judge calls.
MAX_COMPARE_RESPONSES = 4096

# Keys whose presence marks a NeMo Gym resources-server mapping as the genrm_compare one.
_NEMO_MARKER_KEYS = frozenset({"genrm_model_server", "genrm_responses_create_params"})
_NEMO_NULLABLE_KEYS = frozenset({"host", "port"})
_MAX_CONNECTIONS_PER_CLIENT = 16
#: Upper bound of ``judge.affinity_spill_factor`` (lower: 1, spill as soon as above the mean).
MAX_AFFINITY_SPILL_FACTOR = 16.0
_MAX_OTLP_ENDPOINT_CHARS = 2048
#: How an ``auto``-able key's values are named in its errors.
_AUTO_EXPECTED = MappingProxyType({
    "max_active_bytes": "an integer, 'auto' or null",
    "memory_limit_bytes": "an integer or 'auto'",
})
_SEARCH_DEPTH = 8
_VALUE_REPR_CHARS = 60
# Whole words of a key (split on "_" and "-"): "api_key" and "auth-token" are secret,
# "max_output_tokens" is not.
_SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "authorization",
                           "cookie"})


def _default_judge_params() -> dict[str, Any]:
    return {"max_output_tokens": 16384, "temperature": 0.6, "top_p": 0.95}


class JudgeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where and how the judge is called. Empty ``base_urls`` and no plugin: built-in judge.

    ``plugin`` (``module:function``) is checked and imported by the judge, not here.
    ``base_urls`` are OpenAI-style server roots, each ``http://`` or ``https://`` with a host.
    They are normalised on construction: one trailing ``/`` and then one trailing ``/v1`` are
    stripped (``http://judge:8000/v1/`` becomes ``http://judge:8000``); the judge client adds
    ``/v1/...`` itself. A query string or fragment is rejected.

    Raises :class:`ConfigError` (keys prefixed ``judge.``) for any invalid value.
    """

    base_urls: tuple[str, ...] = ()
    api: Literal["responses", "chat"] = "responses"
    api_key_env: str | None = None
    model: str | None = None
    plugin: str | None = None
    plugin_flavor: Literal["trio", "asyncio"] = "trio"
    transport: Literal["h11", "httpx"] = "h11"
    max_connections_per_client: int = 16
    endpoint_failure_threshold: int = 3
    endpoint_cooldown_s: float = 5.0
    max_concurrency_per_endpoint: int | None = None
    prompt: Literal["genrm_roles", "plain"] = "genrm_roles"
    prompt_template_file: str | None = None
    structured_output: Literal["none", "json_schema", "json_object"] = "none"
    seed: Literal["none", "content"] = "none"
    routing: Literal["least_loaded", "cohort_affinity"] = "cohort_affinity"
    affinity_spill_factor: float = 1.5
    engine: Literal["unknown", "vllm", "sglang", "llama_cpp"] = "unknown"

    def __post_init__(self) -> None:
        _validate_judge(self)


class TracingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry traces (issue 20; server/tracing.py), off by default.

    ``otlp_endpoint``: the OTLP/HTTP (protobuf) traces URL; one without a path gets
    ``/v1/traces`` appended (``http://collector:4318`` becomes
    ``http://collector:4318/v1/traces``); null leaves it to the standard
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` variables (else
    ``http://localhost:4318/v1/traces``). ``sample_ratio``: the share of traces started here
    (a cohort's, or a request's without a caller's ``traceparent``) that are recorded, in
    [0, 1]; a caller's sampled flag is followed.

    Raises :class:`ConfigError` (keys prefixed ``tracing.``) for any invalid value.
    """

    enabled: bool = False
    otlp_endpoint: str | None = None
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        _validate_tracing(self)


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration. NeMo Gym ``genrm_compare`` keys first, then ours.

    Validated on construction (directly or through :func:`load_config`); ``log_level`` is
    normalised to upper case. Raises :class:`ConfigError` naming the key for any invalid value.
    """

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
    unparseable_verdict_policy: Literal["default", "mask"] = "default"
    incomplete_cohort_policy: Literal["fail", "judge_present"] = "fail"
    min_cohort_members: int | None = None
    # [ext] (issue 30): how a legacy member (no _ng_group_id) without _ng_rollout_index gets a
    # slot: required (422 bad_coordinates, NeMo Gym 0.7.0) or arrival (the next free slot of
    # its prompt-keyed cohort, as nemo-gym 0.4.0 did; verifiers / prime-rl need it).
    legacy_slots: Literal["required", "arrival"] = "required"
    debug_logging: bool = False
    genrm_responses_create_params: dict[str, Any] = msgspec.field(
        default_factory=_default_judge_params
    )

    # Ours [ext].
    host: str = "127.0.0.1"
    port: int = 8000
    probe_port: int | None = None
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    judge_max_concurrency: int = 1024
    judge_retry_backoff_max_s: float = 10.0
    judge_schedule: Literal["wait_for_all", "eager"] = "wait_for_all"
    judge_order: Literal["complete_group", "closest_group", "oldest_group", "arrival"] = (
        "complete_group"
    )
    max_request_bytes: int = 16 * 1024 * 1024
    max_json_values: int = DEFAULT_MAX_JSON_VALUES
    shutdown_grace_s: float = 5.0
    drain_timeout_s: float | None = None
    rejoin_s: float = 0.0
    state_dir: str | None = None
    max_active_cohorts: int | None = None
    max_active_bytes: int | Literal["auto"] | None = "auto"
    memory_limit_bytes: int | Literal["auto"] = "auto"
    state_sync: Literal["normal", "full"] = "normal"
    request_read_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    max_compare_responses: int = 128
    verdict_reuse: Literal["group", "global", "off"] = "group"
    verdict_cache_max_entries: int = 65536
    malloc_trim_interval_s: float | None = 30.0
    malloc_mmap_threshold_bytes: int | None = 65536
    log_level: str = "INFO"
    log_format: Literal["auto", "json", "text"] = "auto"
    auth_token_env: str | None = None
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        _validate_config(self)


#: glibc's largest ``M_MMAP_THRESHOLD`` on 64-bit (``HEAP_MAX_SIZE / 2``).
MAX_MMAP_THRESHOLD_BYTES = 32 * 2**20

#: ``max_active_bytes: auto`` is this fraction of ``memory_limit_bytes`` (a quarter): room for
#: what admission does not count (bodies being read and decoded, the interpreter, the
#: allocator's free lists) and for members of cohorts already open, which are always admitted.
AUTO_ACTIVE_BYTES_DIVISOR = 4


class MemoryLimit(msgspec.Struct, frozen=True):
    """The memory this process may use, as found on the machine, and where it was found
    (``cgroup v2 memory.max of /sys/fs/cgroup/...``, ``physical memory``)."""

    limit_bytes: int
    source: str


class ResolvedConfig(Config, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A :class:`Config` whose machine-dependent defaults were resolved once, at server start
    (:func:`resolve_memory`): ``memory_limit_bytes`` is a number, ``max_active_bytes`` a number
    or null, and the two ``*_source`` fields say where each came from (``GET /status`` shows
    them in its config summary). Never loaded from a file: these two fields are not keys."""

    memory_limit_bytes: int
    max_active_bytes: int | None
    memory_limit_source: str
    max_active_bytes_source: str


def resolve_memory(cfg: Config, found: MemoryLimit | None) -> ResolvedConfig:
    """Resolve ``memory_limit_bytes: auto`` to ``found`` and ``max_active_bytes: auto`` to
    :data:`AUTO_ACTIVE_BYTES_DIVISOR`-th of the limit. Pure: the caller reads the machine
    (``genrm_trio.server.memory_limit``). ``found`` may be None when ``memory_limit_bytes`` is a
    number. Raises :class:`ConfigError` (key ``memory_limit_bytes``) when it is ``auto`` and
    nothing was found. A :class:`ResolvedConfig` is returned unchanged."""
    if isinstance(cfg, ResolvedConfig):
        return cfg
    if isinstance(cfg.memory_limit_bytes, int):
        limit, limit_source = cfg.memory_limit_bytes, "configured"
    elif found is None:
        raise ConfigError("memory_limit_bytes",
                          "auto: this machine's memory could not be read; set a number")
    else:
        limit, limit_source = found.limit_bytes, found.source
    budget: int | None
    if isinstance(cfg.max_active_bytes, int):
        budget, budget_source = cfg.max_active_bytes, "configured"
    elif cfg.max_active_bytes is None:
        budget, budget_source = None, "null: unlimited"
    else:
        budget = max(1, limit // AUTO_ACTIVE_BYTES_DIVISOR)
        budget_source = (f"auto: a quarter of memory_limit_bytes ({format_bytes(limit)}, "
                         f"{limit_source})")
    fields = msgspec.structs.asdict(cfg)
    fields.update(memory_limit_bytes=limit, max_active_bytes=budget)
    return ResolvedConfig(**fields, memory_limit_source=limit_source,
                          max_active_bytes_source=budget_source)


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``1.5 GiB``, ``512.0 MiB``, ``900 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


_CONFIG_KEYS: frozenset[str] = frozenset(Config.__struct_fields__)
_JUDGE_KEYS: frozenset[str] = frozenset(JudgeConfig.__struct_fields__)
#: Keys whose value is a struct of its own: a dotted key sets one field, a whole mapping merges.
_NESTED: Mapping[str, Any] = MappingProxyType({"judge": JudgeConfig, "tracing": TracingConfig})
# Fields whose value is a free-form mapping: a dotted key reaches inside, a whole value replaces.
_DICT_KEYS = frozenset({"genrm_responses_create_params"})


# --------------------------------------------------------------------------- validation


def _number(
    key: str,
    value: object,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    nullable: bool = False,
    integer: bool = False,
    expected: str | None = None,
) -> None:
    """Check one numeric value: finite, within bounds; ``None`` only when ``nullable``.
    ``expected`` replaces the wording of a wrong type (``an integer, 'auto' or null``)."""
    if value is None and nullable:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
    ):
        want = "an integer" if integer else "a number"
        want = expected or f"{want}{' or null' if nullable else ''}"
        raise ConfigError(key, f"expected {want}, got {_show(value)}")
    if not math.isfinite(value):
        raise ConfigError(key, f"must be finite, got {_show(value)}")
    if gt is not None and not value > gt:
        raise ConfigError(key, f"must be > {_fmt(gt)}, got {_show(value)}")
    if ge is not None and not value >= ge:
        raise ConfigError(key, f"must be >= {_fmt(ge)}, got {_show(value)}")
    if le is not None and not value <= le:
        raise ConfigError(key, f"must be <= {_fmt(le)}, got {_show(value)}")


def _fmt(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _show(value: object) -> str:
    text = repr(value)
    if len(text) > _VALUE_REPR_CHARS:
        text = text[: _VALUE_REPR_CHARS - 3] + "..."
    return text


def _non_empty(key: str, value: object, *, nullable: bool) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, f"must be a non-empty string, got {_show(value)}")


def _normalise_base_url(key: str, url: object) -> str:
    if not isinstance(url, str):
        raise ConfigError(key, f"expected a URL string, got {_show(url)}")
    text = url.strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 -- raises ValueError for an invalid port
    except ValueError as exc:
        raise ConfigError(key, f"not a valid URL {_show(url)}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, f"must be an http:// or https:// URL with a host, got {_show(url)}")
    if parts.query or parts.fragment:
        raise ConfigError(key, f"must not have a query or fragment, got {_show(url)}")
    path = parts.path.removesuffix("/").removesuffix("/v1").removesuffix("/")
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _validate_judge(judge: JudgeConfig) -> None:
    if not isinstance(judge.base_urls, tuple):
        raise ConfigError(
            "judge.base_urls", f"expected a list of URLs, got {_show(judge.base_urls)}"
        )
    urls = tuple(
        _normalise_base_url(f"judge.base_urls[{i}]", url) for i, url in enumerate(judge.base_urls)
    )
    if urls != judge.base_urls:
        msgspec.structs.force_setattr(judge, "base_urls", urls)
    if judge.api not in ("responses", "chat"):
        raise ConfigError("judge.api", f"must be 'responses' or 'chat', got {_show(judge.api)}")
    if judge.plugin_flavor not in ("trio", "asyncio"):
        raise ConfigError(
            "judge.plugin_flavor", f"must be 'trio' or 'asyncio', got {_show(judge.plugin_flavor)}"
        )
    _non_empty("judge.api_key_env", judge.api_key_env, nullable=True)
    if judge.api_key_env is not None and "=" in judge.api_key_env:
        # A value pasted where the variable's name belongs would leak through /status.
        raise ConfigError("judge.api_key_env", "must be the name of an environment variable")
    _non_empty("judge.model", judge.model, nullable=True)
    _number(
        "judge.max_connections_per_client",
        judge.max_connections_per_client,
        ge=1,
        le=_MAX_CONNECTIONS_PER_CLIENT,
        integer=True,
    )
    _number(
        "judge.endpoint_failure_threshold", judge.endpoint_failure_threshold, ge=1, integer=True
    )
    _number("judge.endpoint_cooldown_s", judge.endpoint_cooldown_s, ge=0)
    _number("judge.max_concurrency_per_endpoint", judge.max_concurrency_per_endpoint, ge=1,
            nullable=True, integer=True)
    _choice("judge.prompt", judge.prompt, ("genrm_roles", "plain"))
    _choice("judge.structured_output", judge.structured_output,
            ("none", "json_schema", "json_object"))
    _choice("judge.seed", judge.seed, ("none", "content"))
    _choice("judge.routing", judge.routing, ("least_loaded", "cohort_affinity"))
    _choice("judge.engine", judge.engine, ("unknown", "vllm", "sglang", "llama_cpp"))
    _number("judge.affinity_spill_factor", judge.affinity_spill_factor, ge=1.0,
            le=MAX_AFFINITY_SPILL_FACTOR)
    _non_empty("judge.prompt_template_file", judge.prompt_template_file, nullable=True)
    if judge.prompt_template_file is not None:
        if judge.prompt != "plain":
            raise ConfigError("judge.prompt_template_file",
                              "is only used with judge.prompt: plain")
        read_prompt_template(judge.prompt_template_file)


def _validate_tracing(tracing: TracingConfig) -> None:
    if not isinstance(tracing.enabled, bool):
        raise ConfigError("tracing.enabled",
                          f"expected true or false, got {_show(tracing.enabled)}")
    _number("tracing.sample_ratio", tracing.sample_ratio, ge=0, le=1)
    endpoint = tracing.otlp_endpoint
    if endpoint is None:
        return
    key = "tracing.otlp_endpoint"
    if isinstance(endpoint, str) and len(endpoint) > _MAX_OTLP_ENDPOINT_CHARS:
        raise ConfigError(key, f"must be at most {_MAX_OTLP_ENDPOINT_CHARS} characters")
    _normalise_base_url(key, endpoint)  # an http(s) URL with a host, no query or fragment
    url = endpoint.strip()
    parts = urlsplit(url)
    if not parts.path.strip("/"):
        url = urlunsplit((parts.scheme, parts.netloc, "/v1/traces", "", ""))
    if url != endpoint:
        msgspec.structs.force_setattr(tracing, "otlp_endpoint", url)


def _choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            key, f"must be one of {', '.join(map(repr, choices))}, got {_show(value)}"
        )


def read_prompt_template(path: str) -> judge_prompt.PlainPrompt:
    """Read and check a ``judge.prompt_template_file``. Blocks on file I/O.

    Raises :class:`ConfigError` (key ``judge.prompt_template_file``) for an unreadable file or
    a template that :func:`genrm_trio.judge_prompt.parse_template` rejects, naming the
    placeholder for a missing or unknown one.
    """
    key = "judge.prompt_template_file"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(judge_prompt.MAX_TEMPLATE_CHARS + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path}: {_one_line(str(exc))}") from exc
    try:
        return judge_prompt.parse_template(text)
    except judge_prompt.TemplateError as exc:
        raise ConfigError(key, f"{path}: {exc}") from exc


def min_members_present(cfg: Config) -> int:
    """The fewest distinct slots a cohort needs at its collection deadline to be judged over the
    members present (``incomplete_cohort_policy: judge_present``): ``min_cohort_members``, or
    N - 1 when it is null (one straggler tolerated)."""
    if cfg.min_cohort_members is not None:
        return cfg.min_cohort_members
    return cfg.num_rollouts_per_prompt - 1


def drain_bound_s(cfg: Config) -> float:
    """How long a drain waits for the cohorts open when it began: ``drain_timeout_s``, or, when
    it is null, the longest a cohort can stay open (its collection plus evaluation deadline)."""
    if cfg.drain_timeout_s is not None:
        return cfg.drain_timeout_s
    return cfg.cohort_collection_timeout_s + cfg.cohort_evaluation_timeout_s


def _validate_partial(cfg: Config) -> None:
    _choice("incomplete_cohort_policy", cfg.incomplete_cohort_policy, ("fail", "judge_present"))
    _choice("legacy_slots", cfg.legacy_slots, ("required", "arrival"))
    n = cfg.num_rollouts_per_prompt
    if cfg.incomplete_cohort_policy == "judge_present" and n < 3:
        # A partial cohort needs two members, and at least one slot may be missing.
        raise ConfigError(
            "incomplete_cohort_policy",
            f"judge_present needs num_rollouts_per_prompt >= 3, got {n}")
    if cfg.min_cohort_members is not None:
        _number("min_cohort_members", cfg.min_cohort_members, ge=2, nullable=True, integer=True)
        if cfg.min_cohort_members > n - 1:
            raise ConfigError(
                "min_cohort_members",
                f"must be <= num_rollouts_per_prompt - 1 ({n - 1}), got {cfg.min_cohort_members}")


def _validate_config(cfg: Config) -> None:
    _number("num_rollouts_per_prompt", cfg.num_rollouts_per_prompt, ge=1, integer=True)
    for key in (
        "cohort_collection_timeout_s",
        "cohort_evaluation_timeout_s",
        "judge_request_timeout_s",
    ):
        _number(key, getattr(cfg, key), gt=0)
    _number("cohort_result_ttl_s", cfg.cohort_result_ttl_s, gt=0, nullable=True)
    _number("max_terminal_cohorts", cfg.max_terminal_cohorts, gt=0, integer=True)
    _number("genrm_parse_retries", cfg.genrm_parse_retries, ge=0, integer=True)
    _number("genrm_parse_retry_sleep_s", cfg.genrm_parse_retry_sleep_s, ge=0)
    if cfg.comparison_strategy not in ("circular", "all_pairs"):
        raise ConfigError(
            "comparison_strategy",
            f"must be 'circular' or 'all_pairs', got {_show(cfg.comparison_strategy)}",
        )
    _number("num_judges_per_comparison", cfg.num_judges_per_comparison, ge=1, integer=True)
    if cfg.aggregator_method != "simple_tiebreaker":
        raise ConfigError(
            "aggregator_method", f"must be 'simple_tiebreaker', got {_show(cfg.aggregator_method)}"
        )
    for key in ("reasoning_bonus", "answer_bonus", "default_score", "default_ranking"):
        _number(key, getattr(cfg, key))
    _choice("unparseable_verdict_policy", cfg.unparseable_verdict_policy, ("default", "mask"))
    _number("top_percentile", cfg.top_percentile, gt=0, le=1)
    _validate_partial(cfg)
    for key in (
        "group_reasoning_length_penalty_coeff",
        "group_answer_length_penalty_coeff",
        "group_style_penalty_coeff",
    ):
        _number(key, getattr(cfg, key), ge=0)
    if not isinstance(cfg.genrm_responses_create_params, dict):
        raise ConfigError(
            "genrm_responses_create_params",
            f"expected a mapping, got {_show(cfg.genrm_responses_create_params)}",
        )
    _non_empty("host", cfg.host, nullable=False)
    _number("port", cfg.port, ge=0, le=65535, integer=True)
    _number("probe_port", cfg.probe_port, ge=0, le=65535, nullable=True, integer=True)
    if cfg.probe_port is not None and cfg.probe_port == cfg.port != 0:
        raise ConfigError("probe_port", f"must differ from port ({cfg.port})")
    if not isinstance(cfg.judge, JudgeConfig):
        raise ConfigError("judge", f"expected a JudgeConfig, got {_show(cfg.judge)}")
    if not isinstance(cfg.tracing, TracingConfig):
        raise ConfigError("tracing", f"expected a mapping, got {_show(cfg.tracing)}")
    _number("judge_max_concurrency", cfg.judge_max_concurrency, ge=1, integer=True)
    _number("judge_retry_backoff_max_s", cfg.judge_retry_backoff_max_s, ge=0)
    if cfg.judge_schedule not in ("wait_for_all", "eager"):
        raise ConfigError(
            "judge_schedule", f"must be 'wait_for_all' or 'eager', got {_show(cfg.judge_schedule)}"
        )
    if cfg.judge_order not in ("complete_group", "closest_group", "oldest_group", "arrival"):
        raise ConfigError(
            "judge_order",
            "must be 'complete_group', 'closest_group', 'oldest_group' or 'arrival', "
            f"got {_show(cfg.judge_order)}",
        )
    _number("max_request_bytes", cfg.max_request_bytes, ge=1, integer=True)
    _number("max_json_values", cfg.max_json_values, ge=MIN_JSON_VALUES, integer=True)
    _number("shutdown_grace_s", cfg.shutdown_grace_s, gt=0)
    _number("drain_timeout_s", cfg.drain_timeout_s, gt=0, nullable=True)
    _number("rejoin_s", cfg.rejoin_s, ge=0)
    _non_empty("state_dir", cfg.state_dir, nullable=True)
    _number("max_active_cohorts", cfg.max_active_cohorts, ge=1, nullable=True, integer=True)
    if cfg.max_active_bytes != "auto":
        _number("max_active_bytes", cfg.max_active_bytes, ge=1, nullable=True, integer=True,
                expected=_AUTO_EXPECTED["max_active_bytes"])
    if cfg.memory_limit_bytes != "auto":
        _number("memory_limit_bytes", cfg.memory_limit_bytes, ge=1, integer=True,
                expected=_AUTO_EXPECTED["memory_limit_bytes"])
    if cfg.state_sync not in ("normal", "full"):
        raise ConfigError(
            "state_sync", f"must be 'normal' or 'full', got {_show(cfg.state_sync)}"
        )
    _number("request_read_timeout_s", cfg.request_read_timeout_s, gt=0)
    _number("send_timeout_s", cfg.send_timeout_s, gt=0)
    _number("max_compare_responses", cfg.max_compare_responses, ge=2, le=MAX_COMPARE_RESPONSES,
            integer=True)
    _choice("verdict_reuse", cfg.verdict_reuse, ("group", "global", "off"))
    _number("verdict_cache_max_entries", cfg.verdict_cache_max_entries, ge=1,
            le=MAX_VERDICT_CACHE_ENTRIES, integer=True)
    _number("malloc_trim_interval_s", cfg.malloc_trim_interval_s, gt=0, nullable=True)
    _number("malloc_mmap_threshold_bytes", cfg.malloc_mmap_threshold_bytes, ge=4096,
            le=MAX_MMAP_THRESHOLD_BYTES, integer=True, nullable=True)
    level = cfg.log_level.upper() if isinstance(cfg.log_level, str) else cfg.log_level
    if level not in LOG_LEVELS:
        raise ConfigError(
            "log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {_show(cfg.log_level)}"
        )
    if level != cfg.log_level:
        msgspec.structs.force_setattr(cfg, "log_level", level)
    if cfg.log_format not in ("auto", "json", "text"):
        raise ConfigError(
            "log_format", f"must be 'auto', 'json' or 'text', got {_show(cfg.log_format)}"
        )
    _non_empty("auth_token_env", cfg.auth_token_env, nullable=True)
    if cfg.auth_token_env is not None and (
        "=" in cfg.auth_token_env or cfg.auth_token_env.upper().startswith(ENV_PREFIX)
    ):
        # A token pasted where the variable's name belongs would leak through /status, and a
        # GENRM_TRIO_* name is read as a config override (an unknown key) at start.
        raise ConfigError(
            "auth_token_env",
            f"must be the name of an environment variable not starting with {ENV_PREFIX}",
        )


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """A safe loader that rejects duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            mark = key_node.start_mark
            raise ConfigError(
                str(key), f"duplicate key at line {mark.line + 1}, column {mark.column + 1}"
            )
        result[key] = loader.construct_object(value_node, deep=True)
    return result


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _read_yaml_file(path: str | os.PathLike[str]) -> Any:
    """Read and parse the file. Blocks on file I/O. Raises ConfigError (key ``<file>``)."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("<file>", f"cannot read {name}: {_one_line(str(exc))}") from exc
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError("<file>", f"{name}: invalid YAML{where}: {_one_line(problem)}") from exc


def _parse_value(text: str) -> Any:
    """A value from ``--set`` or the environment: YAML if it parses, else the raw string."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except (yaml.YAMLError, ConfigError):
        return text


# --------------------------------------------------------------------------- file shapes


def _iter_nemo_blocks(
    node: Mapping[Any, Any], path: tuple[str, ...], depth: int
) -> Iterator[tuple[tuple[str, ...], dict[Any, Any]]]:
    """Yield ``(path, mapping)`` for every genrm_compare-like ``resources_servers`` entry."""
    servers = node.get("resources_servers")
    if isinstance(servers, dict):
        for name, block in servers.items():
            if isinstance(block, dict) and (
                name == "genrm_compare" or _NEMO_MARKER_KEYS.intersection(block)
            ):
                yield (*path, "resources_servers", str(name)), block
    if depth <= 0:
        return
    for key, value in node.items():
        if key != "resources_servers" and isinstance(value, dict):
            yield from _iter_nemo_blocks(value, (*path, str(key)), depth - 1)


def _select_block(doc: dict[Any, Any]) -> tuple[dict[Any, Any], str]:
    """Find the mapping that holds our keys; also return where it was found, for messages."""
    allowed = _CONFIG_KEYS | NEMO_IGNORED_KEYS
    if any(isinstance(k, str) and k in allowed for k in doc):
        return doc, "the top level"
    blocks = list(_iter_nemo_blocks(doc, (), _SEARCH_DEPTH))
    if len(blocks) == 1:
        path, block = blocks[0]
        return block, ".".join(path)
    if len(blocks) > 1:
        names = ", ".join(".".join(p) for p, _ in blocks)
        raise ConfigError(
            ".".join(blocks[1][0]), f"more than one genrm_compare server block ({names}); keep one"
        )
    first = next(iter(doc))
    raise ConfigError(
        str(first), "unknown key (and no NeMo Gym genrm_compare resources_servers block found)"
    )


def _file_tree(doc: Any) -> dict[str, Any]:
    """Turn a parsed file into a plain tree of our keys (NeMo-only keys dropped)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError("<file>", f"the top level must be a mapping, got {type(doc).__name__}")
    if not doc:
        return {}
    block, where = _select_block(doc)
    return _block_tree(block, where)


def _block_tree(block: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """Our keys of one server mapping (NeMo-only keys dropped); ``where`` names it in messages."""
    tree: dict[str, Any] = {}
    for key, value in block.items():
        if not isinstance(key, str) or key not in _CONFIG_KEYS | NEMO_IGNORED_KEYS:
            raise ConfigError(str(key), f"unknown key (in {where})")
        if key in NEMO_IGNORED_KEYS:
            continue
        if key in _NEMO_NULLABLE_KEYS and value is None:
            continue
        tree[key] = value
    return tree


# --------------------------------------------------------------------------- overrides


def _set_dotted(tree: dict[str, Any], key: str, value: Any, source: str) -> None:
    """Apply one override to ``tree``: a dotted key sets one leaf; a whole ``judge`` mapping
    merges into the file's (its fields are keys of their own); any other whole value replaces."""
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(key, f"malformed key ({source})")
    top = parts[0]
    if top not in _CONFIG_KEYS:
        raise ConfigError(key, f"unknown key ({source})")
    if top in _NESTED:
        if len(parts) == 1:
            current = tree.get(top)
            if isinstance(value, dict) and isinstance(current, dict):
                tree[top] = {**current, **value}
            else:
                tree[top] = value
            return
        if len(parts) > 2 or parts[1] not in _NESTED[top].__struct_fields__:
            raise ConfigError(key, f"unknown key ({source})")
        current = tree.get(top)
        if current is None:
            current = {}
        if not isinstance(current, dict):
            raise ConfigError(top, f"expected a mapping, got {_show(current)}")
        tree[top] = {**current, parts[1]: value}
        return
    if len(parts) == 1:
        tree[top] = value
        return
    if top not in _DICT_KEYS:
        raise ConfigError(key, f"unknown key ({top} has no sub-keys; {source})")
    node = tree.get(top)
    if node is None:
        node = dict(_default_judge_params())
    if not isinstance(node, dict):
        raise ConfigError(top, f"expected a mapping, got {_show(node)}")
    node = dict(node)
    tree[top] = node
    walked = top
    for part in parts[1:-1]:
        walked = f"{walked}.{part}"
        child = node.get(part)
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(walked, f"expected a mapping to set {key}, got {_show(child)}")
        node[part] = child = dict(child)
        node = child
    node[parts[-1]] = value


def _env_overrides(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """``(dotted key, raw value, source)`` for every ``GENRM_TRIO_*`` variable, sorted by name."""
    found = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        key = ".".join(name[len(ENV_PREFIX) :].lower().split("__"))
        found.append((key, env[name], f"from environment variable {name}"))
    return found


def _parse_override(item: str) -> tuple[str, str, str]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(key or item, f"expected KEY=VALUE, got --set {_show(item)}")
    return key, raw, f"from --set {_show(item)}"


def format_override(key: str, value: Any) -> str:
    """Return a ``KEY=VALUE`` string for :func:`load_config`'s ``overrides`` (the CLI's ``--set``).

    ``value`` is written as JSON, which YAML reads back unchanged, so lists of URLs containing
    commas or brackets survive: ``format_override("judge.base_urls", urls)``. Never blocks.
    """
    return f"{key}={msgspec.json.encode(value).decode()}"


# --------------------------------------------------------------------------- conversion

_AT_PATH = re.compile(r" - at (.*)$")
_BACKTICKED = re.compile(r"`([^`]*)`")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `([^`]*)`")
_INDEX = re.compile(r"\[(\d+)\]")
_TYPE_WORDS = re.compile(r"\b(array|object)\b")
_TYPE_NAMES = MappingProxyType({"array": "list", "object": "mapping"})


def _path_to_key(path: str) -> str:
    return path.removeprefix("$").removeprefix(".")


def _lookup(tree: Any, key: str) -> tuple[bool, Any]:
    """The value at a dotted key with ``[i]`` indexes, if present."""
    node = tree
    for part in key.split("."):
        name, _, rest = part.partition("[")
        if name:
            if not isinstance(node, dict) or name not in node:
                return False, None
            node = node[name]
        for index in _INDEX.findall("[" + rest if rest else ""):
            if not isinstance(node, list | tuple) or int(index) >= len(node):
                return False, None
            node = node[int(index)]
    return True, node


def _literal_choices(key: str) -> tuple[Any, ...]:
    top, dot, rest = key.partition(".")
    struct: Any = _NESTED[top] if dot and top in _NESTED else Config
    name = rest if dot and top in _NESTED else key
    for field in msgspec.structs.fields(struct):
        if field.name == name and get_origin(field.type) is Literal:
            return get_args(field.type)
    return ()


def _translate(
    exc: msgspec.ValidationError, tree: dict[str, Any], sources: dict[str, str]
) -> ConfigError:
    """Turn msgspec's ``... - at `$.a.b``` message into a ConfigError naming ``a.b``."""
    message = str(exc)
    key = ""
    match = _AT_PATH.search(message)
    if match:
        paths = [p for p in _BACKTICKED.findall(match.group(1)) if p.startswith("$")]
        key = _path_to_key(paths[-1]) if paths else ""
        message = message[: match.start()]
    unknown = _UNKNOWN_FIELD.match(message)
    if unknown:
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        problem = "unknown key"
    elif key in _AUTO_EXPECTED:
        # msgspec names the union's types (int | str | null) or calls a wrong string an enum
        # value; neither says that the one string allowed is 'auto'.
        value = _lookup(tree, key)[1]
        got = "null" if value is None else f"{_json_type(value)} {_show(value)}"
        problem = f"expected {_AUTO_EXPECTED[key]}, got {got}"
    elif message.startswith("Invalid enum value"):
        problem = "invalid value" + message.removeprefix("Invalid enum value")
        choices = _literal_choices(key)
        if choices:
            problem = f"{problem}; expected one of {', '.join(map(repr, choices))}"
    else:
        problem = _TYPE_WORDS.sub(lambda m: _TYPE_NAMES.get(m.group(1), m.group(1)), message)
        problem = problem.replace("`", "")
        problem = problem[:1].lower() + problem[1:]
        present, value = _lookup(tree, key)
        if present and value is not None and problem.startswith("expected"):
            problem = f"{problem} {_show(value)}"
        choices = _literal_choices(key)
        if choices:
            problem = f"{problem}; expected one of {', '.join(map(repr, choices))}"
    source = _source_for(key, sources)
    if source:
        problem = f"{problem} ({source})"
    return ConfigError(key or "<config>", _one_line(problem))


def _json_type(value: object) -> str:
    """The YAML/JSON name of ``value``'s type, as msgspec's messages name them."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list | tuple):
        return "list"
    return {int: "int", float: "float", str: "str"}.get(type(value), type(value).__name__)


def _source_for(key: str, sources: dict[str, str]) -> str:
    """The override that set ``key`` or its closest parent, if any."""
    matches = [
        set_key
        for set_key in sources
        if key == set_key or key.startswith((set_key + ".", set_key + "["))
    ]
    return sources[max(matches, key=len)] if matches else ""


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Build a validated :class:`Config`: defaults < YAML file < environment < ``overrides``.

    ``path``: the YAML file (our flat keys or a NeMo Gym ``genrm_compare`` block; see the module
    docstring), or ``None`` for defaults only. ``overrides``: ``"KEY=VALUE"`` strings (the CLI's
    ``--set``, ``--host``, ``--port``, ``--judge-url`` all map onto these), applied in order,
    ``KEY`` dotted for nested keys (``judge.api``, ``genrm_responses_create_params.top_p``),
    ``VALUE`` parsed as YAML (``[http://a, http://b]``, ``null``, ``8``); a value that is not
    valid YAML is taken as a plain string. ``env``: the environment to read ``GENRM_TRIO_*``
    variables from; ``None`` means ``os.environ``.

    Blocks only to read the file. Raises :class:`ConfigError` (one line naming the dotted key and
    the problem) for an unreadable or malformed file, an unknown key, a wrong type or a value out
    of range. The returned Config is frozen and owned by the caller.
    """
    tree = _file_tree(_read_yaml_file(path)) if path is not None else {}
    return _layered_config(tree, overrides, env)


def load_config_block(
    block: Mapping[str, Any],
    where: str,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Like :func:`load_config`, with a NeMo Gym server mapping in place of the file.

    ``block``: the server's mapping, already picked out of NeMo Gym's resolved config (see
    :mod:`genrm_trio.nemo_env`); its keys are read as a ``genrm_compare`` block in a file is
    (NeMo-only keys ignored, null ``host``/``port`` keep the default). ``where`` names the block
    in messages. Never blocks beyond what :func:`load_config` does; raises the same
    :class:`ConfigError`.
    """
    return _layered_config(_block_tree(block, where), overrides, env)


def _layered_config(
    tree: dict[str, Any], overrides: Sequence[str], env: Mapping[str, str] | None
) -> Config:
    """Apply the environment and ``overrides`` to the file's ``tree``, then build the Config."""
    for nested in _NESTED:
        if nested in tree and tree[nested] is None:
            del tree[nested]  # `judge:` with every sub-key commented out
    sources: dict[str, str] = {}
    layered = [*_env_overrides(os.environ if env is None else env)]
    layered += [_parse_override(item) for item in overrides]
    for key, raw, source in layered:
        _set_dotted(tree, key, _parse_value(raw), source)
        sources[key] = source
    if tree.get("verdict_reuse") is False:
        # YAML 1.1 reads a bare `off` as false: `verdict_reuse: off` means what it says.
        tree["verdict_reuse"] = "off"
    params = tree.get("genrm_responses_create_params")
    if isinstance(params, dict) and "input" in params:
        tree["genrm_responses_create_params"] = {k: v for k, v in params.items() if k != "input"}
    try:
        return msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise _translate(exc, tree, sources) from exc
    except ConfigError as exc:
        source = _source_for(exc.key, sources)
        if source:
            raise ConfigError(exc.key, f"{exc.problem} ({source})") from exc
        raise


# --------------------------------------------------------------------------- summary


def _redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{parts.username}:***@{host}", parts.path, "", ""))


def _is_secret_key(key: str) -> bool:
    return bool(_SECRET_WORDS.intersection(key.lower().replace("-", "_").split("_")))


def _redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: "***"
            if isinstance(k, str) and _is_secret_key(k)
            else _redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


def config_summary(cfg: Config) -> dict[str, Any]:
    """The configuration as plain JSON-able values, for ``GET /status``. Never blocks.

    Holds no secret: ``judge.api_key_env`` is the variable's name (its value is never read
    here), passwords in ``judge.base_urls`` and values under secret-looking keys (``*key*``,
    ``*token*``, ``*secret*``, ``*password*``, ``*authorization*``, ``*cookie*``) in
    ``genrm_responses_create_params`` are replaced by ``"***"``. The dict is new, owned by the
    caller.
    """
    summary: dict[str, Any] = msgspec.to_builtins(cfg)
    summary["judge"]["base_urls"] = [_redact_url(u) for u in cfg.judge.base_urls]
    summary["genrm_responses_create_params"] = _redact(summary["genrm_responses_create_params"])
    return summary
