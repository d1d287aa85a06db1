"""``rope-export package triton``: a Triton Inference Server model repository for an ONNX file.

One model folder ``REPO/NAME`` is written, whole or not at all (staged beside it, then renamed):

* ``--backend tensorrt``: ``config.pbtxt`` (platform ``tensorrt_plan``), the engine as
  ``1/model.plan`` (``--engine``, or built here where TensorRT and a GPU exist, from the file's
  ``trt-plugin`` lowering with the profile ``rope-export build`` derives), and the plugin library
  beside ``config.pbtxt``. Triton opens plugin libraries with dlopen
  (``--backend-config=tensorrt,plugins=LIB`` or LD_PRELOAD), so it must be the library that
  registers itself, not the ``_vc_`` one (that one is for IPluginRegistry::loadLibrary).
* ``--backend onnxruntime``: the ``onnx`` (default) or ``ort`` lowering as ``1/model.onnx``, its
  weights in ``1/model.onnx.data`` beside it (onnxruntime resolves them relative to the model).
* ``--backend python``: the same ``1/model.onnx`` run by onnxruntime inside Triton's Python
  backend (``1/model.py``), for servers built without the onnxruntime backend (nvidia-pytriton's).

Dims come from the file: a static dim is written as is, a dynamic one as -1; with
``--max-batch N`` > 0 the first dim of every input and output must be the dynamic batch dim, and
Triton owns it (``max_batch_size: N``). The text is checked against Triton's own ModelConfig schema
(``tritonclient.grpc.model_config_pb2``, strict: an unknown field fails) before anything is written,
when tritonclient is installed; otherwise the command says it did not check. ``README.md`` in the
model folder says how to start the server (the exact plugin flag included) and what was checked.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from rope_export.common.errors import CLIError
from rope_export.common.fileio import check_writable, commit_moves, staging_dir

BACKENDS = ("tensorrt", "onnxruntime", "python")
ORT_TARGETS = ("onnx", "ort")  # lowerings onnxruntime runs
VERSION = "1"
TRITON_DTYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16", onnx.TensorProto.BFLOAT16: "TYPE_BF16",
    onnx.TensorProto.DOUBLE: "TYPE_FP64", onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT16: "TYPE_INT16", onnx.TensorProto.INT8: "TYPE_INT8", onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.BOOL: "TYPE_BOOL", onnx.TensorProto.STRING: "TYPE_STRING",
}  # fmt: skip
NUMPY_FREE = {"TYPE_BF16"}  # the Python backend hands tensors over as numpy, which has no bfloat16
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")

# Triton's Python backend model: runs 1/model.onnx with onnxruntime on the CPU. Written as model.py.
PYTHON_MODEL = '''\
"""Triton Python-backend model written by rope-export: runs model.onnx beside it with onnxruntime."""

import json
import os

import numpy
import onnxruntime
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                # DLPack both ways, not as_numpy()/Tensor(name, array): under numpy 2, Tensor(name, array)
                # answered with outputs of the right shape and no bytes (Triton 2.51's stub; pytriton pins
                # numpy<2); DLPack does not go through that numpy glue.
                feeds = {name: numpy.from_dlpack(pb_utils.get_input_tensor_by_name(request, name))
                         for name in self.inputs}
                results = self.session.run(self.outputs, feeds)
                tensors = [pb_utils.Tensor.from_dlpack(name, numpy.ascontiguousarray(value))
                           for name, value in zip(self.outputs, results)]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request answers with its error; the model stays up
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")))
        return responses
'''


DESCRIPTION = """\
Write REPO/NAME, a Triton Inference Server model folder for FILE.onnx (whole or not at all):
  tensorrt     config.pbtxt, 1/model.plan (--engine, or built here where TensorRT and a GPU exist)
               and the plugin library beside config.pbtxt; start the server with
               tritonserver --model-repository REPO --backend-config=tensorrt,plugins=REPO/NAME/LIB
  onnxruntime  config.pbtxt, 1/model.onnx (the onnx or ort lowering) and 1/model.onnx.data
  python       as onnxruntime, plus 1/model.py running it with onnxruntime in Triton's Python backend
