"""Which weights ``check`` compares an ``export --hf`` file with: never trained against random (or back) silently.

Two tiny Llamas written by save_pretrained (folders A and B: same config, other values), a config-only
folder, and files exported from them; each check runs onnxruntime CPU only, without the sweep.
"""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from rope_export import cli  # noqa: E402
from rope_export.check.model_file import CheckError  # noqa: E402
from rope_export.check.weights import choose_weights  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None, bos_token_id=None,
             eos_token_id=None, tie_word_embeddings=True)
FAST = ["--runners", "onnxruntime-cpu", "--no-sweep", "--batch", "1", "--seq", "4", "--past", "2", "--long-seq", "8"]


def saved(folder, seed: int):
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Folders a (trained), b (other values), config (no weights); exports trained.onnx (from a), random.onnx
    (random weights, seed 0, beside a's checkpoint) and plain.onnx (trained.onnx without rope_export metadata)."""
    root = tmp_path_factory.mktemp("weights")
    out = {"a": saved(root / "a", 5), "b": saved(root / "b", 6), "config": root / "config"}
    transformers.LlamaConfig(**SMALL).save_pretrained(out["config"])
    for name, extra in (("trained", []), ("random", ["--random-weights"])):
        out[name] = root / f"{name}.onnx"
        assert cli.main(["export", "--hf", str(out["a"]), *extra, "-o", str(out[name])]) == 0
    model = onnx.load_model(out["trained"])
    del model.metadata_props[:]
    out["plain"] = root / "plain.onnx"
    onnx.save_model(model, out["plain"])
    return out


def check(capsys, path, *argv) -> tuple[int, str]:
    """``rope-export check PATH ...``: (exit code, stdout and stderr with all whitespace removed: rich folds)."""
    capsys.readouterr()
    code = cli.main(["check", str(path), *FAST, *map(str, argv)])
    out, err = capsys.readouterr()
    return code, "".join((out + err).split())


def squeezed(text: str) -> str:
    return "".join(text.split())


def test_a_trained_export_is_checked_with_its_folder(files, capsys):
    for argv in ([], ["--hf", files["a"]], ["--weights", files["a"]]):
        code, out = check(capsys, files["trained"], *argv)
        assert code == 0 and f"weights{files['a']})" in out and "note:thefilewasexported" not in out, out


def test_summary_json_says_which_weights(files, capsys, tmp_path):
    summary = tmp_path / "summary.json"
    code, _ = check(capsys, files["random"], "--hf", files["a"], "--summary-json", summary)
    assert code == 0 and json.loads(summary.read_text())["weights"] == {"source": "random", "seed": 0}
    code, _ = check(capsys, files["trained"], "--summary-json", summary)
    assert code == 0 and json.loads(summary.read_text())["weights"] == {"source": "folder",
                                                                        "path": str(files["a"].resolve())}


def test_a_random_export_beside_a_checkpoint_is_checked_with_its_seed_and_says_so(files, capsys):
    code, out = check(capsys, files["random"], "--hf", files["a"])
    assert code == 0 and "randomweights,seed0)" in out, out
    assert squeezed(f"note: the file was exported with random weights (seed 0) and is compared with those, not with "
                    f"the checkpoint in {files['a']}; pass --weights {files['a']}") in out
    # asked to compare it with the trained weights: it fails, and the note says why
    code, out = check(capsys, files["random"], "--weights", files["a"])
    assert code == 1 and squeezed(f"note: the file was exported with random weights (seed 0) but is compared with "
                                  f"the weights in {files['a']}, as asked") in out, out


def test_a_file_from_a_is_not_b(files, capsys):
    code, out = check(capsys, files["trained"], "--weights", files["b"])
    assert code == 1 and squeezed(f"exported with the weights in {files['a']} but is compared with the weights in "
                                  f"{files['b']}, as asked") in out, out
    code, out = check(capsys, files["trained"], "--random-weights")
    assert code == 1 and squeezed("is compared with random weights (seed 0), as asked") in out, out


def test_a_file_without_metadata_uses_the_checkpoint_beside_hf(files, capsys):
    """export --hf's rule: the --hf folder's checkpoint (random weights here were the old false FAIL)."""
    code, out = check(capsys, files["plain"], "--hf", files["a"])
    assert code == 0 and f"weights{files['a']})" in out, out
    code, out = check(capsys, files["plain"], "--hf", files["config"])
    assert code == 1 and squeezed(f"random weights (seed 0): the file records no weights and {files['config']} "
                                  "holds no checkpoint") in out, out


def test_the_recorded_folder_comes_first_and_a_gone_one_is_found_beside_hf(files, capsys, tmp_path):
    copy = shutil.copytree(files["a"], tmp_path / "copy")
    code, out = check(capsys, files["trained"], "--hf", copy)  # the recorded folder is there: used, and said
    assert code == 0 and squeezed(f"compared with the weights the file records ({files['a']}), not the checkpoint "
                                  f"in {copy}") in out, out
    model = onnx.load_model(files["trained"])  # as if the folder had moved since the export
    for prop in model.metadata_props:
        if prop.key == "rope_export.hf_weights":
            prop.value = str(tmp_path / "gone")
    moved = tmp_path / "moved.onnx"
    onnx.save_model(model, moved)
    code, out = check(capsys, moved, "--hf", copy)
    assert code == 0 and squeezed(f"records ({tmp_path / 'gone'}) is not there; compared with the checkpoint in "
                                  f"{copy}") in out, out
    code, out = check(capsys, moved)
    assert code == 2 and "isnotthere;pass--weightsDIR" in out, out


def test_choose_weights_rules(tmp_path):
    gone = tmp_path / "gone"
    with pytest.raises(CheckError, match="exclude each other"):
        choose_weights(recorded=None, weights=tmp_path, random_weights=True)
    with pytest.raises(CheckError, match=r"records \(.*gone\) is not there; pass --weights DIR"):
        choose_weights(recorded=str(gone))
    chosen = choose_weights(recorded=None, recorded_seed=7)
    assert (chosen.folder, chosen.seed, chosen.note) == (None, 7, "")
    assert chosen.to_dict() == {"source": "random", "seed": 7}
    chosen = choose_weights(recorded=None, recorded_seed=7, seed=8)
    assert chosen.seed == 8 and "seed 7, compared with seed 8" in chosen.note
    chosen = choose_weights(recorded=str(tmp_path), recorded_seed=7, seed=8)  # a recorded folder: the seed is moot
    assert (chosen.folder, chosen.note) == (str(tmp_path), "")
