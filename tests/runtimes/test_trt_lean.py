"""The plugin libraries in TensorRT's own runtime: the lean runtime from pip, which runs without a GPU.

What TensorRT's Python bindings reach on a C++ plugin, tested here through them (each loading
scenario in a fresh process, tests/trt_lean_probe.py): the plugin registry (CDLL'd libraries that
register themselves, IPluginRegistry.load_library, deregister_library), the creator's identity and
declared fields, create_plugin in the build and runtime phases, and on the plugin its core names,
num_outputs, metadata_string and timing_cache_id. The bindings' IPluginV3OneBuild/Runtime methods
(get_output_data_types, supports_format_combination, get_fields_to_serialize, clone,
attach_to_context...) are documentation stubs for C++ plugins, so the C++ driver
plugins/tests/glue_smoke.cpp makes those calls on the creator that TensorRT's own registry returns
(loadLibrary + getCreator in the runtime library), and the dtype table it prints is held against
rope_export.op.contract here. Without a GPU nothing here builds an engine or enqueues a kernel.

Each test runs once per TensorRT major version whose headers built the libraries and whose lean
runtime is installed: 11.x (the venv, extra trt-lean) and 10.x (build/trt-lean-10), see the Makefile.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest

from rope_export.kernels.cpu_twin import serialize_fields
from rope_export.kernels.libraries import TRT_PLUGIN_LIBRARY, TRT_VC_PLUGIN_LIBRARY, plugin_dir, source_root
from rope_export.op import contract
from rope_export.op.contract import RotaryAttrs, RotaryContractError
from rope_export.op.nodes import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from rope_export.passes import lower

PROBE = Path(__file__).resolve().parents[1] / "trt_lean_probe.py"  # beside conftest.py
LEAN10_DIR = source_root() / "build" / "trt-lean-10"
IDENTITY = [PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE, "IPluginCreatorV3One"]


@dataclass(frozen=True)
class Setup:
    """Plugin libraries built against one TensorRT version, and the lean runtime of that major."""

    version: str  # the headers', e.g. "11.1.0"
    libs: Path  # folder with both plugin libraries and tests/rope_export_glue_smoke
    lean_path: str | None  # folder to put first on sys.path (None: the venv's tensorrt_lean)
    runtime_lib: Path  # libnvinfer_lean.so.<major>

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def static(self) -> str:
        return str(self.libs / TRT_PLUGIN_LIBRARY)

    @property
    def vc(self) -> str:
        return str(self.libs / TRT_VC_PLUGIN_LIBRARY)


def _lean_runtimes() -> dict[int, tuple[str | None, Path]]:
    """major -> (sys.path entry or None for the venv, libnvinfer_lean.so.<major>)."""
    found = {}
    spec = importlib.util.find_spec("tensorrt_lean_libs")
    roots = [(None, Path(spec.origin).parent)] if spec and spec.origin else []
    roots.append((str(LEAN10_DIR), LEAN10_DIR / "tensorrt_lean_libs"))
    for path, folder in roots:
        for lib in sorted(folder.glob("libnvinfer_lean.so.*")):
            found.setdefault(int(lib.name.rsplit(".", 1)[1]), (path, lib))
    return found


def _plugin_builds() -> list[tuple[str, Path]]:
    root = plugin_dir()
    dirs = [root, *sorted(root.glob("trt*"))] if root.is_dir() else []
    builds = []
    for d in dirs:
        version_file = d / "tensorrt_version.txt"
        if version_file.is_file() and (d / TRT_PLUGIN_LIBRARY).is_file() and (d / TRT_VC_PLUGIN_LIBRARY).is_file():
            builds.append((version_file.read_text().strip(), d))
    return builds


def _setups() -> tuple[list[Setup], str]:
    runtimes, builds = _lean_runtimes(), _plugin_builds()
    setups = [Setup(v, d, *runtimes[int(v.split(".")[0])]) for v, d in builds if int(v.split(".")[0]) in runtimes]
    if setups:
        return setups, ""
    if not builds and not runtimes:
        return [], ("TensorRT's headers and its lean runtime are both missing: set TENSORRT_INCLUDE_DIR (e.g. "
                    "NVIDIA/TensorRT's include/ at tag v11.1, extracted outside the repository: docs/tensorrt.md, "
                    "'TensorRT headers') and run `make test`, which builds the plugin "
                    "libraries and installs tensorrt-lean-cu13")
    if not builds:
        return [], ("the TensorRT plugin libraries are not built: set TENSORRT_INCLUDE_DIR to TensorRT's include/ "
                    "and run `make plugin`")
    return [], (f"no TensorRT lean runtime of major version {', '.join(v for v, _ in builds)} is installed: "
                "`make trt-lean` or pip install 'rope-export[trt-lean]'")


SETUPS, SKIP_REASON = _setups()
pytestmark = pytest.mark.skipif(not SETUPS, reason=SKIP_REASON)
setups = pytest.mark.parametrize("setup", SETUPS or [None], ids=[f"trt{s.version}" for s in SETUPS] or ["none"])


def probe(setup: Setup, *steps) -> tuple[list[dict], str]:
    """Run the steps in a fresh process with this setup's lean runtime: (records, stderr)."""
    env = dict(os.environ)
    env.pop("ROPE_EXPORT_TRT_LEAN_PATH", None)
    if setup.lean_path:
        env["ROPE_EXPORT_TRT_LEAN_PATH"] = setup.lean_path
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(list(steps))], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, f"the probe crashed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


