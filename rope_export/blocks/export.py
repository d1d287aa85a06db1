"""``export_module``: any PyTorch module with RoPE to ONNX, one rotary node per rotated tensor.

For a block from any library (torchtune, Meta's reference code, GPT-NeoX/GPT-J-style code, einops
code, your own) the steps are:

1. count the rotations one eager forward performs (``rope_export.detect.count_rotations``: by data
   flow, independent of how the rotation is spelled), recording which Python functions it ran;
2. find the rotary functions among those (``rope_export.detect.functions``: read from the code,
   each verified numerically against a form, then checked on the block's own calls in one more eager
   forward: a function whose replacement differs there, e.g. called with another switch than its
   default, is not hooked and the note says by how much) and export the module with each of them routed
   through the rotary op (``hook_functions=True``; where hooking is exact), on torch.onnx's dynamo
   exporter (batch and sequence dims dynamic where torch allows, ``dynamic_shapes="auto"``); if the
   hooked export fails, the module is exported as it is and the failure noted;
3. fuse every rotation left in the traced graph into rope_export::RotaryEmbedding
   (``rope_export.passes.fuse``: found by what it computes, verified numerically before each
   rewrite; torch.onnx's own RotaryEmbedding-23 nodes at opset >= 23 are adopted);
4. compare the count with the file's rotary nodes (``compare_with_file``): a rotation left
   decomposed raises ``DecomposedRotationError`` naming its module and layer (a warning, and the
   file is written, with ``allow_decomposed=True``);
5. record the module's eager outputs for the example inputs in the file's metadata (``record_example``,
   at most ``EXAMPLE_LIMIT`` bytes): ``rope-export check`` compares every runner with PyTorch on them;
6. run the file, lowered to ``onnx``, on onnxruntime against the eager block on the example and with
   its integer inputs (positions) moved past the traced ones (``module_check``): a mismatch raises
   ``FileMismatchError`` naming the output and the error size;
7. write the file atomically (weights past 2 GB go to ``NAME.onnx.data``); nothing is written when a
   step above raises.

The result reports, per module that rotates, how many rotations it performs, how many became
rotary nodes and why any other was left alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from rope_export.blocks.check import FileMismatchError, check_on_onnxruntime
from rope_export.common.fileio import check_writable
from rope_export.detect import CountReport, RotationCensus, compare_with_file, count_rotations, rotary_nodes
from rope_export.detect.census import module_path_of
from rope_export.exporting import FACTORY_HELP, precision
from rope_export.exporting.onnxruntime_gaps import fill_onnxruntime_gaps
from rope_export.files import onnx_files
from rope_export.passes import FusionReport, fuse


class ModuleExportError(ValueError):
    """An export_module request that cannot be honoured; the message names the fix."""


__all__ = ["FileMismatchError", "ModuleExportError", "export_module"]


@dataclass
class SiteReport:
    """One module that rotates: what the eager forward did, what the file holds."""

    module_path: str
    rotations: int  # plain rotations in one eager forward
    fused: int  # rotary nodes attributed to this module
    refused: int = 0  # scaled (xPos-style) rotations, not RoPE
    why: list[str] = field(default_factory=list)  # reasons of sites left alone here


@dataclass
class ModuleExportResult:
    ir_model: ir.Model  # the fused model (weights not copied)
    path: Path | None
    census: RotationCensus
    fusion: FusionReport
    count: CountReport
    sites: list[SiteReport]

    notes: list[str] = field(default_factory=list)
    hooked: list[str] = field(default_factory=list)  # "function -> form" for each hooked rotary function

    @property
    def model(self) -> onnx.ModelProto:
        """The fused model as a ModelProto (made on first use: a copy of the weights)."""
        if not hasattr(self, "_proto"):
            self._proto = ir.to_proto(self.ir_model)
        return self._proto

    @property
    def rotary_nodes(self) -> int:
        return self.count.found

    def as_text(self) -> str:
        lines = [f"{'module':<36} {'rotations':>9} {'fused':>5}  left decomposed (why)"]
        for s in self.sites:
            why = "; ".join(sorted(set(s.why)))
            refused = f"{s.refused} xPos-style scaled (not RoPE)" if s.refused else ""
            lines.append(f"{s.module_path or '<root>':<36} {s.rotations:>9} {s.fused:>5}  "
                         + ", ".join(p for p in (refused, why) if p))
        lines += [f"hooked: {h}" for h in self.hooked]
        lines.append(self.count.as_text())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def auto_dynamic_shapes(args: tuple, kwargs: dict, shared: bool = True, first_only: bool = False):
    """(per-arg specs, per-kwarg specs) making batch and sequence dynamic.

    ``shared``: the first tensor input's dims 0 and 1 become the named dims ``batch`` and ``seq``,
    and every other input's dim 0/1 of the same example size shares them (so the file says that
    they are equal); dims of size 1 and the rest are left to torch (``Dim.AUTO``). Otherwise every
    dim 0/1 is ``Dim.AUTO`` (torch names each on its own). ``first_only``: only the first tensor's
    dims 0/1 are ``Dim.AUTO``, every other input static (an input whose dims merely have the batch
    size, such as patch coordinates ``[N, 2]`` at batch 2, can make torch.export fail otherwise).
    """
    auto = torch.export.Dim.AUTO
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    named = {}
    if shared and tensors:
        first = tensors[0]
        for axis, name in ((0, "batch"), (1, "seq")):
            if first.dim() > axis and first.shape[axis] > 1 and first.shape[axis] not in named:
                named[int(first.shape[axis])] = torch.export.Dim(name)

    first_tensor = tensors[0] if tensors else None

    def spec(value):
        if isinstance(value, torch.Tensor) and first_only:
            if value is not first_tensor:
                return None
            return {axis: auto for axis in range(min(2, value.dim()))} or None
        if isinstance(value, torch.Tensor):
            return {axis: named.get(int(value.shape[axis]), auto) for axis in range(min(2, value.dim()))} or None
        if isinstance(value, (list, tuple)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        return None

    return spec(args), spec(kwargs)


def export_module(
    module: torch.nn.Module,
    args=(),
    kwargs: dict | None = None,
    *,
    dynamic_shapes="auto",
    output: str | os.PathLike | None = None,
    opset: int = 23,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    allow_decomposed: bool = False,
    hook_functions: bool = True,
    external: str = "auto",
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> ModuleExportResult:
    """Export ``module(*args, **kwargs)`` with one rope_export::RotaryEmbedding per rotated tensor.

    ``dynamic_shapes``: ``"auto"`` (dims 0 and 1 of every tensor input dynamic where torch allows),
    ``None`` (static, the example's shapes) or torch.export's own specification. ``output``: the
    file to write (atomically), or None. ``hook_functions``: route the rotary functions the module's
    code calls through the op while tracing (False: fuse the traced graph only). Raises
    DecomposedRotationError when a rotation stayed decomposed (``allow_decomposed``: warn and keep
    going), RotationCountError when the file has more rotary nodes than the module performs
    rotations. ``external``: where the weights go (``onnx_files.EXTERNAL_DATA``); the file is checked
    with onnx.checker on its way to disk, whatever its size.
    """
    from rope_export.exporting.complex_pairs import has_complex
    from rope_export.exporting.core import check_opset

    say = progress or (lambda message: None)
    kwargs = dict(kwargs or {})
    args = args if isinstance(args, tuple) else (args,)
    check_opset(opset)
    if output is not None:
        check_writable(output)
    if not isinstance(module, torch.nn.Module):
        raise ModuleExportError(f"expected a torch.nn.Module, got {type(module).__name__}")
    module = module.eval()
    notes: list[str] = []
    census, functions = _count_and_find(module, args, kwargs, hook_functions, notes, say)
    say(f"exporting with torch.onnx (dynamo, opset {opset})")
    # complex rotations (any spelling) are traced as real pairs: torch.onnx cannot export complex tensors
    tracer = _Tracer(module, args, kwargs, dynamic_shapes, opset, input_names, output_names, verbose, say,
                     pairs=any(site.form == "complex" for site in census.sites) or has_complex(module))
    if tracer.pairs:
        notes.append("complex tensors traced as real pairs [..., 2] (rope_export.exporting.complex_pairs): torch.onnx "
                     "cannot export complex tensors")
    program, hooked = tracer.program(functions, notes)
    notes += fill_onnxruntime_gaps(program.model)
    say("fusing the rotations of the traced graph")
    fusion = FusionReport()
    model = fuse(program.model, report=fusion, adopt_standard=True,  # in place: no copy of the weights
                 table_inputs=_table_input_names(census, program.model, args, kwargs))
    precision.state_norm_precision(model)  # float32 norm statistics in the types, not only in stash_type
    if output is None:
        if onnx_files.weight_bytes(model) < onnx_files.EXTERNAL_DATA_THRESHOLD:
            onnx.checker.check_model(ir.to_proto(model), full_check=True)
        else:
            notes.append("onnx.checker skipped (weights past 2 GB and no output file): give an output path, the "
                         "file is checked on its way to disk")
    count, sites = _compared(census, fusion, model, allow_decomposed, notes)
    say("recording the module's eager outputs for the example (what `check` compares with PyTorch)")
    recorded, note = record_example(module, args, kwargs, model)
    model.metadata_props.update(recorded)
    if note:
        notes.append(note)
    say("running the file (lowered to onnx) on onnxruntime against the eager block")
    notes += check_on_onnxruntime(module, args, kwargs, model)
    if output is not None:
        say(f"writing {output}")
        onnx_files.write(model, output, external=external, check=True, progress=say)
    return ModuleExportResult(model, None if output is None else Path(output), census, fusion, count, sites, notes,
                              hooked)


def _count_and_find(module, args, kwargs, hook_functions: bool, notes: list[str], say):
    """(the rotations of one eager forward, the rotary functions its code calls that verify on its own calls)."""
    from rope_export.detect.functions import checked_on_real_calls, find_rotary_functions, recorded_calls

    say("counting the rotations of one eager forward")
    with recorded_calls() as called:
        census = count_rotations(module, args, kwargs)
    functions = find_rotary_functions(module, called=called) if hook_functions else []
    if functions:
        say("checking each rotary function on the block's own calls against its replacement")
        checks = checked_on_real_calls(module, args, kwargs, functions)
        functions = [c.function for c in checks if c.ok]
        notes += [f"not hooked: {c.why}; the traced graph is fused instead" for c in checks if not c.ok]
    return census, functions


class _Tracer:
    """torch.onnx's program of the module: with its rotary functions hooked where that traces, else as written;
    ``dynamic_shapes="auto"`` tries shared batch/seq names, then a dim per input, then the first input's only."""

    def __init__(self, module, args, kwargs, dynamic_shapes, opset, input_names, output_names, verbose, say, *,
                 pairs: bool):
        self.module, self.args, self.kwargs, self.dynamic_shapes = module, args, kwargs, dynamic_shapes
        self.opset, self.input_names, self.output_names, self.verbose, self.say = (
            opset, input_names, output_names, verbose, say)
        self.pairs = pairs

    def trace(self, shapes, auto: bool = False):
        from rope_export.exporting.complex_pairs import complex_as_pairs
        from rope_export.exporting.core import custom_translation_table
        from rope_export.exporting.torch_onnx import export_captured, is_capture_failure, quiet_exporter

        if auto and self.kwargs:  # auto_dynamic_shapes' (args specs, kwargs specs)
            shapes = {**_named(self.module, shapes[0]), **shapes[1]}
        elif auto:
            shapes = shapes[0]
        paired = complex_as_pairs(self.module) if self.pairs else contextlib.nullcontext()
        options = dict(opset_version=self.opset, input_names=self.input_names, output_names=self.output_names,
                       verbose=self.verbose, custom_translation_table=custom_translation_table())
        with torch.no_grad(), quiet_exporter(self.verbose), paired:
            try:
                return torch.onnx.export(self.module, self.args, kwargs=self.kwargs or None, dynamo=True,
                                         dynamic_shapes=shapes, **options)
            except Exception as exc:  # noqa: BLE001 - given axes: try torch.export's own capture once
                if self.dynamic_shapes == "auto" or not is_capture_failure(exc):
                    raise
            self.say("torch.onnx's capture failed: capturing with torch.export's defaults, translating that")
            return export_captured(self.module, self.args, self.kwargs, shapes, **options)

    def trace_shapes(self):
        args, kwargs = self.args, self.kwargs
        if self.dynamic_shapes != "auto":
            return self.trace(self.dynamic_shapes)
        try:
            return self.trace(auto_dynamic_shapes(args, kwargs), auto=True)
        except Exception:  # noqa: BLE001 - the shared names did not hold (e.g. a dim torch specializes)
            self.say("batch/seq shared across inputs did not trace; letting torch choose each dim")
        try:
            return self.trace(auto_dynamic_shapes(args, kwargs, shared=False), auto=True)
        except Exception:  # noqa: BLE001 - e.g. torch.export's own assertion on a small non-batch dim
            self.say("dims 0/1 of every input dynamic did not trace; only the first input's, the others static")
            return self.trace(auto_dynamic_shapes(args, kwargs, first_only=True), auto=True)

    def program(self, functions, notes: list[str]):
        """(the program, what was hooked): hooked first; a hooked trace that fails is traced as written and fused."""
        from rope_export.detect.functions import rotary_functions_hooked

        if functions:
            self.say(f"routing {len(functions)} rotary function(s) through the op: "
                     + ", ".join(f.qualified for f in functions))
            try:
                with rotary_functions_hooked(functions):
                    program = self.trace_shapes()
                return program, [f"{f.qualified} -> rope_export::RotaryEmbedding ({f.form.name})" for f in functions]
            except Exception as exc:  # noqa: BLE001 - the plain export below still fuses them
                notes.append(f"the export with rotary functions hooked failed ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:160]}); exported as written and fused instead")
        try:
            return self.trace_shapes(), []
        except Exception as exc:  # noqa: BLE001 - name the complex op the pairs could not take, if that was it
            cause = _complex_rewrite_cause(exc) if self.pairs else None
            if cause is None:
                raise
            raise ModuleExportError(f"{cause}: the block's complex code cannot be traced as real pairs, and "
                                    "torch.onnx cannot export complex tensors") from exc


def _compared(census, fusion, model, allow_decomposed: bool, notes: list[str]):
    """(the count of rotations against rotary nodes, the per-module sites); a shortfall is an error with the sites'
    table unless ``allow_decomposed``."""
    count = compare_with_file(census, model, allow_decomposed=True) if allow_decomposed else None
    sites = site_reports(census, fusion, model)
    if count is None:
        try:
            count = compare_with_file(census, model)
        except ValueError as exc:
            raise type(exc)(f"{exc}\n{_table(sites)}\n" + "".join(f"note: {n}\n" for n in notes)
                            + "nothing was written; pass allow_decomposed=True "
                            "(--allow-decomposed) to write the file anyway") from None
    return count, sites


EXAMPLE_LIMIT = 1 << 20  # bytes of example inputs and eager outputs kept in the file's metadata


def record_example(module: torch.nn.Module, args: tuple, kwargs: dict, model: ir.Model) -> tuple[dict, str]:
    """(metadata naming the module and holding its eager outputs for the example inputs, a note when not recorded).

    The file's inputs are the example's tensors in order (args, then kwargs; torch.onnx drops the rest)
    and its outputs the eager outputs' tensors in order; ``rope_export.check`` compares every runner
    with these on the example (``check.module_reference``)."""
    import base64
    import io

    import numpy as np
    from torch.utils._pytree import tree_leaves

    from rope_export.exporting.core import METADATA_PREFIX

    meta = {METADATA_PREFIX + "source": "module",
            METADATA_PREFIX + "module": f"{type(module).__module__}.{type(module).__qualname__}"}
    with torch.no_grad():
        outputs = [t for t in tree_leaves(module(*args, **kwargs)) if isinstance(t, torch.Tensor)]
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    names_in, names_out = [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]
    if len(inputs) != len(names_in) or len(outputs) != len(names_out):
        return meta, (f"example not recorded: the file's {len(names_in)} inputs / {len(names_out)} outputs are not the "
                      f"example's {len(inputs)} input / {len(outputs)} output tensors")
    arrays = {f"input/{n}": t.detach().cpu() for n, t in zip(names_in, inputs, strict=True)}
    arrays.update({f"output/{n}": t.detach().cpu() for n, t in zip(names_out, outputs, strict=True)})
    size = sum(t.numel() * t.element_size() for t in arrays.values())
    if size > EXAMPLE_LIMIT:
        return meta, (f"example not recorded: its inputs and outputs take {size} bytes, more than the "
                      f"{EXAMPLE_LIMIT} kept in the file; check compares with PyTorch given module=")
    if any(t.dtype == torch.bfloat16 for t in arrays.values()):  # NumPy has no bfloat16
        arrays = {k: t.float() if t.dtype == torch.bfloat16 else t for k, t in arrays.items()}
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **{k: t.numpy() for k, t in arrays.items()})
    meta[METADATA_PREFIX + "module_example"] = base64.b64encode(buffer.getvalue()).decode("ascii")
    return meta, ""


