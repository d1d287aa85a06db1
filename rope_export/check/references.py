"""What each runner is compared with, chosen from the file (or named by the user).

* a preset export: the PyTorch block rebuilt from the metadata (preset, dtype, seed, cache length);
* an ``export --hf`` file, or ``--hf CONFIG [--weights DIR]``: the transformers model rebuilt from
  the config and weights the file records (random weights: the same seed), or for a file that
  records none the checkpoint beside the config (``check.weights``: export --hf's rule), logits and
  every present key/value compared;
* ``--reference OTHER.onnx``: another ONNX file run by onnxruntime, inputs and outputs matched by name;
* nothing to go on: ``onnx-reference`` is the golden and the other runners are compared with it
  (the report says so: they are compared with each other, not with PyTorch).

A reference computes every case's outputs, then frees what it built (``outputs``), so that at real
sizes the reference and the runners take turns with the memory.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np

from rope_export.check.inputs import input_role
from rope_export.check.metadata import HFInfo, PresetInfo
from rope_export.check.model_file import CheckError, ModelFile, TensorSpec, free_memory
from rope_export.check.runners import Limits, Skip, first_line, make_runner, run_cases
from rope_export.check.weights import choose_weights
from rope_export.exporting.core import DTYPES, INPUT_NAMES, OUTPUT_NAMES


class Reference:
    """Base: ``label`` names it in the report; ``independent`` is False when it is one of the runners."""

    label = ""
    independent = True
    position_limit: int | None = None  # the position range the reference knows of (transformers' config)
    vocab: int | None = None
    weight_bytes = 0  # of the file: above model_file.BIG_WEIGHTS memory is collected after the reference ran
    golden_runner: str | None = None  # the runner that serves as the reference (peer mode)

    def expected_outputs(self, mf: ModelFile) -> list[str]:
        return [s.name for s in mf.outputs]

    def outputs(self, cases, say) -> list[dict[str, np.ndarray]]:
        raise NotImplementedError


def _require_outputs(mf: ModelFile, names, what: str) -> None:
    have = {s.name for s in mf.outputs}
    missing = [n for n in names if n not in have]
    if missing:
        raise CheckError(f"{mf.label} has no graph output {', '.join(map(repr, missing))}, which {what} produces: the "
                         f"file is incomplete (its outputs: {sorted(have)}); re-export it")


def _require_int64_positions(mf: ModelFile, what: str) -> None:
    for spec in mf.inputs:
        if input_role(spec) == "position_ids" and spec.type_name != "int64":
            raise CheckError(f"{mf.label}: input {spec.name!r} is {spec.type_name}; {what} takes int64 position ids "
                             "(the op contract): re-export the file, or cast inside the graph")


class PresetReference(Reference):
    def __init__(self, mf: ModelFile, info: PresetInfo, block=None):
        self.info, self.block = info, block
        self.label = f"PyTorch (preset {info.preset.name}, {info.dtype}, seed {info.seed})"
        names = [s.name for s in mf.inputs]
        expected = list(INPUT_NAMES[: 4 if info.decode else 2])
        if names != expected:
            raise CheckError(f"{mf.label}: inputs {names} are not the preset block's {expected} (in that order); the "
                             "file was changed after export: re-export it or give --reference")
        _require_int64_positions(mf, "the preset block")
        _require_outputs(mf, OUTPUT_NAMES, "the preset block")
        self.input_names = expected

    def expected_outputs(self, mf):
        return list(OUTPUT_NAMES)

    def outputs(self, cases, say):
        import torch

        from rope_export.runtimes.contract_runners import to_numpy, to_torch

        info = self.info
        say(f"running {self.label} on {len(cases)} cases")
        block = self.block or info.preset.build_block(DTYPES[info.dtype], seed=info.seed, cache_len=info.cache_len)
        results = []
        with torch.no_grad():
            for case in cases:
                outs = block(*(to_torch(case.feeds[n]) for n in self.input_names))
                results.append(dict(zip(OUTPUT_NAMES, (to_numpy(o) for o in outs), strict=True)))
        del block
        free_memory(self.weight_bytes)
        return results


# -- transformers --------------------------------------------------------------------------------

def _config_from(source):
    """A transformers config from a dict (the file's metadata) or a local path (--hf)."""
    from rope_export import hf

    try:
        if isinstance(source, dict):
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "config.json").write_text(json.dumps(source))
                return hf.load_hf_config(tmp)
        return hf.load_hf_config(source)
    except (ValueError, OSError) as exc:
        raise CheckError(f"the transformers config {'in the metadata' if isinstance(source, dict) else source} cannot "
                         f"be read: {exc}") from None


