"""The task zoo: every RoPE model type of transformers that is not a causal LM, exported with default flags.

For each type (``hf_task_zoo.zoo_types``: rotary code in its modeling file, outside the causal-LM
zoo, not a vision-language model) a tiny random-weight model of the task its config implies is
exported and every file checked against transformers on padded batches (``hf_task_zoo.check_type``).
Whether a type rotates at all is the eager census's call (``export_task`` refuses one that performs
no rotation). What each type does is recorded in ``hf_task_zoo_results.json`` and every test checks
its type against that record, as the causal-LM zoo does: a pass must keep passing the same way, a
refusal keep its reason, an expected failure is ``xfail(strict=True)``.

``make test`` runs ``FAST`` (none: see there) and the coverage test; the types are marked ``slow``.
``make hf-task-zoo`` re-records every type and re-renders the table in docs/tasks.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import hf_task_zoo  # noqa: E402
from hf_task_zoo_table import BEGIN, DOC, END, RESULTS, render  # noqa: E402
from hf_zoo import record, zoo_param  # noqa: E402
from hf_zoo_table import doc_table, load_results  # noqa: E402

RECORDED = load_results(RESULTS)

# make test's share (about 75 s with two workers) holds the encoder kind in test_hf_tasks.py (the ModernBERT folder
# through the command line and every lowering); T5Gemma here, an encoder-decoder, takes 55-110 s on this shared
# 2-core machine, so every zoo type is in make test-slow
FAST: tuple[str, ...] = ()


# the recorded types (the test below holds them equal to the zoo's): finding the zoo's types imports every modeling
# file of transformers, which collection should not pay for
@pytest.mark.parametrize("model_type", [zoo_param(t, FAST, RECORDED) for t in sorted(RECORDED)])
def test_task_zoo_type_exports_and_checks_as_recorded(model_type, tmp_path):
    result = hf_task_zoo.check_type(model_type, tmp_path)
    record(result, "HF_TASK_ZOO_RECORD")
    recorded = RECORDED.get(model_type)
    assert recorded is not None, f"{model_type} has no recorded result: run make hf-task-zoo"
    if recorded["status"] == "refused":
        assert (result.status, result.reason) == ("refused", recorded["reason"])
        return
    assert result.status == "pass", result.reason  # an expected failure fails here (xfail strict)
    assert (result.task, result.files, result.rotary_nodes, result.how) == \
        (recorded["task"], recorded["files"], recorded["rotary_nodes"], recorded["how"])
    assert result.rotary_nodes == result.rotations > 0


def test_every_candidate_is_in_the_zoo_or_left_out_with_its_reason_and_the_docs_table_is_rendered_from_the_records():
    """One test: finding the candidates imports every modeling file of transformers (half a minute)."""
    candidates = hf_task_zoo.candidates()
    zoo, excluded = hf_task_zoo.zoo_types(), hf_task_zoo.excluded()
    assert set(zoo) | set(excluded) == candidates and not set(zoo) & set(excluded)
    assert {"modernbert", "eurobert", "gte", "jina_embeddings_v3", "nomic_bert", "esm", "moonshine",
            "t5gemma"} <= set(zoo)
    assert all(why for why in excluded.values())
    assert sorted(RECORDED) == zoo, "run make hf-task-zoo to record the zoo"
    assert doc_table(Path(DOC).read_text(), BEGIN, END) == render(RECORDED, excluded), \
        "docs/tasks.md's zoo table is not the one rendered from tests/hf/hf_task_zoo_results.json: run make hf-task-zoo"
