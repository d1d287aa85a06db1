"""``export_task``: a transformers model of any task (``rope_export.hf.tasks``) to ONNX, one rotary node per rotation.

The steps are ``export_hf``'s, per file (component) of the task:

1. the components: each file's wrapper and example inputs (``task.components``: ``rope_export.hf.task_io``);
2. the rotations transformers performs in one eager forward of each (``count_rotations``), and the rotary
   functions the model's code called, found and verified (``rope_export.detect``);
3. each component traced with those functions routed through the op, what no hook reached fused
   (``export.traced_and_fused``), its rotary nodes compared with its eager rotations, metadata, the
   atomic write (``export.counted_and_written``).

A task of one component writes ``output`` (an .onnx file); a task of several writes the folder
``output`` with one ``NAME.onnx`` per component, whole or not at all (staged beside it, then moved).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from rope_export.detect.functions import recorded_calls
from rope_export.exporting.core import DTYPES, check_opset, graph_proto
from rope_export.hf.counting import eager_rotations, refuse_no_rope
from rope_export.hf.errors import HFExportError
from rope_export.hf.export import FALLBACKS
from rope_export.hf.families import HFFamily, family_of
from rope_export.hf.hooking import model_state_kept, verified_functions
from rope_export.hf.task_io import Component
from rope_export.hf.task_patches import trace_patched
from rope_export.hf.tasks import CAUSAL_LM, TASK_KIND, TASKS, Task
from rope_export.hf.tracing import counted_and_written, traced_and_fused

MANIFEST = "rope_export_components.json"  # in a folder of components: which files, and which output feeds which input


@dataclass
class TaskFile:
    component: str
    path: Path | None
    model: onnx.ModelProto
    rotations: int  # transformers' rotations in one eager forward of the component
    rotary_nodes: int
    hook: str
    input_names: list[str]
    output_names: list[str]


@dataclass
class TaskExportResult:
    task: str
    family: HFFamily
    files: list[TaskFile]
    path: Path | None  # the file, or the folder of a task of several components
    notes: list[str] = field(default_factory=list)

    @property
    def rotations(self) -> int:
        return sum(f.rotations for f in self.files)

    @property
    def rotary_nodes(self) -> int:
        return sum(f.rotary_nodes for f in self.files)


def export_task(model, task: str | Task, output: str | os.PathLike | None = None, *, family: str | None = None,
                fallback: str = "auto", allow_decomposed: bool = False, allow_no_rope: bool = False, opset: int = 23,
                weights: str | None = None, seed: int = 0, dims: dict[str, int] | None = None,
                external: str = "auto", progress: Callable[[str], None] | None = None,
                verbose: bool = False) -> TaskExportResult:
    """Export ``model`` (built for ``task``) as the task's files, every rotation one rotary node (counted).

    ``output``: the .onnx file of a one-file task, the folder of a task of several (``Task.parts``);
    None: the files stay in memory (``TaskExportResult.files``). ``dims``: the example's sizes
    (``task_io.EXAMPLE_DIMS``: batch, seq, samples, frames, past). The other options are ``export_hf``'s.
    """
    task = TASKS[task] if isinstance(task, str) else task
    if task.components is None:
        raise HFExportError(f"{task.name} is export_hf's path (rope_export.hf.export_hf), not a task export")
    if fallback not in FALLBACKS:
        raise HFExportError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    check_opset(opset)
    say = progress or (lambda message: None)
    fam = family_of(model, family)
    dtype_name = {v: k for k, v in DTYPES.items()}.get(next(model.parameters()).dtype, "fp32")
    notes: list[str] = []
    with model_state_kept(model):
        say(f"making the example inputs of {task.name} ({', '.join(task.parts)})")
        components = task.components(model, task.outputs, dims, seed)
        say("counting the rotations transformers performs in one eager forward of each file")
        with recorded_calls() as called:
            censuses = [eager_rotations(c.module, c.inputs) for c in components]
        refuse_no_rope(_joined(censuses), model.config.model_type, allow_no_rope=allow_no_rope, notes=notes)
        say("finding the rotary functions the model calls")
        functions = verified_functions(model, fam, called, fallback)
    metadata = dict(dtype=dtype_name, kind=TASK_KIND, weights=weights, seed=seed, layer=None)
    options = dict(fam=fam, functions=functions, opset=opset, fallback=fallback, notes=notes, verbose=verbose, say=say)
    with _destination(output, task) as place, trace_patched(model) as patched:
        notes += patched
        files = []
        for index, (component, census) in enumerate(zip(components, censuses, strict=True)):
            say(f"exporting {type(model).__name__}'s {component.name} ({task.name}) with torch.export")
            program, hook = _traced(model, task, index, component, census, seed, options)
            proto = graph_proto(program)
            name_dims(proto, component)
            extra = {"task": task.name, "component": component.name, "task_dims": json.dumps(component.dims)}
            proto, report, description = counted_and_written(
                proto, program, model, census, fam, hook, fallback=fallback, allow_decomposed=allow_decomposed,
                notes=notes, metadata=metadata, extra=extra, output=place(component.name), external=external,
                say=say)
            files.append(TaskFile(component.name, place(component.name), proto, report.expected, report.found,
                                  description, component.input_names, component.output_names))
        if len(components) > 1 and output is not None:
            _write_manifest(place(None), task, files)
    path = None if output is None else Path(output)
    return TaskExportResult(task.name, fam, [_moved(f, path, len(files)) for f in files], path, notes)


def _traced(model, task: Task, index: int, component: Component, census, seed: int, options: dict):
    """(program, hook) of one component, proven transformers at other sizes (``same_at_other_sizes``). A hooked
    trace that is not (a rotary function whose replacement fits the probe's shapes, not this call's) is traced
    again without the hook, and what it left decomposed fused (``rope_export.passes.fuse``), with a note."""
    def trace(functions):
        program, hook = traced_and_fused(model, component.module, component.inputs, component.dynamic_shapes(),
                                         component.input_names, component.output_names, census=census,
                                         layout=component.layout, **{**options, "functions": functions})
        same_at_other_sizes(program, model, task, index, component, seed, options["say"],
                            layers=len(census.plain) // 2)
        return program, hook

    if not options["functions"]:
        return trace([])
    try:
        return trace(options["functions"])
    except HFExportError as hooked:
        options["say"](f"the hooked {component.name} is not transformers at other sizes: tracing it without the hook")
        program, hook = trace([])
        options["notes"].append(f"{component.name}: traced without the rotary hook, then fused ({hooked})")
        return program, hook


def same_at_other_sizes(program, model, task: Task, index: int, component: Component, seed: int, say,
                        layers: int = 1) -> None:
    """Refuse a traced program that is not transformers at sizes other than the example's.

    torch.export keeps a dim dynamic yet may bake a size computed from it into the graph (a float guard it does
    not check, ``task_patches``); the program is run on a second example, every dynamic size about 1.5 times
    the first, against transformers' own forward (unpatched)."""
    import torch

    from rope_export.op.tolerances import for_layers, tolerance

    other = {name: size + size // 2 + 1 for name, size in component.dims.items()}
    say(f"running the traced {component.name} at other sizes ({_sizes(other)}) against transformers")
    with model_state_kept(model):
        again = task.components(model, task.outputs, other, seed + 1)[index]
        with torch.no_grad():
            want = again.module(*again.inputs)
            try:
                got = program.exported_program.module()(*again.inputs)
            except Exception as exc:  # noqa: BLE001 - a size baked into the graph fails to broadcast
                got = exc
    tol = for_layers(tolerance("block", next(model.parameters()).dtype), max(1, layers))
    for name, b, a in zip(component.output_names, want, got if isinstance(got, tuple) else want, strict=True):
        if isinstance(got, Exception):
            what = f"it fails: {type(got).__name__}: {str(got).splitlines()[0][:200] if str(got) else ''}"
        elif a.shape != b.shape:
            what = f"{name} has shape {list(a.shape)}, transformers' {list(b.shape)}"
        elif not tol.at_scale_of(b.float().numpy()).allclose(a.float().numpy(), b.float().numpy()):
            what = f"{name} differs from transformers' by {(a.float() - b.float()).abs().max().item():.3g}"
        else:
            continue
        raise HFExportError(
            f"exporting {type(model).__name__}'s {component.name}: the traced graph is not transformers at "
            f"{_sizes(other)} ({what}): its code fixes a size to the example's while tracing, so no file could "
            "serve other sizes")


def _sizes(dims: dict[str, int]) -> str:
    return ", ".join(f"{name} {size}" for name, size in dims.items())


def _joined(censuses):
    """One census of every component's rotations (for the no-RoPE refusal: a model rotates in some file)."""
    from rope_export.detect import RotationCensus

    return RotationCensus(sites=[site for census in censuses for site in census.sites])


def name_dims(model: onnx.ModelProto, component: Component) -> None:
    """The I/O's symbolic dims by the component's own names (batch, seq, samples, frames, past, ...); the
    presents' past axis, which torch names for the sum, becomes ``past+seq``."""
    names = {}
    graph_inputs = {v.name: v for v in model.graph.input}
    for name, axes in component.axes.items():
        value = graph_inputs.get(name)
        if value is None:
            continue
        dims = value.type.tensor_type.shape.dim
        for axis, dim_name in axes.items():
            if dims[axis].dim_param:
                names[dims[axis].dim_param] = dim_name
    for value in [*model.graph.input, *model.graph.output]:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]
            elif dim.dim_param and value.name.startswith("present.") and axis == 2:
                dim.dim_param = "past+seq"