def transformers_config(config_source, weights: str | None):
    """(config, position limit, vocabulary size) of a transformers reference, its weights folder there; a
    CheckError naming the fix without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise CheckError("comparing with transformers needs it installed: pip install 'rope-export[hf]'; or "
                         "compare with --reference OTHER.onnx") from None
    if weights is not None and not Path(weights).is_dir():
        raise CheckError(f"the weights folder {weights} (recorded in the file or given with --weights) is not "
                         "there; pass --weights DIR with the model's *.safetensors")
    config = _config_from(config_source)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    # the position limit: for a file without metadata
    return config, limit if isinstance(limit, int) and limit > 0 else None, getattr(text, "vocab_size", None)


class TransformersReference(Reference):
    """The causal LM (or one attention layer) of transformers, with past keys/values from the feeds."""

    def __init__(self, mf: ModelFile, info: HFInfo, config_source, weights: str | None):
        self.info, self.weights = info, weights
        self.config, self.position_limit, self.vocab = transformers_config(config_source, weights)
        self.layer_kind = info.kind == "hf-attention"
        where = "random weights, seed " + str(info.seed) if weights is None else f"weights {weights}"
        self.label = f"transformers {type(self.config).__name__.removesuffix('Config')} ({info.dtype}, {where})"
        _require_int64_positions(mf, "transformers")
        names = {s.name for s in mf.inputs}
        if self.layer_kind:
            expected_in, expected_out = set(INPUT_NAMES), list(OUTPUT_NAMES)
            from rope_export import hf

            if getattr(hf, "AttentionWithCache", None) is None:
                raise _NoReference("this rope_export.hf has no attention-layer wrapper to rebuild one layer")
        else:
            past = [re.fullmatch(r"past_key_values\.(\d+)\.(key|value)", s.name) for s in mf.inputs]
            self.layers = sorted({int(m.group(1)) for m in past if m})
            expected_in = {"input_ids", "position_ids", *(f"past_key_values.{i}.{kv}" for i in self.layers
                                                          for kv in ("key", "value"))}
            optional = {"attention_mask"}
            if "position_ids" not in names:  # optimum's Gemma files: positions follow the past length
                expected_in.discard("position_ids")
            expected_out = ["logits", *(f"present.{i}.{kv}" for i in self.layers for kv in ("key", "value"))]
            names -= optional & names
        if expected_in - names:
            raise CheckError(f"{mf.label}: inputs {sorted(names)} are not a transformers export's "
                             f"{sorted(expected_in)}; compare with --reference OTHER.onnx instead")
        if names - expected_in:  # e.g. recurrent states of a hybrid model: not what this reference feeds
            raise _NoReference(f"the file has inputs {sorted(names - expected_in)} that the transformers reference "
                               "does not feed (only token ids, positions, a mask and past keys/values)")
        _require_outputs(mf, expected_out, "the transformers model")
        self.expected = expected_out

    def expected_outputs(self, mf):
        return self.expected

    def _build(self):
        from rope_export import hf

        try:
            return hf.build_hf_model(self.config, self.weights, dtype=self.info.dtype, seed=self.info.seed)
        except (ValueError, OSError) as exc:
            raise CheckError(f"transformers cannot build the model: {exc}") from None

    # "fp32"/"fp64": a causal LM is run layer by layer in that precision (the reference) and in the file's
    # dtype (PyTorch's own error), with the same weights (``check.layer_stream``); None: one run in the file's dtype
    precision: str | None = None
    pytorch_outputs: list[dict[str, np.ndarray]] | None = None  # PyTorch in the file's dtype, per case
    reference_states: list[list[np.ndarray]] | None = None  # [case][layer]: hidden state after each layer
    pytorch_states: list[list[np.ndarray]] | None = None
    stream = None  # the check.layer_stream.LayerStream that ran, for check.layer_ops

    def streams(self) -> bool:
        return self.precision is not None and not self.layer_kind

    fallback_note = ""  # why the layer-streamed reference could not run, when it could not

    def outputs(self, cases, say):
        if self.streams():
            try:
                return self._streamed(cases, say)
            except (CheckError, RuntimeError) as why:  # a checkpoint not readable by name, a model it cannot split
                self.fallback_note = (f"no {self.precision} reference layer by layer ({first_line(why)}): compared "
                                      f"with one run in {self.info.dtype} by the sqrt(layers) tolerance")
                self.precision = self.pytorch_outputs = self.reference_states = self.pytorch_states = None
                self.label = self.label.split(", run layer by layer")[0]
        return self._whole(cases, say)

    def _streamed(self, cases, say):
        import torch
        import transformers

        from rope_export.check.layer_stream import LayerStream
        from rope_export.check.layer_weights import CheckpointWeights, RandomWeights, skeleton
        from rope_export.hf.families import MODEL_TYPES
        from rope_export.hf.loading import EXPERTS_IMPLEMENTATION, check_config

        try:
            check_config(self.config)
        except ValueError as exc:
            raise CheckError(f"transformers cannot build the model: {exc}") from None
        model_type = self.config.model_type
        auto = getattr(transformers, MODEL_TYPES[model_type].auto_class if model_type in MODEL_TYPES else
                       "AutoModelForCausalLM")
        options = dict(attn_implementation="eager", experts_implementation=EXPERTS_IMPLEMENTATION)
        file_dtype, ref_dtype = DTYPES[self.info.dtype], {"fp32": torch.float32, "fp64": torch.float64}[self.precision]
        if self.weights is not None:
            source = CheckpointWeights(self.weights, skeleton(auto, self.config, file_dtype, options))
        else:
            source = RandomWeights(auto, self.config, file_dtype, self.info.seed, options)
        say(f"running {self.label} on {len(cases)} cases")
        self.stream = LayerStream(auto, self.config, source, [ref_dtype, file_dtype], [c.feeds for c in cases],
                                  self.layers, options)  # kept: a layer runs again to find the op that loses precision
        reference, pytorch = self.stream.run(say)
        self.pytorch_outputs, self.pytorch_states = pytorch.outputs, pytorch.layer_states
        self.reference_states = reference.layer_states
        free_memory(self.weight_bytes)
        return reference.outputs

    def _whole(self, cases, say):
        import torch

        say(f"building {self.label}")
        model = self._build()
        say(f"running {self.label} on {len(cases)} cases")
        results = []
        with torch.no_grad():
            for case in cases:
                results.append(self._layer(model, case) if self.layer_kind else self._causal_lm(model, case))
        del model
        free_memory(self.weight_bytes)
        return results

    def _causal_lm(self, model, case) -> dict[str, np.ndarray]:
        from transformers.cache_utils import DynamicCache

        from rope_export.hf.cache_io import returned_cache, with_cache
        from rope_export.runtimes.contract_runners import to_numpy, to_torch

        feeds = {k: to_torch(v) for k, v in case.feeds.items()}
        cache = DynamicCache()
        for i in self.layers:
            key, value = feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"]
            if key.shape[2]:
                cache.update(key, value, i)
        kwargs = {k: feeds[k] for k in ("attention_mask", "position_ids") if k in feeds}
        # without position_ids transformers numbers the new tokens from the past length, as a file without
        # that input does (the cases' masks are all ones, so the mask and the past agree)
        out = with_cache(model, cache, input_ids=feeds["input_ids"], **kwargs)
        result = {"logits": to_numpy(out.logits)}
        layers = returned_cache(out).layers
        for i in self.layers:
            result[f"present.{i}.key"] = to_numpy(layers[i].keys)
            result[f"present.{i}.value"] = to_numpy(layers[i].values)
        return result

    def _layer(self, model, case) -> dict[str, np.ndarray]:
        from rope_export import hf
        from rope_export.runtimes.contract_runners import to_numpy, to_torch

        module = hf.AttentionWithCache(model, self.info.layer or 0).eval()
        outs = module(*(to_torch(case.feeds[n]) for n in INPUT_NAMES))
        return dict(zip(OUTPUT_NAMES, (to_numpy(o) for o in outs), strict=True))


class _NoReference(Exception):
    """The file's own reference cannot be rebuilt here; check falls back to comparing runners."""


