"""The package's import graph: no module imports one that imports it back, and no layer imports upward."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "decodekit"
# Lower layers first: a module may import its own layer or lower ones, never a higher one.
LAYERS = (
    ("decodekit._validation", "decodekit.settings", "decodekit.fields"),
    ("decodekit.logits_processors", "decodekit.decoders", "decodekit.cache"),
    ("decodekit.plan", "decodekit.strategies", "decodekit.models"),
    ("decodekit.generation", "decodekit.trace", "decodekit.context"),
    ("decodekit.eval", "decodekit.demo"),
    ("decodekit.cli", "decodekit.__main__", "decodekit.eval.__main__"),  # the entry points
)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The decodekit modules ``path`` imports, at any depth of its code (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("decodekit"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("decodekit"))
    return {name for name in found if name in modules}


def _layer(module: str) -> int | None:
    """The layer of the longest prefix that names ``module`` or a package holding it."""
    matches = [(len(prefix), index) for index, layer in enumerate(LAYERS) for prefix in layer
               if module == prefix or module.startswith(prefix + ".")]  # fmt: skip
    return max(matches)[1] if matches else None


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    circles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})
    assert not circles, f"import circles: {circles}"


def test_no_layer_imports_upward():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        own = _layer(name)
        if own is None or name == "decodekit":  # the package itself re-exports every layer, lazily
            continue
        for imported in _imports(path, modules):
            theirs = _layer(imported)
            if theirs is not None and theirs > own:
                upward.append(f"{name} -> {imported}")
    assert not upward, f"imports from a higher layer: {upward}"


def test_every_module_has_a_layer():
    unplaced = [name for name in _modules() if name != "decodekit" and _layer(name) is None]
    assert not unplaced, f"modules outside LAYERS: {unplaced}"
