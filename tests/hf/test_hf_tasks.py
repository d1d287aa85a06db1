"""rope_export.hf.tasks: export --hf for tasks other than the causal LM (encoders, embedders, speech,
encoder-decoders), checked against transformers' own forward.

The task zoo (test_hf_task_zoo.py) exports every such model type with default flags; here: the
choice of task for a folder, the issue's ModernBERT masked-LM folder through the command line, one
encoder's embeddings through every lowering, the encoder-decoder files run as a generation loop
against transformers' ``generate``, and the trace patch's equality with transformers' own code.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from rope_export import cli, hf  # noqa: E402
from rope_export.check import check  # noqa: E402
from rope_export.hf.task_export import MANIFEST, export_task  # noqa: E402
from rope_export.hf.task_patches import moonshine_output_length  # noqa: E402
from rope_export.hf.tasks import CAUSAL_LM, TASKS, select_task  # noqa: E402
from rope_export.passes import lower, save_model  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)
MODERNBERT = dict(TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)


def _config(model_type, **extra):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:  # an older transformers (make test-oldest)
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    return transformers.AutoConfig.for_model(model_type, **extra)


# -- which task ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("model_type", "architectures", "task", "cls"), [
    ("modernbert", ["ModernBertForMaskedLM"], "fill-mask", "ModernBertForMaskedLM"),
    ("modernbert", ["ModernBertModel"], "feature-extraction", "ModernBertModel"),
    ("modernbert", ["ModernBertForSequenceClassification"], "text-classification",
     "ModernBertForSequenceClassification"),
    ("modernbert", None, "feature-extraction", "ModernBertModel"),  # a config alone: the base model
    ("moonshine", None, "speech-to-text", "MoonshineForConditionalGeneration"),
    ("t5gemma", None, "text2text-generation", "T5GemmaForConditionalGeneration"),
    ("llama", ["LlamaForCausalLM"], CAUSAL_LM, None),  # causal LMs: export_hf, as before
    ("llama", None, CAUSAL_LM, None),
    ("llama", ["LlamaForSequenceClassification"], "text-classification", "LlamaForSequenceClassification"),
    ("qwen2_vl", ["Qwen2VLForConditionalGeneration"], CAUSAL_LM, None),  # a family of its own: as before
    ("gte", ["NewModel"], "feature-extraction", "GteModel"),  # remote code's class: what the type implies
])
def test_the_task_is_the_class_the_folder_was_saved_with_else_what_the_config_implies(model_type, architectures,
                                                                                      task, cls):
    choice = select_task(_config(model_type, architectures=architectures))
    assert (choice.task.name, choice.build_class) == (task, cls)


def test_task_overrides_and_refusals_name_the_fix():
    config = _config("modernbert", architectures=["ModernBertForMaskedLM"])
    assert select_task(config, "feature-extraction").build_class == "ModernBertModel"
    assert select_task(config, "fill-mask").build_class == "ModernBertForMaskedLM"
    with pytest.raises(hf.HFExportError, match="unknown --task 'embeddings'; known: causal-lm, feature-extraction"):
        select_task(config, "embeddings")
    with pytest.raises(hf.HFExportError, match="no speech-to-text model for model_type 'modernbert'; its tasks: "
                                               "feature-extraction, fill-mask, text-classification"):
        select_task(config, "speech-to-text")
    with pytest.raises(hf.HFExportError, match="names ModernBertForMultipleChoice, which no task of rope-export "
                                               "builds .*pass --task"):
        select_task(_config("modernbert", architectures=["ModernBertForMultipleChoice"]))


def test_causal_lm_options_and_one_file_name_for_two_files_are_refused_before_building(tmp_path, capsys):
    folder = tmp_path / "t5gemma"
    _config("t5gemma", encoder=T5GEMMA_LAYER, decoder=dict(T5GEMMA_LAYER), vocab_size=64).save_pretrained(folder)
    assert cli.main(["export", "--hf", str(folder), "--layer", "0", "-o", str(tmp_path / "x")]) == 2
    assert "--layer is for causal LMs; " in capsys.readouterr().err
    assert cli.main(["export", "--hf", str(folder), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "text2text-generation writes encoder.onnx, decoder.onnx: give -o a folder, not x.onnx" in \
        capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t5gemma"]


def test_every_task_names_a_real_auto_class_and_mapping():
    from transformers.models.auto import modeling_auto

    for task in TASKS.values():
        assert hasattr(transformers, task.auto_class), task.name
        assert isinstance(getattr(modeling_auto, task.mapping), dict), task.name


def test_the_moonshine_patch_computes_transformers_lengths_for_every_audio_it_serves():
    """The integer-division lengths traced for Moonshine equal transformers' int() of float divisions for every
    input transformers gives at least one encoder frame (shorter audio fails in the convolutions anyway)."""
    from transformers.models.moonshine.modeling_moonshine import MoonshineEncoder

    original = [MoonshineEncoder._get_feat_extract_output_lengths(None, n) for n in range(60_000)]
    served = [n for n in range(60_000) if original[n] >= 1]
    assert served[0] == 127 + 64 * 12  # three convolutions: 13 frames of the first, 3 of the second
    assert [moonshine_output_length(n) for n in served] == [original[n] for n in served]


# -- the ModernBERT masked-LM folder, from the command line --------------------------------

@pytest.fixture(scope="module")
def modernbert_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modernbert") / "mlm"
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(_config("modernbert", **MODERNBERT)).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mlm_file(modernbert_folder, tmp_path_factory):
    """``rope-export export --hf`` of the masked-LM folder, with what it printed."""
    out = tmp_path_factory.mktemp("mlm") / "mlm.onnx"
    assert cli.main(["export", "--hf", str(modernbert_folder), "-o", str(out)]) == 0
    return out


def test_a_modernbert_masked_lm_folder_exports_and_checks_against_transformers(modernbert_folder, mlm_file):
    import onnx

    model = onnx.load(mlm_file, load_external_data=False)
    meta = {p.key.removeprefix("rope_export."): p.value for p in model.metadata_props}
    assert (meta["task"], meta["hf_architecture"], meta["hf_weights"], meta["rotations_eager"],
            meta["rotary_nodes"]) == ("fill-mask", "ModernBertForMaskedLM", str(modernbert_folder), "4", "4")
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert [[d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input] == [["batch", "seq"]] * 2
    report = check(mlm_file, runners=("onnxruntime-cpu", "cpu-twin"))
    assert report.reference.startswith("transformers ModernBertForMaskedLM (fill-mask")
    assert {"padded-right", "padded-left", "long-sequence"} <= set(report.cases)
    assert [r.status for r in report.runners] == ["pass", "pass"], report.notes
    assert all(r.sweep.status == "pass" for r in report.runners)  # every rotary node alone, every position


# (in the test above's module, after it: one export of the folder serves both, on whichever worker runs them)
DAMAGED = [
    ("task", "embeddings", "rope_export.task 'embeddings' / component 'model' is no task export rope-export knows"),
    ("task_dims", '{"batch": 2, "seq": 10000000000}', "holds a size outside"),
    ("task_dims", "[1, 2]", "rope_export.task_dims is not a table of sizes"),
    ("hf_architecture", "ModernBertForMultipleChoice", "'ModernBertForMultipleChoice' is not a fill-mask class"),
]


def test_damaged_task_metadata_is_refused_in_one_line(mlm_file, tmp_path):
    import onnx

    from rope_export.check.model_file import CheckError

    for key, value, message in DAMAGED:
        model = onnx.load(mlm_file)
        next(p for p in model.metadata_props if p.key == f"rope_export.{key}").value = value
        damaged = tmp_path / f"damaged-{key}.onnx"
        onnx.save(model, damaged)
        with pytest.raises(CheckError, match=message):
            check(damaged, runners=("onnxruntime-cpu",))


# -- one encoder's embeddings through every lowering -------------------------------------------

def test_an_encoders_embeddings_equal_transformers_through_every_lowering(tmp_path):
    """A ModernBertModel folder (an embedder's checkpoint): last_hidden_state on padded batches, the file lowered
    to each target and checked on the runners that run it, against transformers."""
    folder, out = tmp_path / "embedder", tmp_path / "embed.onnx"
    torch.manual_seed(1)
    transformers.ModernBertModel(_config("modernbert", **MODERNBERT)).eval().save_pretrained(folder)
    assert cli.main(["export", "--hf", str(folder), "-o", str(out)]) == 0
    import onnx

    model = onnx.load(out)
    assert [o.name for o in model.graph.output] == ["last_hidden_state"]
    runners = {"trt-plugin": ("cpu-twin",), "onnx": ("onnxruntime-cpu", "onnx-reference"), "ort": ("onnxruntime-cpu",),
               "decomposed": ("onnxruntime-cpu",)}
    for target, names in runners.items():
        lowered = tmp_path / f"embed-{target}.onnx"
        save_model(lower(model, target), lowered)
        report = check(lowered, runners=names)
        assert report.reference.startswith("transformers ModernBertModel (feature-extraction"), target
        assert [r.status for r in report.runners] == ["pass"] * len(names), (target, report.notes)
        assert "padded-right" in report.cases


def test_a_base_model_of_a_head_checkpoint_is_refused_with_the_fix(modernbert_folder, tmp_path, capsys):
    assert cli.main(["export", "--hf", str(modernbert_folder), "--task", "feature-extraction", "-o",
                     str(tmp_path / "x.onnx")]) == 2
    error = capsys.readouterr().err
    assert "3 unexpected (decoder.bias, head.dense.weight, head.norm.weight)" in error
    assert "holds a ModernBertForMaskedLM checkpoint: as feature-extraction (ModernBertModel) its head's tensors " \
           "are left over" in error
    assert not (tmp_path / "x.onnx").exists()


# -- encoder-decoders: the two files as a generation loop ------------------------------------------

def _generate_with_files(files, encoder_feeds, start: int, steps: int):
    """Greedy tokens from encoder.onnx then decoder.onnx step by step, feeding back its present cache."""
    import onnxruntime as ort

    sessions = {f.component: ort.InferenceSession(lower(f.model, "onnx").SerializeToString()) for f in files}
    hidden, mask = sessions["encoder"].run(None, encoder_feeds)
    decoder = sessions["decoder"]
    names = [i.name for i in decoder.get_inputs()]
    batch = hidden.shape[0]
    past = {i.name: np.zeros([batch, i.shape[1], 0, i.shape[3]], np.float32) for i in decoder.get_inputs()
            if i.name.startswith("past_key_values.")}
    tokens, logits, position = np.full((batch, 1), start, np.int64), [], 0
    for _ in range(steps):
        feeds = {"input_ids": tokens[:, -1:], "position_ids": np.full((batch, 1), position, np.int64),
                 "encoder_hidden_states": hidden, "encoder_attention_mask": mask, **past}
        out = dict(zip([o.name for o in decoder.get_outputs()], decoder.run(None, {n: feeds[n] for n in names}),
                       strict=True))
        logits.append(out["logits"][:, -1])
        past = {f"past_key_values.{k.split('.', 1)[1]}": v for k, v in out.items() if k.startswith("present.")}
        tokens = np.concatenate([tokens, out["logits"][:, -1:].argmax(-1)], axis=1)
        position += 1
    return tokens, np.stack(logits, 1)


T5GEMMA_LAYER = dict(TINY, num_key_value_heads=2, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                     layer_types=["sliding_attention", "full_attention"])
ENCODER_DECODERS = {
    # generation runs past T5Gemma's sliding window of 4: the decoder file keeps the whole past and masks it
    "t5gemma": (lambda: _config("t5gemma", encoder=T5GEMMA_LAYER, decoder=dict(T5GEMMA_LAYER), vocab_size=64),
                lambda batch: {"input_ids": np.random.default_rng(0).integers(3, 64, (batch, 9))}),
    "moonshine": (lambda: _config("moonshine", vocab_size=64, hidden_size=32, intermediate_size=64,
                                  encoder_num_hidden_layers=2, decoder_num_hidden_layers=2,
                                  encoder_num_attention_heads=4, decoder_num_attention_heads=4,
                                  encoder_num_key_value_heads=4, decoder_num_key_value_heads=4,
                                  max_position_embeddings=128, partial_rotary_factor=0.5, pad_token_id=0),
                  lambda batch: {"input_values": np.random.default_rng(0).standard_normal((batch, 4000),
                                                                                         dtype=np.float32)}),
}


@pytest.mark.slow  # 55-80 s each here; the task zoo checks both files of each on padded batches too (slow)
@pytest.mark.parametrize("model_type", ["t5gemma", "moonshine"])
def test_encoder_and_decoder_files_generate_what_transformers_generates(model_type, tmp_path):
    """A padded batch of two: the files' greedy loop (encoder once, then one decoder step at a time with its cache)
    against transformers' generate on the same inputs: the same tokens, logits within the tolerance."""
    make_config, make_inputs = ENCODER_DECODERS[model_type]
    config = make_config()
    choice = select_task(config)
    model = hf.build_hf_model(config, random_weights=True, model_class=choice.build_class)
    result = export_task(model, choice.task, tmp_path / "out")
    assert [f.component for f in result.files] == ["encoder", "decoder"]
    assert all(f.rotary_nodes == f.rotations > 0 for f in result.files)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["files"]["decoder"]["inputs"][:4] == ["input_ids", "position_ids", "encoder_hidden_states",
                                                          "encoder_attention_mask"]
    feeds = make_inputs(2)
    main = next(iter(feeds))
    mask = np.ones(feeds[main].shape, np.int64)
    mask[1, feeds[main].shape[1] * 2 // 3:] = 0  # the second row padded on the right
    steps = 8
    with torch.no_grad():
        want = model.generate(**{main: torch.from_numpy(feeds[main]), "attention_mask": torch.from_numpy(mask)},
                              max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    start = int(want.sequences[0, 0])  # generate's decoder start token
    tokens, logits = _generate_with_files(result.files, {main: feeds[main], "attention_mask": mask}, start, steps)
    np.testing.assert_array_equal(tokens, want.sequences.numpy())
    np.testing.assert_allclose(logits, torch.stack(want.logits, 1).numpy(), atol=1e-4, rtol=1e-4)
