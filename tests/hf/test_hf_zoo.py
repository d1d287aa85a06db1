"""The zoo: every RoPE causal-LM model type of transformers, exported with default flags.

For each type of ``ZOO_TYPES`` a tiny random-weight model is built from its own config
(``hf_zoo_configs``) and ``export_hf`` runs with default flags; the file must have one rotary node
per rotation transformers performs in one eager forward, and match transformers' logits and
present keys/values for a prefill and a decode step (``hf_zoo.check_type``). What each type does
is recorded in ``hf_zoo_results.json``; every test checks its type against that record: an export
that passes must keep passing the same way, a refusal must keep its reason, and an expected failure
is ``xfail(strict=True)`` with the recorded reason, so a fix shows up as an XPASS to record.

``make test`` runs ``FAST``, a third of the zoo (one type of each kind: dense, MoE, MLA,
sliding/NoPE, per-layer geometry, interleaved, partial, DSA, hybrids; every refusal; then the
quickest); the others are marked ``slow`` (``make test-slow``).
``make hf-zoo`` re-records every type and re-renders the table in docs/transformers.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import hf_zoo  # noqa: E402
from hf_zoo_configs import NOT_IN_ZOO, ZOO_TYPES, rotary_source  # noqa: E402
from hf_zoo_table import DOC, doc_table, load_results, render  # noqa: E402

RESULTS = load_results()

# One of each kind, for make test (the family tests in test_hf_export.py cover Llama, Mistral,
# Qwen2/3, Gemma, Phi, Phi-3, GPT-NeoX, GPT-J, Llama 4 and Qwen2-VL on their own).
FAST = (
    "olmo",  # dense, a type rope-export has no entry for
    "mixtral", "qwen3_moe",  # MoE (batched_mm experts)
    "deepseek_v3", "minicpm3",  # MLA: key width != value width, interleaved-to-half-order
    "deepseek_v2",  # MLA with complex freqs_cis
    "gemma3_text", "cohere2",  # sliding window + global layers
    "gemma4_text",  # per-layer geometry
    "glm", "nanochat", "cohere",  # GLM interleaved, sign-flipped rotate_half, repeat-interleaved angles
    "stablelm",  # partial rotary
    "gpt_oss",  # half-width angles, MoE, sinks
    "deepseek_v32",  # DSA: the indexer's keys are cache I/O too
    "bamba", "minimax", "recurrent_gemma",  # hybrids
    # and to make a third of the zoo, the quickest of the rest, every other form and refusal among them
    "codegen", "ernie4_5", "ernie4_5_moe", "cohere2_moe", "youtu",  # interleaved forms
    "lfm2", "lfm2_moe",  # hybrids with conv states
    "persimmon", "modernbert-decoder", "nemotron", "arcee", "lfm3", "olmo2", "internlm3", "smollm3", "granitemoe",
    "moshi", "dbrx", "longcat_flash", "inkling2_text",  # refused, each for its own reason
    "qwen4_exp_text",  # the expected failure
)


@pytest.mark.parametrize("model_type", [hf_zoo.zoo_param(t, FAST, RESULTS) for t in ZOO_TYPES])
def test_zoo_type_exports_by_default_as_recorded(model_type):
    result = hf_zoo.check_type(model_type)
    hf_zoo.record(result, "HF_ZOO_RECORD")
    recorded = RESULTS.get(model_type)
    assert recorded is not None, f"{model_type} has no recorded result: run make hf-zoo"
    if recorded["status"] == "refused":
        assert (result.status, result.reason) == ("refused", recorded["reason"])
        return
    assert result.status == "pass", result.reason  # an expected failure fails here (xfail strict)
    assert (result.rotary_nodes, result.how) == (recorded["rotary_nodes"], recorded["how"])
    assert result.rotary_nodes == result.rotations > 0


# -- the zoo's coverage and its table in docs/transformers.md ---------------------------------------------------

def _rope_causal_lm_types() -> set[str]:
    """Causal-LM model types of the installed transformers whose modeling file has a rotary function or class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {model_type for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
            if rotary_source(class_name)}


def test_the_zoo_and_its_exclusions_cover_every_rope_causal_lm_type():
    every = _rope_causal_lm_types()
    assert set(ZOO_TYPES) | set(NOT_IN_ZOO) == every, "a RoPE causal-LM type is neither in the zoo nor excluded"
    assert not set(ZOO_TYPES) & set(NOT_IN_ZOO)
    assert len(ZOO_TYPES) >= 60


def test_every_zoo_type_is_recorded_and_the_docs_table_is_rendered_from_the_records():
    assert sorted(RESULTS) == sorted(ZOO_TYPES), "run make hf-zoo to record the zoo"
    assert doc_table(Path(DOC).read_text()) == render(RESULTS), \
        "docs/transformers.md's zoo table is not the one rendered from tests/hf/hf_zoo_results.json: run make hf-zoo"