# --- loading: each library the way its hosts load it -------------------------------------------------


@setups
def test_self_registering_library_registers_one_creator_when_opened(setup):
    (imp, before, _, after), _ = probe(setup, ["import"], ["creators"], ["cdll", setup.static], ["creators"])
    assert imp["version"].split(".")[0] == str(setup.major)
    assert before["ours"] == [] and not before["found"]
    assert after["ours"] == [IDENTITY] and after["found"]
    assert after["total"] == before["total"] + 1


@setups
def test_vc_library_registers_through_load_library_only(setup):
    records, _ = probe(setup, ["import"], ["cdll", setup.vc], ["creators"], ["load", setup.vc], ["creators"],
                       ["deregister"], ["creators"])
    _, _, opened, loaded, registered, _, gone = records
    assert opened["ours"] == []  # opening it registers nothing: it is for loadLibrary hosts
    assert loaded["handle"] and registered["ours"] == [IDENTITY]
    assert registered["field_names"] == [["interleaved", "INT32", 1], ["num_heads", "INT32", 1],
                                         ["rotary_embedding_dim", "INT32", 1]]
    assert gone["ours"] == [] and not gone["found"]


@setups
def test_loading_the_same_library_twice_is_harmless(setup):
    records, _ = probe(setup, ["import"], ["cdll", setup.static], ["cdll", setup.static], ["creators"],
                       ["load", setup.vc], ["creators"])
    assert records[3]["ours"] == [IDENTITY]
    # TensorRT's loadLibrary refuses a library whose creator is already registered; the first stays.
    assert records[4]["handle"] is False and records[5]["ours"] == [IDENTITY]
    records, _ = probe(setup, ["import"], ["load", setup.vc], ["load", setup.vc], ["creators"])
    assert records[1]["handle"] and records[2]["handle"] is False and records[3]["ours"] == [IDENTITY]


@setups
def test_self_registering_library_after_the_vc_one_keeps_the_first_and_says_so(setup, tmp_path):
    copy = tmp_path / "copy" / TRT_PLUGIN_LIBRARY  # another copy: its static registration runs again
    copy.parent.mkdir()
    shutil.copy(setup.static, copy)
    records, err = probe(setup, ["import"], ["load", setup.vc], ["cdll", setup.static], ["cdll", str(copy)],
                         ["creators"])
    assert records[1]["handle"] and records[4]["ours"] == [IDENTITY]
    assert err.count("is already registered in libnvinfer_lean.so") == 2, err
    assert "keeping that one" in err


@setups
def test_self_registering_library_given_to_load_library_is_refused_without_a_crash(setup):
    records, _ = probe(setup, ["import"], ["load", setup.static], ["creators"])
    # It exports no getCreators, so TensorRT refuses it; opening it registered the creator anyway.
    assert records[1]["handle"] is False and records[2]["ours"] == [IDENTITY]


@setups
def test_self_registering_library_opened_before_tensorrt_warns_and_registers_nothing(setup):
    records, err = probe(setup, ["cdll", setup.static], ["import"], ["creators"])
    assert records[2]["ours"] == []
    assert f"the plugin was NOT registered: no TensorRT {setup.major} runtime" in err
    # (it would have opened libnvinfer.so.<major> itself, as libnvinfer_plugin's DT_NEEDED does)
    assert f"libnvinfer.so.{setup.major} is not on the library search path" in err
    assert "load TensorRT first" in err and TRT_VC_PLUGIN_LIBRARY in err


def test_libraries_refuse_a_runtime_of_another_major_version():
    by_major = {s.major: s for s in SETUPS}
    if len(by_major) < 2:
        pytest.skip("needs plugin libraries and lean runtimes of two TensorRT major versions (10.x and 11.x)")
    for built in by_major.values():
        for runtime in by_major.values():
            if runtime is built:
                continue
            records, err = probe(runtime, ["import"], ["cdll", built.static], ["load", built.vc], ["creators"])
            assert records[2]["handle"] is False and records[3]["ours"] == []
            assert err.count(f"was built against TensorRT {built.major} headers") == 2, err
            assert f"libnvinfer_lean.so.{runtime.major}" in err


