"""The package's arrows point one way (STYLE.md, "Layout"): a small check of import statements.

It reads every module of ``genrm_trio`` with :mod:`ast` (no import runs), takes every ``import``
and ``from ... import`` in it, at module level or inside a function alike (a lazy import is an
arrow too), and checks three things:

- no cycle between modules;
- the tools (``bench``, ``mock``, ``torture``, ``demo``) are on top: nothing in ``server/``,
  ``caller/`` or the core imports one, and the server never imports the caller;
- the trainer hooks (``integrations/``) stand beside the caller: nothing in ``server/``,
  ``caller/`` or the core imports them, and they import only the core and each other (they talk
  to the server over HTTP, never by import);
- a tool package may use another tool package only by its public names (no ``_private`` name,
  no ``_private`` module).

``cli.py`` loads the commands by name (``importlib``), so it is no arrow here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "genrm_trio"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
TOOLS = ("bench", "mock", "torture", "demo")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every import of ``genrm_trio`` in the file."""
    is_package = path.name == "__init__.py"
    out: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, "") if sub in modules else (base, alias.name))
    return out


def graph(modules: dict[str, Path]) -> dict[str, list[tuple[str, str]]]:
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def tool_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in TOOLS else None


def side_of(module: str) -> str:
    """``tool``, ``server``, ``caller``, ``integrations``, ``cli`` or ``core``."""
    parts = module.split(".")
    if tool_of(module):
        return "tool"
    if len(parts) > 1 and parts[1] in ("server", "caller", "integrations", "cli"):
        return parts[1]
    return "core"


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def violations(modules: dict[str, Path] | None = None) -> list[str]:
    modules = modules if modules is not None else all_modules()
    g = graph(modules)
    out: list[str] = []
    edges = {m: {t for t, _ in targets if t in modules and t != m} for m, targets in g.items()}
    cycle = find_cycle(edges)
    if cycle:
        out.append("import cycle: " + " -> ".join(cycle))
    for module, targets in sorted(g.items()):
        side = side_of(module)
        for target, imported in targets:
            if side in ("server", "caller", "core") and side_of(target) == "tool":
                out.append(f"{module} ({side}) imports the tool {target}")
            if side == "server" and side_of(target) == "caller":
                out.append(f"{module} (server) imports the caller {target}")
            if side in ("server", "caller", "core") and side_of(target) == "integrations":
                out.append(f"{module} ({side}) imports the trainer hook {target}")
            if side == "integrations" and side_of(target) not in ("core", "integrations"):
                out.append(f"{module} (integrations) imports {side_of(target)}'s {target}")
            mine, theirs = tool_of(module), tool_of(target)
            if mine and theirs and mine != theirs:
                private_module = any(p.startswith("_") for p in target.split("."))
                if private_module or imported.startswith("_"):
                    shown = f"{target}.{imported}" if imported else target
                    out.append(f"{module} imports {theirs}'s private {shown}")
    return out


def test_the_walk_sees_the_packages() -> None:
    modules = all_modules()
    assert {"genrm_trio.bench.cli", "genrm_trio.mock.judge", "genrm_trio.torture.local",
            "genrm_trio.server.app", "genrm_trio.caller.collect", "genrm_trio.integrations.client",
            "genrm_trio.integrations.trl", "genrm_trio.integrations.verl",
            "genrm_trio.integrations.slime"} <= set(modules)
    g = graph(modules)
    assert ("genrm_trio.bench.loadgen", "") in g["genrm_trio.bench.rig"]
    # a lazy import inside a function counts
    assert any(t == "genrm_trio.bench.wrk" for t, _ in g["genrm_trio.bench.cases.scaleout"])


def test_imports_point_one_way() -> None:
    assert violations() == []


def test_the_check_catches_bad_arrows(tmp_path: Path) -> None:
    """Each rule fails on a planted bad import (copies of three modules, the package untouched)."""
    modules = all_modules()

    def planted(module: str, line: str) -> list[str]:
        path = tmp_path / (module.replace(".", "_") + ".py")
        path.write_text(modules[module].read_text(encoding="utf-8") + "\n" + line + "\n")
        return violations({**modules, module: path})

    assert planted("genrm_trio.server.app", "from genrm_trio.mock.faults import Fault") == [
        "genrm_trio.server.app (server) imports the tool genrm_trio.mock.faults"]
    assert planted("genrm_trio.errors", "import genrm_trio.mock.http") == [
        "genrm_trio.errors (core) imports the tool genrm_trio.mock.http"]
    assert planted("genrm_trio.demo", "from genrm_trio.mock.judge import _Server") == [
        "genrm_trio.demo imports mock's private genrm_trio.mock.judge._Server"]
    assert planted("genrm_trio.server.app", "import genrm_trio.integrations.client") == [
        "genrm_trio.server.app (server) imports the trainer hook genrm_trio.integrations.client"]
    assert planted("genrm_trio.caller.collect",
                   "from genrm_trio.integrations.trl import GenRMReward") == [
        "genrm_trio.caller.collect (caller) imports the trainer hook genrm_trio.integrations.trl"]
    assert planted("genrm_trio.wire", "from genrm_trio.integrations import client") == [
        "genrm_trio.wire (core) imports the trainer hook genrm_trio.integrations.client"]
    assert planted("genrm_trio.integrations.trl",
                   "from genrm_trio.server.cohort import CohortRegistry") == [
        "genrm_trio.integrations.trl (integrations) imports server's genrm_trio.server.cohort"]
    assert planted("genrm_trio.integrations.client", "import genrm_trio.caller.collect") == [
        "genrm_trio.integrations.client (integrations) imports caller's genrm_trio.caller.collect"]
    assert planted("genrm_trio.integrations.client", "from genrm_trio.mock import judge") == [
        "genrm_trio.integrations.client (integrations) imports tool's genrm_trio.mock.judge"]
    assert planted("genrm_trio.integrations.verl", "from genrm_trio.server import app") == [
        "genrm_trio.integrations.verl (integrations) imports server's genrm_trio.server.app"]
    assert planted("genrm_trio.server.cohort", "from genrm_trio.integrations import slime") == [
        "genrm_trio.server.cohort (server) imports the trainer hook genrm_trio.integrations.slime"]
    (cycle,) = planted("genrm_trio.bench.records", "from genrm_trio.bench.run import run_bench")
    assert cycle.startswith("import cycle: ") and "genrm_trio.bench.records" in cycle
