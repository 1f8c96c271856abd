"""The structure of ``kvbroker._server``: its modules as nodes, their imports as arrows.

``python -m kvbroker._server.structure`` prints the graph as Mermaid (``--dot``: Graphviz
DOT), the drawing in ``docs/design.md``. Every import counts: at the top, inside functions,
and under ``if TYPE_CHECKING:`` (an annotation's import is a dependency of the design too).
``tests/test_architecture.py`` asserts the graph has no circle. Reads source only (``ast``).
"""

from __future__ import annotations

import ast
import pathlib
import sys

__all__ = ["cycles", "dot", "import_graph", "mermaid"]

HERE = pathlib.Path(__file__).resolve().parent


def import_graph(folder: pathlib.Path = HERE) -> dict[str, set[str]]:
    """Module name -> the sibling modules it imports (relative imports of ``folder``)."""
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        tree = ast.parse((folder / f"{name}.py").read_text(), name)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            if node.module:
                deps.add(node.module.split(".")[0])
            else:  # from . import x
                deps.update(alias.name for alias in node.names)
        graph[name] = (deps & modules) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (as a path back to its first module) per strongly connected group (the
    group's other modules are in circles with these too)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, set(group)) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A path from the group's first module back to it, within the group."""
    first = min(group)
    paths = {first: [first]}
    todo = [first]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & group):
            if w == first:
                return [*paths[v], first]
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    return sorted(group)


def mermaid(graph: dict[str, set[str]]) -> str:
    lines = ["graph TD"]
    for name in sorted(graph):
        deps = sorted(graph[name])
        if not deps:
            lines.append(f"    {name}")
        lines += [f"    {name} --> {dep}" for dep in deps]
    return "\n".join(lines)


def dot(graph: dict[str, set[str]]) -> str:
    lines = ["digraph kvbroker_server {", "    rankdir=TB;"]
    for name in sorted(graph):
        lines.append(f'    "{name}";')
        lines += [f'    "{name}" -> "{dep}";' for dep in sorted(graph[name])]
    return "\n".join([*lines, "}"])


def main(argv: list[str]) -> int:
    graph = import_graph()
    print(dot(graph) if "--dot" in argv else mermaid(graph))
    found = cycles(graph)
    for circle in found:
        print("cycle: " + " -> ".join(circle), file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
