"""``check()``: open the file, pick the reference, make the inputs, then the reference and the runners
take turns: the reference computes every case and is freed, then each runner runs and is freed,
then each rotary node alone is swept over every position on every runner.
"""

from __future__ import annotations

import os
import time

import numpy as np
import onnx

from rope_export.check import cache_rows
from rope_export.check.compare import compare_against_pytorch, compare_output, token_errors, token_limit_ratios
from rope_export.check.graph import rotary_nodes, rotary_slices
from rope_export.check.inputs import InputPlan, describe_plan, find_vocab, input_role, stress_cases, user_cases
from rope_export.check.layer_errors import compare_layers, layer_outputs, pytorch_layer_errors
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
from rope_export.common.bounds import format_bytes
from rope_export.exporting.core import DTYPES
from rope_export.op.tolerances import against_pytorch, for_layers, tolerance

PRECISIONS = ("auto", "fp32", "fp64", "none")


def _raw_positions(mf: ModelFile) -> bool:
    """Whether a standard/contrib rotary node reads position_ids straight from the graph's input
    (lowered with --trust-positions): then positions outside the caches are not legal for the file."""
    inputs = {s.name for s in mf.inputs}
    return any(rn.kind in ("onnx", "ort") and rn.position_ids in inputs for rn in rotary_nodes(mf.proto.graph))


