"""The package's layout rules (docs/architecture.md), checked on the source text:

- each stage imports only the stages below it (errors/system < pagecache < formats < storage <
  write < batch < data < loading < tools/integrations/cli), lazy imports inside functions included;
- no import cycles, lazy imports inside functions included;
- no module imports another module's private name (``from gpufeed.x import _y``);
- gpufeed.formats knows no torch, but for the .pt container (formats/mmap/pt.py, lazily);
- no module over MAX_MODULE_LINES lines, no function body over MAX_FUNCTION_LINES lines
  (signature and docstring not counted) unless its docstring says why ("Long because ..."):
  a warning; over HARD_MODULE_LINES / HARD_FUNCTION_LINES a failure;
- the public API stays small.

``python tests/unit/test_layout.py`` prints the largest modules and functions.
"""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "app" / "src" / "gpufeed"
MAX_MODULE_LINES = 500  # soft caps: a warning
MAX_FUNCTION_LINES = 80
HARD_MODULE_LINES = 800  # hard caps: a failure
HARD_FUNCTION_LINES = 120
MAX_PUBLIC_NAMES = 20
# lowest first; a module may import from its own layer and the ones before it
LAYERS = (
    {"_version", "errors", "system"},
    {"pagecache"},
    {"formats", "pixels"},
    {"storage"},
    {"write"},
    {"batch"},
    {"data"},
    {"loading"},
    {"tools", "integrations", "ray", "cli", "cliargs", "__init__", "__main__"},
)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer(name: str) -> int:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, members in enumerate(LAYERS) if top in members)


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every gpufeed import in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
    return [f for f in found if f[0] == "gpufeed" or f[0].startswith("gpufeed.")]


def type_checking_lines(path: Path) -> set[int]:
    """Lines of ``if TYPE_CHECKING:`` blocks: imports for annotations only, never run."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """module -> the gpufeed modules it imports (inside functions too; ``from gpufeed.x import
    y`` with gpufeed.x.y a module is an edge to it). A package's __init__ that imports its own
    modules is no cycle, so the package a module lies in is not an edge of its own."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        skip = type_checking_lines(path)
        edges = set()
        for target, names, line in imports(path):
            if line in skip:
                continue
            subs = {f"{target}.{n}" for n in names} & MODULES.keys()
            edges |= subs
            if len(subs) < len(names) or not names:  # a name defined in target itself
                edges.add(target)
        graph[name] = {e for e in edges if e in MODULES and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def function_lengths(path: Path):
    """(name, lines of its body without the docstring, docstring) of every function."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node) or ""
            body = node.body[1:] if doc and len(node.body) > 1 else node.body
            yield node.name, node.end_lineno - body[0].lineno + 1, doc


def test_each_stage_imports_only_the_stages_below():
    wrong = []
    for name, path in MODULES.items():
        for target, names, line in imports(path):
            if target == "gpufeed":  # from gpufeed import x: a submodule or the API
                targets = [f"gpufeed.{n}" for n in names if f"gpufeed.{n}" in MODULES]
            else:
                targets = [target]
            wrong += [f"{name}:{line} -> {t}" for t in targets if layer(t) > layer(name)]
    assert wrong == []


def test_no_import_cycles():
    """No cycle in the import graph, imports inside functions included: a cycle held together
    by a late import is still one that breaks when someone moves that import."""
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_crosses_modules():
    wrong = [
        f"{name}:{line} imports {target}.{n}"
        for name, path in MODULES.items()
        for target, names, line in imports(path)
        for n in names
        if n.startswith("_") and not n.startswith("__") and target != name
    ]
    assert wrong == []


def test_formats_know_no_torch():
    for name, path in MODULES.items():
        if not name.startswith("gpufeed.formats"):
            continue
        tree = ast.parse(path.read_text())
        torch = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            and any(
                (getattr(n, "module", None) or a.name).split(".")[0] == "torch" for a in n.names
            )
        ]
        if name == "gpufeed.formats.mmap.pt":
            top = {n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
            assert torch and not set(torch) & top, "formats/mmap/pt.py imports torch lazily"
        else:
            assert torch == [], f"{name} imports torch (lines {torch})"


def long_modules(limit: int) -> dict[str, int]:
    return {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > limit
    }


def long_functions(limit: int) -> list[str]:
    return [
        f"{name}.{fn}: {n} lines"
        for name, path in MODULES.items()
        for fn, n, doc in function_lengths(path)
        if n > limit and "Long because" not in doc
    ]


@pytest.mark.slow
def test_modules_and_functions_are_small():
    """Past the soft caps a warning, a reason to look, not to split by line count; past the
    hard caps a failure."""
    soft = [f"{name}: {n} lines" for name, n in long_modules(MAX_MODULE_LINES).items()]
    soft += long_functions(MAX_FUNCTION_LINES)
    if soft:
        warnings.warn("over the soft size caps: " + "; ".join(soft), stacklevel=1)
    assert long_modules(HARD_MODULE_LINES) == {}
    assert long_functions(HARD_FUNCTION_LINES) == []


def test_the_public_api_is_small_and_resolves():
    import gpufeed

    assert len(gpufeed.__all__) <= MAX_PUBLIC_NAMES
    for name in gpufeed.__all__:
        assert getattr(gpufeed, name) is not None, name


def test_a_removed_public_name_says_where_it_lives():
    import gpufeed

    with pytest.raises(
        AttributeError,
        match=r"gpufeed.HDF5Dataset was removed in 0.2: use "
        r"gpufeed.data.map_style.HDF5Dataset",
    ):
        gpufeed.HDF5Dataset  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        gpufeed.no_such_name  # noqa: B018


def report() -> str:
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in MODULES.items()), reverse=True)
    funcs = sorted(
        ((n, f"{name}.{fn}") for name, p in MODULES.items() for fn, n, _ in function_lengths(p)),
        reverse=True,
    )
    lines = [f"{len(MODULES)} modules; largest (limit {MAX_MODULE_LINES} lines):"]
    lines += [f"  {n:5d}  {name}" for n, name in sizes[:8]]
    lines.append(
        f"longest function bodies (limit {MAX_FUNCTION_LINES} lines, docstring not counted):"
    )
    lines += [f"  {n:5d}  {name}" for n, name in funcs[:8]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(print(report()))
