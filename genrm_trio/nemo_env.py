"""The server block NeMo Gym hands to a server it launches, read from the environment (pure core).

NeMo Gym 0.7.0's ``gym env start`` (``nemo_gym/cli/env.py``, ``RunHelper._start``) starts every
config block that has an ``entrypoint`` as ``<venv>/bin/python <entrypoint>`` in the server's
folder (``resources_servers/<server name>/`` under its search roots), with two variables set:

* ``NEMO_GYM_CONFIG_DICT``: the whole merged config as YAML (``OmegaConf.to_yaml``), host and
  port filled in for every launched block, but ``${...}`` interpolations left unresolved (NeMo
  Gym's own servers resolve them when they read their block);
* ``NEMO_GYM_CONFIG_PATH``: the launched block's top-level key.

The server's own mapping is ``config[path][<server type>][<server name>]``; NeMo Gym's servers
take the first entry at each level, and a server type holds exactly one server. NeMo Gym's
clients (agents, the collector) call that block's host and port.

:func:`read_nemo_env` takes an environment mapping, checks that the block is a resources server
with a host and a port, resolves the interpolations in the keys genrm-trio reads, and returns the
block for :func:`genrm_trio.config.load_config_block`, which loads it like a NeMo Gym
``genrm_compare`` block in a YAML file (NeMo-only keys ignored). Interpolations resolved: an
absolute key path (``${num_repeats}``, ``${a.b.c}``, list items as ``${a.0}``), whole values or
inside a string, and ``${oc.env:NAME}`` / ``${oc.env:NAME,default}`` from the same environment
mapping (the value read as YAML, like a ``GENRM_TRIO_*`` override); anything else (relative
paths, other resolvers) is a one-line error naming the key.

NeMo Gym's ``genrm_model_server`` reference (genrm_compare's judge: a model server block of the
same config) decides the judge: ``judge.base_urls`` becomes that server's address, unless the
block sets ``judge.base_urls`` or ``judge.plugin`` itself. The NeMo Gym ``genrm_model`` server
speaks the protocol of our default ``judge.api: responses`` with ``judge.prompt: genrm_roles``.

Never blocks, never reads the process environment itself. Every problem raises
:class:`~genrm_trio.errors.ConfigError` whose key names the variable, and the path inside the
config when there is one (``NEMO_GYM_CONFIG_DICT.genrm_trio.resources_servers.genrm_trio.port``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec
import yaml

from genrm_trio.config import Config
from genrm_trio.errors import ConfigError

CONFIG_DICT_VAR = "NEMO_GYM_CONFIG_DICT"
CONFIG_PATH_VAR = "NEMO_GYM_CONFIG_PATH"
RESOURCES_SERVERS = "resources_servers"
_MODEL_SERVERS = "responses_api_models"
_LAUNCHED_BY = "gym env start sets it for every server it launches"
_OUR_KEYS = frozenset(Config.__struct_fields__)
_INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")
_MAX_INTERPOLATION_DEPTH = 16
_VALUE_REPR_CHARS = 60


class NemoServerBlock(msgspec.Struct, frozen=True, kw_only=True):
    """One resources-server block of NeMo Gym's resolved config, ready for the config loader.

    ``block`` is the server's mapping (``host`` and ``port`` set by NeMo Gym), interpolations
    resolved in genrm-trio's keys. ``judge_server`` and ``judge_url``: the model server that
    ``genrm_model_server`` names (its top-level key) and its address, when that reference decides
    the judge. The caller owns it.
    """

    top_level_key: str
    server_name: str
    block: dict[str, Any]
    host: str
    port: int
    judge_server: str | None = None
    judge_url: str | None = None

    @property
    def where(self) -> str:
        """Where the block sits in the config, dotted, for messages."""
        return f"{self.top_level_key}.{RESOURCES_SERVERS}.{self.server_name}"

    @property
    def url(self) -> str:
        """The address NeMo Gym's clients call."""
        return _url(self.host, self.port)

    def config_block(self) -> dict[str, Any]:
        """The mapping for :func:`genrm_trio.config.load_config_block`: ``block`` with
        ``judge.base_urls`` set to ``judge_url`` when there is one. New, owned by the caller."""
        if self.judge_url is None:
            return dict(self.block)
        judge = self.block.get("judge")
        judge_keys = dict(judge) if isinstance(judge, dict) else {}
        judge_keys["base_urls"] = [self.judge_url]
        return {**self.block, "judge": judge_keys}


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > _VALUE_REPR_CHARS:
        text = text[: _VALUE_REPR_CHARS - 3] + "..."
    return text


