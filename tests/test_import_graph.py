"""The shape of ``sparrow_nemo``: no import cycle between packages or between modules, no overlong module.

Every import statement counts, wherever it is: at the top, inside a function (a lazy import) or under
``if TYPE_CHECKING:`` (a type-only import is still a dependency). A package is a direct subpackage of
``sparrow_nemo`` (``grpo``, ``rollout``, ...); a top-level module (``model_shapes``, ``cli``) is its own node.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import sparrow_nemo

ROOT = Path(sparrow_nemo.__file__).resolve().parent

#: package cycles still in the tree, each with the change that removes it. The test fails when one is
#: gone (delete its entry) and on any other cycle.
KNOWN_PACKAGE_CYCLES: dict[frozenset[str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: Path, name: str, known: Iterable[str]) -> set[str]:
    """The sparrow_nemo modules ``path`` imports (``from pkg import mod`` resolves to ``pkg.mod``)."""
    known = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<sparrow_nemo>"


def _cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _witness(edges: Mapping[str, set[str]], component: list[str]) -> str:
    """One edge list inside a cycle, for the failure message."""
    members = set(component)
    return "; ".join(
        f"{a} -> {', '.join(sorted(edges[a] & members))}" for a in component if edges[a] & members
    )


def test_no_module_imports_itself_around_a_cycle() -> None:
    edges = _graph()
    cycles = _cycles(edges)
    assert not cycles, "module import cycles: " + " | ".join(_witness(edges, c) for c in cycles)


def test_no_package_cycle() -> None:
    modules = _graph()
    edges: dict[str, set[str]] = {}
    via: dict[tuple[str, str], str] = {}
    for module, targets in modules.items():
        for target in targets:
            a, b = _package(module), _package(target)
            if a != b and not module.endswith("sparrow_nemo"):
                edges.setdefault(a, set()).add(b)
                via.setdefault((a, b), f"{module} -> {target}")
    for package in {_package(m) for m in modules}:
        edges.setdefault(package, set())
    cycles = _cycles(edges)
    new = [c for c in cycles if frozenset(c) not in KNOWN_PACKAGE_CYCLES]
    detail = [
        " , ".join(via[(a, b)] for a in c for b in sorted(edges[a] & set(c)) if (a, b) in via) for c in new
    ]
    assert not new, f"package cycles {new}: " + " | ".join(detail)
    gone = [sorted(k) for k in KNOWN_PACKAGE_CYCLES if sorted(k) not in cycles]
    assert not gone, f"these package cycles are gone: delete them from KNOWN_PACKAGE_CYCLES: {gone}"


#: the layering of the rooms, as imports a package must not make: run output (``run_io``) knows no loop and no
#: worker (the trainer passes it numbers and folders); the policy worker (its refit included) and the rollout
#: engines know no loop and no run output.
FORBIDDEN_IMPORTS: dict[str, set[str]] = {
    "run_io": {"grpo", "policy", "rollout", "callbacks", "control", "evaluation", "commands", "experiments"},
    "policy": {"grpo", "run_io", "callbacks", "control", "commands", "experiments"},
    "rollout": {"grpo", "policy", "run_io", "commands", "experiments"},
}


def test_packages_keep_their_layer() -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _package(target) in FORBIDDEN_IMPORTS.get(_package(module), set())
    )
    assert not wrong, f"imports across the layering (FORBIDDEN_IMPORTS): {wrong}"


def test_the_graph_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    # the walker must not miss an import inside a function or under TYPE_CHECKING
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparrow_nemo.a import X\n"
        "def f():\n    import sparrow_nemo.b.c\n"
    )
    known = {"sparrow_nemo.a", "sparrow_nemo.b", "sparrow_nemo.b.c"}
    assert _imports(source, "sparrow_nemo.z", known) == {"sparrow_nemo.a", "sparrow_nemo.b.c"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


#: the longest a module may grow: "about 600 lines" (issue 22; policy/plan.py is at 617)
MAX_MODULE_LINES = 650


def test_no_module_over_the_line_limit() -> None:
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    over = {n: lines for n, lines in long.items() if lines > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them): {over}"


#: packages the Sparrow controller (``control/``) must not import: it sits below the loop that applies its
#: decisions and the user callbacks that see its reports
ABOVE_CONTROL = ("grpo", "callbacks", "commands", "experiments", "cli")


def test_control_is_below_grpo() -> None:
    graph = _graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _package(module) == "control"
        for target in targets
        if _package(target) in ABOVE_CONTROL
    )
    assert not upward, f"control/ imports a package above it: {upward}"
    assert any(_package(m) == "grpo" and any(_package(t) == "control" for t in ts) for m, ts in graph.items())
