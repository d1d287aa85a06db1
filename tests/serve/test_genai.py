"""rope_export.serve.genai: `rope-export package genai` folders run in onnxruntime-genai as they are.

Each family is a tiny random-weight model built offline from its config and saved with
save_pretrained (weights given explicitly). The folder is loaded by onnxruntime-genai's own
``og.Model``; 16 greedy tokens, fed and read as ids, must equal transformers' ``generate``: one
prompt, and a batch of two prompts of different lengths (genai 0.18: padded on the right with
pad_token_id; transformers: padded on the left with an attention_mask). End-of-sequence is held
off for 16 tokens on both sides (min_length / min_new_tokens), so every token is compared.

GPT-J, GPT-NeoX, Qwen3-MoE and Gemma-3 are families onnxruntime-genai's own model builder refuses
(transformers 5.24). The default run keeps four families; the rest of the matrix is ``slow``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

og = pytest.importorskip("onnxruntime_genai", reason="needs onnxruntime-genai (pip install onnxruntime-genai)")
transformers = pytest.importorskip("transformers")

from rope_export import cli  # noqa: E402
from rope_export.serve.errors import ServeError  # noqa: E402
from rope_export.serve.genai import GENAI_CONFIG, MODEL_FILE, package_genai  # noqa: E402

NEW = 16
PAD, BOS, EOS = 0, 1, 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # no pad id inside a prompt: genai finds pads by id
# Wide enough weights that greedy picks are not near-ties (transformers' 0.02 makes logits almost flat).
TOKENS = dict(vocab_size=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.2)
COMMON = dict(TOKENS, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128)


def _gemma(cls, **extra):  # sliding window past the test's lengths: genai's right-padding gap counts in it
    return lambda: cls(**COMMON, num_key_value_heads=2, head_dim=8, sliding_window=64, **extra)


# family -> (config factory, target); the builder-refused ones first. Both lowerings are exercised.
FAMILIES = {
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(**COMMON, rotary_pct=0.5), "onnx"),
    "gptj": (lambda: transformers.GPTJConfig(**TOKENS, n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4),
             "ort"),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=8, num_experts=4,
                                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                                      decoder_sparse_step=1, mlp_only_layers=[]), "onnx"),
    "gemma3_text": (_gemma(transformers.Gemma3TextConfig), "ort"),
    "llama": (lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2), "ort"),
    "qwen2": (lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2), "onnx"),
    "phi3": (lambda: transformers.Phi3Config(**COMMON, num_key_value_heads=2, original_max_position_embeddings=32,
                                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.5,
                                                              "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0],
                                                              "original_max_position_embeddings": 32}), "ort"),
    "gemma2": (_gemma(transformers.Gemma2Config), "onnx"),
}
DEFAULT = ("gpt_neox", "qwen3_moe", "llama")  # two the builder refuses, one it takes; ~25 s each here
MATRIX = [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.slow) for name in FAMILIES]


def build(family: str):
    from rope_export.hf import build_hf_model

    return build_hf_model(FAMILIES[family][0](), seed=0)


BUFFER_DEFAULT = ("gpt_neox",)
BUFFER_MATRIX = [pytest.param(name, marks=() if name in BUFFER_DEFAULT else pytest.mark.slow)
                 for name in FAMILIES if name != "gemma2"]  # Gemma-2's soft-capping is refused (test below)


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    """(family, kv_buffer) -> (transformers model, genai folder), built once per module."""
    made, models = {}, {}

    def get(family: str, kv_buffer: bool = False):
        if (family, kv_buffer) not in made:
            root = tmp_path_factory.mktemp(family)
            if family not in models:
                models[family] = build(family)
            model = models[family]
            model.save_pretrained(root / "hf")
            out = root / "genai"
            package_genai(out, hf=root / "hf", weights=root / "hf", target=FAMILIES[family][1], kv_buffer=kv_buffer)
            made[family, kv_buffer] = model, out
        return made[family, kv_buffer]

    return get


def genai_generate(folder, rows: list[list[int]]) -> list[list[int]]:
    """NEW greedy tokens per row from onnxruntime-genai, rows padded on the right with PAD (genai 0.18's rule)."""
    model = og.Model(str(folder))
    width = max(len(r) for r in rows)
    ids = np.array([r + [PAD] * (width - len(r)) for r in rows], dtype=np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + NEW, min_length=width + NEW, do_sample=False, batch_size=len(rows))
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(i)][width:] for i in range(len(rows))]