def _table_input_names(census: RotationCensus, model: ir.Model, args: tuple, kwargs: dict) -> list[str]:
    """The file's inputs that the census found to be cos/sin tables (the file's inputs are the example's tensors in
    order; none when torch.onnx dropped some)."""
    from torch.utils._pytree import tree_leaves

    count = sum(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs)))
    names = [v.name for v in model.graph.inputs]
    return [names[i] for i in census.table_inputs] if len(names) == count else []


def _complex_rewrite_cause(exc: BaseException):
    """The ComplexRewriteError an export failure was caused by (torch.export wraps errors), or None."""
    from rope_export.exporting.complex_pairs import ComplexRewriteError

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ComplexRewriteError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _named(module: torch.nn.Module, per_arg) -> dict:
    """Positional dynamic-shape specs keyed by the forward's parameter names (needed with kwargs)."""
    import inspect

    names = [p for p in inspect.signature(module.forward).parameters if p != "self"]
    return dict(zip(names, per_arg or (), strict=False))


def site_reports(census: RotationCensus, fusion: FusionReport, model: ir.Model) -> list[SiteReport]:
    """Per module: rotations counted, rotary nodes attributed, reasons of sites left alone there."""
    by_path: dict[str, SiteReport] = {}
    for site in census.sites:
        report = by_path.setdefault(site.module_path, SiteReport(site.module_path, 0, 0))
        if site.scaled:
            report.refused += 1
        else:
            report.rotations += 1
    for node in rotary_nodes(model):
        path = _match(node.module_path, by_path)
        if path is not None:
            by_path[path].fused += 1
    producers = {out.name: node for node in model.graph for out in node.outputs if out.name}
    for row in fusion.rows():
        if row.status != "left alone":
            continue
        node = producers.get(row.site)
        scope = module_path_of(node) if node is not None else None
        path = _match(scope, by_path)
        if path is None:  # a look-alike the census did not count: its own row, with the reason
            path = scope if scope is not None else "<unattributed>"
            by_path.setdefault(path, SiteReport(path, 0, 0))
        by_path[path].why.append(row.detail)
    return list(by_path.values())


