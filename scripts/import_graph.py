"""The project's import graph: package arrows, module cycles and forbidden arrows (read from the AST).

    .venv/bin/python scripts/import_graph.py                    # package graph, cycles, violations
    .venv/bin/python scripts/import_graph.py --modules trainer  # module arrows out of trainer.*
    .venv/bin/python scripts/import_graph.py --dot graph.dot --svg graph.svg   # drawings
    .venv/bin/python scripts/import_graph.py --check            # exit 1 on a cycle or a forbidden arrow

The rules (`RULES`) are the layering of docs/design/README.md, which also says how the graph is
read (no module is imported); tests/test_layering.py runs `check` on every test run.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the project's top-level packages (tests, examples and scripts use them; nothing imports those)
PACKAGES = ("proto", "plan", "harts_client", "planner_service", "trainer", "kernels", "harts_cli", "benchmarks")

#: heavy or server-side third-party packages the torch-free generator side must not need
_NOT_FOR_GENERATORS = ("torch", "triton", "numba", "fastapi", "starlette", "uvicorn", "grpc", "transformers")


@dataclass(frozen=True, slots=True)
class Rule:
    """Imports from `source` (a package) into any of `targets` (packages or third-party names) are forbidden."""

    source: str
    targets: tuple[str, ...]
    why: str
    lazy_ok: tuple[str, ...] = ()
    """Modules of `source` allowed to import the targets inside a function body (never at module level)."""


RULES: tuple[Rule, ...] = (
    Rule("planner_service", ("trainer",), "the planner and the trainer meet only in proto/ and plan/"),
    Rule("trainer", ("planner_service",), "the planner and the trainer meet only in proto/ and plan/"),
    Rule("harts_client", (*_NOT_FOR_GENERATORS, "planner_service", "trainer", "kernels", "harts_cli", "benchmarks"),
         "a rollout generator installs harts[client] alone: numpy, httpx, protobuf",
         # an inference engine is the adapter of its framework: it imports it when it is built
         # (harts_client.engines.make_engine), and only a generator that uses it installs it; a
         # model's chat template is rendered by transformers' tokenizer when a model directory has one
         lazy_ok=("harts_client.engines.transformers_engine", "harts_client.chat")),
    Rule("proto", tuple(p for p in PACKAGES if p != "proto"), "proto/ is the wire: the .proto files, generated code, array codecs"),
    Rule("plan", ("planner_service", "trainer", "harts_client", "kernels", "harts_cli", "benchmarks", "torch", "triton",
                  "fastapi", "grpc"), "plan/ is what a plan means, below both sides: proto, numpy, numba"),
    Rule("kernels", tuple(p for p in PACKAGES if p != "kernels"), "kernels/ depends on torch and triton only"),
    Rule("harts_cli", ("benchmarks",), "a product command never imports the benchmarks (harts bench runs them as a subprocess)"),
    Rule("benchmarks", ("harts_cli",), "the benchmarks sit apart from the runner that starts them"),
    *(Rule(p, ("benchmarks",), "nothing in the product imports the benchmarks")
      for p in ("planner_service", "trainer", "harts_client")),
)


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's arrow."""

    source: str
    """Importing module (dotted)."""
    target: str
    """Imported project module (dotted), or a third-party top-level name when `external`."""
    line: int
    """Line of the statement in the source module."""
    lazy: bool
    """Inside a function body (runs when called)."""
    type_only: bool
    """Under `if TYPE_CHECKING:`."""
    external: bool
    """`target` is not a project module."""

    def where(self) -> str:
        kind = " (lazy)" if self.lazy else " (TYPE_CHECKING)" if self.type_only else ""
        return f"{self.source}:{self.line} -> {self.target}{kind}"


