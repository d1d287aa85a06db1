"""``rope-export package triton``: every config.pbtxt parsed by Triton's own schema, the files each
backend loads, and (where nvidia-pytriton's tritonserver runs) a served request against transformers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from exported import exported_model

from rope_export import cli
from rope_export.passes import lower, save_model
from rope_export.serve import triton

ROOT = Path(__file__).resolve().parents[2]
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                                       reason="tritonclient[grpc] is not installed")
from google.protobuf import text_format  # noqa: E402  (after the skip: the schema comes with tritonclient)


def parse(folder: Path):
    """config.pbtxt as Triton reads it: strict text format of its ModelConfig (an unknown field fails)."""
    return text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model.onnx"
    save_model(exported_model("tiny"), path)
    return path


def runtime_inputs(model: onnx.ModelProto) -> list[str]:
    initializers = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


@pytest.mark.parametrize("backend", triton.BACKENDS)
def test_every_config_parses_with_tritons_schema_and_matches_the_file(tiny_file, tmp_path, backend):
    packaged = triton.write_repository(tiny_file, tmp_path / "repo", backend=backend, name="tiny", max_batch=4)
    config = parse(packaged.folder)
    assert "validated against Triton's ModelConfig schema" in packaged.validated
    assert config.name == "tiny" and config.max_batch_size == 4
    assert (config.platform, config.backend) == {"tensorrt": ("tensorrt_plan", ""), "onnxruntime": (
        "onnxruntime_onnx", ""), "python": ("", "python")}[backend]
    model = exported_model("tiny")
    assert [t.name for t in config.input] == runtime_inputs(model)
    assert [t.name for t in config.output] == [o.name for o in model.graph.output]
    by_name = {t.name: t for t in [*config.input, *config.output]}
    # Triton owns the batch dim: [batch, seq, 64] -> [-1, 64]; [batch, 2, past, 16] -> [2, -1, 16]
    assert list(by_name["hidden_states"].dims) == [-1, 64]
    assert list(by_name["past_key"].dims) == [2, -1, 16]
    assert list(by_name["present_value"].dims) == [2, -1, 16]
    assert by_name["position_ids"].data_type == model_config_pb2.TYPE_INT64
    assert by_name["output"].data_type == model_config_pb2.TYPE_FP32


def test_the_schema_check_is_strict():
    with pytest.raises(triton.TritonPackageError, match="no field named \"dynamic_batcher\""):
        triton.validate_config('name: "m"\ndynamic_batcher { }\n')  # the field is dynamic_batching
    with pytest.raises(triton.TritonPackageError, match="TYPE_FLOAT32"):
        triton.validate_config('name: "m"\ninput { name: "x" data_type: TYPE_FLOAT32 dims: [ 1 ] }\n')


def test_without_tritonclient_the_command_says_it_did_not_validate(tiny_file, tmp_path, monkeypatch, capsys):
    for module in ("tritonclient", "tritonclient.grpc", "tritonclient.grpc.model_config_pb2"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now fails, as when it is not installed
    assert cli.main(["package", "triton", str(tiny_file), "-o", str(tmp_path / "repo")]) == 0
    assert "config.pbtxt: not validated: tritonclient is not installed" in capsys.readouterr().out
    assert "not validated" in (tmp_path / "repo" / "model" / "README.md").read_text()
    parse(tmp_path / "repo" / "model")  # the same text, checked here instead


def test_without_batching_the_batch_dim_is_an_ordinary_dynamic_dim(tiny_file, tmp_path):
    config = parse(triton.write_repository(tiny_file, tmp_path, max_batch=0).folder)
    assert config.max_batch_size == 0
    assert list(config.input[0].dims) == [-1, -1, 64]


def test_a_tensor_of_the_batch_dim_only_is_reshaped_as_triton_wants(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    path = tmp_path / "sum.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    batched = parse(triton.write_repository(path, tmp_path / "a").folder).output[0]
    assert list(batched.dims) == [1] and batched.HasField("reshape") and list(batched.reshape.shape) == []
    whole = parse(triton.write_repository(path, tmp_path / "b", max_batch=0).folder).output[0]
    assert list(whole.dims) == [-1] and not whole.HasField("reshape")


def test_batching_needs_a_dynamic_first_dim(tmp_path):
    model = onnx.load_from_string(exported_model("tiny").SerializeToString())
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1  # hidden_states [1, seq, 64]
    path = tmp_path / "static.onnx"
    onnx.save(model, path)
    with pytest.raises(triton.TritonPackageError, match="hidden_states has first dim fixed to 1; pass --max-batch 0"):
        triton.write_repository(path, tmp_path / "repo")
    assert not (tmp_path / "repo" / "static").exists()


def test_onnxruntime_backend_serves_the_lowering_with_its_weights_beside_it(tiny_file, tmp_path):
    folder = triton.write_repository(tiny_file, tmp_path / "repo", backend="onnxruntime", target="ort").folder
    served = folder / "1" / "model.onnx"
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["model.onnx", "model.onnx.data"]
    assert "opset" not in (folder / "README.md").read_text()  # the ort lowering needs no opset-23 onnxruntime
    graph = onnx.load(served, load_external_data=False)
    assert {(n.domain, n.op_type) for n in graph.graph.node if n.op_type == "RotaryEmbedding"} == {
        ("com.microsoft", "RotaryEmbedding")}
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in graph.graph.initializer)
    # what Triton's onnxruntime backend does: open the file by its path; the weights resolve beside it
    rng = np.random.default_rng(0)
    feeds = {"hidden_states": rng.standard_normal((2, 5, 64), dtype=np.float32),
             "position_ids": np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]], dtype=np.int64),
             "past_key": rng.standard_normal((2, 2, 3, 16), dtype=np.float32),
             "past_value": rng.standard_normal((2, 2, 3, 16), dtype=np.float32)}
    got = onnxruntime.InferenceSession(served, providers=["CPUExecutionProvider"]).run(None, feeds)
    reference = lower(exported_model("tiny"), "ort")
    want = onnxruntime.InferenceSession(reference.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def elf(path: Path) -> Path:
    path.write_bytes(b"\x7fELF" + bytes(60))
    return path


def test_tensorrt_backend_places_engine_and_plugin_and_says_the_server_flag(tiny_file, tmp_path):
    engine = tmp_path / "built.engine"
    engine.write_bytes(b"an engine")
    plugin = elf(tmp_path / "librope_export_trt_plugin.so")
    packaged = triton.write_repository(tiny_file, tmp_path / "repo", backend="tensorrt", engine=engine, plugin=plugin)
    folder = packaged.folder
    assert (folder / "1" / "model.plan").read_bytes() == b"an engine"
    assert (folder / plugin.name).read_bytes() == plugin.read_bytes()
    placed = (folder / plugin.name).resolve()
    flag = f"--backend-config=tensorrt,plugins={placed}"
    assert packaged.server_command == f"tritonserver --model-repository {(tmp_path / 'repo').resolve()} {flag}"
    readme = (folder / "README.md").read_text()
    assert flag in readme and f"LD_PRELOAD={placed} tritonserver" in readme
    assert parse(folder).instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU


def test_tensorrt_backend_without_tensorrt_says_what_is_missing(tiny_file, tmp_path, monkeypatch):
    monkeypatch.setenv("ROPE_EXPORT_PLUGIN_DIR", str(tmp_path / "no-plugins"))
    monkeypatch.setattr("rope_export.runtimes.trt.tensorrt_unavailable_reason", lambda: "TensorRT is not installed")
    packaged = triton.write_repository(tiny_file, tmp_path / "repo", backend="tensorrt", max_batch=2)
    assert not (packaged.folder / "1" / "model.plan").exists()
    readme = (packaged.folder / "README.md").read_text()
    assert "1/model.plan is missing: TensorRT is not installed" in readme and "--max-batch 2" in readme
    assert "librope_export_trt_plugin.so is not built" in readme
    assert "batch: 1..2 (opt 1) from --max-batch 2" in readme  # the profile rope-export build would use
    assert "plugins=" in packaged.server_command  # where the library goes, once built


def test_with_tensorrt_the_engine_is_built_from_the_trt_plugin_lowering(tiny_file, tmp_path, monkeypatch):
    """Where TensorRT and a GPU exist, rope-export build's own build_engine makes 1/model.plan (faked here)."""
    from rope_export.op.nodes import PLUGIN_NAME

    calls = []

    def build_engine(onnx_path, out_path, plugins, shapes=None, *, max_batch=1, say=None):
        model = onnx.load(onnx_path)
        calls.append(([n.op_type for n in model.graph.node if n.op_type == PLUGIN_NAME], plugins, max_batch))
        Path(out_path).write_bytes(b"built")

    monkeypatch.setattr("rope_export.runtimes.trt.tensorrt_unavailable_reason", lambda: None)
    monkeypatch.setattr("rope_export.runtimes.trt.build_engine", build_engine)
    plugin = elf(tmp_path / "librope_export_trt_plugin.so")
    folder = triton.write_repository(tiny_file, tmp_path / "repo", backend="tensorrt", plugin=plugin,
                                     max_batch=3).folder
    assert calls == [([PLUGIN_NAME, PLUGIN_NAME], [plugin], 3)]  # q and k became plugin nodes
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "1/model.plan", "README.md", "config.pbtxt", plugin.name]  # the lowered file was only a means


