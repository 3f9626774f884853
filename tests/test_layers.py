"""The package's layering: its module graph has no cycle (issue 53: one design, no module reaching back up).

Every import counts, wherever it is written: at the top of a module, inside a function, under
``if TYPE_CHECKING:``. ``from verispec.x import y`` where ``y`` is a submodule is an edge to ``verispec.x.y``,
else to ``verispec.x``. A package's ``__init__`` that only re-exports names imported on first use (PEP 562:
``verispec``, ``verispec.models``, ``verispec.grammar``) is the package's public face for users, not a layer:
its own imports are not edges (it loads nothing on import), and importing it (``from verispec import
__version__``) is an edge to it alone. Importing ``verispec.x.y`` is not an edge to ``verispec.x``'s
``__init__`` (Python runs it, but the design depends on ``y``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "verispec"


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from its ``__init__``)."""
    names = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _lazy_face(tree: ast.Module) -> bool:
    """Whether a package ``__init__`` re-exports lazily: a module ``__getattr__`` (PEP 562)."""
    return any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body)


def _imported(
    tree: ast.Module, name: str, is_package: bool, modules: dict[str, Path], eager: bool = False
) -> Iterator[str]:
    """The modules that module ``name`` imports, anywhere in it (``eager``: only the imports its body runs on
    import, not those in functions or under ``if TYPE_CHECKING:``)."""
    for node in tree.body if eager else ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package (its own name for a package)
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield submodule if submodule in modules else source


def module_graph() -> dict[str, set[str]]:
    """Each module → the package's modules it imports (itself excluded)."""
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        eager = is_package and _lazy_face(tree)  # a public face: what it imports on first use is no edge
        imported = _imported(tree, name, is_package, modules, eager)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def components(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` (Tarjan's, iterative), each as a set of nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for child in edges:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.add(member)
                        if member == node:
                            break
                    found.append(frozenset(members))
    return found


def cycles() -> list[frozenset[str]]:
    """The graph's components of more than one module: its design cycles."""
    return [c for c in components(module_graph()) if len(c) > 1]


def describe(cycle: frozenset[str], graph: dict[str, set[str]]) -> str:
    """A cycle's modules and the edges inside it, one line each."""
    edges = [f"  {m} -> {', '.join(sorted(graph[m] & cycle))}" for m in sorted(cycle)]
    return f"{len(cycle)} modules:\n" + "\n".join(edges)


def test_components_on_a_known_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(map(sorted, components(graph))) == [["a", "b", "c"], ["d", "e"], ["f"], ["g"]]


def test_the_graph_sees_every_kind_of_import() -> None:
    snippet = ast.parse(
        "import p.a\n"
        "from p.b import thing\n"
        "from p import c\n"
        "from . import d\n"
        "from .e import other\n"
        "if TYPE_CHECKING:\n"
        "    from p.f import T\n"
        "def later():\n"
        "    from p.g import x\n"
    )
    modules = dict.fromkeys((f"p.{m}" for m in "abcdefg"), Path())
    assert set(_imported(snippet, "p.z", False, modules)) == {"p.a", "p.b", "p.c", "p.d", "p.e", "p.f", "p.g"}
    assert set(_imported(snippet, "p.z", False, modules, eager=True)) == {"p.a", "p.b", "p.c", "p.d", "p.e"}
    graph = module_graph()
    assert graph["verispec"] == {"verispec.errors"}  # the lazy public face: what it runs on import
    assert "verispec.drafting.suffix_cache" in graph["verispec.choice"]  # under TYPE_CHECKING there


def test_no_design_cycle() -> None:
    """At 6a9e143, one cycle of 41 modules (closed in options.py: ModelChoice loading a Speculator; the
    drafters importing the registry that builds them; Constraint making its state from grammar.rounds)."""
    graph = module_graph()
    found = cycles()
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph) for c in found)


if __name__ == "__main__":  # print the cycles found (the issue's "before" and "after")
    graph = module_graph()
    for cycle in cycles():
        print(describe(cycle, graph))


def _chooses_by_name(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` picks a drafter by a name written out: ``drafter="ngram"``, ``DRAFTERS["eagle"]``, or
    ``x.drafter == "none"`` / ``kind.name != "eagle"`` / ``drafter_name == ...``."""

    def named(value: ast.AST) -> bool:
        return isinstance(value, ast.Constant) and value.value in names

    def drafterish(value: ast.AST) -> bool:
        word = (
            value.attr
            if isinstance(value, ast.Attribute)
            else value.id
            if isinstance(value, ast.Name)
            else ""
        )
        return "drafter" in word or (word == "name" and isinstance(value, ast.Attribute))

    if isinstance(node, ast.keyword):
        return node.arg == "drafter" and named(node.value)
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Name) and node.value.id == "DRAFTERS" and named(node.slice)
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(named(side) for side in sides) and any(drafterish(side) for side in sides)
    return False


def test_no_drafter_is_chosen_by_a_name_literal_outside_the_registry() -> None:
    """Issue 53: a drafter's name means something only in the registry (``registry.PLAIN``, ``EAGLE``, ...);
    the bench's method labels are labels, not choices, and stay as they are."""
    from verispec.drafting.registry import DRAFTERS

    names = set(DRAFTERS)
    found = []
    for name, path in module_names().items():
        if name == f"{PACKAGE}.drafting.registry" or name.startswith(f"{PACKAGE}.bench"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found += [f"{name}:{getattr(n, 'lineno', 0)}" for n in ast.walk(tree) if _chooses_by_name(n, names)]
    assert not found, f"drafters chosen by a name literal: {found}"