def check(
    model: onnx.ModelProto | str | os.PathLike,
    runners: tuple[str, ...] = RUNNERS,
    *,
    reference: str | os.PathLike | None = None,
    hf_config: str | os.PathLike | None = None,
    weights: str | os.PathLike | None = None,
    seed: int | None = None,
    random_weights: bool = False,
    inputs: list[str] | None = None,
    batch: int | None = None,
    seq: int | None = None,
    past: int | None = None,
    long_seq: int | None = None,
    sweep: bool = True,
    reference_block=None,
    module=None,
    args=None,
    kwargs: dict | None = None,
    plugin_library: str | None = None,
    memory_limit_gb: float | None = None,
    max_in_memory_gb: float | None = None,
    piece_limit_gb: float | None = None,
    precision: str = "auto",
    progress=None,
) -> CheckReport:
    """Run every runner on the file and compare with its reference (see ``rope_export.check``).

    ``module`` (with ``args``/``kwargs``, the example it was exported with): the PyTorch module a file of
    ``export_module`` came from, run on every case as the reference (``check.module_reference``).
    ``precision``: the layer-streamed reference of a transformers causal LM (``references.choose_reference``)."""
    if precision not in PRECISIONS:
        raise CheckError(f"unknown reference precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    say = progress or (lambda message: None)
    runners = tuple(runners)
    check_runner_names(runners)
    if reference is not None and hf_config is not None:
        raise CheckError("give either --reference OTHER.onnx or --hf CONFIG, not both")
    limit = memory_limit_bytes(memory_limit_gb)
    max_in_memory = MAX_IN_MEMORY if max_in_memory_gb is None else int(max_in_memory_gb * 1e9)
    limits = Limits(limit, max_in_memory, None if piece_limit_gb is None else int(piece_limit_gb * 1e9))
    say(f"opening {model if not isinstance(model, onnx.ModelProto) else 'the model'}")
    mf = ModelFile.open(model)
    source = file_source(mf)
    preset = hf_info = None
    metadata_notes = []
    try:  # the RoPE configuration and sizes the file records, also used when another reference is named
        preset = read_preset_info(mf, limit) if source == "preset" else None
        hf_info = read_hf_info(mf, limit) if source == "transformers" else None
    except CheckError as exc:
        if reference is None and hf_config is None:
            raise
        metadata_notes.append(f"the file's metadata is not used: {exc}")
    example = read_example(mf) if not inputs else None
    if module is not None:
        if reference is not None or hf_config is not None:
            raise CheckError("give module= or --reference/--hf, not both")
        ref, notes = ModuleReference(mf, module, args, kwargs), []
        ref.weight_bytes = mf.weight_bytes
    elif source == "diffusers" and reference is None and hf_config is None:
        from rope_export.check.diffusers_reference import DiffusersReference

        ref, notes = DiffusersReference(mf), []
        ref.weight_bytes = mf.weight_bytes
    elif example is not None and source is None and reference is None and hf_config is None:
        ref, notes = RecordedReference(mf, example, limits), []
        ref.weight_bytes = mf.weight_bytes
    else:
        ref, notes = choose_reference(mf, source=source, preset=preset, hf_info=hf_info, reference_path=reference,
                                      hf_config=hf_config, weights=None if weights is None else str(weights),
                                      seed=seed, random_weights=random_weights, reference_block=reference_block,
                                      precision=precision, limits=limits)
    notes = metadata_notes + notes
    if mf.contrib_ops:
        notes.append(f"onnxruntime contrib ops ({', '.join(mf.contrib_ops)}): onnx.checker checked the rest of the "
                     "graph, onnxruntime's session creation checks them; onnx.reference, the CPU twin and TensorRT "
                     "have no kernels for them")
    dtype = (preset or hf_info).dtype if (preset or hf_info) else _file_dtype(mf)
    layers = _layers(mf)
    tol = for_layers(tolerance("block", DTYPES[dtype]), layers)
    rope = preset.rope if preset else (hf_info.rope if hf_info else None)
    position_limit = preset.position_limit if preset else (hf_info.position_limit if hf_info else None)
    position_limit = position_limit or ref.position_limit

    slices, slice_notes = rotary_slices(mf)
    notes += slice_notes
    stored_rows = [int(mf.initializer(s.tables["cos"]).dims[0]) for s in slices if s.tables]
    # per-token caches cut from a table (Meta's freqs_cis): the positions it has rows for
    stored_rows += [s.table_rows for s in slices if not s.tables and not s.chosen.position_ids and s.table_rows]
    if position_limit is None and stored_rows:
        position_limit = min(stored_rows)
    say("comparing every row of the stored cos/sin caches")
    ropes, rope_notes = slice_ropes(mf, slices, rope, hf_info.rope_by_layer_type if hf_info else {},
                                    hf_info.layer_types if hf_info else [])
    notes += rope_notes
    tables = cache_rows.check_tables(mf, rope, slices, position_limit, ropes)

    past_end = not _raw_positions(mf) and (
        (preset is not None and not preset.rope.seq_len_dependent)
        or (source is None and bool(stored_rows) and all(s.tables for s in slices)))
    if past_end and isinstance(ref, (ModuleReference, OnnxFileReference)):
        past_end = False  # the file passes such tokens through; a module or plain export indexes its tables with them
        notes.append(f"no case past the end of the positions: the reference ({ref.label}) has no pass-through for "
                     "them")
    vocab = find_vocab(mf) or (hf_info.config.get("vocab_size") if hf_info else None) or ref.vocab
    positions_in = tuple(dict.fromkeys(s.name for sl in slices for s in sl.position_inputs if len(s.dims or ()) == 2))
    plan = InputPlan(**{k: v for k, v in dict(batch=batch, seq=seq, past=past, long_seq=long_seq).items()
                        if v is not None}, position_limit=position_limit, past_end_allowed=past_end,
                     vocab=vocab if isinstance(vocab, int) else None, position_inputs=positions_in,
                     original_context=rope.original_max_position_embeddings if rope is not None else None)
    for name in ("batch", "seq", "long_seq"):
        if getattr(plan, name) < 1:
            raise CheckError(f"--{name.replace('_', '-')} must be at least 1")
    if plan.past < 0:
        raise CheckError("--past must be 0 or more")
    if inputs:
        cases, described = user_cases(list(inputs), mf), f"the user's feeds ({', '.join(map(str, inputs))})"
    elif hasattr(ref, "cases"):  # a reference with inputs of its own (a diffusers denoiser's latent sizes)
        cases, described = ref.cases(mf)
    else:
        cases, case_notes = stress_cases(mf, plan, limit)
        notes += case_notes
        described = describe_plan(plan)
    if example is not None:  # the example export_module ran the module on: its eager outputs are in the file
        cases.append(example.case())
        described += f"; and the example recorded at export (case {example.case().name})"
    if source == "transformers" and plan.vocab is None and not inputs:
        notes.append("the vocabulary size was not found; token ids are drawn below 2")

    started = time.perf_counter()
    try:
        expected = ref.outputs(cases, say)
    except CheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - the reference refusing these inputs is the file's problem
        raise CheckError(f"the reference ({ref.label}) cannot run the inputs: {first_line(exc)}") from None
    say(f"reference done in {time.perf_counter() - started:.1f} s")
    measured = bool(getattr(ref, "streams", lambda: False)())  # after the run: a stream that could not run fell back
    rule = against_pytorch(DTYPES[dtype]) if measured else None
    notes += [ref.fallback_note] if getattr(ref, "fallback_note", "") else []
    if measured:
        notes.append(f"pass rule, measured: {rule.describe()} (rope_export.op.tolerances.against_pytorch)")
    elif layers > 1:
        notes.append(f"tolerance: one block's times sqrt({layers} layers) (rope_export.op.tolerances.for_layers): no "
                     "higher-precision reference for this file")
    layer_names, pytorch_layers = [], None
    if measured and ref.reference_states:
        layer_names, why = layer_outputs(mf.proto.graph, len(ref.reference_states[0]))
        if layer_names:
            mf.add_layer_outputs(layer_names, next(s.elem_type for s in mf.outputs if s.name == "logits"))
            pytorch_layers = pytorch_layer_errors(ref.reference_states, ref.pytorch_states)
        else:
            notes.append(f"no error per decoder layer: {why}")
    free_memory(mf.weight_bytes)
    compared_outputs = ref.expected_outputs(mf)
    missing = [o.name for o in mf.outputs if o.name not in compared_outputs]
    if missing:
        notes.append(f"outputs not compared (the reference does not produce them): {', '.join(missing)}")

    reports = []
    for i, name in enumerate(runners, 1):
        if name == ref.golden_runner:
            reports.append(RunnerReport(name, "golden", "the reference the other runners are compared with"))
            continue
        say(f"[{i}/{len(runners)}] {name}: preparing")
        try:
            runner, note = make_runner(name, mf, plugin_library=plugin_library, cases=cases, limits=limits)
        except Skip as skip:
            reports.append(RunnerReport(name, "skipped", str(skip)))
            continue
        except Exception as exc:  # noqa: BLE001 - a runner that cannot load the file fails, named
            reports.append(RunnerReport(name, "FAIL", first_line(exc)))
            continue
        say(f"[{i}/{len(runners)}] {name}: running {len(cases)} cases{note}")
        started = time.perf_counter()
        try:
            prefix = f"[{i}/{len(runners)}] {name}: "
            actual, latency = run_cases(runner, cases, lambda message, prefix=prefix: say(prefix + message))
        except Skip as skip:  # a piece onnxruntime has no kernel for
            reports.append(RunnerReport(name, "skipped", str(skip)))
            continue
        except Exception as exc:  # noqa: BLE001 - a runner that crashes is a failed comparison, named
            reports.append(RunnerReport(name, "FAIL", first_line(exc)))
            continue
        finally:
            if isinstance(runner, StreamedRunner):
                note = note.rstrip(")") + f"; {format_bytes(runner.kept_bytes)} of values kept between pieces)"
            del runner
            mf.release()
            free_memory(mf.weight_bytes)
        say(f"[{i}/{len(runners)}] {name}: done in {time.perf_counter() - started:.1f} s")
        pytorch = ref.pytorch_outputs if measured else None
        reports.append(_compare(name, note, latency, cases, actual, expected, compared_outputs, tol, pytorch, rule))
        if pytorch_layers is not None:
            reports[-1].layers = compare_layers(name, actual, [c.name for c in cases], ref.reference_states,
                                                pytorch_layers, rule)

    if sweep and slices and getattr(ref, "sweep_note", ""):
        notes.append(ref.sweep_note)
    elif sweep and slices:
        results, sweep_notes = cache_rows.sweep(
            mf, slices, runners, ropes=ropes, position_limit=position_limit, out_of_range_allowed=past_end,
            plugin_library=plugin_library, max_in_memory=max_in_memory, say=say)
        notes += sweep_notes
        for r in reports:
            r.sweep = results.get(r.runner)
            if r.sweep is not None and r.sweep.status == "FAIL":
                r.status = "FAIL"
    elif not slices and not tables:
        notes.append("no rotary node could be run alone (none in the file, or none with static head sizes); the "
                     "positions are covered by the stress cases only")
    if mf.external:
        notes.append(f"weights: {format_bytes(mf.weight_bytes)} in external data, read by each runner from the "
                     "path in turn")
    return CheckReport(
        model=mf.label, reference=ref.label, against=_short(ref), independent=ref.independent, dtype=dtype,
        tolerance=tol, rule=rule, pytorch_layers=_max_per_layer(pytorch_layers), runners=reports,
        tables=tables, inputs=described, cases=[c.name for c in cases], notes=notes,
        preset=preset.preset.name if preset else "", sweep_tolerance=tolerance("op", DTYPES[dtype]),
        weights=getattr(ref, "weights_source", {}))


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
