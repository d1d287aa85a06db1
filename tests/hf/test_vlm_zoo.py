"""The VLM zoo: every image-text-to-text model type of transformers, tiny, its towers censused, exported whole
where rope-export has an entry for it (``vlm_zoo.check_type``).

What each type does is recorded in ``vlm_zoo_results.json``; every test checks its type against that record (the
same outcome, the same rotation counts, the same reason), so a change shows up as a failure to look at and record
again. ``make test`` runs one type of each outcome (``FAST``); the others are marked ``slow``. ``make vlm-zoo``
re-records every type and re-renders the table in docs/vision-language.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import vlm_zoo  # noqa: E402
from vlm_zoo_table import DOC, doc_table, load_results, render  # noqa: E402

RESULTS = load_results()
NOT_IN_ZOO = {
    "t5gemma2": "an encoder-decoder whose default config allocates 19 GB before any size can be shrunk",
    "pi0": "a robot policy (PaliGemma with an action expert): its tiny build takes minutes and it generates actions",
    "vision-encoder-decoder": "a composite of any encoder and decoder, no model of its own (its default config is "
                              "empty)",
}
# one type of each outcome but the exports: refused with the census (the text tower rotates, the vision tower
# not), a tiny config that does not build; the exported types are in the slow set (test_vlm_export.py runs
# Qwen2.5-VL whole in make test)
FAST = ("llava", "chameleon")


def _types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(NOT_IN_ZOO))


def _param(model_type: str):
    return pytest.param(model_type, marks=[] if model_type in FAST else [pytest.mark.slow], id=model_type)


def _record(result: vlm_zoo.VLMZooResult) -> None:
    path = os.environ.get("VLM_ZOO_RECORD")
    if path:
        with open(path, "a") as sink:
            sink.write(json.dumps(result.as_dict()) + "\n")


@pytest.mark.parametrize("model_type", [_param(t) for t in _types()])
def test_vlm_zoo_type_as_recorded(model_type):
    result = vlm_zoo.check_type(model_type)
    _record(result)
    recorded = RESULTS.get(model_type)
    assert recorded is not None, f"{model_type} has no recorded result: run make vlm-zoo"
    got = {k: v for k, v in result.as_dict().items() if k not in ("model_type", "seconds", "max_error")}
    want = {k: v for k, v in recorded.items() if k != "max_error"}
    assert got == want
    if result.status == "pass":
        nodes = [int(n) for n in result.rotary_nodes.split("+")]
        assert nodes[0] == result.vision_rotations > 0 and nodes[2] == result.text_rotations > 0


def test_the_zoo_holds_every_image_text_to_text_type_and_the_docs_table_is_rendered_from_the_records():
    assert sorted(RESULTS) == _types(), "run make vlm-zoo to record the zoo"
    assert doc_table(Path(DOC).read_text()) == render(RESULTS), \
        "docs/vision-language.md's zoo table is not the one rendered from tests/hf/vlm_zoo_results.json: make vlm-zoo"
    exported = {t for t, r in RESULTS.items() if r["status"] == "pass"}
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3", "llama4"} <= exported