# -- another ONNX file ---------------------------------------------------------------------------

def _describe(spec: TensorSpec) -> str:
    return f"{spec.name} {spec.type_name} {list(spec.dims) if spec.dims is not None else '[?]'}"


class OnnxFileReference(Reference):
    """``--reference OTHER.onnx`` run by onnxruntime on the same feeds."""

    def __init__(self, mf: ModelFile, path, limits: Limits):
        try:
            self.other = ModelFile.open(path)
        except CheckError as exc:
            raise CheckError(f"--reference: {exc}") from None
        self.label = f"onnxruntime on {self.other.label}"
        self.limits = limits
        mine = {s.name: s for s in mf.inputs}
        theirs = {s.name: s for s in self.other.inputs}
        if set(mine) != set(theirs):
            raise CheckError(f"--reference {self.other.label}: its inputs {sorted(theirs)} do not match the file's "
                             f"{sorted(mine)}; give a reference with the same input names")
        for name, spec in mine.items():
            other = theirs[name]
            same_rank = spec.dims is None or other.dims is None or len(spec.dims) == len(other.dims)
            static_ok = same_rank and all(not (isinstance(a, int) and isinstance(b, int) and a != b)
                                          for a, b in zip(spec.dims or (), other.dims or (), strict=False))
            if spec.elem_type != other.elem_type or not static_ok:
                raise CheckError(f"--reference {self.other.label}: input {_describe(other)} does not match the file's "
                                 f"{_describe(spec)}")
        common = [s.name for s in mf.outputs if s.name in {o.name for o in self.other.outputs}]
        if not common:
            raise CheckError(f"--reference {self.other.label}: no output name in common with the file (its outputs: "
                             f"{[o.name for o in self.other.outputs]}; the file's: {[o.name for o in mf.outputs]})")
        self.common = common

    def expected_outputs(self, mf):
        return self.common

    def outputs(self, cases, say):
        say(f"running {self.label} on {len(cases)} cases")
        try:
            runner, note = make_runner("onnxruntime-cpu", self.other, limits=self.limits)
        except Skip as why:
            raise CheckError(f"--reference: onnxruntime cannot run it: {why}") from None
        if note:
            say(f"{self.label}:{note}")
        try:
            results, _ = run_cases(runner, cases, say)
        except Exception as exc:  # noqa: BLE001 - the reference file is the user's
            raise CheckError(f"--reference: onnxruntime failed on it: {first_line(exc)}") from None
        del runner
        free_memory(self.weight_bytes)
        return [{k: v for k, v in r.items() if k in self.common} for r in results]


