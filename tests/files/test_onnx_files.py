"""ONNX files past 2 GB, proven on small models forced to external data.

What is checked: every external-data layout round-trips (read back by onnx and by onnxruntime,
independent readers); the model and its data are written as a pair, data first, and an error or
interrupt (exception, real SIGINT/SIGTERM) leaves the old pair as it was and no temporary files;
a graph pass over a lazily loaded model never opens the data file; unusable files are refused in
one line naming the file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rope_export.common import fileio
from rope_export.files import onnx_files
from rope_export.files.onnx_files import OnnxFileError

RNG = np.random.default_rng(0)


def mlp_model(layers: int = 6, width: int = 64, seed: int = 0) -> onnx.ModelProto:
    """x -> (MatMul W_i, Add b_i, Relu)*: weights of 16 kB each (external), biases of 256 B (inline)."""
    rng = np.random.default_rng(seed)
    nodes, inits, name = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [name, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"y{i}"])]
        name = f"y{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", width])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def run_ort(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def weights_of(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def listing(folder) -> list[str]:
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())


X = RNG.standard_normal((3, 64)).astype(np.float32)


@pytest.fixture(autouse=True)
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt here even when the suite runs as a background job (SIGINT ignored)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("direct_io", ["1", "0"], ids=["past-page-cache", "page-cache"])  # files.direct
@pytest.mark.parametrize("external", ["auto", "never", "single", "per-tensor"])
def test_every_layout_round_trips_through_onnx_and_onnxruntime(tmp_path, external, direct_io, monkeypatch):
    monkeypatch.setenv("ROPE_EXPORT_DIRECT_IO", direct_io)
    model = mlp_model()
    want = run_ort_proto(model)
    path = tmp_path / "m.onnx"
    written = onnx_files.write(model, path, external=external, check=True)
    expected = {"auto": "never", "never": "never", "single": "single", "per-tensor": "per-tensor"}[external]
    assert written.external == expected
    assert listing(tmp_path) == (["m.onnx"] if expected == "never" else
                                 ["m.onnx", "m.onnx.data" + ("/" if expected == "per-tensor" else "")])
    stored = onnx.load(str(path), load_external_data=False).graph.initializer
    external_names = sorted(t.name for t in stored if t.data_location == TensorProto.EXTERNAL)
    assert external_names == ([] if expected == "never" else [f"w{i}" for i in range(6)])  # biases (256 B) inline
    if expected == "per-tensor":
        assert sorted(os.listdir(tmp_path / "m.onnx.data")) == [f"w{i}" for i in range(6)]
    onnx.checker.check_model(str(path), full_check=True)
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, array in weights_of(path).items():
        np.testing.assert_array_equal(array, original[name], err_msg=name)
    np.testing.assert_array_equal(run_ort(path, X), want)
    assert {p.name: n for p, n in written.files} == {p.name: (sum(f.stat().st_size for f in p.rglob("*"))
                                                              if p.is_dir() else p.stat().st_size)
                                                     for p in tmp_path.iterdir()}


def run_ort_proto(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def test_auto_goes_external_past_the_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_files, "EXTERNAL_DATA_THRESHOLD", 10_000)  # pretend 2 GB is 10 kB
    written = onnx_files.write(mlp_model(), tmp_path / "m.onnx")
    assert written.external == "single" and listing(tmp_path) == ["m.onnx", "m.onnx.data"]
    with pytest.raises(OnnxFileError, match="past protobuf's 2 GB limit"):
        onnx_files.write(mlp_model(), tmp_path / "n.onnx", external="never")
    assert listing(tmp_path) == ["m.onnx", "m.onnx.data"]


def test_auto_keeps_up_to_32_mb_inside_and_writes_more_beside_it(tmp_path, monkeypatch):
    """Not 2 GB: in-file weights are serialized in one ModelProto and parsed whole by every reader (the module doc)."""
    assert onnx_files.resolve_external("auto", 32 * 2**20) == "never"
    assert onnx_files.resolve_external("auto", 32 * 2**20 + 1) == "single"
    assert onnx_files.resolve_external("never", 32 * 2**20 + 1) == "never"  # asked for: inside, up to 2 GB
    monkeypatch.setattr(onnx_files, "AUTO_INLINE_MAX", 50_000)  # the MLP's 98 kB of weights past it
    written = onnx_files.write(mlp_model(), tmp_path / "m.onnx")
    assert written.external == "single" and listing(tmp_path) == ["m.onnx", "m.onnx.data"]
    np.testing.assert_array_equal(run_ort(tmp_path / "m.onnx", X), run_ort_proto(mlp_model()))


def test_a_lazy_model_is_copied_to_a_new_file_tensor_by_tensor(tmp_path):
    first = tmp_path / "a.onnx"
    onnx_files.write(mlp_model(), first, external="single")
    lazy = onnx_files.load(first)
    big = [v.const_value for v in lazy.graph.initializers.values() if v.const_value.nbytes > onnx_files.INLINE_LIMIT]
    assert len(big) == 6 and all(type(t).__name__ == "ExternalTensor" for t in big)
    for external in ("per-tensor", "never", "single"):
        out = tmp_path / f"b-{external}.onnx"
        onnx_files.write(lazy, out, external=external, check=True)
        np.testing.assert_array_equal(run_ort(out, X), run_ort(first, X))


# -- atomic pair writes ----------------------------------------------------------------------

def old_pair(tmp_path):
    path = tmp_path / "m.onnx"
    onnx_files.write(mlp_model(seed=1), path, external="single")
    return path, path.read_bytes(), (tmp_path / "m.onnx.data").read_bytes()


def assert_old_pair_intact(tmp_path, path, model_bytes, data_bytes):
    assert listing(tmp_path) == ["m.onnx", "m.onnx.data"], "temporary files or a half pair were left behind"
    assert path.read_bytes() == model_bytes and (tmp_path / "m.onnx.data").read_bytes() == data_bytes


class Interrupting:
    """A progress callable whose per-tensor detail raises KeyboardInterrupt at the n-th tensor."""

    def __init__(self, at: int):
        self.at, self.seen = at, 0

    def __call__(self, message):
        pass

    def detail(self, message):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("external", ["single", "per-tensor"])
def test_an_interrupt_while_writing_keeps_the_old_pair(tmp_path, external):
    path, model_bytes, data_bytes = old_pair(tmp_path)
    progress = Interrupting(at=3)
    with pytest.raises(KeyboardInterrupt):
        onnx_files.write(mlp_model(seed=2), path, external=external, progress=progress)
    assert progress.seen == 3
    assert_old_pair_intact(tmp_path, path, model_bytes, data_bytes)


def test_a_failing_check_writes_nothing(tmp_path):
    path, model_bytes, data_bytes = old_pair(tmp_path)
    bad = mlp_model(seed=2)
    bad.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(onnx.checker.ValidationError, match="NoSuchOp"):
        onnx_files.write(bad, path, external="single", check=True)
    assert_old_pair_intact(tmp_path, path, model_bytes, data_bytes)


def test_the_data_lands_before_the_model_and_signals_wait_for_both(tmp_path, monkeypatch):
    """Over an existing pair (files.commit): the data under the name the old model does not read, the model that
    names it, then the old data out; SIGINT waits for all."""
    path, _, _ = old_pair(tmp_path)
    replaced, real_replace = [], os.replace

    def replace(source, target):
        if not replaced:
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the commit
        replaced.append((os.path.basename(source), os.path.relpath(target, tmp_path)))
        real_replace(source, target)

    monkeypatch.setattr(fileio.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        onnx_files.write(mlp_model(seed=3), path, external="single")
    # all moves done before the interrupt was delivered
    assert [(s, t.split(os.sep)[-1]) for s, t in replaced] == [("m.onnx.2.data", "m.onnx.2.data"),
                                                                ("m.onnx", "m.onnx"), ("m.onnx.data", "m.onnx.data")]
    assert replaced[2][1].startswith(".m.onnx.")  # the old data into the staging folder, removed with it
    monkeypatch.undo()
    assert listing(tmp_path) == ["m.onnx", "m.onnx.2.data"]
    np.testing.assert_array_equal(run_ort(path, X), run_ort_proto(mlp_model(seed=3)))


def test_switching_layouts_replaces_the_old_data(tmp_path):
    path = tmp_path / "m.onnx"
    onnx_files.write(mlp_model(seed=1), path, external="per-tensor")
    onnx_files.write(mlp_model(seed=2), path, external="single")
    assert listing(tmp_path) == ["m.onnx", "m.onnx.2.data"] and (tmp_path / "m.onnx.2.data").is_file()
    onnx_files.write(mlp_model(seed=3), path, external="per-tensor")
    assert listing(tmp_path) == ["m.onnx", "m.onnx.data/"]
    np.testing.assert_array_equal(run_ort(path, X), run_ort_proto(mlp_model(seed=3)))


CHILD = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started from a background job
    sys.path.insert(0, {tests!r})
    from test_onnx_files import mlp_model
    from rope_export.files import onnx_files
    if {sigterm_handler}:  # what the CLI installs: SIGTERM becomes an exception, so cleanup runs
        def to_exit(signum, frame):
            raise SystemExit(143)
        signal.signal(signal.SIGTERM, to_exit)

    class Slow:
        def __call__(self, message):
            pass
        def detail(self, message):
            print("tensor", flush=True)
            time.sleep(0.3)

    onnx_files.write(mlp_model(layers=40, seed=5), {path!r}, external={external!r}, progress=Slow())
""")