def transformers_generate(model, rows: list[list[int]]) -> list[list[int]]:
    """NEW greedy tokens per row from transformers, rows padded on the left with an attention_mask."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=PAD, eos_token_id=EOS)
    return out[:, width:].tolist()


@pytest.mark.parametrize("family", MATRIX)
def test_genai_generates_transformers_tokens(family, packaged):
    model, folder = packaged(family)
    config = json.loads((folder / GENAI_CONFIG).read_text())
    assert config["model"]["decoder"]["inputs"]["attention_mask"] == "attention_mask"
    assert config["search"]["past_present_share_buffer"] is False
    single = genai_generate(folder, PROMPTS[:1])
    assert single == transformers_generate(model, PROMPTS[:1]), family
    batch = genai_generate(folder, PROMPTS)
    want = transformers_generate(model, PROMPTS)
    assert batch == want, family
    # each row of the padded batch is what that prompt alone gives (padding changed nothing)
    assert [batch[1]] == transformers_generate(model, PROMPTS[1:]), family
    assert len({tuple(row) for row in batch}) == 2  # the rows differ: the comparison sees each prompt


@pytest.mark.parametrize("family", BUFFER_MATRIX)
def test_kv_buffer_folder_shares_the_buffers_and_generates_transformers_tokens(family, packaged, tmp_path):
    """--kv-buffer: each past is a [batch, kv_heads, max_length, head] buffer genai binds as the present too."""
    import onnx

    model, folder = packaged(family, kv_buffer=True)
    config = json.loads((folder / GENAI_CONFIG).read_text())
    assert config["search"]["past_present_share_buffer"] is True
    graph = onnx.load(str(folder / MODEL_FILE), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    layers = config["model"]["decoder"]["num_hidden_layers"]
    assert ops.count("TensorScatter") == 2 * layers and ops.count("Attention") == layers
    # no present is a Concat of its past any more: the step writes only its own tokens
    producers = {out: n.op_type for n in graph.node for out in n.output}
    assert {producers[o.name] for o in graph.output if o.name.startswith("present.")} == {"TensorScatter"}
    assert genai_generate(folder, PROMPTS[:1]) == transformers_generate(model, PROMPTS[:1]), family
    assert genai_generate(folder, PROMPTS) == transformers_generate(model, PROMPTS), family
    # packaging such a file again (MODEL.onnx) sees its buffers: the config shares them too
    again = package_genai(tmp_path / "again", model=folder / MODEL_FILE)
    assert again.config["search"]["past_present_share_buffer"] is True


def test_kv_buffer_refuses_attention_soft_capping():
    from rope_export.hf import HFExportError, export_hf

    with pytest.raises(HFExportError, match="soft-capping"):
        export_hf(build("gemma2"), kv_buffer=True)


def test_config_reads_the_files_geometry_and_token_ids(packaged):
    _, folder = packaged("gpt_neox")
    config = json.loads((folder / GENAI_CONFIG).read_text())
    decoder = config["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["num_key_value_heads"],
            decoder["head_size"], decoder["hidden_size"]) == (2, 4, 4, 8, 32)
    assert (config["model"]["eos_token_id"], config["model"]["pad_token_id"], config["model"]["bos_token_id"]) == (
        EOS, PAD, BOS)
    assert config["model"]["context_length"] == 128
    assert decoder["filename"] == MODEL_FILE
    import onnx

    graph = onnx.load(str(folder / MODEL_FILE), load_external_data=False).graph
    ops = {(n.domain, n.op_type) for n in graph.node}
    assert ("", "RotaryEmbedding") in ops and not any(d == "rope_export" for d, _ in ops)
    names = {v.name for v in graph.input} | {v.name for v in graph.output}
    for name in (*decoder["inputs"].values(), *decoder["outputs"].values()):
        assert name.replace("%d", "1") in names, name


def test_an_exported_file_packages_and_a_file_without_mask_is_said(tmp_path, packaged):
    """MODEL.onnx input: the config comes from the file's metadata; the lowering is redone for the target."""
    from rope_export.hf import export_hf

    model, _ = packaged("gpt_neox")
    path = tmp_path / "m.onnx"
    export_hf(model, path)  # no attention_mask: genai runs it, padded batches would attend to the pads
    out = tmp_path / "pkg"
    package = package_genai(out, model=path, target="onnx")
    assert any("no attention_mask" in note for note in package.notes)
    assert "attention_mask" not in package.config["model"]["decoder"]["inputs"]
    assert genai_generate(out, PROMPTS[:1]) == transformers_generate(model, PROMPTS[:1])


def test_tokenizer_files_are_copied_and_load_in_genai(tmp_path, packaged):
    tokenizers = pytest.importorskip("tokenizers")
    _, folder = packaged("gpt_neox")
    tokenizer_dir = tmp_path / "tok"
    # a byte-pair tokenizer of single characters (onnxruntime-extensions reads BPE, not WordLevel)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXY"
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(tokenizer_dir)
    out = tmp_path / "pkg"
    # an already lowered package file is a valid MODEL.onnx too (nothing left to lower)
    package = package_genai(out, model=folder / MODEL_FILE, tokenizer=tokenizer_dir)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in package.files}
    genai_model = og.Model(str(out))
    tokenizer = og.Tokenizer(genai_model)
    assert list(tokenizer.encode("abc")) == fast.encode("abc") == [3, 4, 5]
    assert tokenizer.decode([3, 4, 5]) == "abc"


def test_bad_inputs_are_one_line_errors(tmp_path, packaged, capsys):
    with pytest.raises(ServeError, match="either"):
        package_genai(tmp_path / "a")
    with pytest.raises(ServeError, match="onnxruntime-genai runs"):
        package_genai(tmp_path / "a", hf=tmp_path, target="trt-plugin")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ServeError, match="other files"):
        package_genai(busy, hf=tmp_path)
    assert cli.main(["package", "genai", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rope-export package: error:") and len(err.strip().splitlines()) == 1
    assert (busy / "notes.txt").read_text() == "mine"


def test_cli_export_with_mask_then_package_and_replace(tmp_path, packaged):
    """`export --hf --attention-mask` then `package genai MODEL.onnx`; packaging again replaces the folder."""
    model, _ = packaged("llama")
    model.save_pretrained(tmp_path / "hf")
    exported = tmp_path / "m.onnx"
    assert cli.main(["export", "--hf", str(tmp_path / "hf"), "--weights", str(tmp_path / "hf"), "--attention-mask",
                     "-o", str(exported)]) == 0
    out = tmp_path / "pkg"
    for target in ("onnx", "ort"):
        assert cli.main(["package", "genai", str(exported), "-o", str(out), "--target", target]) == 0
        assert {p.name for p in out.iterdir()} == {GENAI_CONFIG, MODEL_FILE}
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
        assert genai_generate(out, PROMPTS) == transformers_generate(model, PROMPTS), target