# --- create_plugin with the fields TensorRT's ONNX parser passes --------------------------------------


def _lowered_node(attrs: RotaryAttrs) -> onnx.NodeProto:
    """The node the trt-plugin lowering writes for one rotary node with these attributes."""
    from onnx import TensorProto, helper

    half = (attrs.rotary_embedding_dim or 32) // 2  # 8 heads of 32 channels
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, 8 * 32])
    cos = helper.make_tensor_value_info("cos", TensorProto.FLOAT, [64, half])
    sin = helper.make_tensor_value_info("sin", TensorProto.FLOAT, [64, half])
    pos = helper.make_tensor_value_info("pos", TensorProto.INT64, [1, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 3, 8 * 32])
    node = helper.make_node(contract.OP_TYPE, ["x", "cos", "sin", "pos"], ["y"], domain=contract.DOMAIN,
                            **attrs.as_onnx_attributes())
    graph = helper.make_graph([node], "g", [x, cos, sin, pos], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(contract.DOMAIN, 1)])
    (lowered,) = lower(model, "trt-plugin").graph.node
    return lowered


def parser_fields(node: onnx.NodeProto, declared: list[list]) -> list[list]:
    """onnx-tensorrt's loadFields: for each field the creator declares, the node's attribute of that
    name if present, INT -> INT32 x 1, STRING -> CHAR (no terminator); other attributes are dropped."""
    attrs = {a.name: a for a in node.attribute}
    fields = []
    for name, _, _ in declared:
        if name not in attrs:
            continue
        a = attrs[name]
        if a.type == onnx.AttributeProto.INT:
            fields.append([name, "INT32", [a.i]])
        elif a.type == onnx.AttributeProto.STRING:
            fields.append([name, "CHAR", a.s.decode()])
    return fields


@setups
def test_the_lowered_node_creates_the_plugin_in_both_phases(setup):
    attrs = RotaryAttrs(interleaved=True, num_heads=8, rotary_embedding_dim=32)
    node = _lowered_node(attrs)
    (_, _, registered), _ = probe(setup, ["import"], ["load", setup.vc], ["creators"])
    fields = parser_fields(node, registered["field_names"])
    assert fields == [["interleaved", "INT32", [1]], ["num_heads", "INT32", [8]],
                      ["rotary_embedding_dim", "INT32", [32]]]
    records, err = probe(setup, ["import"], ["load", setup.vc], ["create", "BUILD", fields],
                         ["create", "RUNTIME", fields])
    for made in records[2:]:
        assert made["created"], err
        assert made["identity"] == [PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE]
        assert made["num_outputs"] == 1
        assert made["metadata"] == made["timing_cache_id"] == "interleaved=1 num_heads=8 rotary_embedding_dim=32"


@setups
def test_missing_attributes_take_defaults_when_building_only(setup):
    one = [["num_heads", "INT32", [4]]]
    records, err = probe(setup, ["import"], ["cdll", setup.static], ["create", "BUILD", []],
                         ["create", "BUILD", one], ["create", "RUNTIME", one])
    assert records[2]["metadata"] == "interleaved=0 num_heads=0 rotary_embedding_dim=0"
    assert records[3]["metadata"] == "interleaved=0 num_heads=4 rotary_embedding_dim=0"
    assert not records[4]["created"]
    assert "lacks field 'interleaved': the engine is damaged or was built by another plugin version" in err


@setups
def test_serialized_fields_recreate_an_equal_plugin(setup):
    # The fields the plugin serializes (getFieldsToSerialize calls this same core code; the C++ driver
    # checks the plugin's own) re-create it in TensorRT's deserialization phase.
    for attrs in (RotaryAttrs(True, 8, 32), RotaryAttrs(False, 0, 0), RotaryAttrs(False, 64, 128)):
        saved = [[f.name, f.type, [int.from_bytes(f.data, "little", signed=True)]] for f in serialize_fields(attrs)]
        records, err = probe(setup, ["import"], ["cdll", setup.static], ["create", "RUNTIME", saved])
        assert records[2]["created"], err
        assert records[2]["metadata"] == (f"interleaved={int(attrs.interleaved)} num_heads={attrs.num_heads} "
                                          f"rotary_embedding_dim={attrs.rotary_embedding_dim}")