def _parse_config_dict(text: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(CONFIG_DICT_VAR, f"not valid YAML{where}: {_one_line(problem)}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(
            CONFIG_DICT_VAR, f"must be a mapping of top-level keys, got {type(doc).__name__}"
        )
    return doc


# --------------------------------------------------------------------------- interpolation


class _Resolver:
    """Resolves OmegaConf-style ``${...}`` interpolations against one config and environment."""

    def __init__(self, doc: dict[str, Any], env: Mapping[str, str]) -> None:
        self._doc = doc
        self._env = env

    def value(self, value: Any, key: str, depth: int = 0) -> Any:
        """``value`` with every interpolation resolved; ``key`` names it in messages."""
        if depth > _MAX_INTERPOLATION_DEPTH:
            raise ConfigError(key, "interpolations nest too deep (a reference cycle?)")
        if isinstance(value, dict):
            return {k: self.value(v, f"{key}.{k}", depth) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, f"{key}[{i}]", depth) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERPOLATION.fullmatch(value)
        if whole is not None:  # the referenced value keeps its type, as in OmegaConf
            return self._reference(whole.group(1), key, depth)
        text = _INTERPOLATION.sub(
            lambda m: str(self._reference(m.group(1), key, depth)), value)
        if "${" in text:
            raise ConfigError(key, f"cannot resolve the interpolation in {_show(value)}")
        return text

    def _reference(self, expr: str, key: str, depth: int) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.env:"):
            name, sep, default = expr.removeprefix("oc.env:").partition(",")
            raw = self._env.get(name.strip())
            if raw is None:
                if not sep:
                    raise ConfigError(key, f"${{{expr}}}: environment variable {name.strip()!r} "
                                           "is not set")
                raw = default.strip()
            return self.value(_yaml_scalar(raw), key, depth + 1)
        if ":" in expr or expr.startswith(".") or not expr:
            raise ConfigError(key, f"${{{expr}}}: only absolute key paths and oc.env are "
                                   "resolved here")
        node: Any = self._doc
        for part in expr.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ConfigError(key, f"${{{expr}}} names no key of {CONFIG_DICT_VAR}")
        return self.value(node, key, depth + 1)


def _yaml_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


# --------------------------------------------------------------------------- the block


def _only_entry(node: Any, key: str, what: str) -> tuple[str, Any]:
    """The first (NeMo Gym: the only) entry of the mapping at ``key``."""
    if not isinstance(node, dict) or not node:
        raise ConfigError(key, f"expected a mapping holding one {what}, got {_show(node)}")
    name, value = next(iter(node.items()))
    return str(name), value


def _server_block(doc: dict[str, Any], top: str) -> tuple[str, str, dict[str, Any]]:
    """Server type, server name and mapping of the block under top-level key ``top``."""
    key = f"{CONFIG_DICT_VAR}.{top}"
    server_type, servers = _only_entry(doc[top], key, "server type")
    name, block = _only_entry(servers, f"{key}.{server_type}", "server")
    if not isinstance(block, dict):
        raise ConfigError(f"{key}.{server_type}.{name}",
                          f"expected a server mapping, got {_show(block)}")
    return server_type, name, block


def _address(block: dict[str, Any], where: str, resolver: _Resolver) -> tuple[str, int]:
    host = resolver.value(block.get("host"), f"{where}.host")
    port = resolver.value(block.get("port"), f"{where}.port")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{where}.host", f"not set ({_LAUNCHED_BY})")
    if isinstance(port, bool) or not isinstance(port, int):
        raise ConfigError(f"{where}.port", f"not set to a port number ({_LAUNCHED_BY})")
    return host, port


def _judge_from_model_server(
    doc: dict[str, Any], block: dict[str, Any], where: str, resolver: _Resolver
) -> tuple[str, str] | None:
    """The model server ``genrm_model_server`` names and its URL, when it decides the judge."""
    ref = resolver.value(block.get("genrm_model_server"), f"{where}.genrm_model_server")
    judge = block.get("judge")
    if not isinstance(ref, dict) or ref.get("type") != _MODEL_SERVERS:
        return None
    if isinstance(judge, dict) and (judge.get("base_urls") or judge.get("plugin")):
        return None  # our own judge keys win over NeMo Gym's reference
    name = ref.get("name")
    key = f"{where}.genrm_model_server.name"
    if not isinstance(name, str) or not isinstance(doc.get(name), dict):
        raise ConfigError(key, f"names {_show(name)}, which is not a top-level key of the config")
    server_type, server_name, model_block = _server_block(doc, name)
    if server_type != _MODEL_SERVERS:
        raise ConfigError(key, f"names {name!r}, which is a {server_type} block, not a "
                               f"{_MODEL_SERVERS} block")
    host, port = _address(model_block, f"{CONFIG_DICT_VAR}.{name}.{server_type}.{server_name}",
                          resolver)
    return name, _url(host, port)


def read_nemo_env(env: Mapping[str, str]) -> NemoServerBlock:
    """The resources-server block NeMo Gym launched this process for, from ``env``.

    ``env``: the process environment (``os.environ``) or any mapping standing in for it; it is
    read for ``NEMO_GYM_CONFIG_DICT``, ``NEMO_GYM_CONFIG_PATH`` and the variables that
    ``${oc.env:...}`` interpolations name. Never blocks. Raises :class:`ConfigError` when a
    variable is missing or empty, the config is not a YAML (or JSON) mapping, the path is not one
    of its top-level keys, the block there is not a ``resources_servers`` block, its host or port
    is not set, an interpolation cannot be resolved, or ``genrm_model_server`` names no model
    server of the config. The returned block is new and owned by the caller.
    """
    text = env.get(CONFIG_DICT_VAR, "")
    top = env.get(CONFIG_PATH_VAR, "")
    for name, value in ((CONFIG_DICT_VAR, text), (CONFIG_PATH_VAR, top)):
        if not value.strip():
            raise ConfigError(name, f"not set ({_LAUNCHED_BY})")
    doc = _parse_config_dict(text)
    if top not in doc:
        shown = ", ".join(sorted(map(str, doc))[:8]) or "none"
        raise ConfigError(CONFIG_PATH_VAR,
                          f"{top!r} is not a top-level key of {CONFIG_DICT_VAR} (it has: {shown})")
    server_type, server_name, raw = _server_block(doc, top)
    if server_type != RESOURCES_SERVERS:
        raise ConfigError(
            f"{CONFIG_DICT_VAR}.{top}", f"is a {server_type} block, not a {RESOURCES_SERVERS} "
            "block: genrm-trio is a resources server",
        )
    at = f"{CONFIG_DICT_VAR}.{top}.{RESOURCES_SERVERS}.{server_name}"
    resolver = _Resolver(doc, env)
    host, port = _address(raw, at, resolver)
    # Only our keys are resolved: the loader ignores NeMo-only keys, whatever they hold.
    block = {k: resolver.value(v, f"{at}.{k}") if k in _OUR_KEYS else v for k, v in raw.items()}
    judge = _judge_from_model_server(doc, raw, at, resolver)
    judge_server, judge_url = judge if judge is not None else (None, None)
    return NemoServerBlock(top_level_key=top, server_name=server_name, block=block, host=host,
                           port=port, judge_server=judge_server, judge_url=judge_url)


def check_served_address(found: NemoServerBlock, host: str, port: int) -> None:
    """Raise :class:`ConfigError` unless the server is to listen where NeMo Gym's clients call.

    ``host`` and ``port``: the loaded config's, after the environment and ``--set`` overrides,
    which must not move the server off the block's address (nothing would reach it). Never blocks.
    """
    for key, ours, nemo in (("host", host, found.host), ("port", port, found.port)):
        if ours != nemo:
            raise ConfigError(
                key, f"{_show(ours)} differs from {_show(nemo)} in NeMo Gym's block "
                f"{found.where}, which NeMo Gym's clients call; drop the override",
            )


def check_external_block(found: NemoServerBlock) -> None:
    """Raise :class:`ConfigError` if a block that names an external genrm-trio sets our keys.

    Such a block only says where the server runs (``host``, ``port``) plus NeMo-only keys; a
    genrm_compare key there would have no effect, since the external server reads its own
    configuration. Never blocks.
    """
    for key in found.block:
        if key in _OUR_KEYS and key not in ("host", "port"):
            raise ConfigError(
                f"{found.where}.{key}", "has no effect here: the external genrm-trio at "
                f"{found.url} reads its own --config and --set; set it there",
            )
