"""Project ground rules that are cheap to check: what each layer may import, and no import cycles.

The layers point one way: cluster -> actors -> engine, cluster -> protos, bench -> engine and
cluster; ``settings`` (the config model) is a leaf that actors and cluster both import. The
module graph below is read with ``ast`` from every .py file of our packages and counts every
import: at module level, inside functions (lazy ones) and relative ones.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("engine", "actors", "cluster", "settings", "protos", "bench")
FORBIDDEN_IN_ENGINE = {"ray", "grpc", "yaml"}
ALLOWED_IN_ENGINE = {"torch", "transformers", "engine"}


@dataclass(frozen=True)
class LayerRule:
    """Modules of ``package`` must not import ``forbidden`` (at all, or only at import time)."""

    package: str
    forbidden: frozenset[str]
    why: str
    import_time_only: bool = False


LAYER_RULES = [
    LayerRule("actors", frozenset({"cluster", "bench"}), "actors sit below cluster and bench"),
    LayerRule("engine", frozenset(OURS) - {"engine"}, "engine is pure torch + transformers"),
    LayerRule("settings", frozenset(OURS) - {"settings"}, "settings is a leaf"),
    LayerRule("protos", frozenset(OURS) - {"protos"}, "protos is the generated gRPC contract"),
    LayerRule("cluster", frozenset({"bench"}), "the CLI may load bench commands lazily, never at import",
              import_time_only=True),
]


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (both our modules) at ``line``; ``lazy``: inside a function."""

    source: str
    target: str
    line: int
    lazy: bool

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}{', lazy' if self.lazy else ''})"


def module_name(path: Path) -> str:
    """``cluster/build.py`` -> ``cluster.build``; ``cluster/__init__.py`` -> ``cluster``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in OURS for p in sorted((ROOT / package).rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` runs: its longest prefix that is a module.

    >>> resolve("cluster.build.load_target"), resolve("torch.nn")
    ('cluster.build', None)
    """
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def absolute_base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (``from .build`` in cluster.cli -> cluster.build)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imported_names(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Dotted names an import statement may load (``from a import b`` may load ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = absolute_base(module, node)
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def module_edges(module: str) -> list[Edge]:
    """Every import of ours in ``module``, at module level or inside a function (lazy)."""
    edges: list[Edge] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = {resolve(name) for name in imported_names(module, child)} - {None, module}
                edges.extend(Edge(module, target, child.lineno, lazy) for target in sorted(targets))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(MODULES[module].read_text()), lazy=False)
    return edges


EDGES = [edge for module in MODULES for edge in module_edges(module)]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one node (each holds a cycle).

    >>> [sorted(c) for c in strongly_connected({"a": {"b"}, "b": {"a", "c"}, "c": set()})]
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """A shortest import path from ``start`` back to itself (breadth first), both ends included.

    >>> shortest_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a")
    ['a', 'b', 'c', 'a']
    """
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph.get(node, ())):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if successor not in parents:
                    parents[successor] = node
                    following.append(successor)
        frontier = following
    return []


def describe_cycle(cycle: list[str]) -> str:
    by_pair = {(e.source, e.target): e for e in EDGES}
    return "\n    ".join(str(by_pair[pair]) for pair in zip(cycle, cycle[1:]))


def graph_of(edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
    return graph


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted((ROOT / "engine").rglob("*.py")), ids=lambda p: p.name)
def test_engine_imports_only_torch_transformers_and_stdlib(path):
    roots = imported_roots(path)
    assert not roots & FORBIDDEN_IN_ENGINE
    third_party = {r for r in roots if r not in sys.stdlib_module_names and r != "__future__"}
    assert third_party <= ALLOWED_IN_ENGINE, f"{path.name} imports {sorted(third_party - ALLOWED_IN_ENGINE)}"


def test_required_layout():
    for name in ("pyproject.toml", "cluster", "actors", "protos", "engine", "configs", "tests", "k8s", "settings"):
        assert (ROOT / name).exists(), name


@pytest.mark.parametrize("source, target, lazy", [
    ("cluster.serve_app", "actors.group", False),     # absolute, at module level
    ("cluster.serve_app", "cluster.openai_api", True),  # relative, inside a method
    ("actors.group", "actors.verifier", False),       # relative, at module level
    ("protos.specinfer_pb2_grpc", "protos.specinfer_pb2", False),  # from a package import a module
])
def test_module_graph_sees_every_kind_of_import(source, target, lazy):
    """The rules below are only as good as the graph: it must hold lazy and relative imports."""
    assert any(e.source == source and e.target == target and e.lazy == lazy for e in EDGES), \
        [str(e) for e in EDGES if e.source == source]


@pytest.mark.parametrize("rule", LAYER_RULES, ids=lambda r: f"{r.package}-not-{'-'.join(sorted(r.forbidden))}")
def test_layer_rule(rule):
    broken = [e for e in EDGES if e.source.split(".")[0] == rule.package
              and e.target.split(".")[0] in rule.forbidden and not (rule.import_time_only and e.lazy)]
    assert not broken, f"{rule.why}:\n  " + "\n  ".join(f"{MODULES[e.source].relative_to(ROOT)}: {e}"
                                                        for e in broken)


def test_no_import_cycles():
    graph = graph_of(EDGES)
    cycles = strongly_connected(graph)
    messages = [f"{', '.join(sorted(c))}, for instance:\n    " + describe_cycle(shortest_cycle(graph, min(c)))
                for c in cycles]
    assert not cycles, "import cycles between our modules:\n  " + "\n\n  ".join(messages)


def test_the_command_line_parser_imports_no_engine():
    """`specinfer --help` (and every usage error) builds the whole parser: it must not pay for
    torch and transformers (seconds), which only the commands that run models need."""
    import subprocess

    code = ("import sys, cluster.cli; cluster.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("module", ["actors.merge", "cluster.serve_app"])
def test_processes_that_run_no_model_skip_the_modeling_stack(module):
    """The merge actor and the ingress replica run no model: their process starts without
    transformers' modeling stack (``transformers.modeling_utils`` and what it pulls in cost ~2-3 s of
    CPU per process, and every application starts both). Model code imports it where a model is
    loaded or an attention registered."""
    import subprocess

    code = f"import sys, {module}; print('transformers.modeling_utils' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
