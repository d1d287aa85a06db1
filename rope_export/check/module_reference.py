"""PyTorch as the reference of a file ``export_module`` wrote (no preset, no transformers config).

* the example ``export_module`` recorded (``rope_export.module_example``: the example inputs and the
  module's eager outputs for them, at most ``blocks.export.EXAMPLE_LIMIT`` bytes): one more case,
  ``recorded-example``, on which every runner is compared with PyTorch; the other cases are compared
  with onnx-reference (the runners with each other);
* ``check(file, module=..., args=...)``: the module itself computes every case. The file's inputs are
  the example's tensors in order (``args``, then ``kwargs``; without an example, each input one
  positional argument), its outputs the module's output tensors in order.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile
from dataclasses import dataclass

import numpy as np

from rope_export.check.inputs import Case
from rope_export.check.model_file import CheckError, ModelFile
from rope_export.check.references import GoldenRunnerReference, Reference
from rope_export.check.runners import Limits, first_line

RECORDED_CASE = "recorded-example"
KEY = "module_example"


@dataclass
class RecordedExample:
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    module: str

    def case(self) -> Case:
        return Case(RECORDED_CASE, dict(self.inputs), None)


def read_example(mf: ModelFile) -> RecordedExample | None:
    """The recorded example, validated against the file's inputs and outputs, or None when there is none."""
    raw = mf.metadata.get(KEY)
    if not raw:
        return None
    try:
        with np.load(io.BytesIO(base64.b64decode(raw, validate=True)), allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (ValueError, binascii.Error, zipfile.BadZipFile, OSError) as exc:
        raise CheckError(f"{mf.label}: metadata rope_export.{KEY} is not the example export_module records "
                         f"({first_line(exc)}); re-export the file") from None
    inputs = {k.removeprefix("input/"): v for k, v in arrays.items() if k.startswith("input/")}
    outputs = {k.removeprefix("output/"): v for k, v in arrays.items() if k.startswith("output/")}
    want_in, want_out = [s.name for s in mf.inputs], [s.name for s in mf.outputs]
    if sorted(inputs) != sorted(want_in) or not outputs or set(outputs) - set(want_out):
        raise CheckError(f"{mf.label}: the recorded example has inputs {sorted(inputs)} and outputs {sorted(outputs)}, "
                         f"not the file's {want_in} and {want_out}: the file was changed after export; re-export it")
    return RecordedExample(inputs, outputs, mf.metadata.get("module", "the module"))


class RecordedReference(Reference):
    """The recorded eager outputs on the recorded example; onnx-reference (the golden) on the other cases."""

    independent = False
    short = "onnx-reference and PyTorch's recorded outputs"

    def __init__(self, mf: ModelFile, example: RecordedExample, limits: Limits):
        self.golden = GoldenRunnerReference(mf, limits, "no module given to rerun")
        self.example = example
        self.label = (f"PyTorch ({example.module}, eager outputs recorded at export) on case {RECORDED_CASE}; "
                      f"{self.golden.golden_runner} on the other cases (the runners compared with each other)")

    def expected_outputs(self, mf):
        return [s.name for s in mf.outputs if s.name in self.example.outputs]

    def outputs(self, cases, say):
        others = [c for c in cases if c.name != RECORDED_CASE]
        computed = iter(self.golden.outputs(others, say) if others else [])
        return [dict(self.example.outputs) if c.name == RECORDED_CASE else next(computed) for c in cases]


class ModuleReference(Reference):
    """The PyTorch module given to ``check``, run on every case."""

    def __init__(self, mf: ModelFile, module, args=None, kwargs=None):
        import torch

        if not isinstance(module, torch.nn.Module):
            raise CheckError(f"module= must be a torch.nn.Module, not {type(module).__name__}")
        self.module = module.eval()
        if args is None and not kwargs:
            self.structure = None
        else:
            args = () if args is None else tuple(args) if isinstance(args, (tuple, list)) else (args,)
            self.structure = (args, dict(kwargs or {}))
        self.input_names = [s.name for s in mf.inputs]
        self.output_names = [s.name for s in mf.outputs]
        self.label = f"PyTorch ({type(module).__name__}, given to check)"
        if self.structure is not None:
            leaves = self._leaves(self.structure)
            if len(leaves) != len(self.input_names):
                raise CheckError(f"the example args have {len(leaves)} tensors but the file has "
                                 f"{len(self.input_names)} inputs {self.input_names}; give the args it was exported "
                                 "with")

    @staticmethod
    def _leaves(structure):
        import torch
        from torch.utils._pytree import tree_flatten

        leaves, _ = tree_flatten(structure)
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    def _call_args(self, feeds: dict[str, np.ndarray]):
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten

        from rope_export.runtimes.contract_runners import to_torch

        tensors = iter(to_torch(feeds[n]) for n in self.input_names)
        if self.structure is None:
            return tuple(tensors), {}
        leaves, spec = tree_flatten(self.structure)
        args, kwargs = tree_unflatten([next(tensors) if isinstance(t, torch.Tensor) else t for t in leaves], spec)
        return args, kwargs

    def outputs(self, cases, say):
        import torch
        from torch.utils._pytree import tree_leaves

        from rope_export.runtimes.contract_runners import to_numpy

        say(f"running {self.label} on {len(cases)} cases")
        results = []
        with torch.no_grad():
            for case in cases:
                args, kwargs = self._call_args(case.feeds)
                outs = [t for t in tree_leaves(self.module(*args, **kwargs)) if isinstance(t, torch.Tensor)]
                if len(outs) != len(self.output_names):
                    raise CheckError(f"the module returns {len(outs)} tensors but the file has "
                                     f"{len(self.output_names)} outputs {self.output_names}")
                results.append(dict(zip(self.output_names, map(to_numpy, outs), strict=True)))
        return results

