"""The TensorRT engine path (rope_export.runtimes.trt). Without TensorRT's builder and a GPU: the one-line
refusal, argument parsing, the profile derived from the file, the check that rotary nodes became
plugin layers, the rename of pre-rename files, and loading both plugin libraries into the lean
runtime's registry; the engine tests skip, saying why."""

from __future__ import annotations

import multiprocessing
import sys
from types import SimpleNamespace

import onnx
import pytest
import torch
from exported import CACHE_LEN, exported_model

from rope_export import cli
from rope_export.common.errors import CLIError
from rope_export.kernels.libraries import TRT_PLUGIN_LIBRARY, TRT_VC_PLUGIN_LIBRARY, plugin_dir
from rope_export.op import reference
from rope_export.op.nodes import LEGACY_PLUGIN_NAME, PLUGIN_NAME
from rope_export.op.tolerances import tolerance
from rope_export.passes import lower
from rope_export.runtimes import trt as rtrt
from rope_export.runtimes.trt_profiles import ProfileError, derive_profile

UNAVAILABLE = rtrt.tensorrt_unavailable_reason()


def _cli(monkeypatch, argv):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["rope_export.cli.build_plugin", "rope_export.cli.build"])
    return cli.main(argv)


def test_build_without_tensorrt_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError, on any machine
    rc = _cli(monkeypatch, ["build", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.engine")])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1
    assert err.startswith("rope-export build: error: TensorRT is not installed")
    assert not (tmp_path / "m.engine").exists()


def test_parse_shape():
    assert rtrt.parse_shape("x:1x8x16x64") == ("x", ((1, 8, 16, 64),) * 3)
    assert rtrt.parse_shape("input:0:1x4:2x4:8x4") == ("input:0", ((1, 4), (2, 4), (8, 4)))
    for bad in ["x", ":1x2", "x:1xa", "x:1x2:1x2x3:1x2", "x:1x2:3x4:"]:
        with pytest.raises(CLIError, match="--shape"):
            rtrt.parse_shape(bad)


def test_missing_plugin_library_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="rope-export build-plugin"):
        rtrt.load_plugins([tmp_path / "librope_export_trt_plugin.so"])


# --- the profile of `rope-export build`, from the file ------------------------------------------------


@pytest.fixture(scope="module")
def decode_file() -> onnx.ModelProto:
    return lower(exported_model("tiny", decode=True), "trt-plugin")


def _dims(profile, name):
    return tuple(tuple(d) for d in profile[name])


def test_profile_without_shapes_comes_from_the_file(decode_file):
    profile, notes = derive_profile(decode_file)
    hidden = decode_file.graph.input[0].type.tensor_type.shape.dim[2].dim_value
    kv_heads, head_dim = (decode_file.graph.input[2].type.tensor_type.shape.dim[i].dim_value for i in (1, 3))
    # batch 1..1, seq 1..cache length, past 0..cache length - 1 (the caches' rows: CACHE_LEN)
    assert _dims(profile, "hidden_states") == ((1, 1, hidden), (1, CACHE_LEN, hidden), (1, CACHE_LEN, hidden))
    assert _dims(profile, "position_ids") == ((1, 1), (1, CACHE_LEN), (1, CACHE_LEN))
    assert _dims(profile, "past_key") == ((1, kv_heads, 0, head_dim), (1, kv_heads, CACHE_LEN - 1, head_dim),
                                          (1, kv_heads, CACHE_LEN - 1, head_dim))
    assert profile["past_value"] == profile["past_key"]
    assert f"seq: 1..{CACHE_LEN} (opt {CACHE_LEN}) from the rotary caches' {CACHE_LEN} rows" in notes
    assert any(n.startswith("batch: 1..4 ") for n in derive_profile(decode_file, max_batch=4)[1])


def test_partial_shapes_are_completed_consistently(decode_file):
    hidden = decode_file.graph.input[0].type.tensor_type.shape.dim[2].dim_value
    given = {"hidden_states": ((1, 1, hidden), (2, 16, hidden), (4, 32, hidden))}
    profile, notes = derive_profile(decode_file, given)
    assert _dims(profile, "position_ids") == ((1, 1), (2, 16), (4, 32))  # batch and seq follow hidden_states
    assert [p[0] for p in profile["past_key"]] == [1, 2, 4]
    assert [p[2] for p in profile["past_key"]] == [0, CACHE_LEN - 1, CACHE_LEN - 1]  # past: still the default
    assert "seq: 1..32 (opt 16) from --shape hidden_states" in notes


@pytest.mark.parametrize("given, message", [
    ({"position_ids": ((1, 1), (2, 2), (4, 4)), "hidden_states": ((1, 1, 64), (2, 2, 64), (8, 8, 64))},
     "'batch' .* one name is one range"),
    ({"hidden_states": ((1, 1, 32), (1, 1, 32), (1, 1, 32))}, "the file fixes it to 64"),
    ({"position_ids": ((1, 1, 1), (1, 1, 1), (1, 1, 1))}, "rank 3, but the file's position_ids has rank 2"),
    ({"position_ids": ((1, 8), (1, 4), (1, 16))}, "needs MIN <= OPT <= MAX, got 8, 4, 16"),
    ({"input_ids": ((1, 1), (1, 1), (1, 1))}, "names input_ids, not inputs of the file"),
])
def test_contradictory_shapes_are_refused_with_the_reason(decode_file, given, message):
    assert decode_file.graph.input[0].type.tensor_type.shape.dim[2].dim_value == 64
    with pytest.raises(ProfileError, match=message):
        derive_profile(decode_file, given)


def test_a_dim_without_a_default_asks_for_shape():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 8])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]))
    with pytest.raises(ProfileError, match=r"x dim 1 is 'tokens', which has no default range; pass --shape x:"):
        derive_profile(model)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "seq"
    with pytest.raises(ProfileError, match="x dim 1 \\('seq'\\) has no known maximum: the file has no rotary cache"):
        derive_profile(model)
    assert derive_profile(model, {"x": ((1, 1, 8), (1, 4, 8), (2, 9, 8))})[0]["x"][2] == (2, 9, 8)


