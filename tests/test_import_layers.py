"""The packages of src/aqr as layers (docs/architecture.md): no import cycle between modules (imports inside
functions count), no private name imported from another module, and a package imports only lower layers."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: The layers of docs/architecture.md; a package imports only packages of lower layers (and itself).
LAYERS: dict[str, int] = {
    "_version": 0, "util": 1, "core": 2, "data": 2, "backends": 3, "models": 3, "adapt": 4, "methods": 5,
    "harness": 6, "deploy": 6, "experiments": 7, "cli": 8, "__main__": 9, "__init__": 9,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports() -> list[tuple[str, str, list[str], str]]:
    """Every import of src/aqr as (importing module, imported module, names taken, where), TYPE_CHECKING aside."""
    modules = {_module_name(p): p for p in SRC.joinpath("aqr").rglob("*.py")}
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if _in_type_checking(node, parents):
                continue
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [(name, a.name, [], where) for a in node.names if a.name.startswith("aqr")]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                if not base.startswith("aqr"):
                    continue
                names = [a.name for a in node.names]
                submodules = [n for n in names if f"{base}.{n}" in modules]
                if submodules:  # ``from . import x``: an import of the submodule x
                    found += [(name, f"{base}.{n}", [], where) for n in submodules]
                rest = [n for n in names if n not in submodules]
                if rest:
                    found.append((name, base, rest, where))
    return [(a, b, n, w) for a, b, n, w in found if a != b]


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for source, target, _, _ in imports():
        graph.setdefault(source, set()).add(target)
    # a module importing its own package's __init__ (which re-exports it) is not a cycle of code
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w.startswith(v + ".") or v.startswith(w + "."):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_from_another_module() -> None:
    wrong = [f"{where}: {source} imports {target}.{n}" for source, target, names, where in imports()
             for n in names if n.startswith("_") and not n.startswith("__") and target != "aqr._version"]
    assert not wrong, "private names imported across modules:\n" + "\n".join(wrong)


def test_packages_import_only_lower_layers() -> None:
    wrong = []
    for source, target, _, where in imports():
        a = source.split(".")[1] if source.count(".") else "__init__"
        b = target.split(".")[1] if target.count(".") else "__init__"
        if a != b and LAYERS[b] >= LAYERS[a]:
            wrong.append(f"{where}: aqr.{a} (layer {LAYERS[a]}) imports aqr.{b} (layer {LAYERS[b]})")
    assert not wrong, "imports against the layers of docs/architecture.md:\n" + "\n".join(wrong)