config.pbtxt is checked against Triton's ModelConfig schema (tritonclient) before anything is
written; README.md in the folder says how to serve it and what was checked."""


class TritonPackageError(CLIError):
    """A file, option or config that cannot make a Triton model repository; the message says why."""


@dataclass(frozen=True)
class TensorConfig:
    name: str
    data_type: str  # TYPE_FP32, ...
    dims: tuple[int, ...]  # -1: dynamic; without the batch dim when max_batch_size > 0


@dataclass
class Packaged:
    folder: Path  # REPO/NAME
    backend: str
    config: str  # config.pbtxt's text
    validated: str  # how the config was checked, one line
    server_command: str  # how to start tritonserver on this repository
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value.type.tensor_type.shape.dim]


def tensor_configs(model: onnx.ModelProto, max_batch: int) -> tuple[list[TensorConfig], list[TensorConfig]]:
    """The runtime inputs and the outputs as Triton sees them (initializers are not inputs)."""
    initializers = {i.name for i in model.graph.initializer}
    sides = []
    for values in ([v for v in model.graph.input if v.name not in initializers], list(model.graph.output)):
        side = []
        for value in values:
            elem = value.type.tensor_type.elem_type
            if elem not in TRITON_DTYPES:
                raise TritonPackageError(f"{value.name} has ONNX type {onnx.TensorProto.DataType.Name(elem)}, "
                                         "which Triton has no type for")
            dims = _dims(value)
            if max_batch > 0:
                if not dims or isinstance(dims[0], int):
                    first = "no dims" if not dims else f"first dim fixed to {dims[0]}"
                    raise TritonPackageError(
                        f"--max-batch {max_batch} makes Triton own the first dim of every tensor, but {value.name} has "
                        f"{first}; pass --max-batch 0 (the batch is then an ordinary dim)")
                dims = dims[1:]
            side.append(TensorConfig(value.name, TRITON_DTYPES[elem], tuple(d if isinstance(d, int) else -1
                                                                          for d in dims)))
        sides.append(side)
    return sides[0], sides[1]


def config_text(name: str, backend: str, max_batch: int, inputs: list[TensorConfig],
                outputs: list[TensorConfig]) -> str:
    """config.pbtxt: protobuf text of Triton's ModelConfig."""
    head = {"tensorrt": 'platform: "tensorrt_plan"', "onnxruntime": 'platform: "onnxruntime_onnx"',
            "python": 'backend: "python"'}[backend]
    lines = [f'name: "{name}"', head, f"max_batch_size: {max_batch}"]
    for key, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            # Triton wants at least one dim: a tensor of the batch dim only (or a scalar) is written as
            # [1], reshaped to [] when Triton owns the batch (what its onnxruntime backend's autofill does)
            dims = ", ".join(str(d) for d in t.dims) or "1"
            reshape = "\n  reshape {\n    shape: [ ]\n  }" if not t.dims and max_batch > 0 else ""
            lines.append(f'{key} {{\n  name: "{t.name}"\n  data_type: {t.data_type}\n  dims: [ {dims} ]{reshape}\n}}')
    kind = {"tensorrt": "KIND_GPU", "python": "KIND_CPU"}.get(backend)
    if kind:  # onnxruntime: Triton picks GPU where there is one, else CPU
        lines.append(f"instance_group {{\n  count: 1\n  kind: {kind}\n}}")
    lines.append(f'version_policy {{\n  specific {{\n    versions: [ {VERSION} ]\n  }}\n}}')
    return "\n".join(lines) + "\n"


