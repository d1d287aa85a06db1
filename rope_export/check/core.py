"""``check()``: open the file, pick the reference, make the inputs, then the reference and the runners
take turns: the reference computes every case and is freed, then each runner runs and is freed,
then each rotary node alone is swept over every position on every runner.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np
import onnx

from rope_export.check import cache_rows, vlm
from rope_export.check.compare import compare_against_pytorch, compare_output, token_errors, token_limit_ratios
from rope_export.check.graph import rotary_nodes, rotary_slices
from rope_export.check.inputs import InputPlan, describe_plan, find_vocab, input_role, stress_cases, user_cases
from rope_export.check.layer_errors import compare_layers, layer_outputs, pytorch_layer_errors
from rope_export.check.layer_faults import diagnose, finding_line, precision_findings
from rope_export.check.layer_rope import slice_ropes
from rope_export.check.metadata import file_source, read_hf_info, read_preset_info
from rope_export.check.model_file import CheckError, ModelFile, free_memory, memory_limit_bytes
from rope_export.check.module_reference import ModuleReference, RecordedReference, read_example
from rope_export.check.pieces import StreamedRunner
from rope_export.check.references import OnnxFileReference, _file_dtype, choose_reference
from rope_export.check.report import CheckReport, RunnerReport
from rope_export.check.runners import (
    MAX_IN_MEMORY,
    RUNNERS,
    Limits,
    Skip,
    check_runner_names,
    first_line,
    make_runner,
    run_cases,
)
from rope_export.check.task_reference import TaskReference
from rope_export.common.bounds import format_bytes
from rope_export.exporting.core import DTYPES
from rope_export.op.tolerances import against_pytorch, for_layers, tolerance

PRECISIONS = ("auto", "fp32", "fp64", "none")


def _raw_positions(mf: ModelFile) -> bool:
    """Whether a standard/contrib rotary node reads position_ids straight from the graph's input
    (lowered with --trust-positions): then positions outside the caches are not legal for the file."""
    inputs = {s.name for s in mf.inputs}
    return any(rn.kind in ("onnx", "ort") and rn.position_ids in inputs for rn in rotary_nodes(mf.proto.graph))


@dataclass
class CheckOptions:
    """What ``check`` is asked to do beyond the file and its runners (each field: a ``rope-export check`` flag)."""

    # the reference (default: read from the file)
    reference: str | os.PathLike | None = None  # --reference OTHER.onnx
    hf_config: str | os.PathLike | None = None  # --hf
    weights: str | os.PathLike | None = None
    seed: int | None = None
    random_weights: bool = False
    reference_block: object = None  # a preset's PyTorch block (Python API)
    module: object = None  # export_module's module, with the example it was exported with
    args: object = None
    kwargs: dict | None = None
    precision: str = "auto"  # the layer-streamed reference of a transformers causal LM
    # the inputs
    inputs: list[str] | None = None  # the user's feeds
    batch: int | None = None
    seq: int | None = None
    past: int | None = None
    long_seq: int | None = None
    sweep: bool = True  # each rotary node alone over every position
    # the runners and their memory
    plugin_library: str | None = None
    memory_limit_gb: float | None = None
    max_in_memory_gb: float | None = None
    piece_limit_gb: float | None = None

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise CheckError(f"unknown reference precision {self.precision!r}; choose from {', '.join(PRECISIONS)}")
        if self.reference is not None and self.hf_config is not None:
            raise CheckError("give either --reference OTHER.onnx or --hf CONFIG, not both")
        if self.module is not None and (self.reference is not None or self.hf_config is not None):
            raise CheckError("give module= or --reference/--hf, not both")

    def limits(self) -> Limits:
        max_in_memory = MAX_IN_MEMORY if self.max_in_memory_gb is None else int(self.max_in_memory_gb * 1e9)
        piece = None if self.piece_limit_gb is None else int(self.piece_limit_gb * 1e9)
        return Limits(memory_limit_bytes(self.memory_limit_gb), max_in_memory, piece)

    @property
    def named_reference(self) -> bool:
        return self.reference is not None or self.hf_config is not None


@dataclass
class _Subject:
    """The file and what it says of itself: its source, recorded RoPE configuration, rotary slices, caches."""

    mf: ModelFile
    source: str | None
    preset: object = None  # metadata.PresetInfo
    hf_info: object = None  # metadata.HFInfo
    example: object = None  # the example export_module recorded
    notes: list[str] = field(default_factory=list)
    dtype: str = "fp32"
    rope: object = None
    position_limit: int | None = None
    slices: list = field(default_factory=list)
    ropes: list = field(default_factory=list)
    stored_rows: list[int] = field(default_factory=list)
    tables: object = None


def check(model: onnx.ModelProto | str | os.PathLike, runners: tuple[str, ...] = RUNNERS,
          options: CheckOptions | None = None, *, progress=None, **settings) -> CheckReport:
    """Run every runner on the file and compare with its reference (see ``rope_export.check``).

    ``options`` (or its fields as keywords, ``settings``): ``module`` (with ``args``/``kwargs``, the example it was
    exported with) is the PyTorch module a file of ``export_module`` came from, run on every case as the reference
    (``check.module_reference``); ``precision``: the layer-streamed reference of a transformers causal LM
    (``references.choose_reference``)."""
    options = dataclasses.replace(options or CheckOptions(), **settings)
    options.validate()
    say = progress or (lambda message: None)
    runners = tuple(runners)
    check_runner_names(runners)
    limits = options.limits()
    say(f"opening {model if not isinstance(model, onnx.ModelProto) else 'the model'}")
    mf = ModelFile.open(model)
    options, vlm_notes, vlm_feeds = _vlm_component(mf, options)
    subject = _read_subject(mf, options, limits)
    subject.notes[:0] = vlm_notes
    ref = _reference(subject, options, limits)
    say("comparing every row of the stored cos/sin caches")
    _read_caches(subject)
    layers = _layers(subject.mf)
    tol = for_layers(tolerance("block", DTYPES[subject.dtype]), layers)
    past_end = _past_end_allowed(subject, ref)
    cases, described = _cases(subject, ref, options, past_end, limits)
    del vlm_feeds  # read into the cases: their scratch folder goes
    expected, rule, pytorch_layers = _run_reference(subject, ref, cases, layers, say)
    precision = _stated_below_pytorch(subject, ref, rule)
    compared_outputs = ref.expected_outputs(subject.mf)
    missing = [o.name for o in subject.mf.outputs if o.name not in compared_outputs]
    if missing:
        subject.notes.append(f"outputs not compared (the reference does not produce them): {', '.join(missing)}")
    reports = [_run_runner(name, f"[{i}/{len(runners)}] {name}: ", subject, ref, cases, expected, compared_outputs,
                           tol, rule, pytorch_layers, options.plugin_library, limits, say)
               for i, name in enumerate(runners, 1)]
    _sweep(subject, reports, runners, options, past_end, limits, say, ref)
    if subject.mf.external:
        subject.notes.append(f"weights: {format_bytes(subject.mf.weight_bytes)} in external data, read by each "
                             "runner from the path in turn")
    return CheckReport(
        model=subject.mf.label, reference=ref.label, against=_short(ref), independent=ref.independent,
        dtype=subject.dtype, tolerance=tol, rule=rule, pytorch_layers=_max_per_layer(pytorch_layers),
        runners=reports, tables=subject.tables, inputs=described, cases=[c.name for c in cases], notes=subject.notes,
        preset=subject.preset.preset.name if subject.preset else "",
        sweep_tolerance=tolerance("op", DTYPES[subject.dtype]), weights=getattr(ref, "weights_source", {}),
        precision=precision)


def _vlm_component(mf: ModelFile, options: CheckOptions):
    """(options, notes, feeds to keep until the cases are read): a vision-language component file
    (``check.vlm``) is compared with its transformers submodule, on its own cases where the stress cases do not
    fit it; any other file, or a reference named, is left as it is."""
    if options.module is not None or options.named_reference or vlm.vlm_record(mf) is None:
        return options, [], None
    module, notes, feeds = vlm.component_reference(mf, weights=options.weights, seed=options.seed,
                                                   random_weights=options.random_weights)
    inputs = options.inputs or (feeds.paths if feeds is not None else None)
    return dataclasses.replace(options, module=module, inputs=inputs), notes, feeds


def _read_subject(mf: ModelFile, options: CheckOptions, limits: Limits) -> _Subject:
    """The file's source and the RoPE configuration and sizes it records (also used when another reference is
    named: then metadata that cannot be read is a note, not an error)."""
    subject = _Subject(mf, file_source(mf))
    try:
        subject.preset = read_preset_info(mf, limits.memory) if subject.source == "preset" else None
        subject.hf_info = read_hf_info(mf, limits.memory) if subject.source == "transformers" else None
    except CheckError as exc:
        if not options.named_reference:
            raise
        subject.notes.append(f"the file's metadata is not used: {exc}")
    subject.example = read_example(mf) if not options.inputs else None
    recorded = subject.preset or subject.hf_info
    subject.dtype = recorded.dtype if recorded else _file_dtype(mf)
    subject.rope = recorded.rope if recorded else None
    subject.position_limit = recorded.position_limit if recorded else None
    return subject


def _reference(subject: _Subject, options: CheckOptions, limits: Limits):
    """The reference the runners are compared with: the module, the recorded example, or the file's own."""
    mf = subject.mf
    if options.module is not None:
        ref, notes = ModuleReference(mf, options.module, options.args, options.kwargs), []
        ref.weight_bytes = mf.weight_bytes
    elif subject.source == "diffusers" and not options.named_reference:
        from rope_export.check.diffusers_reference import DiffusersReference

        ref, notes = DiffusersReference(mf), []
        ref.weight_bytes = mf.weight_bytes
    elif subject.example is not None and subject.source is None and not options.named_reference:
        ref, notes = RecordedReference(mf, subject.example, limits), []
        ref.weight_bytes = mf.weight_bytes
    else:
        ref, notes = choose_reference(
            mf, source=subject.source, preset=subject.preset, hf_info=subject.hf_info,
            reference_path=options.reference, hf_config=options.hf_config,
            weights=None if options.weights is None else str(options.weights), seed=options.seed,
            random_weights=options.random_weights, reference_block=options.reference_block,
            precision=options.precision, limits=limits, task_reference=TaskReference)
    subject.notes += notes
    if mf.contrib_ops:
        subject.notes.append(f"onnxruntime contrib ops ({', '.join(mf.contrib_ops)}): onnx.checker checked the rest "
                             "of the graph, onnxruntime's session creation checks them; onnx.reference, the CPU twin "
                             "and TensorRT have no kernels for them")
    subject.position_limit = subject.position_limit or ref.position_limit
    return ref