# --- parsing: every rotary node must become our plugin layer -----------------------------------------


def test_files_lowered_before_the_rename_are_parsed_as_the_plugin(decode_file):
    old = onnx.ModelProto()
    old.CopyFrom(decode_file)
    for node in old.graph.node:
        if node.op_type == PLUGIN_NAME:
            node.op_type = LEGACY_PLUGIN_NAME  # TensorRT >= 10.15 would import this as its own layer
    expected = rtrt.rotary_nodes(old)
    assert len(expected) == 2  # q and k
    assert rtrt.use_current_op_type(old) == 2
    assert [n.op_type for n in old.graph.node if n.output[0] in expected] == [PLUGIN_NAME] * 2


def _network(layers):
    """The part of TensorRT's INetworkDefinition that check_rotary_layers reads."""
    objs = [SimpleNamespace(type=kind, num_outputs=len(outs), get_output=lambda j, o=outs: SimpleNamespace(name=o[j]))
            for kind, outs in layers]
    return SimpleNamespace(num_layers=len(objs), get_layer=lambda i: objs[i])


def test_rotary_nodes_that_did_not_become_plugin_layers_are_refused():
    trt = SimpleNamespace(LayerType=SimpleNamespace(PLUGIN_V3=SimpleNamespace(name="PLUGIN_V3")))
    rotary = SimpleNamespace(name="ROTARY_EMBEDDING")
    expected = {"q_rot": "rope_q", "k_rot": "rope_k"}
    rtrt.check_rotary_layers(_network([(trt.LayerType.PLUGIN_V3, ["q_rot"]), (trt.LayerType.PLUGIN_V3, ["k_rot"])]),
                             expected, trt)
    with pytest.raises(CLIError, match=r"2 of 2 rotary node\(s\) did not become RopeExportRotaryEmbedding plugin "
                                       r"layers \(rope_q: became a ROTARY_EMBEDDING layer; rope_k: no layer "
                                       r"produces k_rot\)"):
        rtrt.check_rotary_layers(_network([(rotary, ["q_rot"])]), expected, trt)


def _load_and_list(paths) -> list[str] | str:
    import tensorrt_lean as trt

    try:
        rtrt.load_plugins(paths, trt)
    except CLIError as exc:
        return str(exc)
    return [c.name for c in trt.get_plugin_registry().all_creators if c.name.startswith("RopeExport")]