def validate_config(text: str) -> str:
    """Parse ``text`` strictly as Triton's ModelConfig; one line saying how it was checked.

    TritonPackageError when it does not parse (an unknown field, a wrong enum, a bad value)."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as exc:
        return f"not validated: tritonclient is not installed (pip install 'tritonclient[grpc]'; {exc})"
    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise TritonPackageError(f"config.pbtxt does not parse as Triton's ModelConfig: {exc}") from None
    from importlib.metadata import version

    return f"validated against Triton's ModelConfig schema (tritonclient {version('tritonclient')}, strict)"


def default_name(path: Path) -> str:
    """A model name from the file name: model.onnx.onnx -> model_onnx."""
    stem = path.name.removesuffix(".onnx")
    return re.sub(r"[^A-Za-z0-9_-]", "_", stem) or "model"


def _check_plugin(plugin: Path) -> None:
    from rope_export.kernels.libraries import TRT_PLUGIN_LIBRARY, TRT_VC_PLUGIN_LIBRARY

    if not plugin.is_file():
        raise TritonPackageError(f"plugin library {plugin} not found; build it with `rope-export build-plugin "
                                 "--tensorrt-include-dir ...` (it lands in build/plugins)")
    if plugin.name == TRT_VC_PLUGIN_LIBRARY:
        raise TritonPackageError(f"{plugin.name} registers its plugin only through IPluginRegistry::loadLibrary; "
                                 f"Triton opens plugin libraries with dlopen: pass {TRT_PLUGIN_LIBRARY}")
    with open(plugin, "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise TritonPackageError(f"plugin library {plugin} is not a shared library (no ELF header)")


def server_command(repo: Path, plugin: Path | None) -> str:
    base = f"tritonserver --model-repository {repo.resolve()}"
    return f"{base} --backend-config=tensorrt,plugins={plugin.resolve()}" if plugin else base


def _readme(p: Packaged, repo: Path, plugin: Path | None, profile_notes: list[str]) -> str:
    lines = [f"# Triton model `{p.folder.name}` ({p.backend} backend), written by rope-export", "",
             "Start the server (loopback only unless you mean to expose it):", "", "```",
             p.server_command + " --http-address 127.0.0.1 --grpc-address 127.0.0.1", "```", ""]
    if plugin:
        lines += ["The engine's rotary layers are our TensorRT plugin: the server must load "
                  f"`{plugin.name}` before it reads the engine, with the flag above, or with", "", "```",
                  f"LD_PRELOAD={plugin.resolve()} tritonserver --model-repository {repo.resolve()}", "```", "",
                  "The paths are absolute: change them if you move the repository.", ""]
    if p.backend == "python":
        lines += ["model.py runs 1/model.onnx with onnxruntime in the Python backend's interpreter, which needs "
                  "onnxruntime and numpy. With nvidia-pytriton's server: copy "
                  "`python_backend_stubs/3.X/triton_python_backend_stub` (your Python) into `backends/python/`, "
                  "pass `--backend-directory` to that `backends`, put `nvidia_pytriton.libs` on LD_LIBRARY_PATH "
                  "and your virtualenv's `bin` first on PATH (what tests/serve/test_triton.py does).", ""]
    if profile_notes:
        lines += ["Shapes the engine's optimization profile accepts:", ""] + [f"- {n}" for n in profile_notes] + [""]
    lines += [f"config.pbtxt: {p.validated}.", ""]
    lines += [f"Note: {n}" for n in p.notes]
    return "\n".join(lines).rstrip() + "\n"


def write_repository(onnx_path: str | os.PathLike, repo: str | os.PathLike, *, backend: str = "onnxruntime",
                     name: str | None = None, engine: str | os.PathLike | None = None,
                     plugin: str | os.PathLike | None = None, max_batch: int = 1, target: str = "onnx",
                     external: str = "single", force: bool = False,
                     say: Callable[[str], None] | None = None) -> Packaged:
    """Write ``REPO/NAME`` for ``onnx_path`` (see the module doc); returns what was written."""
    say = say or (lambda _: None)
    onnx_path, repo = Path(onnx_path), Path(repo)
    if backend not in BACKENDS:
        raise TritonPackageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if target not in ORT_TARGETS:
        raise TritonPackageError(f"--target {target}: onnxruntime runs {' or '.join(ORT_TARGETS)}")
    if max_batch < 0:
        raise TritonPackageError(f"--max-batch {max_batch}: give 0 (no batching by Triton) or more")
    if not onnx_path.is_file():
        raise FileNotFoundError(f"ONNX file {onnx_path} not found")
    if backend != "tensorrt" and (engine or plugin):
        raise TritonPackageError("--engine and --plugin are for --backend tensorrt")
    name = name or default_name(onnx_path)
    if not _NAME.match(name) or name in (".", ".."):
        raise TritonPackageError(f"model name {name!r}: use letters, digits, '_', '-', '.'")
    folder = repo / name
    if folder.exists() and not force:
        raise TritonPackageError(f"{folder} exists; pass --force to replace that model folder")
    proto = onnx.load(str(onnx_path), load_external_data=False)  # the graph only: weights stay on disk
    inputs, outputs = tensor_configs(proto, max_batch)
    if backend == "python":
        bad = [t.name for t in inputs + outputs if t.data_type in NUMPY_FREE]
        if bad:
            raise TritonPackageError(f"the Python backend passes numpy arrays, which have no bfloat16 "
                                     f"({', '.join(bad)}); "
                                     "use --backend onnxruntime or tensorrt, or export fp16/fp32")
    text = config_text(name, backend, max_batch, inputs, outputs)
    validated = validate_config(text)  # before anything is written
    say(f"config.pbtxt: {validated}")
    plugin_path = None
    if backend == "tensorrt":
        from rope_export.runtimes.trt import default_plugin_library

        plugin_path = Path(plugin) if plugin else default_plugin_library()
        if plugin:
            _check_plugin(plugin_path)
    repo.mkdir(parents=True, exist_ok=True)
    anchor = repo / f"{name}.staged"  # the fileio helpers take a file path: the folder itself may exist (--force)
    check_writable(anchor)
    packaged = Packaged(folder, backend, text, validated, "")
    profile_notes: list[str] = []
    with staging_dir(anchor) as stage:
        model_dir = stage / name
        (model_dir / VERSION).mkdir(parents=True)
        if backend == "tensorrt":
            profile_notes = _stage_tensorrt(onnx_path, proto, model_dir, engine, plugin_path, max_batch, packaged, say)
        else:
            opset = _stage_onnx(onnx_path, model_dir / VERSION / "model.onnx", target, external, say)
            if target == "onnx" and opset >= 23:  # Triton images carry the onnxruntime of their release
                packaged.notes.append(
                    f"1/model.onnx uses ai.onnx opset {opset} (RotaryEmbedding-23): the server's onnxruntime must "
                    "implement that opset; for an older one write --target ort (com.microsoft RotaryEmbedding)")
                say(f"note: {packaged.notes[-1]}")
            if backend == "python":
                (model_dir / VERSION / "model.py").write_text(PYTHON_MODEL)
        # tensorrt: the flag names the library's place in the folder even when it is not built yet
        installed_plugin = folder / plugin_path.name if plugin_path else None
        packaged.server_command = server_command(repo, installed_plugin)
        (model_dir / "config.pbtxt").write_text(text)
        (model_dir / "README.md").write_text(_readme(packaged, repo, installed_plugin, profile_notes))
        packaged.files = sorted(folder / p.relative_to(model_dir) for p in model_dir.rglob("*") if p.is_file())
        commit_moves([(model_dir, folder)], trash=stage / ".replaced")
    return packaged


def _stage_onnx(onnx_path: Path, target_path: Path, target: str, external: str, say) -> int:
    """The file lowered to ``target`` (a no-op for a file already lowered), its weights beside it;
    returns its ai.onnx opset."""
    from rope_export.passes import LoweringLog, load_ir, lower, save_model

    log = LoweringLog()
    say(f"lowering {onnx_path} to {target} (weights stay on disk) for {VERSION}/{target_path.name}")
    model = lower(load_ir(onnx_path), target, log=log)
    save_model(model, target_path, external=external)  # into the staging folder: its paths mean nothing to a user
    for note in log.notes:
        say(f"note: {note}")
    return max((v for k, v in model.opset_imports.items() if k in ("", "ai.onnx")), default=0)


def _stage_tensorrt(onnx_path: Path, proto: onnx.ModelProto, model_dir: Path, engine, plugin_path: Path, max_batch: int,
                    packaged: Packaged, say) -> list[str]:
    """1/model.plan (given, or built here where TensorRT can) and the plugin library beside config.pbtxt."""
    from rope_export.runtimes.trt import build_engine, tensorrt_unavailable_reason
    from rope_export.runtimes.trt_profiles import ProfileError, derive_profile

    try:
        _, notes = derive_profile(proto, max_batch=max_batch)
    except ProfileError as exc:
        notes = []
        packaged.notes.append(f"no profile derived from the file ({exc}); the engine's own profile applies")
    plan = model_dir / VERSION / "model.plan"
    if engine:
        engine = Path(engine)
        if not engine.is_file():
            raise FileNotFoundError(f"engine {engine} not found")
        shutil.copyfile(engine, plan)
        notes = []  # the given engine's profile is whatever it was built with
        packaged.notes.append(f"1/model.plan is {engine}; it must have been built with a batch range up to "
                              f"--max-batch {max_batch} (rope-export build --max-batch {max_batch})")
    else:
        reason = tensorrt_unavailable_reason()
        if reason:
            packaged.notes.append(
                f"1/model.plan is missing: {reason}. On a machine with TensorRT and a GPU run "
                f"`rope-export lower {onnx_path} --target trt-plugin -o model.trt-plugin.onnx && rope-export build "
                f"model.trt-plugin.onnx -o {packaged.folder / VERSION / 'model.plan'} --max-batch {max_batch}`; "
                "Triton does not load the model until then")
            say(f"warning: {packaged.notes[-1]}")
        else:
            _check_plugin(plugin_path)
            lowered = model_dir / "model.trt-plugin.onnx"
            _stage_onnx(onnx_path, lowered, "trt-plugin", "single", say)
            say(f"building the TensorRT engine (max batch {max_batch})")
            build_engine(lowered, plan, [plugin_path], max_batch=max_batch, say=say)
            from rope_export.files.onnx_files import remove

            remove(lowered)
    if plugin_path.is_file():
        _check_plugin(plugin_path)
        shutil.copyfile(plugin_path, model_dir / plugin_path.name)
        return notes
    packaged.notes.append(f"the plugin library {plugin_path} is not built, so none is in this folder; build it with "
                          "`rope-export build-plugin --tensorrt-include-dir ...` and run again with --plugin")
    say(f"warning: {packaged.notes[-1]}")
    return notes