def _read_caches(subject: _Subject) -> None:
    """The rotary slices and every row of their stored cos/sin caches, compared with the RoPE configuration."""
    mf, hf_info = subject.mf, subject.hf_info
    subject.slices, slice_notes = rotary_slices(mf)
    subject.notes += slice_notes
    rows = [int(mf.initializer(s.tables["cos"]).dims[0]) for s in subject.slices if s.tables]
    # per-token caches cut from a table (Meta's freqs_cis): the positions it has rows for
    rows += [s.table_rows for s in subject.slices if not s.tables and not s.chosen.position_ids and s.table_rows]
    subject.stored_rows = rows
    if subject.position_limit is None and rows:
        subject.position_limit = min(rows)
    subject.ropes, rope_notes = slice_ropes(mf, subject.slices, subject.rope,
                                            hf_info.rope_by_layer_type if hf_info else {},
                                            hf_info.layer_types if hf_info else [])
    subject.notes += rope_notes
    subject.tables = cache_rows.check_tables(mf, subject.rope, subject.slices, subject.position_limit, subject.ropes)


def _past_end_allowed(subject: _Subject, ref) -> bool:
    """Whether cases may hold positions past the file's range (its rotary nodes pass such tokens through)."""
    preset = subject.preset
    past_end = not _raw_positions(subject.mf) and (
        (preset is not None and not preset.rope.seq_len_dependent)
        or (subject.source is None and bool(subject.stored_rows) and all(s.tables for s in subject.slices)))
    if past_end and isinstance(ref, (ModuleReference, OnnxFileReference)):
        subject.notes.append(f"no case past the end of the positions: the reference ({ref.label}) has no "
                             "pass-through for them")  # a module or plain export indexes its tables with them
        return False
    return past_end


