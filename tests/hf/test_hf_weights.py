"""``export --hf DIR`` and the weights: DIR's own checkpoint, never random weights without saying so.

Every model is a tiny one built offline from its config and written with ``save_pretrained`` (no hub);
the reference is what transformers' own ``from_pretrained(DIR)`` computes. Files are run lowered to
ai.onnx RotaryEmbedding-23 on onnxruntime.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from rope_export import cli, hf  # noqa: E402
from rope_export.hf import checkpoint_files, checkpoints  # noqa: E402
from rope_export.hf.loading import weights_beside  # noqa: E402
from rope_export.op.tolerances import tolerance  # noqa: E402

AUTO = transformers.AutoModelForCausalLM
TOL = tolerance("block", "float32")
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
IDS = torch.tensor([[3, 17, 42, 5, 60, 1], [9, 8, 7, 6, 5, 4]])
RANDOM_LINE = "random weights (seed 0): not a trained model"


def llama(**overrides):
    """Tied embeddings: the checkpoint has no lm_head.weight, legitimately."""
    return transformers.LlamaConfig(**{**SMALL, "tie_word_embeddings": True, **overrides})


def saved(folder, config, seed: int = 5, **save):
    """A trained-looking model (seeded, not rope-export's draws) written by save_pretrained into ``folder``."""
    torch.manual_seed(seed)
    model = AUTO.from_config(config, attn_implementation="eager")
    model.save_pretrained(folder, **save)
    return folder


def reference_logits(folder) -> torch.Tensor:
    model = AUTO.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=IDS, position_ids=positions()).logits


def positions() -> torch.Tensor:
    return torch.arange(IDS.shape[1]).expand(IDS.shape).contiguous()


def file_logits(path) -> np.ndarray:
    """The exported file lowered to ai.onnx, run on onnxruntime (prefill, empty past)."""
    import onnxruntime as ort

    from rope_export.passes import lower

    model = onnx.load_model(path)
    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": IDS.numpy(), "position_ids": positions().numpy()}
    for value in model.graph.input[2:]:
        dims = value.type.tensor_type.shape.dim
        feeds[value.name] = np.zeros((IDS.shape[0], dims[1].dim_value, 0, dims[3].dim_value), np.float32)
    return session.run(["logits"], feeds)[0]


def export(capsys, *argv) -> tuple[int, str, str]:
    """``rope-export export --hf ...`` through the console script's entry point: (exit code, stdout, stderr)."""
    capsys.readouterr()  # not what came before (save_pretrained's progress bars)
    code = cli.main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def summary_first_line(out: str) -> str:
    """The first line after the step table (the summary of the export)."""
    lines = out.splitlines()
    end = next(n for n, line in enumerate(lines) if line.startswith("└"))
    return lines[end + 1]


# -- (a) a folder with weights exports them ---------------------------------------------------

def test_a_save_pretrained_folder_exports_its_own_weights(tmp_path, capsys):
    folder = saved(tmp_path / "llama", llama())
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")  # tied: absent, and that is fine
    code, out, err = export(capsys, "--hf", folder, "-o", tmp_path / "m.onnx", "--summary-json", tmp_path / "s.json")
    assert code == 0, err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["weights"] == {"source": "folder", "path": str(folder.resolve())}
    first = summary_first_line(out)
    assert first == f"weights from {folder}" and "random" not in first
    meta = hf.read_hf_metadata(onnx.load_model(tmp_path / "m.onnx", load_external_data=False))
    assert meta["hf_weights"] == str(folder)  # check rebuilds from these weights, not from a seed
    got, want = file_logits(tmp_path / "m.onnx"), reference_logits(folder).numpy()
    assert TOL.allclose(got, want), f"max error {np.abs(got - want).max():.3g}"
    # and check compares the file with those trained weights (not with a seed's)
    assert cli.main(["check", str(tmp_path / "m.onnx"), "--runners", "onnxruntime-cpu", "--no-sweep"]) == 0
    assert f"weights{folder})" in "".join(capsys.readouterr().out.split())  # rich may fold the long path


# -- (b) the forms save_pretrained writes -----------------------------------------------------

