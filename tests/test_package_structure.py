"""The package's structure: no import cycle, data flowing down the layers of docs/layout.md, front ends that
share the export core instead of importing each other, every command registered one way (a module of cli/), and
no module past about 500 lines nor function past about 80."""

from __future__ import annotations

import ast
from pathlib import Path

import rope_export

PACKAGE = Path(rope_export.__file__).parent
# docs/layout.md's table, bottom up: a module imports its own package and lower layers only
LAYERS = (("common",), ("op",), ("files", "kernels"), ("exporting",), ("passes",), ("detect", "runtimes"),
          ("presets", "hf", "blocks"), ("diffusion",), ("check", "serve"), ("bench",), ("cli",))
FRONT_ENDS = ("presets", "hf", "blocks")
MAX_LINES = 550  # "about 500": a module past this is split by what its parts hold
MAX_FUNCTION_LINES = 90  # "about 80": a function past this is split by what its steps do
# "module:function" -> why it stays long for now
LONG_FUNCTIONS: dict[str, str] = {
}


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
    """Imports of a package in the same or a higher layer."""
    found = []
    for module, targets in graph.items():
        own = package_of(module)
        for target in targets:
            other = package_of(target)
            if own is None or other is None or other == own:
                continue
            if layer_of(other) >= layer_of(own):
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_no_module_of_the_package_is_in_an_import_cycle():
    graph = import_graph()
    assert "rope_export.hf.export" in graph and "rope_export.detect.functions" in graph
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in import_graph()} - {None, "models"}
    assert packages == {p for layer in LAYERS for p in layer}


def test_data_flows_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_finding_rotations_and_running_files_need_no_graph_pass():
    # detect/ and runtimes/ read files and runs; the op's node identities live in op/, not in a lowering rule
    crossing = [f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
                if package_of(m) in ("detect", "runtimes") and package_of(t) == "passes"]
    assert crossing == []


def test_the_layer_rule_finds_an_upward_import():
    graph = {"rope_export.files.onnx_files": {"rope_export.exporting.core"},
             "rope_export.exporting.core": {"rope_export.files.onnx_files"},
             "rope_export.passes.lowering": {"rope_export.cli.options"},
             "rope_export.cli.passes": {"rope_export.passes.lowering"}}
    assert upward_imports(graph) == ["rope_export.files.onnx_files -> rope_export.exporting.core",
                                     "rope_export.passes.lowering -> rope_export.cli.options"]


def test_the_front_ends_share_the_core_and_never_import_each_other():
    graph = import_graph()
    assert {"rope_export.exporting.core"} <= graph["rope_export.hf.export"]
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


def registrations_outside_cli(sources: dict[str, str]) -> list[str]:
    """Modules outside cli/ that register a command: a top-level ``register`` function, or a parser given the
    ``func`` a command line runs (``set_defaults(func=...)``). ``sources``: module name -> its text."""
    found = []
    for module, text in sources.items():
        if package_of(module) == "cli":
            continue
        tree = ast.parse(text)
        if any(isinstance(n, ast.FunctionDef) and n.name == "register" for n in tree.body):
            found.append(f"{module}: register()")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "set_defaults" and any(k.arg == "func" for k in node.keywords)):
                found.append(f"{module}: set_defaults(func=...)")
    return sorted(found)


def test_every_command_registers_one_way():
    from rope_export.cli import COMMANDS

    for name, (_help, module) in COMMANDS.items():
        assert package_of(module) == "cli", (name, module)
        assert any(isinstance(n, ast.FunctionDef) and n.name == "register"
                   for n in ast.parse((PACKAGE / "cli" / f"{module.rsplit('.', 1)[1]}.py").read_text()).body), name
    sources = {_module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert registrations_outside_cli(sources) == []
    assert "rope_export.cli" not in {t.rsplit(".", 1)[0] for m, ts in import_graph().items()
                                     if package_of(m) != "cli" for t in ts}


def test_the_registration_rule_finds_a_planted_exception():
    planted = {"rope_export.serve.triton": "def register(subparsers):\n    pass\n",
               "rope_export.runtimes.trt": "def add(p):\n    p.set_defaults(func=print)\n",
               "rope_export.cli.build": "def register(subparsers):\n    pass\n"}
    assert registrations_outside_cli(planted) == ["rope_export.runtimes.trt: set_defaults(func=...)",
                                                  "rope_export.serve.triton: register()"]


def long_functions(sources: dict[str, str], limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """"module:function" -> lines, for every function (methods and nested ones too) longer than ``limit``."""
    found = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found[f"{module}:{node.name}"] = lines
    return found


def test_no_function_is_past_about_80_lines():
    sources = {_module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert set(long_functions(sources)) - set(LONG_FUNCTIONS) == set()
    assert set(LONG_FUNCTIONS) - set(long_functions(sources)) == set()  # an exception no longer needed goes


def test_the_length_rule_finds_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions({"m": f"def short():\n    pass\n\n\ndef long():\n{body}"}) == {
        "m:long": MAX_FUNCTION_LINES + 1}