def _cases(subject: _Subject, ref, options: CheckOptions, past_end: bool, limits: Limits) -> tuple[list, str]:
    """The inputs every runner and the reference compute: the user's feeds, or stress cases sized by the flags,
    the file's metadata and the defaults; plus the example export_module recorded."""
    mf, hf_info, rope = subject.mf, subject.hf_info, subject.rope
    vocab = find_vocab(mf) or (_config_vocab(hf_info.config) if hf_info else None) or ref.vocab
    positions_in = tuple(dict.fromkeys(s.name for sl in subject.slices for s in sl.position_inputs
                                       if len(s.dims or ()) == 2))
    sizes = {k: v for k, v in dict(batch=options.batch, seq=options.seq, past=options.past,
                                   long_seq=options.long_seq).items() if v is not None}
    plan = InputPlan(**sizes, position_limit=subject.position_limit, past_end_allowed=past_end,
                     vocab=vocab if isinstance(vocab, int) else None, position_inputs=positions_in,
                     original_context=rope.original_max_position_embeddings if rope is not None else None)
    for name in ("batch", "seq", "long_seq"):
        if getattr(plan, name) < 1:
            raise CheckError(f"--{name.replace('_', '-')} must be at least 1")
    if plan.past < 0:
        raise CheckError("--past must be 0 or more")
    if options.inputs:
        cases = user_cases(list(options.inputs), mf)
        described = f"the user's feeds ({', '.join(map(str, options.inputs))})"
    elif hasattr(ref, "own_cases"):  # a reference that knows its inputs (a task file's; a denoiser's latent sizes)
        cases, case_notes, described = ref.own_cases(mf, plan)
        subject.notes += case_notes
    else:
        cases, case_notes = stress_cases(mf, plan, limits.memory)
        subject.notes += case_notes
        described = describe_plan(plan)
    if subject.example is not None:  # the example export_module ran the module on: its eager outputs are in the file
        cases.append(subject.example.case())
        described += f"; and the example recorded at export (case {subject.example.case().name})"
    if subject.source == "transformers" and plan.vocab is None and not options.inputs:
        subject.notes.append("the vocabulary size was not found; token ids are drawn below 2")
    return cases, described