def as_bin(folder, shards: int = 1):
    """The folder's safetensors rewritten as transformers 4 wrote PyTorch checkpoints (transformers 5 only
    reads them): pytorch_model.bin, or shards listed in pytorch_model.bin.index.json."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if shards == 1:
        torch.save(tensors, folder / "pytorch_model.bin")
        return folder
    names, weight_map = sorted(tensors), {}
    for n in range(shards):
        shard = f"pytorch_model-{n + 1:05d}-of-{shards:05d}.bin"
        part = names[n::shards]
        torch.save({name: tensors[name] for name in part}, folder / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


FORMS = {
    "sharded safetensors": lambda folder: saved(folder, llama(num_hidden_layers=2), max_shard_size="20KB"),
    "pytorch .bin": lambda folder: as_bin(saved(folder, llama(num_hidden_layers=2))),
    "sharded pytorch .bin": lambda folder: as_bin(saved(folder, llama(num_hidden_layers=2)), shards=3),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_checkpoint_form_loads_by_rope_exports_own_reader(tmp_path, form):
    folder = FORMS[form](tmp_path)
    files = checkpoint_files.checkpoint_files(folder)
    assert (len(files) > 1) == ("sharded" in form) and {f.suffix for f in files} == {
        ".bin" if ".bin" in form else ".safetensors"}
    assert weights_beside(folder) == folder == weights_beside(folder / "config.json")  # a folder or its config.json
    config = hf.load_hf_config(folder)
    model, report = checkpoints.build_causal_lm(AUTO, config, torch.float16, weights=folder)
    # read straight into fp16 parameters, not through transformers' loader
    assert report.loader == ("pytorch" if ".bin" in form else "safetensors") and report.files == sorted(map(str, files))
    assert report.converted == {"fp32->fp16": report.tensors}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    built = hf.build_hf_model(folder)  # the Python API's default is the CLI's: the checkpoint beside the config
    with torch.no_grad():
        got = built(input_ids=IDS, position_ids=positions()).logits
    assert torch.equal(got, reference_logits(folder))


def test_a_bin_checkpoint_is_copied_into_the_parameters_without_a_float32_copy(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.float32 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() > 64:  # > inv_freq
                    self.float32.append(str(func))
            return out

    torch.manual_seed(5)
    AUTO.from_config(llama(), attn_implementation="eager", dtype=torch.bfloat16).save_pretrained(tmp_path)
    as_bin(tmp_path, shards=2)
    with Made() as made:
        model, report = checkpoints.build_causal_lm(AUTO, llama(), torch.float16, weights=tmp_path)
    assert report.loader == "pytorch" and report.converted == {"bf16->fp16": report.tensors}
    assert made.float32 == [], f"a float32 tensor was made while loading: {made.float32[:3]}"
    stored = {}
    for shard in sorted(tmp_path.glob("*.bin")):
        stored.update(torch.load(shard, weights_only=True))
    params = dict(model.named_parameters())
    for name, tensor in stored.items():
        assert torch.equal(params[name], tensor.to(torch.float16)), name


def test_what_transformers_drops_on_loading_is_accepted(tmp_path):
    """A stored rotary inv_freq (a non-persistent buffer) is skipped; a checkpoint saved from the base model
    (no ``model.`` prefix) is placed by transformers' renaming, as from_pretrained places it."""
    folder = saved(tmp_path / "extra", llama())
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "model.rotary_emb.inv_freq": torch.ones(4)}, folder / "model.safetensors",
              metadata={"format": "pt"})
    model, report = checkpoints.build_causal_lm(AUTO, hf.load_hf_config(folder), torch.float32, weights=folder)
    assert report.loader == "safetensors" and report.tensors == len(tensors)
    assert not torch.equal(model.model.rotary_emb.inv_freq, torch.ones(4))  # computed, not read

    base = tmp_path / "base"
    torch.manual_seed(5)
    transformers.AutoModel.from_config(llama()).save_pretrained(base)
    assert all(not name.startswith("model.") for name in load_file(base / "model.safetensors"))
    model, report = checkpoints.build_causal_lm(AUTO, llama(), torch.float32, weights=base)
    assert report.loader == "transformers"
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, AUTO.from_pretrained(base, config=llama(),
                                                                             attn_implementation="eager")(
            input_ids=IDS).logits)


# -- (c) a checkpoint that does not fit -------------------------------------------------------

def test_the_checkpoint_of_another_model_is_an_error_naming_tensors(tmp_path, capsys):
    folder = tmp_path / "qwen2"
    transformers.Qwen2Config(**SMALL).save_pretrained(folder)
    gptj = saved(tmp_path / "gptj", transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                            rotary_dim=4, n_positions=64,
                                                            bos_token_id=None, eos_token_id=None))
    out = tmp_path / "m.onnx"
    code, _, err = export(capsys, "--hf", folder, "--weights", gptj, "-o", out)
    assert code == 2 and not out.exists()
    assert err.count("\n") == 1, err  # one line, not transformers' table of every tensor
    assert f"checkpoint {gptj} does not fit the config: 14 tensor(s) missing (model.embed_tokens.weight, " in err
    assert "14 unexpected (" in err and "transformer.h.0.attn." in err

    # the same weights inside the --hf folder itself
    (folder / "model.safetensors").write_bytes((gptj / "model.safetensors").read_bytes())
    code, _, err = export(capsys, "--hf", folder, "-o", out)
    assert code == 2 and not out.exists() and "does not fit the config" in err


