"""The import graph of `cortex_worker` and `cortex_api`, read with `ast` (nothing is imported).

Every import of a project module counts: at the top of a module, inside a function (it runs
when the function does) and under `if TYPE_CHECKING:` (it ties the layers together all the
same). Relative imports and `from pkg import module` are resolved to module names.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cortex_worker", "cortex_api")

API_APP_MODULE = "cortex_api.app"
"""The module of the API's app factory (`create_app`): what the API server process imports."""
WORKER_ONLY_PREFIXES = (
    "cortex_worker.sandbox",
    "cortex_worker.tools.builtin",
    "cortex_worker.tools.calculator",
    "cortex_worker.tools.files",
    "cortex_worker.tools.http",
    "cortex_worker.tools.runtime",
    "cortex_worker.tools.sandboxed",
)
"""The sandbox and the tool implementations: only workers that run tools load them."""


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `line` (`runs`: False under `if TYPE_CHECKING:`)."""

    source: str
    target: str
    line: int
    runs: bool

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def module_files() -> dict[str, Path]:
    """Module name → file, for every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, runs: bool = True) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under `tree`, with whether it runs (not under TYPE_CHECKING)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, runs
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), runs=False)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), runs)
        else:
            yield from _imports(node, runs)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             known: Mapping[str, Path]) -> list[str]:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        # `from pkg import name`: the submodule `pkg.name` if there is one, else `pkg` itself
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    return [name for name in dict.fromkeys(names) if name in known]


@cache
def import_graph() -> dict[str, tuple[Edge, ...]]:
    """Module → the imports of project modules it makes, in file order."""
    known = module_files()
    graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = []
        for node, runs in _imports(tree):
            for target in _targets(module, path.name == "__init__.py", node, known):
                if target != module:
                    edges.append(Edge(module, target, node.lineno, runs))
        graph[module] = tuple(edges)
    return graph


def _components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _shortest_path(graph: Mapping[str, tuple[Edge, ...]], start: str, goal: str,
                   allowed: Iterable[str] | None = None) -> list[Edge] | None:
    """The fewest edges from `start` to `goal` (through `allowed` modules only, if given)."""
    allowed = set(graph) if allowed is None else set(allowed)
    came: dict[str, Edge | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in graph[node]:
            if edge.target in came or edge.target not in allowed:
                continue
            came[edge.target] = edge
            if edge.target == goal:
                path = []
                step: Edge | None = edge
                while step is not None:
                    path.append(step)
                    step = came[step.source]
                return path[::-1]
            queue.append(edge.target)
    return None


def _describe_cycle(graph: Mapping[str, tuple[Edge, ...]], component: list[str]) -> str:
    """One cycle of a component, as a readable path, and the component's other members."""
    start = component[0]
    best: list[Edge] | None = None
    for edge in graph[start]:
        if edge.target in component:
            back = _shortest_path(graph, edge.target, start, component)
            if back is not None and (best is None or len(back) + 1 < len(best)):
                best = [edge, *back]
    assert best is not None
    lines = [f"cycle among {len(component)} modules: {', '.join(component)}", f"  {start}"]
    lines += [f"  -> {edge.target}  (line {edge.line} of {edge.source}"
              f"{', TYPE_CHECKING only' if not edge.runs else ''})" for edge in best]
    return "\n".join(lines)


def worker_cycles() -> list[str]:
    """The cycles among cortex_worker modules, described."""
    graph = import_graph()
    worker = {m: tuple(e for e in edges if e.target.startswith("cortex_worker."))
              for m, edges in graph.items() if m.startswith("cortex_worker.")}
    targets = {m: {e.target for e in edges} for m, edges in worker.items()}
    return [_describe_cycle(worker, component) for component in _components(targets)]


def _worker_only(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in WORKER_ONLY_PREFIXES)


def _loaded_with(module: str) -> list[str]:
    """`module` and the packages above it: importing it runs their `__init__` first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def runtime_graph() -> dict[str, tuple[Edge, ...]]:
    """Edges that run: TYPE_CHECKING imports dropped, a package `__init__` made explicit."""
    graph = import_graph()
    out: dict[str, tuple[Edge, ...]] = {}
    for module, edges in graph.items():
        runtime = []
        for edge in edges:
            if edge.runs:
                runtime += [Edge(module, target, edge.line, True)
                            for target in _loaded_with(edge.target)
                            if target in graph and target != module]
        out[module] = tuple(dict.fromkeys(runtime))
    return out


# ---------------------------------------------------------------- the tests


def test_the_graph_sees_imports_in_functions_and_relative_forms() -> None:
    graph = import_graph()
    tools_runtime = {(e.target, e.runs) for e in graph["cortex_worker.tools.runtime"]}
    assert ("cortex_worker.sandbox.docker", True) in tools_runtime  # inside `_docker`
    workflows = {e.target for e in graph["cortex_worker.workflows"]}
    assert {"cortex_worker.workflows.output", "cortex_worker.workflows.spec"} <= workflows
    assert "cortex_api.app" in {e.target for e in graph["cortex_api"]}  # in `__getattr__`


def test_no_import_cycle_among_worker_modules() -> None:
    cycles = worker_cycles()
    assert not cycles, "import cycles (break them at their cause):\n" + "\n".join(cycles)


def test_the_api_process_does_not_import_the_sandbox_or_tool_code() -> None:
    graph = runtime_graph()
    banned = sorted(m for m in graph if _worker_only(m))
    paths = [path for target in banned
             if (path := _shortest_path(graph, API_APP_MODULE, target)) is not None]
    shown = "\n".join("  " + " -> ".join([API_APP_MODULE, *(e.target for e in path)])
                      for path in paths)
    assert not paths, f"{API_APP_MODULE} reaches worker-only code:\n{shown}"