def _run_reference(subject: _Subject, ref, cases: list, layers: int, say):
    """The reference's outputs for every case; with a higher-precision reference also the rule against PyTorch's
    own error and PyTorch's error per decoder layer (whose outputs the file then also gives)."""
    try:
        expected = ref.outputs(cases, say)
    except CheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - the reference refusing these inputs is the file's problem
        raise CheckError(f"the reference ({ref.label}) cannot run the inputs: {first_line(exc)}") from None
    measured = bool(getattr(ref, "streams", lambda: False)())  # after the run: a stream that could not run fell back
    rule = against_pytorch(DTYPES[subject.dtype]) if measured else None
    subject.notes += [ref.fallback_note] if getattr(ref, "fallback_note", "") else []
    if measured:
        subject.notes.append(f"pass rule, measured: {rule.describe()} (rope_export.op.tolerances.against_pytorch)")
    elif layers > 1:
        subject.notes.append(f"tolerance: one block's times sqrt({layers} layers) (rope_export.op.tolerances."
                             "for_layers): no higher-precision reference for this file")
    pytorch_layers = None
    if measured and ref.reference_states:
        mf = subject.mf
        layer_names, why = layer_outputs(mf.proto.graph, len(ref.reference_states[0]))
        if layer_names:
            mf.add_layer_outputs(layer_names, next(s.elem_type for s in mf.outputs if s.name == "logits"))
            pytorch_layers = pytorch_layer_errors(ref.reference_states, ref.pytorch_states)
        else:
            subject.notes.append(f"no error per decoder layer: {why}")
    free_memory(subject.mf.weight_bytes)
    return expected, rule, pytorch_layers


def _stated_below_pytorch(subject: _Subject, ref, rule) -> list[dict]:
    """The ops the file states below PyTorch's precision, found by a runner or not (``layer_faults``), as notes."""
    if rule is None or getattr(ref, "stream", None) is None:
        return []
    found = precision_findings(subject.mf, ref.stream, str(DTYPES[subject.dtype]).removeprefix("torch."))
    layers = len(ref.reference_states[0]) if ref.reference_states else 0
    subject.notes += [finding_line(finding, layers) for finding in found]
    return found


def _run_runner(name, prefix, subject: _Subject, ref, cases, expected, outputs, tol, rule, pytorch_layers,
                plugin_library, limits: Limits, say) -> RunnerReport:
    """One runner on every case, freed after, compared with the reference; skipped or failed with the reason."""
    mf = subject.mf
    if name == ref.golden_runner:
        return RunnerReport(name, "golden", "the reference the other runners are compared with")
    say(prefix + "preparing")
    try:
        runner, note = make_runner(name, mf, plugin_library=plugin_library, cases=cases, limits=limits)
    except Skip as skip:
        return RunnerReport(name, "skipped", str(skip))
    except Exception as exc:  # noqa: BLE001 - a runner that cannot load the file fails, named
        return RunnerReport(name, "FAIL", first_line(exc))
    say(f"{prefix}running {len(cases)} cases{note}")
    try:
        actual, latency = run_cases(runner, cases, lambda message: say(prefix + message))
    except Skip as skip:  # a piece onnxruntime has no kernel for
        return RunnerReport(name, "skipped", str(skip))
    except Exception as exc:  # noqa: BLE001 - a runner that crashes is a failed comparison, named
        return RunnerReport(name, "FAIL", first_line(exc))
    finally:
        if isinstance(runner, StreamedRunner):
            note = note.rstrip(")") + f"; {format_bytes(runner.kept_bytes)} of values kept between pieces)"
        del runner
        mf.release()
        free_memory(mf.weight_bytes)
    say(f"{prefix}comparing with the reference")
    pytorch = ref.pytorch_outputs if rule is not None else None
    report = _compare(name, note, latency, cases, actual, expected, outputs, tol, pytorch, rule)
    if pytorch_layers is not None:
        report.layers = compare_layers(name, actual, [c.name for c in cases], ref.reference_states, pytorch_layers,
                                       rule)
    if rule is not None:  # outside PyTorch's envelope: which op, and the file's fault or the runner's (layer_faults)
        del actual
        diagnose(report, mf, cases, ref, rule, str(DTYPES[subject.dtype]).removeprefix("torch."),
                 lambda runner, view: make_runner(runner, view, plugin_library=plugin_library, cases=cases,
                                                  limits=limits), limits.max_in_memory, say)
    return report