def _load_in_lean(paths) -> list[str] | str:
    """load_plugins in a forked child: a fresh plugin registry, without re-importing the package."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(_load_and_list, ([str(p) for p in paths],))


def test_load_plugins_registers_the_creator_with_either_library():
    built = plugin_dir()
    if not (built / TRT_VC_PLUGIN_LIBRARY).is_file() or not _lean_importable():
        pytest.skip("needs the TensorRT plugin libraries (TENSORRT_INCLUDE_DIR) and tensorrt_lean (make trt-lean)")
    for paths in ([built / TRT_PLUGIN_LIBRARY], [built / TRT_VC_PLUGIN_LIBRARY],
                  [built / TRT_PLUGIN_LIBRARY, built / TRT_VC_PLUGIN_LIBRARY]):
        assert _load_in_lean(paths) == [PLUGIN_NAME], paths
    refused = _load_in_lean([built / "librope_export_twin.so"])  # a library without our plugin
    assert refused.startswith(f"the {PLUGIN_NAME} plugin (version 1, namespace rope_export) is not registered "
                              "after loading librope_export_twin.so"), refused


def _lean_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt_lean") is not None


def _rotary_onnx(path, dtype, interleaved, with_pos):
    """One trt-plugin node, as the lowering writes it (string routing attributes included)."""
    import onnx
    from onnx import TensorProto, helper

    elem = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}[dtype]
    inputs = [
        helper.make_tensor_value_info("x", elem, ["b", 8, "s", 64]),
        helper.make_tensor_value_info("cos", elem, [128, 32] if with_pos else ["b", "s", 32]),
        helper.make_tensor_value_info("sin", elem, [128, 32] if with_pos else ["b", "s", 32]),
    ]
    if with_pos:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]))
    node = helper.make_node(
        PLUGIN_NAME,
        [i.name for i in inputs],
        ["y"],
        domain="trt.plugins",  # as rope_export.passes.lower_trt_plugin writes it
        interleaved=int(interleaved),
        num_heads=0,
        rotary_embedding_dim=64,
        plugin_namespace="rope_export",
        plugin_version="1",
    )
    graph = helper.make_graph([node], "rotary", inputs, [helper.make_tensor_value_info("y", elem, ["b", 8, "s", 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trt.plugins", 1)])
    onnx.save(model, path)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved, with_pos", [(False, True), (True, False)])
def test_engine_builds_saves_loads_and_matches_reference(tmp_path, dtype, interleaved, with_pos):
    plugin_lib = rtrt.default_plugin_library()
    if not plugin_lib.is_file():
        pytest.skip(f"{plugin_lib} not built (rope-export build-plugin with TensorRT headers and libraries)")
    onnx_path, engine_path = tmp_path / "rotary.onnx", tmp_path / "rotary.engine"
    _rotary_onnx(onnx_path, dtype, interleaved, with_pos)
    shapes = {"x": ((1, 8, 1, 64), (2, 8, 16, 64), (4, 8, 64, 64))}
    if with_pos:
        shapes["position_ids"] = ((1, 1), (2, 16), (4, 64))
    else:
        shapes["cos"] = shapes["sin"] = ((1, 1, 32), (2, 16, 32), (4, 64, 32))
    rtrt.build_engine(onnx_path, engine_path, [plugin_lib], shapes)
    engine = rtrt.load_engine(engine_path, [plugin_lib])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 10, 64, generator=gen).to(dtype)
    rows = (128,) if with_pos else (3, 10)
    cos, sin = (torch.randn(*rows, 32, generator=gen).to(dtype) for _ in range(2))
    feeds = {"x": x, "cos": cos, "sin": sin}
    pos = None
    if with_pos:
        pos = torch.randint(-2, 130, (3, 10), generator=gen)
        feeds["position_ids"] = pos
    y = torch.as_tensor(rtrt.run_engine(engine, feeds)["y"]).cpu()
    expected = reference.rotary_embedding(x, cos, sin, pos, interleaved=interleaved, rotary_embedding_dim=64)
    assert tolerance("op", str(dtype)).allclose(y.float(), expected.float())
