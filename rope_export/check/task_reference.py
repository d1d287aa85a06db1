"""The reference of a file ``export --hf`` wrote for a task other than the causal LM (``rope_export.hf.tasks``),
and the cases it is checked on.

The file records its task, its component and the transformers class it was built as; the reference
rebuilds that class from the recorded config and weights (``check.weights``' rule), makes the task's
components (``Task.components``) and runs the file's one eagerly: transformers' own forward with the
feeds as keywords, its output fields (last hidden state, pooled output, logits) or, for a decoder
step, its logits and present keys/values.

The cases are an encoder's: a full batch, a batch padded on the right with rows of different
lengths, the same padded on the left (token ids), one long sequence, and one reaching the end of the
position range (where that is at most ``END_CASE_LIMIT`` tokens); a decoder step's: a first step, a
padded encoder output, a decode step with a past, and one at the last position. Sizes start from the
example the file was traced with (``rope_export.task_dims``: audio samples or frames, past).
"""

from __future__ import annotations

import json

import numpy as np

from rope_export.check.inputs import Case
from rope_export.check.metadata import HFInfo
from rope_export.check.model_file import CheckError, ModelFile, free_memory
from rope_export.check.references import Reference, _require_int64_positions, transformers_config

END_CASE_LIMIT = 1024  # an encoder's end-of-positions case runs a whole sequence of that many tokens at most
LENGTH_INPUTS = {"input_ids": "seq", "input_values": "samples", "input_features": "frames"}