def _sweep(subject: _Subject, reports, runners, options: CheckOptions, past_end: bool, limits: Limits, say,
           ref) -> None:
    """Each rotary node alone over every position, on every runner; a failed sweep fails its runner (unless the
    reference says why its nodes cannot run alone: ``sweep_note``)."""
    if options.sweep and subject.slices and getattr(ref, "sweep_note", ""):
        subject.notes.append(ref.sweep_note)
    elif options.sweep and subject.slices:
        results, sweep_notes = cache_rows.sweep(
            subject.mf, subject.slices, runners, ropes=subject.ropes, position_limit=subject.position_limit,
            out_of_range_allowed=past_end, plugin_library=options.plugin_library,
            max_in_memory=limits.max_in_memory, say=say)
        subject.notes += sweep_notes
        for r in reports:
            r.sweep = results.get(r.runner)
            if r.sweep is not None and r.sweep.status == "FAIL":
                r.status = "FAIL"
    elif not subject.slices and not subject.tables:
        subject.notes.append("no rotary node could be run alone (none in the file, or each for the reason noted); "
                             "the positions are covered by the cases only")


def _config_vocab(config: dict):
    """The vocabulary size a transformers config names (a multimodal config's text config holds it)."""
    text = config.get("text_config")
    return config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)


def _layers(mf: ModelFile) -> int:
    """Blocks stacked in the file: layers with a past key/value input, or rotary nodes two by two."""
    past = sum(1 for s in mf.inputs if input_role(s) == "past")
    return max(1, past // 2, len(rotary_nodes(mf.proto.graph)) // 2)


def _short(ref) -> str:
    if getattr(ref, "short", None):
        return ref.short
    label = ref.label
    if label.startswith("PyTorch"):
        return "PyTorch"
    if label.startswith("transformers"):
        return "transformers"
    if ref.golden_runner:
        return ref.golden_runner
    return label


def _max_per_layer(errors: list[list[float]] | None) -> list[float] | None:
    return None if errors is None else [max(per_case) for per_case in zip(*errors, strict=True)]


def _compare(name, note, latency, cases, actual, expected, outputs, tol, pytorch=None, rule=None) -> RunnerReport:
    """Each case's outputs against the reference: by ``rule`` against PyTorch's own error where ``pytorch``
    (its outputs in the file's dtype) is given, else by ``tol``."""
    report = RunnerReport(name, "pass", note.strip(" ()"), latency)
    for k, (case, got, want) in enumerate(zip(cases, actual, expected, strict=True)):
        stats = []
        for output in outputs:
            if output not in got:
                stats.append(compare_output(output, np.zeros(0), np.zeros(1), tol))
                stats[-1].problem = "the runner gave no such output"
                continue
            if pytorch is not None:
                stats.append(compare_against_pytorch(output, got[output], want[output], pytorch[k][output], tol, rule))
            else:
                stats.append(compare_output(output, got[output], want[output], tol))
        report.cases[case.name] = stats
        if case.positions is not None:
            for output in outputs:  # the first output with one row per token: error by position
                errors = token_errors(got.get(output, np.zeros(0)), want[output])
                if errors is not None and errors.shape == case.positions.shape:
                    decided = next(st for st in stats if st.output == output)
                    if decided.bound is not None:  # the rule against PyTorch decided: the plot draws its bound
                        with np.errstate(divide="ignore", invalid="ignore"):
                            ratios = np.nan_to_num(errors / decided.bound, nan=0.0, posinf=np.inf)
                    else:
                        ratios = token_limit_ratios(got[output], want[output], tol)
                    report.position_error.add(case.positions, errors, ratios)
                    break
    if report.failures():
        report.status = "FAIL"
    return report
