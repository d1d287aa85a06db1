"""rope_export.hf as a package: no import cycle through it, its public names, its one-line refusals."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import rope_export

PACKAGE = Path(rope_export.__file__).parent


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


def test_no_module_of_the_package_is_in_an_import_cycle():
    graph = import_graph()
    assert "rope_export.hf.exporting" in graph and "rope_export.detect.functions" in graph
    assert import_cycles(graph) == []
    # data flows down: the front ends (presets, hf, blocks) share the export core and never import each other
    front_ends = ("rope_export.presets", "rope_export.hf", "rope_export.blocks")
    for module, targets in graph.items():
        own = next((f for f in front_ends if module.startswith(f)), None)
        if own:
            assert not [t for t in targets if t.startswith(front_ends) and not t.startswith(own)], module


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_public_names_other_modules_use_stay_importable():
    from rope_export import hf

    for name in ("build_hf_model", "load_hf_config", "read_hf_metadata", "hf_io_names", "hf_example_inputs",
                 "export_hf", "rotary_hooked", "HF_FAMILIES", "MODEL_TYPES", "family_of",
                 "run_hf_export", "wants_hf_export", "HFExportError", "rotate_half_qk", "FORMS"):
        assert hasattr(hf, name), name
    assert hf.hf_io_names(2) == (
        ["input_ids", "position_ids", "past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key",
         "past_key_values.1.value"], ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"])


def test_a_hidden_size_that_is_not_a_multiple_of_the_heads_is_one_clear_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    from rope_export import cli, hf

    # a config class that checks this itself (Llama) refuses the file; its reason is the line
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                     intermediate_size=64, num_key_value_heads=2).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**llama, "hidden_size": 30}))
    with pytest.raises(hf.HFExportError, match=r"not a config transformers accepts: .*hidden size \(30\) is not a "
                                               r"multiple of the number of attention heads \(4\)\.$"):
        hf.load_hf_config(path)
    code = cli.main(["export", "--hf", str(path), "-o", str(tmp_path / "x.onnx")])
    assert code == 2 and not (tmp_path / "x.onnx").exists()
    # one that does not (GPT-J) is refused by rope-export before anything is built
    gptj = transformers.GPTJConfig(vocab_size=64, n_embd=30, n_head=4, n_layer=1, rotary_dim=4)
    with pytest.raises(hf.HFExportError, match=r"^gptj: hidden_size 30 is not a multiple of num_attention_heads 4"):
        hf.build_hf_model(gptj)


def test_an_operator_torch_onnx_cannot_translate_is_named():
    """transformers' default experts implementation (grouped_mm) emits an op torch.onnx has no translation for."""
    transformers = pytest.importorskip("transformers")
    from rope_export import hf

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="grouped_mm").eval()
    with pytest.raises(hf.HFExportError, match=r"torch\.onnx cannot translate .*grouped_mm"):
        hf.export_hf(model)
    built = hf.build_hf_model(config)  # rope-export's own build: batched_mm, which exports
    assert built.config._experts_implementation == "batched_mm"
    assert hf.export_hf(built).custom_nodes == 2
