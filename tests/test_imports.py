"""The import graph of dflash_jax, pallas_kernels and convert, read with `ast`.

Every import counts, at module level and inside functions: a function-level import that closes
a cycle is still a cycle for a reader. The checks:
  * no import cycle among the project's modules (the failure names the cycle);
  * pallas_kernels imports nothing from dflash_jax (kernels take arrays and static sizes);
  * the low modules (config, params, rope, sharding, kv_cache, impl) import no module above them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_jax", "pallas_kernels", "convert")
LOW = frozenset(f"dflash_jax.{m}" for m in ("config", "params", "rope", "sharding", "kv_cache", "impl"))


def module_name(file: Path) -> str:
    parts = list(file.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            out[module_name(file)] = file
    return out


def imported_names(file: Path, name: str, modules: frozenset[str] = frozenset()) -> set[str]:
    """Every module name the file imports (absolute, relative ones resolved), anywhere in it.

    `from package import module` counts as importing that module (one of `modules`), not the
    package: a submodule that imports its sibling does not depend on the package's __init__.
    """
    is_package = file.name == "__init__.py"
    tree = ast.parse(file.read_text(), str(file))
    # `if TYPE_CHECKING:` imports never run; they name types for the reader and the checker.
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a package import counts as its __init__)."""
    known = frozenset(modules)
    graph = {}
    for name, file in modules.items():
        graph[name] = {m for m in imported_names(file, name, known) if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. Depth-first search with colours."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in colour:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        colour[node] = 2
        return None

    for start in sorted(graph):
        if start not in colour:
            found = visit(start)
            if found:
                return found
    return None


GRAPH = import_graph(project_modules())


def test_the_checker_sees_every_package_and_a_function_level_import():
    assert {"dflash_jax.model", "dflash_jax.drafter", "pallas_kernels.tree_attention",
            "convert.layout"} <= set(GRAPH)
    # sharding imports the attention kernel inside `attention`, not at module level.
    assert "pallas_kernels.tree_attention" in GRAPH["dflash_jax.sharding"]


def test_the_checker_reports_a_cycle_on_a_small_graph():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"x": {"x"}}) == ["x", "x"]
    assert cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}) == [["a", "b", "a"], ["b", "c", "b"]]


def test_relative_function_level_and_type_only_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text("from typing import TYPE_CHECKING\nfrom . import other, CONSTANT\n"
                                "from .sub import thing\nimport pkg.deep.mod\nif TYPE_CHECKING:\n    import pkg.types\n"
                                "def f():\n    from pkg import late\n")
    got = imported_names(pkg / "mod.py", "pkg.mod", frozenset({"pkg.other", "pkg.sub", "pkg.late"}))
    assert got == {"typing", "pkg.other", "pkg", "pkg.sub", "pkg.deep.mod", "pkg.late"}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, each found then broken at its first edge, until none is left (so one
    failure lists every circle to cut, not just the first)."""
    graph = {k: set(v) for k, v in graph.items()}
    out = []
    while (cycle := find_cycle(graph)) is not None:
        out.append(cycle)
        graph[cycle[0]].discard(cycle[1])
    return out


def test_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_pallas_kernels_import_nothing_from_dflash_jax():
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "dflash_jax")
           for m, deps in GRAPH.items() if m.startswith("pallas_kernels")}
    bad = {m: deps for m, deps in bad.items() if deps}
    assert not bad, f"pallas_kernels modules importing dflash_jax: {bad}"


@pytest.mark.parametrize("low", sorted(LOW))
def test_low_modules_import_nothing_above_them(low):
    if low not in GRAPH:
        pytest.skip(f"{low} does not exist")
    above = sorted(d for d in GRAPH[low] if d.split(".")[0] == "dflash_jax" and d not in LOW
                   and d != "dflash_jax")
    assert not above, f"{low} imports modules above it: {above}"