@dataclass(slots=True)
class ImportGraph:
    """Project modules and their import arrows."""

    modules: dict[str, Path]
    """Dotted module name -> source file."""
    imports: list[Import] = field(default_factory=list)
    """Every arrow, project and external."""

    def edges(self) -> dict[str, set[str]]:
        """Module -> project modules it imports (self-imports left out)."""
        out: dict[str, set[str]] = defaultdict(set)
        for imp in self.imports:
            if not imp.external and imp.target != imp.source:
                out[imp.source].add(imp.target)
        return out

    def package_edges(self) -> dict[tuple[str, str], int]:
        """(importing package, imported package or third-party name) -> number of arrows."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for imp in self.imports:
            src, dst = top(imp.source), top(imp.target)
            if src != dst:
                out[src, dst] += 1
        return dict(out)


def top(module: str) -> str:
    return module.split(".", 1)[0]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def scan(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> ImportGraph:
    """Parse every module of `packages` under `root` into an ImportGraph.

    Raises:
        SyntaxError: a module that does not parse (named in the message).
    """
    graph = ImportGraph(modules={})
    for pkg in packages:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            graph.modules[_module_name(path, root)] = path

    def resolve(name: str) -> str | None:
        while name and name not in graph.modules:
            name = name.rpartition(".")[0]
        return name or None

    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"

        def add(target: str, node: ast.stmt, lazy: bool, type_only: bool) -> None:
            found = resolve(target)
            if found is not None:
                graph.imports.append(Import(module, found, node.lineno, lazy, type_only, external=False))
            elif top(target) not in packages:
                graph.imports.append(Import(module, top(target), node.lineno, lazy, type_only, external=True))

        def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node, lazy, type_only)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package of this module, `level - 1` up
                    here = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(here[: len(here) - (node.level - 1)])
                    name = f"{base}.{node.module}" if node.module else base
                else:
                    name = node.module or ""
                submodules = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in graph.modules]
                for sub in submodules:
                    add(sub, node, lazy, type_only)
                if len(submodules) < len(node.names):
                    add(name, node, lazy, type_only)
            for child in ast.iter_child_nodes(node):
                visit(child,
                      lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                      type_only or (isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body))

        visit(tree, False, False)
    return graph


def cycles(graph: ImportGraph) -> list[list[str]]:
    """One import circle per strongly connected group of modules (Tarjan), each as a closed path
    [m0, m1, ..., m0] through the group, sorted."""
    edges = graph.edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.add(m)
                    if m == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return sorted(_closed_path(sorted(g)[0], g, edges) for g in groups)


def _closed_path(start: str, group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside `group` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(edges.get(m, ())):
                if t == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if t in group and t not in parent:
                    parent[t] = m
                    nxt.append(t)
        frontier = nxt
    raise AssertionError(f"{start} is in a strongly connected group but on no cycle")


def violations(graph: ImportGraph, rules: tuple[Rule, ...] = RULES) -> list[tuple[Rule, Import]]:
    """Every arrow a rule forbids, with the rule."""
    out = []
    for imp in graph.imports:
        for rule in rules:
            if top(imp.source) == rule.source and top(imp.target) in rule.targets:
                if imp.lazy and imp.source in rule.lazy_ok:
                    continue
                out.append((rule, imp))
    return out


def dot(graph: ImportGraph, modules: bool = False) -> str:
    """Graphviz DOT of the package graph (arrow labels: import count; forbidden arrows red), or of
    the module graph with `modules` (arrows on a cycle red)."""
    lines = ["digraph harts {", '  rankdir=BT; node [shape=box, fontname="Helvetica"];']
    if modules:
        on_cycle = {(a, b) for c in cycles(graph) for a, b in zip(c, c[1:])}
        for src, dsts in sorted(graph.edges().items()):
            for dst in sorted(dsts):
                color = ' [color=red]' if (src, dst) in on_cycle else ""
                lines.append(f'  "{src}" -> "{dst}"{color};')
    else:
        bad = {(top(i.source), top(i.target)) for _, i in violations(graph)}
        for (src, dst), n in sorted(graph.package_edges().items()):
            if dst in PACKAGES:
                color = ", color=red, fontcolor=red" if (src, dst) in bad else ""
                lines.append(f'  "{src}" -> "{dst}" [label="{n}"{color}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def svg(graph: ImportGraph) -> str:
    """The package graph as a standalone SVG: importers above what they import (longest-path layers),
    forbidden arrows and arrows inside a package cycle in red."""
    pkg_edges = {(a, b) for (a, b) in graph.package_edges() if b in PACKAGES}
    nodes = sorted({p for e in pkg_edges for p in e} | {top(m) for m in graph.modules})
    layer = {n: 0 for n in nodes}
    for _ in nodes:  # longest path from the bottom; a cycle stops growing after len(nodes) rounds
        for a, b in pkg_edges:
            layer[a] = max(layer[a], min(layer[b] + 1, len(nodes)))
    rows: dict[int, list[str]] = defaultdict(list)
    for n in nodes:
        rows[layer[n]].append(n)
    w, h, gap_x, gap_y = 150, 36, 40, 80
    width = max(len(r) for r in rows.values()) * (w + gap_x) + gap_x
    height = (max(rows) + 1) * (h + gap_y) + gap_y
    pos = {}
    for lv, members in rows.items():
        offset = (width - len(members) * (w + gap_x) + gap_x) / 2
        for i, n in enumerate(members):
            pos[n] = (offset + i * (w + gap_x), height - gap_y - (lv + 1) * (h + gap_y) + gap_y)
    bad = {(top(i.source), top(i.target)) for _, i in violations(graph)}
    bad |= {(a, b) for a, b in pkg_edges if (b, a) in pkg_edges}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" font-family="Helvetica" font-size="13">',
           '<defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto">'
           '<path d="M0,0 L10,5 L0,10 z"/></marker>'
           '<marker id="r" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto">'
           '<path d="M0,0 L10,5 L0,10 z" fill="red"/></marker></defs>']
    for a, b in sorted(pkg_edges):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        red = (a, b) in bad
        y1, y2 = (ya + h, yb) if ya < yb else (ya, yb + h)
        out.append(f'<line x1="{xa + w / 2:.0f}" y1="{y1:.0f}" x2="{xb + w / 2:.0f}" y2="{y2:.0f}" '
                   f'stroke="{"red" if red else "#555"}" marker-end="url(#{"r" if red else "a"})"/>')
    for n, (x, y) in pos.items():
        out.append(f'<rect x="{x:.0f}" y="{y:.0f}" width="{w}" height="{h}" rx="4" fill="#eef3fb" stroke="#335"/>'
                   f'<text x="{x + w / 2:.0f}" y="{y + h / 2 + 5:.0f}" text-anchor="middle">{n}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def report(graph: ImportGraph, modules_of: str | None = None) -> str:
    """The text report: package arrows (with third-party names), then cycles and violations."""
    lines = []
    if modules_of:
        lines.append(f"module arrows out of {modules_of}:")
        lines += [f"  {i.where()}" for i in sorted(graph.imports, key=lambda i: (i.source, i.line))
                  if i.source == modules_of or i.source.startswith(modules_of + ".")]
    else:
        project: dict[str, list[str]] = defaultdict(list)
        third: dict[str, list[str]] = defaultdict(list)
        for (src, dst), n in sorted(graph.package_edges().items()):
            if dst in PACKAGES:
                project[src].append(f"{dst} ({n})")
            elif dst not in sys.stdlib_module_names:
                third[src].append(dst)
        lines.append(f"package arrows (number of imports; {len(graph.modules)} modules):")
        lines += [f"  {src} -> {', '.join(project[src]) or '-'}; third-party: {', '.join(third[src]) or '-'}"
                  for src in sorted({top(m) for m in graph.modules})]
    found = cycles(graph)
    lines.append(f"import cycles: {len(found) or 'none'}")
    lines += [f"  {' -> '.join(c)}" for c in found]
    bad = violations(graph)
    lines.append(f"forbidden arrows: {len(bad) or 'none'}")
    lines += [f"  {imp.where()}: {rule.why}" for rule, imp in bad]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    p.add_argument("--modules", metavar="PREFIX", help="list the module arrows out of PREFIX (a package or module)")
    p.add_argument("--dot", type=Path, help="write the package graph (module graph with --modules) as Graphviz DOT")
    p.add_argument("--svg", type=Path, help="write the package graph as SVG (no Graphviz needed)")
    p.add_argument("--check", action="store_true", help="exit 1 when there is a cycle or a forbidden arrow")
    args = p.parse_args(argv)
    graph = scan(args.root)
    print(report(graph, args.modules))
    if args.dot:
        args.dot.write_text(dot(graph, modules=bool(args.modules)))
    if args.svg:
        args.svg.write_text(svg(graph))
    return 1 if args.check and (cycles(graph) or violations(graph)) else 0


if __name__ == "__main__":
    sys.exit(main())