MALFORMED = [
    ([["interleaved", "INT32", [2]]], "field 'interleaved' must be 0 (rotate-half) or 1 (interleaved), got 2"),
    ([["num_heads", "INT32", [-1]]], "field 'num_heads' must be in [0, 2147483647] (0: take H from 4-D X), got -1"),
    ([["rotary_embedding_dim", "INT32", [63]]], "field 'rotary_embedding_dim' must be even"),
    ([["rotary_embedding_dim", "INT64", [1 << 40]]], "field 'rotary_embedding_dim' must be in [0, 2147483647]"),
    ([["num_heads", "FLOAT32", [8.0]]], "field 'num_heads' must be INT32 (or INT64), got FLOAT32"),
    ([["num_heads", "CHAR", "8"]], "field 'num_heads' must be INT32 (or INT64), got CHAR"),
    ([["num_heads", "INT32", [8, 8]]], "field 'num_heads' must hold exactly 1 value, got 2"),
    ([["num_heads", "NONE", None]], "field 'num_heads' must be INT32 (or INT64), got UNKNOWN"),
    ([["heads", "INT32", [8]]], "unknown field 'heads'; the fields are interleaved, num_heads and rotary_embedding"),
    ([["num_heads", "INT32", [8]], ["num_heads", "INT32", [8]]], "field 'num_heads' is given more than once"),
]


@setups
def test_every_malformed_field_is_refused_with_its_message(setup):
    steps = [["import"], ["load", setup.vc]]
    steps += [["create", phase, fields] for fields, _ in MALFORMED for phase in ("BUILD", "RUNTIME")]
    records, err = probe(setup, *steps)
    assert [r["created"] for r in records[2:]] == [False] * (2 * len(MALFORMED))
    messages = [line for line in err.splitlines() if "cannot create the plugin of layer 'layer0'" in line]
    assert len(messages) == 2 * len(MALFORMED), err
    for i, (_, expected) in enumerate(MALFORMED):
        for line in messages[2 * i: 2 * i + 2]:
            assert expected in line, (expected, line)


# --- what only C++ reaches: the driver on the creator from TensorRT's own registry -------------------


def _driver(setup: Setup, *args: str) -> subprocess.CompletedProcess:
    driver = setup.libs / "tests" / "rope_export_glue_smoke"
    return subprocess.run([str(driver), setup.vc, str(setup.runtime_lib), *args], capture_output=True, text=True,
                          timeout=120)


@setups
def test_clone_attach_serialize_shapes_and_enqueue_refusals_in_tensorrts_registry(setup):
    proc = _driver(setup)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("glue smoke test: ok"), proc.stderr


def _contract_output(types: list[str], nb_inputs: int) -> tuple[str | None, str]:
    x, cos, sin, *rest = types[:nb_inputs]
    if cos != sin:
        return None, "must have the same dtype"
    try:
        contract.check_dtypes(x, cos, rest[0] if rest else None)
    except RotaryContractError as exc:
        return None, str(exc)
    return x, ""


@setups
def test_output_types_and_formats_over_the_whole_dtype_table(setup):
    proc = _driver(setup, "--dtype-table")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6**4 + 6**5  # float32/16, bfloat16, int64, int32, int8 at every position
    accepted = 0
    for row in rows:
        types, n = row["types"], row["nb_inputs"]
        output, error = _contract_output(types, n)
        assert row["output"] == output, row
        assert error in row["error"], row
        allowed = output is not None and types[n] == output  # the output has X's dtype
        assert row["accepted"] == allowed, row
        accepted += allowed
    # fp32/fp16/bf16 X x (X-typed or fp32 caches), without and with int64 positions
    assert accepted == 5 * 2


# --- a trt-plugin file without our library cannot become TensorRT's own layer -----------------------


@setups
def test_a_trt_plugin_node_cannot_fall_back_to_tensorrts_rotary_layer(setup):
    node = _lowered_node(RotaryAttrs(False, 8, 0))
    attrs = {a.name: a for a in node.attribute}
    # The parser dispatches by op type: an op type with an importer never reaches a plugin. Ours is no
    # op of any ONNX domain (TensorRT's importers are named after those), and not RotaryEmbedding.
    assert node.op_type == PLUGIN_NAME != contract.OP_TYPE
    assert not any(onnx.defs.has(node.op_type, domain) for domain in ("", "ai.onnx", "com.microsoft", "ai.onnx.ml"))
    assert attrs["plugin_namespace"].s.decode() == PLUGIN_NAMESPACE
    assert attrs["plugin_version"].s.decode() == PLUGIN_VERSION
    # So the fallback plugin importer looks up exactly this creator: absent without our library (the
    # parse fails with "Plugin not found"), present once it is loaded.
    (_, without), _ = probe(setup, ["import"], ["creators"])
    (_, _, with_lib), _ = probe(setup, ["import"], ["cdll", setup.static], ["creators"])
    assert not without["found"] and with_lib["found"]
    assert with_lib["ours"][0][:3] == [node.op_type, attrs["plugin_version"].s.decode(),
                                       attrs["plugin_namespace"].s.decode()]
