"""The house rules, checked on the source itself (parsed with ``ast``, nothing imported).

* no import cycle between modules;
* the layer order: a module imports only modules of its own layer or a lower one (``LAYERS``);
* at most ``MAX_LOCAL_IMPORTS`` function-local imports of seqlab, each explained by a comment;
* no source file over ``MAX_LINES`` lines;
* every C source and header the package compiles at run time is in the wheel (``package-data``).

docs/architecture.md explains the layers and why they are in this order.
"""
from __future__ import annotations

import ast
import tomllib
from fnmatch import fnmatch
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "seqlab"
MAX_LINES = 400
MAX_LOCAL_IMPORTS = 5

# Lowest first. A module may import its own layer or a lower one, never a higher one. The key is the first name
# under seqlab (a subpackage or a top-level module); "" is seqlab/__init__.py itself.
LAYERS: list[tuple[str, ...]] = [
    ("", "config", "model"),
    ("runtime",),
    ("data", "objectives", "eval"),
    ("generate",),
    ("nnqs", "train"),
    ("accel", "quant"),
    ("io",),
    ("serve",),
    ("cli", "__main__"),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under src/seqlab (packages by their __init__.py)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    """The seqlab modules an import statement loads (``from a import b`` loads a.b when b is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target != PACKAGE and not target.startswith(PACKAGE + "."):
        return []
    found = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return found or [target]


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported seqlab module, line, inside a function?) for every import statement of ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((t, child.lineno, in_function) for t in _resolve(module, child, is_package))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


IMPORTS = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER_OF.get(parts[1] if len(parts) > 1 else "")


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(SRC.parent)}:{line}"


def test_every_module_has_a_layer():
    missing = sorted({m.split(".")[1] for m in MODULES if _layer(m) is None})
    assert not missing, f"add these to LAYERS in {__file__} (and to docs/architecture.md): {missing}"


def find_cycles(graph: dict[str, list[str]]) -> list[str]:
    """Depth-first search; every back edge closes a cycle, reported as its path."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []
    cycles: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in graph.get(m, []):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return cycles


def test_no_import_cycles():
    """Function-local imports count: one that closes a cycle only hides it (and breaks at the first reorder)."""
    graph = {m: sorted({t for t, _, _ in IMPORTS[m] if t in MODULES and t != m}) for m in MODULES}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_layer_order():
    """Function-local imports count too: hiding an upward import inside a function does not make it right."""
    bad = []
    for m, imports in IMPORTS.items():
        for target, line, _ in imports:
            lo, hi = _layer(m), _layer(target)
            if lo is not None and hi is not None and hi > lo:
                bad.append(f"{_where(m, line)}: {m} (layer {lo}) imports {target} (layer {hi})")
    assert not bad, "imports of a higher layer:\n  " + "\n  ".join(sorted(bad))


def test_few_function_local_imports_each_with_a_reason():
    local = [(m, line) for m, imports in IMPORTS.items() for _, line, is_local in imports if is_local]
    local = sorted(set(local))
    unexplained = []
    for m, line in local:
        lines = MODULES[m].read_text(encoding="utf-8").splitlines()
        here, before = lines[line - 1], lines[line - 2] if line >= 2 else ""
        if "#" not in here and not before.strip().startswith("#"):
            unexplained.append(_where(m, line))
    listing = "\n  ".join(_where(m, line) for m, line in local)
    assert len(local) <= MAX_LOCAL_IMPORTS, (
        f"{len(local)} function-local seqlab imports (at most {MAX_LOCAL_IMPORTS}); move them to the top of the "
        f"file:\n  {listing}")
    assert not unexplained, ("function-local seqlab imports need a comment saying why (same or previous line):\n  "
                             + "\n  ".join(unexplained))


def test_no_source_file_over_the_limit():
    long = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long.append(f"{path.relative_to(SRC.parent)}: {n} lines")
    assert not long, f"source files over {MAX_LINES} lines:\n  " + "\n  ".join(long)


def test_the_checks_see_what_they_should():
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []
    local = ast.parse("def f():\n    from seqlab.model import masks  # why\n").body[0].body[0]
    assert _resolve("seqlab.generate.loop", local, False) == ["seqlab.model.masks"]
    rel = ast.parse("from .engine import prefill\n").body[0]
    assert _resolve("seqlab.generate.loop", rel, False) == ["seqlab.generate.engine"]
    assert ("seqlab.generate.engine", False) in {(t, loc) for t, _, loc in IMPORTS["seqlab.generate.loop"]}
    assert _layer("seqlab.cli.generate") > _layer("seqlab.io.hf") > _layer("seqlab.generate.engine") > \
        _layer("seqlab.model.masks") == _layer("seqlab")


def test_every_c_source_ships_in_the_wheel():
    """A kernel source left out of ``package-data`` works from a checkout and is silently missing from an
    installed wheel (the accelerator then falls back to the slow path)."""
    pyproject = tomllib.loads((SRC.parent / "pyproject.toml").read_text(encoding="utf-8"))
    globs = pyproject["tool"]["setuptools"]["package-data"][PACKAGE]
    sources = [p.relative_to(SRC / PACKAGE).as_posix() for p in (SRC / PACKAGE).rglob("*") if p.suffix in (".c", ".h")]
    assert len(sources) >= 8  # the accelerator's kernels and headers, and the quantised-product kernel
    assert [s for s in sources if not any(fnmatch(s, g) for g in globs)] == []