def test_a_checkpoint_with_other_shapes_is_an_error_naming_them(tmp_path, capsys):
    folder = saved(tmp_path / "llama", llama(intermediate_size=48))
    llama().save_pretrained(folder)  # the config says 64
    out = tmp_path / "m.onnx"
    code, _, err = export(capsys, "--hf", folder, "-o", out)
    assert code == 2 and not out.exists() and err.count("\n") == 1, err
    assert "does not fit the config: 3 of other shapes (model.layers.0.mlp.down_proj.weight is [32, 48] in the " \
           "checkpoint, [32, 64] in the model;" in err


def truncated_after_header(path) -> None:
    """Cut a .safetensors file just past its JSON header: names and shapes intact, no tensor data."""
    data = path.read_bytes()
    path.write_bytes(data[:8 + int.from_bytes(data[:8], "little") + 16])


def no_loading(monkeypatch) -> None:
    """Fail the test if any checkpoint data would be loaded (ours or transformers')."""
    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint data was loaded")

    monkeypatch.setattr(checkpoints, "_from_pretrained", refuse)
    monkeypatch.setattr(checkpoints, "load_checkpoint", refuse)


def test_a_checkpoint_that_does_not_fit_is_refused_from_its_headers_alone(tmp_path, capsys, monkeypatch):
    """The refusal names the tensors although the file holds no tensor data: nothing but the header was read."""
    no_loading(monkeypatch)
    folder = tmp_path / "qwen2"
    transformers.Qwen2Config(**SMALL).save_pretrained(folder)
    gptj = saved(tmp_path / "gptj", transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                            rotary_dim=4, n_positions=64,
                                                            bos_token_id=None, eos_token_id=None))
    truncated_after_header(gptj / "model.safetensors")
    code, _, err = export(capsys, "--hf", folder, "--weights", gptj, "-o", tmp_path / "m.onnx")
    assert code == 2 and err.count("\n") == 1, err
    assert "does not fit the config: 14 tensor(s) missing (model.embed_tokens.weight, " in err
    assert "truncated" not in err

    # other shapes, and the .bin form (names and shapes from the pickle, its storages mapped, not read)
    other = saved(tmp_path / "llama", llama(intermediate_size=48))
    llama().save_pretrained(other)
    truncated_after_header(other / "model.safetensors")
    code, _, err = export(capsys, "--hf", other, "-o", tmp_path / "m.onnx")
    assert code == 2 and "does not fit the config: 3 of other shapes (model.layers.0.mlp.down_proj.weight is " \
                         "[32, 48] in the checkpoint, [32, 64] in the model;" in err, err
    as_bin(saved(tmp_path / "bin", llama(intermediate_size=48)), shards=2)
    llama().save_pretrained(tmp_path / "bin")
    code, _, err = export(capsys, "--hf", tmp_path / "bin", "-o", tmp_path / "m.onnx")
    assert code == 2 and "does not fit the config: 3 of other shapes" in err, err


def test_renamed_and_fused_experts_are_not_refused_from_the_headers(tmp_path):
    """Mixtral as save_pretrained writes it (block_sparse_moe, one tensor per expert): the header check follows
    transformers' renaming and fusing, so the checkpoint loads, as from_pretrained loads it."""
    config = transformers.MixtralConfig(**{**SMALL, "num_local_experts": 4})
    folder = saved(tmp_path / "mixtral", config)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in load_file(folder / "model.safetensors")
    model, report = checkpoints.build_causal_lm(AUTO, config, torch.float32, weights=folder)
    assert report.loader == "transformers"
    reference = AUTO.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        got, want = model(input_ids=IDS).logits, reference(input_ids=IDS).logits
    assert TOL.allclose(got.numpy(), want.numpy()), f"max error {(got - want).abs().max():.3g}"


def test_a_truncated_checkpoint_that_fits_is_refused_before_reading(tmp_path, capsys, monkeypatch):
    no_loading(monkeypatch)
    folder = saved(tmp_path / "llama", llama())
    truncated_after_header(folder / "model.safetensors")
    code, _, err = export(capsys, "--hf", folder, "-o", tmp_path / "m.onnx")
    assert code == 2 and "the file is truncated or corrupt" in err, err


