"""The package's structure: no import cycle, data flowing down the layers of docs/layout.md, front ends that
share the export core instead of importing each other, and no module past about 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import rope_export

PACKAGE = Path(rope_export.__file__).parent
# docs/layout.md's table, bottom up: a module imports its own package and lower layers only
LAYERS = (("common",), ("op",), ("files", "kernels"), ("exporting",), ("passes",), ("detect", "runtimes"),
          ("presets", "hf", "blocks"), ("diffusion",), ("check", "serve"), ("cli",), ("bench",))
FRONT_ENDS = ("presets", "hf", "blocks")
MAX_LINES = 550  # "about 500": a module past this is split by what its parts hold


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the rope_export modules it imports, anywhere in the file (function-level imports too).

    Except in the package's own ``__init__``: a lazy ``__getattr__`` there is the facade's way of
    offering a name without importing its module, and is not followed."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        tree = ast.parse(path.read_text())
        for node in (tree.body if path == PACKAGE / "__init__.py" else ast.walk(tree)):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets |= submodules
                if len(submodules) < len(node.names):  # a name defined in node.module itself
                    targets.add(node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the rope_export facade (__version__, export_module)


def layer_of(package: str) -> int:
    return next(i for i, packages in enumerate(LAYERS) if package in packages)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a package in the same or a higher layer. A command's own module (``PACKAGE.cli``) may also
    import the command line's shared options (``rope_export.cli``), which import nothing below them."""
    found = []
    for module, targets in graph.items():
        own = package_of(module)
        for target in targets:
            other = package_of(target)
            if own is None or other is None or other == own:
                continue
            if module.endswith(".cli") and other == "cli":
                continue
            if layer_of(other) >= layer_of(own):
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_no_module_of_the_package_is_in_an_import_cycle():
    graph = import_graph()
    assert "rope_export.hf.exporting" in graph and "rope_export.detect.functions" in graph
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in import_graph()} - {None, "models"}
    assert packages == {p for layer in LAYERS for p in layer}


def test_data_flows_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_layer_rule_finds_an_upward_import():
    graph = {"rope_export.files.onnx_files": {"rope_export.exporting.core"},
             "rope_export.exporting.core": {"rope_export.files.onnx_files"},
             "rope_export.passes.cli": {"rope_export.cli.options"}}
    assert upward_imports(graph) == ["rope_export.files.onnx_files -> rope_export.exporting.core"]


def test_the_front_ends_share_the_core_and_never_import_each_other():
    graph = import_graph()
    assert {"rope_export.exporting.core"} <= graph["rope_export.hf.exporting"]
    assert {"rope_export.exporting.core"} <= graph["rope_export.blocks.export"]
    assert {"rope_export.exporting.core"} <= graph["rope_export.presets.export"]
    # diffusers' transformers are modules: their front end is built on export_module, a layer above the others
    assert {"rope_export.blocks.export", "rope_export.exporting.core"} <= graph["rope_export.diffusion.exporting"]
    crossing = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
                if package_of(m) in FRONT_ENDS and package_of(t) in FRONT_ENDS and package_of(t) != package_of(m)]
    assert crossing == []


def test_no_module_is_past_about_500_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
