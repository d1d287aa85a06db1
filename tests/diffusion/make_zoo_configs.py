"""Write ``diffusers_zoo_configs.py``: the tiny configs of diffusers' own model tests, one per transformer class.

``python tests/diffusion/make_zoo_configs.py DIFFUSERS_CHECKOUT`` reads every
``tests/models/transformers/test_models_*.py`` of a diffusers source tree (Apache-2.0), runs each tester
config's ``get_init_dict()`` (their test helpers stubbed: nothing else of the test suite is needed) and writes
the first config of each model class, with the file it came from. The zoo builds every transformer class of the
installed diffusers from these configs (``diffusers_zoo.py``); a class with none is listed as such.
"""

from __future__ import annotations

import ast
import json
import pprint
import sys
import types
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "diffusers_zoo_configs.py"


def _stub(name: str):
    """A stand-in for a name the test file imports from diffusers' own test helpers."""
    import torch

    if name == "torch_device":
        return "cpu"
    if name.isupper():
        return False
    if name[0].isupper():  # tester mixins and BaseModelTesterConfig
        return type(name, (), {"torch_dtype": torch.float32, "generator": property(
            lambda self: torch.Generator("cpu").manual_seed(0))})
    return lambda *args, **kwargs: args[0] if len(args) == 1 and callable(args[0]) and not kwargs else None


def _module(path: Path) -> types.ModuleType:
    tree = ast.parse(path.read_text())
    namespace: dict = {"__name__": f"diffusers_tests.{path.stem}"}
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            for alias in node.names:
                namespace[alias.asname or alias.name] = _stub(alias.name)
        else:
            body.append(node)
    tree.body = body
    exec(compile(tree, str(path), "exec"), namespace)  # noqa: S102 - diffusers' own test file, read to get configs
    module = types.ModuleType(namespace["__name__"])
    vars(module).update(namespace)
    return module


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def configs(checkout: Path) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for path in sorted((checkout / "tests" / "models" / "transformers").glob("test_models_*.py")):
        try:
            module = _module(path)
        except Exception as exc:  # noqa: BLE001 - a test file this script cannot read: say so, go on
            print(f"skipped {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        for value in vars(module).values():
            if not isinstance(value, type) or not hasattr(value, "get_init_dict") or not hasattr(value, "model_class"):
                continue
            try:
                tester = value()
                name = tester.model_class.__name__
                init = tester.get_init_dict()
            except Exception as exc:  # noqa: BLE001
                print(f"skipped {path.name}:{value.__name__}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            if name not in found:
                found[name] = {"config": _jsonable(init), "from": path.name}  # in tests/models/transformers/
    return dict(sorted(found.items()))


def main(checkout: str) -> None:
    found = configs(Path(checkout))
    header = ('"""Tiny configs of diffusers\' transformer classes, from diffusers\' own model tests (Apache-2.0),\n'
              'written by ``make_zoo_configs.py``; do not edit by hand."""\n\n')
    text = header + f"CONFIGS = {pprint.pformat(found, width=100, sort_dicts=False)}\n"
    json.loads(json.dumps(found))  # JSON values only
    OUT.write_text(text)
    print(f"{len(found)} classes -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
