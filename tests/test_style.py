"""Style rules that the suite enforces: ruff, mypy, and the one-way import direction."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import background
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "weft"

# package -> packages it must never import (DESIGN: server -> engine -> {model, sample, structured,
# speculative} -> core; agents (tool calls, reasoning) and parallel (ranks' shards) sit on core alone)
ABOVE_AGENTS = [
    "weft.engine", "weft.model", "weft.sample", "weft.structured", "weft.cuda", "weft.llm", "weft.server",
]  # fmt: skip
FORBIDDEN = {
    "model": ["weft.engine", "weft.sample", "weft.structured", "weft.llm", "weft.server"],
    "speculative": ["weft.engine", "weft.model", "weft.cuda", "weft.llm", "weft.server"],
    "agents": [*ABOVE_AGENTS, "weft.speculative", "weft.parallel"],
    "parallel": [*ABOVE_AGENTS, "weft.speculative", "weft.agents"],
    "sample": ["weft.model", "weft.engine", "weft.llm", "weft.server"],
    "structured": ["weft.model", "weft.engine", "weft.llm", "weft.server"],
    "engine": ["weft.llm", "weft.server", "weft.cli"],
    "cuda": ["weft.model", "weft.engine", "weft.sample", "weft.structured", "weft.llm", "weft.server"],
    "server": ["weft.cli"],
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_imports_go_one_way(subpackage):
    for path in (PACKAGE / subpackage).rglob("*.py"):
        for module in imported_modules(path):
            for banned in FORBIDDEN[subpackage]:
                assert not module.startswith(banned), f"{path.relative_to(ROOT)} imports {module}"


# The core modules that every package may import import none of the packages above them.
CORE = [
    "arrays.py",
    "config.py",
    "params.py",
    "schema_objects.py",
    "outputs.py",
    "fields.py",
    "tokenizer.py",
    "detokenize.py",
    "kernels.py",
    "kv_format.py",
    "ops.py",
    "native/__init__.py",
]
ABOVE_CORE = [  # every package of weft, and the modules at the top
    "weft.agents",
    "weft.bench",
    "weft.cuda",
    "weft.default_model",
    "weft.engine",
    "weft.model",
    "weft.parallel",
    "weft.sample",
    "weft.speculative",
    "weft.structured",
    "weft.llm",
    "weft.server",
    "weft.cli",
    "weft.demo",
]


def test_the_core_test_knows_every_package():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} - {"native"}
    assert {f"weft.{p}" for p in packages} <= set(ABOVE_CORE)


@pytest.mark.parametrize("module", CORE)
def test_core_modules_import_no_package_above_them(module):
    for imported in imported_modules(PACKAGE / module):
        assert not imported.startswith(tuple(ABOVE_CORE)), f"weft/{module} imports {imported}"


def module_graph() -> dict[str, set[str]]:
    """weft's modules -> the weft modules each imports (anywhere in it, TYPE_CHECKING blocks and
    imports inside functions included)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}
    modules = {name.removesuffix(".__init__"): path for name, path in paths.items()}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:  # `from weft.engine import group` imports weft.engine.group
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_cycle():
    graph = module_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


MAX_FUNCTION_LINES = 60


def test_functions_are_short():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                num_lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({num_lines} lines)")
    assert not long, "functions over 60 lines: " + ", ".join(long)


def _function_lines(path: Path, name: str) -> int:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return (node.end_lineno or node.lineno) - node.lineno + 1
    raise AssertionError(f"no function {name} in {path}")


def test_the_step_is_laid_out_once():
    """The engine's step stays in its shape (one step layout, speculation a component, sequences
    holding their own state): the scheduler <= 380 lines, `ModelRunner.plan` <= 30, a `Sequence` of
    <= 20 fields, and no branch of the engine on whether speculation is on."""
    import dataclasses

    from weft.engine.sequence import Sequence

    engine = PACKAGE / "engine"
    assert len((engine / "scheduler.py").read_text().splitlines()) <= 380
    assert _function_lines(engine / "runner.py", "plan") <= 30
    assert len(dataclasses.fields(Sequence)) <= 20, [f.name for f in dataclasses.fields(Sequence)]
    assert "speculation is None" not in (engine / "engine.py").read_text()
    assert "speculation is not None" not in (engine / "engine.py").read_text()


def _tool(name: str) -> list[str]:
    if shutil.which(name) is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [sys.executable, "-m", name]


def test_ruff_clean():
    result = subprocess.run(
        [*_tool("ruff"), "check", "weft", "tests", "tools"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.background
def test_mypy_clean():
    """mypy over the package: started at collection, in the background (tests/background.py)."""
    command = _tool("mypy")
    if not background.started("mypy"):
        background.start("mypy", command)
    code, output = background.finish("mypy")
    assert code == 0, output
