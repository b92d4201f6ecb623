"""The package's layers import only downward. Lowest first:

    core       rotaryquant.*: errors, paths, quants, gguf_io, kvtypes, files, data, machine, assets, build, ...
    bindings   rotaryquant.bindings (bindings/)
    converter  rotaryquant.converter (converter/)
    eval       rotaryquant.eval (eval/)
    top        rotaryquant.plan, plan_cli, plan_verify, demo: the planner and the demo, above what they use

Every module's imports are read with ``ast`` (top-level, function-local and relative ones; the folders are
mapped to packages by pyproject.toml's ``[tool.setuptools.package-dir]``), and the test fails, naming the
module and the edge, on an import of a higher layer, on a cycle among the package's modules, and on a
function-local import that is not of a heavy optional dependency or does not say why it is lazy
(``import torch  # lazy: optional, heavy``, or a ``# lazy: ...`` comment on the line above).
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = "rotaryquant"

# lowest first; a module's layer is the one of the longest prefix that names it
LAYERS = ("core", "bindings", "converter", "eval", "top")
LAYER_OF = {
    "rotaryquant": "core",
    "rotaryquant.bindings": "bindings",
    "rotaryquant.converter": "converter",
    "rotaryquant.eval": "eval",
    "rotaryquant.plan": "top",
    "rotaryquant.plan_cli": "top",
    "rotaryquant.plan_verify": "top",
    "rotaryquant.demo": "top",
}

# what a function may import lazily (top-level package names): heavy, or optional (only some commands need
# them; llama_cpp and gguf are installed by rq-setup, which runs before either exists)
LAZY_OK = frozenset({
    "torch", "transformers", "safetensors", "tokenizers", "huggingface_hub", "matplotlib", "scipy",
    "websocket", "llama_cpp", "gguf", "conversion",
})
_REASON = re.compile(r"#\s*lazy:\s*\S")


@dataclass(frozen=True)
class Import:
    module: str   # the importing module
    target: str   # the imported module (the most specific one that exists, for the package's own)
    line: int
    local: bool   # inside a function
    reason: bool  # a "# lazy: ..." comment on the line or just above it


def layer(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__), for every .py file of the package's folders."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    out: dict[str, tuple[Path, bool]] = {}
    # deepest mapping last, so a folder mapped on its own wins over its parent's mapping
    for pkg, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        base = REPO / folder
        for path in sorted(base.rglob("*.py")):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = (path, path.name == "__init__.py")
    return out


def _resolve(module: str, is_init: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_init else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _has_reason(lines: list[str], lineno: int) -> bool:
    if _REASON.search(lines[lineno - 1]):
        return True
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    return above.startswith("#") and bool(_REASON.search(above))


@cache
def imports() -> tuple[Import, ...]:
    mods = modules()
    found: list[Import] = []
    for name, (path, is_init) in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(name, is_init, node)
                # "from pkg import mod" imports the module pkg.mod
                subs = [f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in mods]
                targets = subs + ([src] if len(subs) < len(node.names) else [])
            else:
                continue
            for t in targets:
                while t.startswith(ROOT + ".") and t not in mods:  # an attribute: its module
                    t = t.rsplit(".", 1)[0]
                found.append(Import(name, t, node.lineno, id(node) in local,
                                    _has_reason(lines, node.lineno)))
    return tuple(found)


def _own(target: str) -> bool:
    return target == ROOT or target.startswith(ROOT + ".")


def upward_edges() -> list[str]:
    rank = {n: i for i, n in enumerate(LAYERS)}
    return [f"{i.module} ({layer(i.module)}) imports {i.target} ({layer(i.target)}), line {i.line}"
            for i in imports() if _own(i.target) and rank[layer(i.target)] > rank[layer(i.module)]]


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for i in imports():
        if _own(i.target) and i.target in graph:
            graph[i.module].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred nodes, recursion is fine
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def bad_local_imports() -> list[str]:
    out = []
    for i in imports():
        if not i.local:
            continue
        top = i.target.split(".")[0]
        if top not in LAZY_OK:
            out.append(f"{i.module}, line {i.line}: function-local import of {i.target} (not a heavy optional "
                       "dependency: import it at the top of the module)")
        elif not i.reason:
            out.append(f"{i.module}, line {i.line}: function-local import of {i.target} without a reason "
                       "(add '# lazy: <why>' on the line or just above)")
    return out


def test_the_scan_sees_the_package():
    """Every folder mapped, relative and function-local imports resolved (else the checks below see nothing)."""
    mods = modules()
    assert {"rotaryquant.errors", "rotaryquant.bindings.ggml", "rotaryquant.converter.cli",
            "rotaryquant.eval.cli", "rotaryquant.plan_cli", "rotaryquant.quants.isoquant_tables_so"} <= set(mods)
    found = imports()
    assert any(i.target == "rotaryquant.quants.isoquant_tables_so" for i in found)  # "from .x import": relative
    assert any(i.local and i.target == "llama_cpp" and i.reason for i in found)
    assert {layer(m) for m in mods} == set(LAYERS)


def test_layers_import_only_downward():
    edges = upward_edges()
    assert not edges, "imports of a higher layer (" + " < ".join(LAYERS) + "):\n  " + "\n  ".join(edges)


def test_no_import_cycles():
    found = cycles()
    assert not found, "import cycles among the package's modules:\n  " + "\n  ".join(
        " <-> ".join(c) for c in found)


def test_function_local_imports_are_heavy_optional_and_say_why():
    bad = bad_local_imports()
    assert not bad, f"{len(bad)} function-local imports:\n  " + "\n  ".join(bad)


if __name__ == "__main__":  # a report of all three
    print("\n".join(upward_edges()))
    print("\n".join(" <-> ".join(c) for c in cycles()))
    print("\n".join(bad_local_imports()))
