"""The diffusers zoo (``diffusers_zoo.py``): every transformer class of the installed diffusers, its rotations
counted through the recipe that fits it and, where it rotates, exported, each as recorded in
``diffusers_zoo_results.json`` (whose table is docs/diffusers.md's).

``make test`` counts one class of each kind (``FAST``: the float position ids of Flux, Wan's strided writes,
CogVideoX's tables as inputs, HunyuanVideo's and LTX-Video's masks, Lumina 2's complex product, a class that
does not rotate, one no recipe fits); the other counts and every export are slow (``make test-slow``).
``make diffusers-zoo`` re-records every class and re-renders the table.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("diffusers")

import diffusers_zoo  # noqa: E402
from diffusers_zoo_table import DOC, doc_table, load_results, render  # noqa: E402

RESULTS = load_results()
CLASSES = sorted(RESULTS)  # the installed diffusers' classes are listed by a slow test (importing them all takes ~7 s)
FAST = ("FluxTransformer2DModel", "WanTransformer3DModel", "CogVideoXTransformer3DModel",
        "HunyuanVideoTransformer3DModel", "LTXVideoTransformer3DModel", "Lumina2Transformer2DModel",
        "SanaTransformer2DModel", "SD3Transformer2DModel")
ROTATING = ("rotates", "exports", "export fails")


def _record(result: diffusers_zoo.ZooResult) -> None:
    path = os.environ.get("DIFFUSERS_ZOO_RECORD")
    if path:
        with open(path, "a") as sink:
            sink.write(json.dumps(result.as_dict()) + "\n")


def _recorded(name: str) -> dict:
    recorded = RESULTS.get(name)
    assert recorded is not None, f"{name} has no recorded result: run make diffusers-zoo"
    return recorded


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CLASSES])
def test_census_as_recorded(name):
    result = diffusers_zoo.census(name)
    _record(result)
    recorded = _recorded(name)
    if recorded["status"] in ROTATING:
        assert result.status == "rotates", result.reason
        assert (result.family, result.rotations, result.forms) == (recorded["family"], recorded["rotations"],
                                                                   recorded["forms"])
    else:
        assert (result.status, result.reason) == (recorded["status"], recorded["reason"])


def _export_param(name: str):
    marks = [pytest.mark.slow]
    if RESULTS[name]["status"] == "export fails":
        marks.append(pytest.mark.xfail(strict=True, reason=RESULTS[name]["reason"]))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_export_param(n) for n in sorted(RESULTS) if RESULTS[n]["status"] in ROTATING])
def test_a_rotating_class_exports_one_node_per_rotation_as_recorded(name):
    result = diffusers_zoo.exported(name)
    _record(result)
    assert result.status == "exports", result.reason  # an expected failure fails here (xfail strict)
    assert result.rotary_nodes == result.rotations == RESULTS[name]["rotations"] > 0
    assert result.reason == RESULTS[name]["reason"]  # both latent sizes compared; the axes made static, if any


@pytest.mark.slow
def test_every_transformer_class_of_the_installed_diffusers_is_recorded():
    assert CLASSES == diffusers_zoo.zoo_classes(), "run make diffusers-zoo to record the installed diffusers' classes"


def test_the_docs_table_is_rendered_from_the_records():
    assert doc_table(DOC.read_text()) == render(RESULTS), \
        "docs/diffusers.md's zoo table is not the one rendered from diffusers_zoo_results.json: run make diffusers-zoo"