@contextlib.contextmanager
def _destination(output, task: Task):
    """A function ``place(component) -> path`` to write each file to: ``output`` itself for one file; for several,
    ``NAME.onnx`` in a staging folder beside ``output``, moved into place when every file is written."""
    from rope_export.common.fileio import commit_moves, staging_dir

    if output is None:
        yield lambda name: None
        return
    output = Path(output)
    if len(task.parts) == 1:
        yield lambda name: output
        return
    check_output_folder(output, task)
    with staging_dir(output.with_name(output.name + ".export")) as stage:  # staging_dir takes a file's path
        folder = stage / "out"
        folder.mkdir()
        yield lambda name: folder / (MANIFEST if name is None else f"{name}.onnx")
        commit_moves([(folder, output)], stage / "trash")


def check_output_folder(output: Path, task: Task) -> None:
    """Refuse, before any work, a folder that cannot take a task's files (a file name, a folder of other files)."""
    if output.suffix == ".onnx":
        files = ", ".join(f"{part}.onnx" for part in task.parts)
        raise HFExportError(f"{task.name} writes {files}: give -o a folder, not {output.name}")
    if output.exists() and (not output.is_dir() or (any(output.iterdir()) and not (output / MANIFEST).is_file())):
        raise HFExportError(f"{output} exists and is not an empty folder or an earlier export of components "
                            f"(no {MANIFEST}); give a new folder")


def _write_manifest(path: Path, task: Task, files: list[TaskFile]) -> None:
    from rope_export.common.fileio import atomic_write_text

    manifest = {"task": task.name, "files": {f.component: {"file": f"{f.component}.onnx", "inputs": f.input_names,
                                                           "outputs": f.output_names} for f in files}}
    atomic_write_text(path, json.dumps(manifest, indent=1) + "\n")


def _moved(file: TaskFile, output: Path | None, count: int) -> TaskFile:
    """The file's final path (a component written in the staging folder ends up in ``output``)."""
    if output is not None and count > 1:
        file.path = output / f"{file.component}.onnx"
    return file


def is_task_export(choice) -> bool:
    return choice.task.name != CAUSAL_LM