# -- the runners among themselves ----------------------------------------------------------------

GOLDEN_ORDER = ("onnx-reference", "onnxruntime-cpu")


class GoldenRunnerReference(Reference):
    """No reference to rebuild: onnx.reference is the golden (onnxruntime CPU where it cannot run the file)."""

    independent = False

    def __init__(self, mf: ModelFile, limits: Limits, why: str):
        self.mf = mf
        reasons = []
        for name in GOLDEN_ORDER:
            try:
                self.runner, self.note = make_runner(name, mf, limits=limits)
            except Skip as skip:
                reasons.append(f"{name}: {skip}")
                continue
            self.golden_runner = name
            break
        else:
            raise CheckError(f"{mf.label}: {why}, and no runner can serve as the golden ({'; '.join(reasons)})")
        self.why = why
        self.label = (f"{self.golden_runner} (golden; {why}: the runners are compared with each other, not with "
                      "PyTorch)")

    def outputs(self, cases, say):
        say(f"running {self.golden_runner} (the golden) on {len(cases)} cases{self.note}")
        try:
            results, _ = run_cases(self.runner, cases, say)
        except Exception as exc:  # noqa: BLE001
            raise CheckError(f"{self.golden_runner}, the golden, cannot run the file: {first_line(exc)}") from None
        del self.runner
        free_memory(self.weight_bytes)
        return results