@pytest.mark.parametrize(("name", "content", "message"), [
    ("librope_export_trt_vc_plugin.so", b"\x7fELF", "Triton opens plugin libraries with dlopen"),
    ("librope_export_trt_plugin.so", b"text", "not a shared library"),
])
def test_plugins_triton_cannot_load_are_refused(tiny_file, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(triton.TritonPackageError, match=message):
        triton.write_repository(tiny_file, tmp_path / "repo", backend="tensorrt", plugin=tmp_path / name)
    assert not (tmp_path / "repo" / "model").exists()


def test_an_existing_model_folder_is_replaced_only_with_force_and_never_half_written(tiny_file, tmp_path):
    repo = tmp_path / "repo"
    triton.write_repository(tiny_file, repo, backend="onnxruntime")
    with pytest.raises(triton.TritonPackageError, match="exists; pass --force"):
        triton.write_repository(tiny_file, repo, backend="python")
    with pytest.raises(FileNotFoundError, match="engine .* not found"):
        triton.write_repository(tiny_file, repo, backend="tensorrt", engine=tmp_path / "none.plan", force=True)
    assert parse(repo / "model").platform == "onnxruntime_onnx"  # the failed run left the old folder
    triton.write_repository(tiny_file, repo, backend="python", force=True)
    assert parse(repo / "model").backend == "python"
    assert sorted(p.name for p in repo.iterdir()) == ["model"]  # no staging folder left


def test_the_command_line(tiny_file, tmp_path, capsys):
    assert cli.main(["package", "triton", str(tiny_file), "-o", str(tmp_path / "repo"), "--name", "m"]) == 0
    out = capsys.readouterr().out
    assert "validated against Triton's ModelConfig schema" in out
    assert "note: 1/model.onnx uses ai.onnx opset 23 (RotaryEmbedding-23)" in out  # the default target, onnx
    assert f"serve it with: tritonserver --model-repository {(tmp_path / 'repo').resolve()}" in out
    assert cli.main(["package", "triton", str(tiny_file), "-o", str(tmp_path / "repo"), "--name", "m",
                     "--engine", "x.plan"]) == 2
    assert capsys.readouterr().err.strip() == ("rope-export package: error: --engine and --plugin are for "
                                               "--backend tensorrt")


# -- served by Triton's own server --------------------------------------------------------------

def _pytriton_root() -> Path | None:
    """The folder holding pytriton/tritonserver and nvidia_pytriton.libs (nvidia-pytriton's wheel)."""
    env = os.environ.get("ROPE_EXPORT_PYTRITON")
    candidates = [Path(env)] if env else []
    spec = importlib.util.find_spec("pytriton")
    if spec and spec.origin:
        candidates.append(Path(spec.origin).parents[1])
    candidates.append(ROOT / "build" / "pytriton")  # pip install --no-deps --target build/pytriton nvidia-pytriton
    return next((c for c in candidates if (c / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tritonserver(repo: Path, work: Path):
    """tritonserver on loopback with the Python backend only; yields the gRPC address."""
    root = _pytriton_root()
    if root is None:
        pytest.skip("no tritonserver: install nvidia-pytriton (pip install --no-deps --target build/pytriton "
                    "nvidia-pytriton==0.7.0; its numpy<2 pin would break this venv) or set ROPE_EXPORT_PYTRITON")
    server = root / "pytriton" / "tritonserver"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = server / "python_backend_stubs" / python / "triton_python_backend_stub"
    if not stub.is_file():
        pytest.skip(f"nvidia-pytriton has no Python backend stub for Python {python}")
    backends = work / "backends"
    shutil.copytree(server / "backends", backends)
    shutil.copy(stub, backends / "python")  # what pytriton does: the stub of this Python
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [
        str(root / "nvidia_pytriton.libs"), os.environ.get("LD_LIBRARY_PATH")])))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the stub's Python is this venv's
    grpc_port, http_port = _free_port(), _free_port()
    log = (work / "tritonserver.log").open("w")
    proc = subprocess.Popen(
        [str(server / "bin" / "tritonserver"), "--model-repository", str(repo), "--backend-directory", str(backends),
         "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--allow-metrics", "false", "--exit-timeout-secs", "5"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"127.0.0.1:{grpc_port}", proc, work / "tritonserver.log"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _infer(client, model: str, feeds: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in feeds.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "INT64" if value.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer(model, inputs, client_timeout=60)
    return {name: result.as_numpy(name) for name in outputs}


def test_served_by_tritonserver_matches_transformers(tmp_path):
    """A tiny random-weight Llama (save_pretrained, offline), exported, packaged for the Python backend,
    served by Triton's own server on loopback: prefill then one decode step through the KV cache."""
    pytest.importorskip("transformers")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    if _pytriton_root() is None:
        pytest.skip("no tritonserver: install nvidia-pytriton (pip install --no-deps --target build/pytriton "
                    "nvidia-pytriton==0.7.0) or set ROPE_EXPORT_PYTRITON")
    import torch
    import transformers

    from rope_export import hf
    from rope_export.cli.demo import TINY_LLAMA

    folder = tmp_path / "llama"
    config = transformers.AutoConfig.for_model(**TINY_LLAMA)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(folder)
    hf.export_hf(hf.build_hf_model(folder, weights=folder), tmp_path / "llama.onnx")
    models = {f"llama_{target}": target for target in triton.ORT_TARGETS}  # ai.onnx and com.microsoft rotary
    for name, target in models.items():
        folder = triton.write_repository(tmp_path / "llama.onnx", tmp_path / "repo", backend="python", name=name,
                                         target=target).folder
        graph = onnx.load(folder / "1" / "model.onnx", load_external_data=False).graph
        domains = {n.domain for n in graph.node if n.op_type == "RotaryEmbedding"}
        assert domains == {"" if target == "onnx" else "com.microsoft"}, (target, domains)

    ids = np.array([[3, 17, 99, 5, 42, 7, 200]], dtype=np.int64)
    with torch.no_grad():
        want = reference(torch.from_numpy(ids)).logits.numpy()
    layers = TINY_LLAMA["num_hidden_layers"]
    cache = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    empty = np.zeros((1, 2, 0, 16), np.float32)
    served = {}
    with tritonserver(tmp_path / "repo", tmp_path) as (address, proc, log):
        client = grpcclient.InferenceServerClient(address)
        deadline = time.monotonic() + 120
        while not all(_ready(client, name) for name in models):
            assert proc.poll() is None, f"tritonserver exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"models not ready in 120 s: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        for name in models:
            prefill = _infer(client, name, {"input_ids": ids[:, :6], "position_ids": np.arange(6)[None],
                                            **{f"past_key_values.{i}.{kv}": empty for i in range(layers)
                                               for kv in ("key", "value")}}, ["logits", *cache])
            past = {f"past_key_values.{n.split('.', 1)[1]}": prefill[n] for n in cache}
            decode = _infer(client, name, {"input_ids": ids[:, 6:], "position_ids": np.array([[6]]), **past},
                            ["logits", "present.0.key"])
            served[name] = prefill, decode
        client.close()
    for name, (prefill, decode) in served.items():
        assert prefill["logits"].shape == (1, 6, 256) and decode["present.0.key"].shape == (1, 2, 7, 16)
        errors = np.abs(prefill["logits"] - want[:, :6]).max(), np.abs(decode["logits"] - want[:, 6:]).max()
        print(f"{name}: max abs error vs transformers, prefill {errors[0]:.2e}, decode {errors[1]:.2e}")
        np.testing.assert_allclose(prefill["logits"], want[:, :6], atol=1e-4, rtol=0, err_msg=name)
        np.testing.assert_allclose(decode["logits"], want[:, 6:], atol=1e-4, rtol=0, err_msg=name)


def _ready(client, model: str) -> bool:
    try:
        return client.is_model_ready(model)
    except Exception:  # the server is still starting: not listening yet
        return False