@pytest.mark.parametrize(("sig", "external"), [(signal.SIGINT, "single"), (signal.SIGTERM, "per-tensor")])
def test_a_real_signal_mid_write_leaves_the_old_pair(tmp_path, sig, external):
    path, model_bytes, data_bytes = old_pair(tmp_path)
    code = CHILD.format(tests=os.path.dirname(__file__), sigterm_handler=sig == signal.SIGTERM, path=str(path),
                        external=external)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"tensor"  # writing has started
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".m.onnx.")]
    assert staged, "the write should be staged beside the target"
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    assert child.returncode != 0, err.decode()
    assert_old_pair_intact(tmp_path, path, model_bytes, data_bytes)


def test_not_enough_disk_is_said_before_writing(tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(onnx_files.shutil, "disk_usage", lambda folder: usage(10**9, 10**9, 1000))
    with pytest.raises(OnnxFileError, match=r"weights need 99.8 kB and .* has 1.0 kB free"):
        onnx_files.write(mlp_model(), tmp_path / "m.onnx", external="single")
    assert listing(tmp_path) == []


# -- loading -----------------------------------------------------------------------------------

def test_unusable_files_are_named_in_one_line(tmp_path):
    path, _, _ = old_pair(tmp_path)
    cases = {}
    (tmp_path / "empty.onnx").write_bytes(b"")
    cases["empty.onnx"] = r"is empty \(0 bytes\)"
    (tmp_path / "junk.onnx").write_bytes(os.urandom(4096))
    cases["junk.onnx"] = "not (a readable ONNX file|an ONNX model)"
    (tmp_path / "folder.onnx").mkdir()
    cases["folder.onnx"] = "is a folder"
    for name, message in cases.items():
        with pytest.raises(OnnxFileError, match=message) as info:
            onnx_files.load(tmp_path / name)
        assert name in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="no such ONNX file"):
        onnx_files.load(tmp_path / "missing.onnx")
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(OnnxFileError, match="m.onnx.data is .* bytes but tensor 'w5' ends at byte"):
        onnx_files.load(path)
    data.unlink()
    with pytest.raises(OnnxFileError, match="keeps its weights in m.onnx.data, which is missing"):
        onnx_files.load(path)


def test_data_outside_the_models_folder_is_refused(tmp_path):
    model = mlp_model()
    (tmp_path / "sub").mkdir()
    onnx_files.write(model, tmp_path / "sub" / "m.onnx", external="single")
    proto = onnx.load(str(tmp_path / "sub" / "m.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secret.data"
    (tmp_path / "secret.data").write_bytes(b"\0" * 200_000)
    onnx.save(proto, str(tmp_path / "sub" / "evil.onnx"))
    with pytest.raises(OnnxFileError, match="outside the model's folder"):
        onnx_files.load(tmp_path / "sub" / "evil.onnx")


def test_writes_wait_for_a_usable_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        onnx_files.write(mlp_model(), tmp_path / "no" / "m.onnx")
    (tmp_path / "dir.onnx").mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        onnx_files.write(mlp_model(), tmp_path / "dir.onnx")
    assert listing(tmp_path) == ["dir.onnx/"]


def test_sigint_during_a_slow_step_is_not_deferred():
    """signals_deferred holds signals only for the commit's renames, not longer."""
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        with fileio.signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # still held here
        time.sleep(5)  # delivered before this
    assert time.perf_counter() - start < 2
