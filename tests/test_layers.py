"""The package's layering (docs/architecture.md §1): every ``sidejax`` import in a module is allowed by the
module's layer, so nothing imports upwards and there are no cycles between layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sidejax"

# top-level part of the module path -> the sidejax parts it may import (besides itself)
BASE = {"types", "utils", "bits", "keys"}
ALLOWED = {
    "types": set(),
    "utils": {"types"},
    "bits": {"types"},
    "keys": {"types", "utils"},
    "distributions": BASE,
    "blocks": BASE,
    "layout": BASE,
    "metrics": BASE,
    "lattices": {"types", "utils"},
    "privacy": {"types", "utils"},
    "bayes": {"types", "utils", "keys"},
    "coding": BASE | {"distributions", "blocks", "layout", "lattices"},
    "data": BASE,
    "models": BASE,
    "fl": BASE | {"distributions", "blocks", "layout", "metrics", "lattices", "coding"},
    "algorithms": BASE
    | {"distributions", "blocks", "layout", "metrics", "lattices", "privacy", "bayes", "coding", "fl"},
    # transports: the round's parties apart (sidejax.flower), above the engine, beside the algorithms
    "flower": BASE | {"coding", "fl"},
    "__init__": None,  # the package root re-exports everything
}


def _part(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sidejax."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "sidejax":
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("sidejax."))
    return out


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_module_imports_only_lower_layers(path):
    part = _part(path)
    assert part in ALLOWED, f"{path}: add its layer to docs/architecture.md and to ALLOWED here"
    allowed = ALLOWED[part]
    if allowed is None:
        return
    bad = sorted(_imports(path) - allowed - {part})
    assert not bad, f"{path.relative_to(ROOT)} (layer {part!r}) imports {bad}; allowed: {sorted(allowed)}"


def test_fl_coding_imports_are_the_contract_only():
    """The engine depends on the Coder contract's messages, not on any particular coder."""
    for path in (ROOT / "fl").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sidejax.coding"):
                assert node.module == "sidejax.coding.base", f"{path.name} imports {node.module}"


EXPERIMENTS = ROOT.parent / "experiments"


def _experiment_imports(path: Path) -> set[str]:
    """The ``experiments`` modules ``path`` imports, at module level or inside functions (a lazy import is
    still a dependency), leaving out imports only for type checkers (``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(node)
        for top in ast.walk(tree)
        if isinstance(top, ast.If) and ast.unparse(top.test).endswith("TYPE_CHECKING")
        for node in ast.walk(top)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "experiments":
            out.update(f"experiments.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("experiments."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("experiments."))
    return out


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_experiments_import_graph_has_no_cycle():
    """docs/architecture.md §1: the experiment layer imports downwards only (no two modules that need each
    other), and the library never imports the experiments."""
    graph = {_module_name(p): _experiment_imports(p) for p in sorted(EXPERIMENTS.rglob("*.py"))}
    for name in graph:  # an import of a package's module also names the package: keep modules only
        graph[name] = {m for m in graph[name] if m in graph and m != name}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep] if dep in path else [name, dep]
                raise AssertionError(f"import cycle in experiments/: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    for path in MODULES:
        text = path.read_text()
        assert "import experiments" not in text and "from experiments" not in text, (
            f"{path.relative_to(ROOT.parent)} imports the experiments: the library must not depend on them"
        )
