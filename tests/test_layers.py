"""The server's layers (issue 47 items 1 and 2), read from its import graph:
every import of every module under kvcached_service/server, at module
level, in a function or under TYPE_CHECKING, resolved to the module it
names. A module may import its own layer and those below it
(kvcached_service.server.LAYERS, bottom first), and no set of modules may
import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtest import ROOT
from kvcached_service import server

SERVER = ROOT / "kvcached_service" / "server"
PKG = "kvcached_service.server"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in SERVER.rglob("*.py")}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the server that `path` imports, anywhere in it."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub`: the submodule when there is one, else the package
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != me}
    return out


def layer_of(mod: str) -> str | None:
    """The layer a module belongs to (None: the package itself and
    __main__, which only start ops/)."""
    rest = mod[len(PKG) + 1:].split(".") if mod != PKG else []
    return rest[0] if rest and rest[0] != "__main__" else None


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) for m, p in known.items()}


def test_every_module_is_in_a_layer():
    stray = [m for m in modules() if layer_of(m) is None and m not in (PKG, f"{PKG}.__main__")]
    assert not stray, f"modules outside every layer ({', '.join(server.LAYERS)}): {stray}"
    assert {layer_of(m) for m in modules()} - {None} == set(server.LAYERS)


def test_no_module_imports_a_layer_above_its_own():
    rank = {name: i for i, name in enumerate(server.LAYERS)}
    up = []
    for mod, deps in graph().items():
        mine = layer_of(mod)
        for dep in deps:
            theirs = layer_of(dep)
            if mine is not None and theirs is not None and rank[theirs] > rank[mine]:
                up.append(f"{mod} ({mine}) imports {dep} ({theirs})")
    assert not up, "imports that run up a layer:\n" + "\n".join(sorted(up))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_not_even_under_type_checking():
    found = cycles(graph())
    assert not found, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("bad", ["up", "circle"])
def test_the_checks_catch_what_they_look_for(bad):
    """The checks above fail on a graph that breaks them (so they cannot
    pass by reading nothing)."""
    g = graph()
    assert len(g) > 20 and sum(len(d) for d in g.values()) > 40  # the real graph was read
    core, ops = f"{PKG}.core.daemon", f"{PKG}.ops.metrics"
    assert core in g and ops in g and core in g[ops]
    if bad == "up":
        rank = {name: i for i, name in enumerate(server.LAYERS)}
        assert rank[layer_of(ops)] > rank[layer_of(core)]
    else:
        assert cycles({**g, core: g[core] | {ops}})


# Issue 47 item 4: a function reads as one step, or as a short sequence of
# named steps. The C client's and the hook's are held to the same length by
# scripts/check-fn-length.py (scripts/test-c.sh).
MAX_FUNCTION_LINES = 60


def long_functions(root: Path) -> list[str]:
    """`file:function (N lines)` for every function of the package's
    Python (generated code aside) longer than MAX_FUNCTION_LINES, docstring
    included."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "_generated" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(root.parent)}:{node.name} ({n} lines)")
    return out


def test_no_function_of_the_package_is_over_60_lines():
    assert long_functions(ROOT / "kvcached_service") == []


def test_the_length_check_sees_a_long_function(tmp_path):
    pkg = tmp_path / "kvcached_service"
    (pkg / "_generated").mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "m.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}")
    (pkg / "_generated" / "g.py").write_text(f"def long():\n{body}")
    assert long_functions(pkg) == [f"kvcached_service/m.py:long ({MAX_FUNCTION_LINES + 1} lines)"]