class TaskReference(Reference):
    """transformers' model of the file's task, running the file's component eagerly."""

    def __init__(self, mf: ModelFile, info: HFInfo, config_source, weights: str | None):
        self.config, self.position_limit, self.vocab = transformers_config(config_source, weights)
        from rope_export.hf.task_io import MAX_DIM
        from rope_export.hf.tasks import TASKS, classes

        meta = mf.metadata
        self.task = TASKS.get(meta.get("task", ""))
        self.component = meta.get("component", "")
        if self.task is None or self.task.components is None or self.component not in self.task.parts:
            raise CheckError(f"{mf.label}: metadata rope_export.task {meta.get('task')!r} / component "
                             f"{self.component!r} is no task export rope-export knows; re-export the file")
        try:
            self.dims = {str(k): int(v) for k, v in json.loads(meta.get("task_dims") or "{}").items()}
        except (ValueError, TypeError, AttributeError):
            raise CheckError(f"{mf.label}: metadata rope_export.task_dims is not a table of sizes; re-export the "
                             "file") from None
        if any(not 0 <= size <= MAX_DIM for size in self.dims.values()):
            raise CheckError(f"{mf.label}: metadata rope_export.task_dims {self.dims} holds a size outside [0, "
                             f"{MAX_DIM}]; re-export the file")
        self.info, self.weights, self.architecture = info, weights, meta.get("hf_architecture")
        known = classes(self.task, self.config.model_type)
        if self.architecture not in known:
            raise CheckError(f"{mf.label}: metadata rope_export.hf_architecture {self.architecture!r} is not a "
                             f"{self.task.name} class of {self.config.model_type!r} ({', '.join(known) or 'none'});"
                             " re-export the file")
        where = "random weights, seed " + str(info.seed) if weights is None else f"weights {weights}"
        self.label = (f"transformers {self.architecture} ({self.task.name}, {self.component}; {info.dtype}, "
                      f"{where})")
        self.short = "transformers"
        _require_int64_positions(mf, "transformers")
        self.input_names = [s.name for s in mf.inputs]

    def outputs(self, cases, say):
        import torch

        from rope_export import hf
        from rope_export.hf.tasks import TaskChoice
        from rope_export.runtimes.contract_runners import to_numpy, to_torch

        say(f"building {self.label}")
        try:
            model = hf.build_hf_model(self.config, self.weights, dtype=self.info.dtype, seed=self.info.seed,
                                      model_class=TaskChoice(self.task, self.architecture, "").build_class)
        except (ValueError, OSError) as exc:
            raise CheckError(f"transformers cannot build the model: {exc}") from None
        parts = self.task.components(model, self.task.outputs, self.dims, self.info.seed)
        part = next(p for p in parts if p.name == self.component)
        if part.input_names != self.input_names:
            raise CheckError(f"the file's inputs {self.input_names} are not the {self.component}'s "
                             f"{part.input_names} (in that order); re-export the file or give --reference")
        say(f"running {self.label} on {len(cases)} cases")
        results = []
        with torch.no_grad():
            for case in cases:
                outs = part.module(*(to_torch(case.feeds[n]) for n in part.input_names))
                results.append({name: to_numpy(o) for name, o in zip(part.output_names, outs, strict=True)})
        del model, parts, part
        free_memory(self.weight_bytes)
        return results

    # -- the cases ------------------------------------------------------------------------------

    def own_cases(self, mf: ModelFile, plan) -> tuple[list[Case], list[str], str]:
        """(cases, notes, how they were made) for this file."""
        rng = np.random.default_rng(plan.seed)
        limit = self.position_limit
        specs = {s.name: s for s in mf.inputs}
        base = {**self.dims, "batch": plan.batch}
        notes: list[str] = []
        if "past" in base:  # a decoder step
            seq = min(plan.seq, limit or plan.seq)
            plans = [("first-step", {**base, "seq": seq, "past": 0}, None, 0),
                     ("padded-encoder-output", {**base, "batch": 3, "seq": seq, "past": 0}, "right", 0),
                     ("decode", {**base, "batch": 3, "seq": 1, "past": plan.past}, "right", plan.past)]
            if limit is not None and "position_ids" in specs:
                plans.append(("decode-end-of-positions", {**base, "seq": 1, "past": plan.past}, None, limit - 1))
        else:
            length = next((LENGTH_INPUTS[n] for n in specs if n in LENGTH_INPUTS), None)
            grow = {"seq": plan.seq, "samples": base.get("samples", 0), "frames": base.get("frames", 0)}
            full = {**base, **({length: grow[length]} if length else {})}
            plans = [("batch", full, None, 0), ("padded-right", {**full, "batch": 3}, "right", 0)]
            if length == "seq":
                plans.append(("padded-left", {**full, "batch": 3}, "left", 0))
                long_seq = min(plan.long_seq, limit or plan.long_seq)
                plans.append(("long-sequence", {**full, "batch": 1, "seq": long_seq}, None, 0))
                if limit is not None and long_seq < limit <= END_CASE_LIMIT:
                    plans.append(("end-of-positions", {**full, "batch": 1, "seq": limit}, None, 0))
                elif limit is not None and limit > END_CASE_LIMIT:
                    notes.append(f"no case reaches the end of the {limit} positions (a whole sequence past "
                                 f"{END_CASE_LIMIT} tokens); the rotary nodes alone are swept over every position")
            elif length is not None:
                plans.append(("long-input", {**full, "batch": 1, length: 4 * full[length]}, None, 0))
        cases = [self._case(name, sizes, pad, first, mf, rng) for name, sizes, pad, first in plans]
        described = (f"the {self.task.name} {self.component}'s cases from its traced example ("
                     + ", ".join(f"{k} {v}" for k, v in self.dims.items()) + "): padded batches, long inputs")
        return cases, notes, described

    def _case(self, name: str, sizes: dict[str, int], pad: str | None, first: int, mf: ModelFile, rng) -> Case:
        feeds, lengths = {}, _row_lengths(sizes, pad)
        for spec in mf.inputs:
            shape = tuple(d if isinstance(d, int) else sizes.get(str(d), None) for d in (spec.dims or ()))
            if spec.dims is None or None in shape:
                raise CheckError(f"{mf.label}: cannot size input {spec.name!r} {list(spec.dims or [])} from the "
                                 f"traced example's sizes {sizes}; pass --inputs feeds.npz")
            if spec.name.endswith("attention_mask"):
                value = _mask(shape, lengths, pad)
            elif spec.name == "input_ids":
                value = rng.integers(0, self.vocab or 2, shape)
            elif spec.name == "position_ids":
                value = np.broadcast_to(first + np.arange(shape[1]), shape).copy()
            elif spec.is_float:
                value = rng.standard_normal(shape, dtype=np.float32)
            else:
                value = np.zeros(shape)
            feeds[spec.name] = np.asarray(value).astype(spec.dtype)
        positions = None
        if "input_ids" in feeds:
            positions = np.broadcast_to(first + np.arange(feeds["input_ids"].shape[1]), feeds["input_ids"].shape)
        return Case(name, feeds, positions)


def _row_lengths(sizes: dict[str, int], pad: str | None) -> list[float]:
    """Each row's share of its mask: all of it, or (padded) 1, 2/3, 1/3 of it."""
    batch = sizes["batch"]
    return [1.0] * batch if pad is None else [1.0 - row / batch for row in range(batch)]


def _mask(shape, shares: list[float], pad: str | None) -> np.ndarray:
    mask = np.ones(shape, dtype=np.int64)
    length = shape[1]
    for row, share in enumerate(shares):
        keep = max(1, int(round(length * share)))
        if pad == "left":
            mask[row, : length - keep] = 0
        else:
            mask[row, keep:] = 0
    return mask
