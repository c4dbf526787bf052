"""The import graph of the k3post package, read from the source with `ast` (nothing is imported).

Usage::

    python bench/import_graph.py [--root k3post] [--max-lines 800] [--json]

Every ``import`` / ``from ... import`` of a k3post module is an edge, wherever it sits: at module level, inside a
function (a lazy import is still a dependency, only a hidden one) or in a class body. Imports under
``if TYPE_CHECKING:`` are left out (they never run). ``from pkg import name`` is an edge to ``pkg.name`` when that
is a module, else to ``pkg``. Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``; those
package edges are left out (an ``__init__`` that re-exports is a layout choice, not a circle of the code), except
that an import of a package itself is an edge to its ``__init__``.

Printed (the last line with ``--json`` is one JSON object with the same keys):

* ``circles``: the strongly connected components of more than one module, largest first, each sorted;
* ``function_imports``: the number of import statements inside functions that import a k3post module, with the
  count per module (largest first);
* ``long_modules``: the modules over ``--max-lines`` lines, longest first.

`tests/test_import_graph.py` runs `import_graph` on the package to keep the circles it allows from growing.

Shape legend: none.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ImportGraph", "import_graph", "strongly_connected", "main"]

_REPO = Path(__file__).resolve().parents[1]


class ImportGraph:
    """Modules of one package, the edges between them and where each edge's import sits (a plain class, not a
    dataclass: `tests/bench_module.load_bench` executes this file without registering it in ``sys.modules``)."""

    def __init__(self, modules: dict[str, Path]) -> None:
        self.modules = modules
        self.edges: dict[str, set[str]] = {m: set() for m in modules}
        self.function_imports: Counter[str] = Counter()  # module -> import statements inside functions
        self.lines: dict[str, int] = {}

    def circles(self) -> list[list[str]]:
        """The strongly connected components of more than one module, largest first, each sorted."""
        comps = [sorted(c) for c in strongly_connected(self.modules, self.edges) if len(c) > 1]
        return sorted(comps, key=lambda c: (-len(c), c))

    def long_modules(self, max_lines: int) -> list[tuple[str, int]]:
        return sorted(((m, n) for m, n in self.lines.items() if n > max_lines), key=lambda mn: (-mn[1], mn[0]))


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that can run, with whether it sits inside a function (an explicit stack: the
    package's 45k lines take a fraction of a second)."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, in_function))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend((n, in_function) for n in child.orelse)
                out.extend((n, in_function) for n in child.orelse if isinstance(n, (ast.Import, ast.ImportFrom)))
            elif isinstance(child, (ast.expr, ast.expr_context, ast.operator, ast.cmpop, ast.unaryop, ast.boolop)):
                continue  # no statement inside an expression (a lambda holds none either)
            else:
                stack.append((child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))))
    return out


def import_graph(root: Path | str = _REPO / "k3post") -> ImportGraph:
    """Read every ``.py`` file under the package directory ``root`` (its parent is the import root)."""
    root = Path(root).resolve()
    base = root.parent
    modules = {_module_name(p, base): p for p in sorted(root.rglob("*.py"))}
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    graph = ImportGraph(modules)

    def known(name: str) -> str | None:
        """The longest prefix of the dotted ``name`` that is a module of the package."""
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in modules:
                return cand
        return None

    for mod, path in modules.items():
        text = path.read_text(encoding="utf-8")
        graph.lines[mod] = len(text.splitlines())
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError as e:
            raise ValueError(f"{path}:{e.lineno}: cannot parse: {e.msg}") from e
        here = mod if mod in packages else mod.rpartition(".")[0]  # the package relative imports start from
        for node, in_function in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [t for a in node.names if (t := known(a.name))]
            else:
                if node.level:
                    pkg = here.split(".")
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    source = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    full = f"{source}.{a.name}"
                    t = full if full in modules else known(source)
                    if t:
                        targets.append(t)
            targets = [t for t in targets if t != mod]
            if targets:
                graph.edges[mod].update(targets)
                if in_function:
                    graph.function_imports[mod] += 1
    return graph


def strongly_connected(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative, so deep graphs do not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(edges.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, todo = work[-1]
            if todo:
                w = todo.pop(0)
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, sorted(edges.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp: set[str] = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(_REPO / "k3post"), help="the package directory (default: k3post)")
    ap.add_argument("--max-lines", type=int, default=800, help="report modules longer than this (default 800)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the numbers")
    args = ap.parse_args(argv)
    g = import_graph(args.root)
    circles = g.circles()
    long = g.long_modules(args.max_lines)
    n_lines = sum(g.lines.values())
    print(f"{len(g.modules)} modules, {n_lines} lines, {sum(len(e) for e in g.edges.values())} import edges")
    print(f"import circles (strongly connected, > 1 module, function-level imports counted): {len(circles)}")
    for c in circles:
        print(f"  [{len(c)}] " + " ".join(c))
    total = sum(g.function_imports.values())
    print(f"imports of k3post modules inside functions: {total} in {len(g.function_imports)} modules")
    for m, n in g.function_imports.most_common(10):
        print(f"  {n:4d} {m}")
    print(f"modules over {args.max_lines} lines: {len(long)}")
    for m, n in long:
        print(f"  {n:5d} {m}")
    if args.json:
        out = {
            "modules": len(g.modules),
            "lines": n_lines,
            "circles": circles,
            "function_imports": total,
            "function_imports_by_module": dict(g.function_imports.most_common()),
            "long_modules": dict(long),
        }
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