def test_weights_rope_export_cannot_read_are_never_replaced_by_random_ones(tmp_path, capsys):
    llama().save_pretrained(tmp_path)
    torch.save({}, tmp_path / "consolidated.00.pth")
    code, _, err = export(capsys, "--hf", tmp_path, "-o", tmp_path / "m.onnx")
    assert code == 2 and "holds consolidated.00.pth but none of model.safetensors.index.json" in err
    assert "--random-weights" in err and not (tmp_path / "m.onnx").exists()


# -- (d) random weights: only from a config, or when asked -------------------------------------

def test_a_config_only_folder_exports_random_weights_and_says_so_first(tmp_path, capsys):
    llama().save_pretrained(tmp_path)
    code, out, err = export(capsys, "--hf", tmp_path, "-o", tmp_path / "m.onnx")
    assert code == 0, err
    assert summary_first_line(out).startswith(f"{RANDOM_LINE} ({tmp_path} holds no checkpoint")
    assert hf.read_hf_metadata(onnx.load_model(tmp_path / "m.onnx"))["hf_weights"] == "random"


def test_random_weights_when_asked_even_beside_a_checkpoint(tmp_path, capsys):
    folder = saved(tmp_path / "llama", llama())
    code, out, err = export(capsys, "--hf", folder, "--random-weights", "--seed", "0", "-o", tmp_path / "m.onnx",
                            "--summary-json", tmp_path / "s.json")
    assert code == 0, err
    assert summary_first_line(out) == f"{RANDOM_LINE} (--random-weights)"
    assert json.loads((tmp_path / "s.json").read_text())["weights"] == {"source": "random", "seed": 0}
    got, want = file_logits(tmp_path / "m.onnx"), reference_logits(folder).numpy()
    assert not TOL.allclose(got, want)  # not the trained model
    code, _, err = export(capsys, "--hf", folder, "--random-weights", "--weights", folder, "-o", tmp_path / "n.onnx")
    assert code == 2 and "exclude each other" in err


def test_the_python_api_builds_random_weights_only_when_asked_or_from_a_config(tmp_path):
    folder = saved(tmp_path / "llama", llama())
    want = reference_logits(folder)

    def logits(model):
        with torch.no_grad():
            return model(input_ids=IDS, position_ids=positions()).logits

    assert torch.equal(logits(hf.build_hf_model(folder / "config.json")), want)
    random = hf.build_hf_model(folder, random_weights=True, seed=3)
    assert not TOL.allclose(logits(random).numpy(), want.numpy())
    assert torch.equal(logits(random), logits(hf.build_hf_model(llama(), seed=3)))  # a config object: random
    with pytest.raises(hf.HFExportError, match="exclude each other"):
        hf.build_hf_model(folder, folder, random_weights=True)


# -- (e) a model without RoPE -----------------------------------------------------------------

def test_a_model_without_rope_is_refused_unless_allowed(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64).save_pretrained(folder)
    out = tmp_path / "m.onnx"
    code, _, err = export(capsys, "--hf", folder, "-o", out)
    assert code == 2 and not out.exists()
    assert err.strip().endswith("error: gpt2 performs no rotary position embedding: nothing for rope-export to "
                                "fuse; export it with torch.onnx, or pass --allow-no-rope to write the file anyway")
    with pytest.warns(UserWarning, match="gpt2 performs no rotary position embedding"):
        code, stdout, err = export(capsys, "--hf", folder, "--allow-no-rope", "-o", out)
    assert code == 0 and out.exists(), err
    assert "--allow-no-rope: written anyway" in " ".join(stdout.split())


def test_tensors_stored_in_the_dtype_asked_for_are_mapped_from_the_file_not_read(tmp_path):
    torch.manual_seed(7)
    AUTO.from_config(llama(), attn_implementation="eager", dtype=torch.float32).save_pretrained(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    model, report = checkpoints.build_causal_lm(AUTO, llama(), torch.float32, weights=tmp_path)
    assert report.loader == "safetensors" and report.mapped == report.tensors > 0 and report.converted == {}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied parameters stay one
    with torch.no_grad():
        got = model(input_ids=IDS, position_ids=positions()).logits
        assert torch.equal(got, reference_logits(tmp_path))
        model.model.embed_tokens.weight.add_(1)  # copy-on-write: the checkpoint is never written
    assert (tmp_path / "model.safetensors").read_bytes() == before
    converted, report = checkpoints.build_causal_lm(AUTO, llama(), torch.float16, weights=tmp_path)
    assert report.mapped == 0 and report.converted == {"fp32->fp16": report.tensors}