def choose_reference(mf: ModelFile, *, source: str | None, preset: PresetInfo | None, hf_info: HFInfo | None,
                     reference_path=None, hf_config=None, weights=None, seed: int | None = None,
                     random_weights: bool = False, reference_block=None, precision: str = "auto",
                     limits: Limits, task_reference: type | None = None) -> tuple[Reference, list[str]]:
    """The reference for this file and flags, and notes for the report.

    ``precision``: of a transformers causal LM's layer-streamed reference: "fp32", "fp64", "none" (one run in the
    file's dtype), or "auto" (fp32 for a half-precision file, else none). ``task_reference``: the reference of
    a file of another task (``check.task_reference.TaskReference``)."""
    notes: list[str] = []
    ref = _choose(mf, notes, source, preset, hf_info, reference_path, hf_config, weights, seed, random_weights,
                  reference_block, limits, task_reference)
    ref.weight_bytes = mf.weight_bytes
    if isinstance(ref, TransformersReference) and not ref.layer_kind:
        if precision == "auto":
            precision = "fp32" if ref.info.dtype in ("fp16", "bf16") else "none"
        if precision != "none" and precision != ref.info.dtype:
            ref.precision = precision
            ref.label += f", run layer by layer in {precision} and in {ref.info.dtype}"
    return ref, notes


def _choose(mf, notes, source, preset, hf_info, reference_path, hf_config, weights, seed, random_weights,
            reference_block, limits, task_reference=None) -> Reference:
    if reference_path is not None:
        return OnnxFileReference(mf, reference_path, limits)
    if hf_config is not None or (source == "transformers" and hf_info is not None):
        asked = dict(hf_config=hf_config, weights=weights, random_weights=random_weights, seed=seed)
        if hf_info is None:  # --hf on a file without transformers metadata: export --hf's rule
            choice = choose_weights(**asked)
            hf_info = HFInfo(_file_dtype(mf), choice.seed, "hf-causal-lm", {}, None, None)
        else:  # the weights the file records, unless told otherwise (and then a note says so)
            choice = choose_weights(recorded=hf_info.weights, recorded_seed=hf_info.seed, **asked)
            hf_info.seed = choice.seed
        if choice.note:
            notes.append(choice.note)
        try:
            # a file of another task than the causal LM (rope_export.hf.tasks): check.task_reference
            kind = task_reference if hf_info.kind == "hf-task" and task_reference else TransformersReference
            ref = kind(mf, hf_info, hf_config or hf_info.config, choice.folder)
            ref.weights_source = choice.to_dict()
            return ref
        except _NoReference as why:
            notes.append(f"transformers is not the reference: {why}")
            return GoldenRunnerReference(mf, limits, "no transformers reference for this file")
    if source == "preset" and preset is not None:
        return PresetReference(mf, preset, reference_block)
    return GoldenRunnerReference(mf, limits, "the file has no rope_export metadata and no --reference or --hf "
                                                    "was given")


def _file_dtype(mf: ModelFile) -> str:
    from rope_export.check.model_file import FLOAT_ELEM_TYPES

    for spec in [*mf.outputs, *mf.inputs]:
        name = FLOAT_ELEM_TYPES.get(spec.elem_type)
        if name in DTYPES:
            return name
    return "fp32"
