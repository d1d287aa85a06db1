"""Comparison tolerances: the one place they are set, and why.

Two kinds of comparison:

* ``op``: two implementations of the rotary op contract on the same inputs. Both compute in
  float32 and round once to the storage dtype, so they differ only by float32 rounding order
  (FMA or not) and by that final rounding landing one unit in the last place (ulp) apart.
  Tolerance: about two storage ulps. fp32: 1e-5; fp16 (ulp 2^-10 ~ 9.8e-4): 2e-3;
  bf16 (ulp 2^-7 ~ 7.8e-3): 1.6e-2.
* ``block``: a whole attention block (projections, softmax, matmuls) run by two runtimes. In half
  precision each matmul accumulates with a different order and rounding, so errors of a few
  ulps of the *output scale* are normal; the absolute part is set for outputs of order 1, and an
  output whose RMS is larger gets it times that RMS (``at_scale_of``): a logit near zero carries the
  rounding of the large terms that cancelled to make it.

A whole model (a causal LM of L such blocks) is held to the block tolerance times sqrt(L)
(``for_layers``): each block's rounding differences are independent of the others', so they add in
quadrature. Measured: a Llama-3.2-1B-shaped model (16 layers, random weights) in fp16 differs
between onnxruntime CPU and transformers by up to 1.9e-2 in its logits (mean 2.4e-3), inside
4 x 1e-2 and outside the single-block 1e-2. Three Llama-3.1-8B-shaped layers (hidden 4096, logits
of RMS 1.3, max 7.4) differ by up to 2.1e-2 on a 128-token sequence, while transformers itself in
fp16 differs from its own fp32 run by 2.4e-2 there: inside 1.3 x sqrt(3) x 1e-2, outside
sqrt(3) x 1e-2.

float64 (the cos/sin tables of a file of plain ops that stores them so; the rotary op itself takes no
float64) is held to float32's tolerances: a value stored wider is at least as exact as the float32 the
contract computes in.

A value passes when ``|a - b| <= atol + rtol * |b|`` (numpy.allclose's rule).

The sqrt(L) rule is a guess about how rounding adds up. Where a higher-precision reference exists
(a transformers file in half precision: ``check.layer_stream`` runs the same weights in float32),
check measures instead: per output and case, error(artefact vs the float32 reference) is held to
``PYTORCH_FACTOR`` times error(transformers in the file's dtype vs the same reference), plus a floor
of one ``op`` tolerance at the output's scale (``against_pytorch``). The factor is 2: onnxruntime and
PyTorch round every op's output to the same dtype, but in other orders (fused kernels, fp32 GEMM
accumulation of fp16 weights), so either may be the closer one by a few ulps; a defect (a wrong row,
a missing scale) costs orders of magnitude, not a factor. The floor covers outputs PyTorch gets
(nearly) exact, where any other rounding order would fail a pure ratio. The same bound is the
"envelope" the per-layer errors are held to. sqrt(L) stays for files without such a reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def allclose(self, actual, expected) -> bool:
        import numpy as np

        a = np.asarray(actual, dtype=np.float64)
        b = np.asarray(expected, dtype=np.float64)
        return bool(np.all(np.abs(a - b) <= self.atol + self.rtol * np.abs(b)))

    def at_scale_of(self, expected) -> Tolerance:
        """This tolerance for an output like ``expected``: the absolute part times its RMS when that is
        above 1 (finite values only), the relative part as it is."""
        import numpy as np

        b = np.asarray(expected, dtype=np.float64)
        finite = b[np.isfinite(b)]
        rms = float(np.sqrt(np.mean(finite * finite))) if finite.size else 0.0
        return Tolerance(self.atol * max(1.0, rms), self.rtol)


TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "op": {
        "float32": Tolerance(atol=1e-5, rtol=1e-5),
        "float64": Tolerance(atol=1e-5, rtol=1e-5),
        "float16": Tolerance(atol=2e-3, rtol=2e-3),
        "bfloat16": Tolerance(atol=1.6e-2, rtol=1.6e-2),
    },
    "block": {
        "float32": Tolerance(atol=1e-4, rtol=1e-4),
        "float64": Tolerance(atol=1e-4, rtol=1e-4),
        "float16": Tolerance(atol=1e-2, rtol=1e-2),
        "bfloat16": Tolerance(atol=6e-2, rtol=6e-2),
    },
}


def tolerance(kind: str, dtype: str) -> Tolerance:
    """``kind`` is "op" or "block"; ``dtype`` a name such as "float16" (torch dtypes accepted)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return TOLERANCES[kind][name]
    except KeyError:
        raise KeyError(
            f"no tolerance for kind={kind!r}, dtype={name!r}; kinds: {sorted(TOLERANCES)}, "
            f"dtypes: {sorted(TOLERANCES['op'])}"
        ) from None


PYTORCH_FACTOR = 2.0  # how much worse than PyTorch in the file's dtype an artefact may be (see the module doc)


@dataclass(frozen=True)
class AgainstPyTorch:
    """The bound on error(artefact vs higher-precision reference), given PyTorch's own error in the file's dtype."""

    factor: float
    floor: float  # for outputs of order 1; times the reference's RMS where that is above 1

    def bound(self, pytorch_error: float, scale: float = 1.0) -> float:
        return self.factor * pytorch_error + self.floor * max(1.0, scale)

    def describe(self) -> str:
        return (f"error <= {self.factor:g} x PyTorch's own error in the file's dtype + {self.floor:g} "
                "(x the output's RMS where above 1), both against the float32 reference")


def against_pytorch(dtype: str) -> AgainstPyTorch:
    """The measured rule for a file of ``dtype`` (module doc): PYTORCH_FACTOR, floor one op tolerance."""
    return AgainstPyTorch(PYTORCH_FACTOR, tolerance("op", dtype).atol)


def for_layers(tol: Tolerance, layers: int) -> Tolerance:
    """The tolerance of ``layers`` stacked blocks: the block's, times sqrt(layers) (see the module doc)."""
    scale = math.sqrt(max(1, int(layers)))
    return Tolerance(tol.atol * scale, tol.rtol * scale)