def _match(path: str | None, by_path: dict) -> str | None:
    """The census path that a node's module path names (the same, or its innermost enclosing one)."""
    if path is None:
        return None
    if path in by_path:
        return path
    enclosing = [p for p in by_path if path.startswith(p + ".") or p.startswith(path + ".")]
    return max(enclosing, key=len) if enclosing else None


def _table(sites: list[SiteReport]) -> str:
    return "\n".join(f"  {s.module_path or '<root>'}: {s.rotations} rotation(s), {s.fused} fused"
                     + (f" (left alone: {'; '.join(sorted(set(s.why)))})" if s.why else "") for s in sites)


# -- CLI: rope-export export --module package.module:factory -----------------------------------------



def load_factory(spec: str) -> dict:
    """Import ``spec`` and call its factory; returns the export_module arguments as a dict."""
    import importlib
    import importlib.util

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ModuleExportError(f"--module {spec!r}: expected {FACTORY_HELP}")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ModuleExportError(f"--module {spec!r}: no such file {path}")
            spec_ = importlib.util.spec_from_file_location(path.stem, path)
            python_module = importlib.util.module_from_spec(spec_)
            spec_.loader.exec_module(python_module)
        else:
            python_module = importlib.import_module(where)
    except ModuleExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module failed to import: say which and why
        raise ModuleExportError(f"--module {spec!r}: importing {where} failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(python_module, name, None)
    if not callable(factory):
        raise ModuleExportError(f"--module {spec!r}: {where} has no callable {name!r}")
    try:
        made = factory()
    except Exception as exc:  # noqa: BLE001
        raise ModuleExportError(f"--module {spec!r}: {name}() failed: {type(exc).__name__}: {exc}") from None
    if isinstance(made, dict):
        parts = dict(made)
    elif isinstance(made, tuple) and len(made) in (2, 3):
        parts = dict(zip(("module", "args", "kwargs"), made, strict=False))
    else:
        raise ModuleExportError(f"--module {spec!r}: {name}() returned {type(made).__name__}; expected {FACTORY_HELP}")
    unknown = set(parts) - {"module", "args", "kwargs", "dynamic_shapes", "input_names", "output_names"}
    if unknown or "module" not in parts:
        raise ModuleExportError(f"--module {spec!r}: {name}() returned keys {sorted(parts)}; expected {FACTORY_HELP}")
    if not isinstance(parts["module"], torch.nn.Module):
        raise ModuleExportError(f"--module {spec!r}: {name}() returned a {type(parts['module']).__name__} where a "
                                "torch.nn.Module belongs")
    args = parts.get("args", ())
    parts["args"] = args if isinstance(args, tuple) else tuple(args) if isinstance(args, list) else (args,)
    return parts
