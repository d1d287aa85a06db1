"""The scale benchmark's yardsticks beside ``export --hf``: onnxruntime-genai's model builder and
onnxruntime's mobius on the same model folder, and a plain file copy of the exported weights on the
same disk.

* **the builder** (``python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p DTYPE -e cpu``, run
  in the work folder as a user runs it, so its default ``./cache_dir`` lands there) and **mobius**
  (``mobius build --config FOLDER OUT --dtype DTYPE``; the ``mobius`` extra) write the graph
  directly, without tracing: fast, but only for the families they know. Both read a
  ``save_pretrained`` folder (the builder wants a tokenizer too), so when either is installed the
  benchmark first writes one (``write_model_folder``: the size's config, random weights with the
  seed ``export --hf`` uses, safetensors, and a word-level tokenizer of the model's vocabulary) and
  every export of that run reads the same folder. Default flags on every side but the dtype. Not
  installed: the row is skipped with the reason.
* **the file copy**: ``cp`` of the exported ``.onnx.data`` beside itself, right after the export
  wrote it, so both run on the same disk with the same page cache; ``write_rate`` gives the
  export's own writing step (from its ``--summary-json``) in MB/s for the ratio.

``python -m rope_export.bench.scale_peers folder CONFIG_DIR OUT_DIR --dtype fp32`` writes the folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

BUILDER_MODULE = "onnxruntime_genai.models.builder"
BUILDER = "genai builder"  # the step's name in the benchmark's tables
MOBIUS = "mobius"
PEERS = (BUILDER, MOBIUS)  # the graph builders export --hf is held to (the faster of them)
COPY = "file copy"
FULL_TRACE = "export --hf --trace full"  # every layer traced (the default stamps per kind: rope_export.hf.stamping)
PACKAGE = "package genai --hf"  # a genai folder, as the builder writes one
WRITING_STEP = "writing "  # export --hf's step log: "writing PATH and its weights (...) to NAME.data"


def builder_missing() -> str:
    """'' when onnxruntime-genai's model builder can run here, else why not (one line)."""
    try:
        found = importlib.util.find_spec(BUILDER_MODULE) is not None
    except ImportError:  # onnxruntime_genai itself is missing
        found = False
    if not found:
        return "onnxruntime-genai is not installed (pip install 'rope-export[serve]')"
    return ""


def builder_command(folder: Path, output: Path, dtype: str) -> list[str]:
    """The builder on ``folder`` for the CPU, in ``dtype`` (fp32, fp16, bf16: the same names), as a user types it."""
    return [sys.executable, "-m", BUILDER_MODULE, "-i", str(folder), "-o", str(output), "-p", dtype, "-e", "cpu"]


def mobius_missing() -> str:
    """'' when onnxruntime's mobius can run here, else why not (one line)."""
    try:
        found = importlib.util.find_spec("mobius") is not None and importlib.util.find_spec("onnx_shape_inference")
    except ImportError:
        found = False
    return "" if found else "mobius is not installed (pip install 'rope-export[mobius]')"


def mobius_command(folder: Path, output: Path, dtype: str) -> list[str]:
    """``mobius build --config FOLDER OUT`` in ``dtype`` (its default is f32), through its console script's module."""
    names = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}
    return [sys.executable, "-m", "mobius", "build", "--config", str(folder), str(output), "--dtype", names[dtype]]


def copy_command(source: Path, target: Path) -> list[str]:
    return ["cp", "--", str(source), str(target)]


def write_rate(export_steps: list[dict], data_bytes: int) -> float | None:
    """Bytes per second of ``export --hf``'s writing step (graph and weights), or None without one."""
    seconds = [s["seconds"] for s in export_steps if s.get("name", "").startswith(WRITING_STEP)]
    return data_bytes / seconds[0] if seconds and seconds[0] > 0 else None


def write_model_folder(config_dir: str | os.PathLike, folder: str | os.PathLike, *, dtype: str = "fp16",
                       seed: int = 0, progress=None) -> Path:
    """``folder``: config, random weights (``seed``, as ``export --hf --random-weights`` builds them) as
    safetensors, and a tokenizer (the builder refuses a folder without one)."""
    from rope_export.hf import build_hf_model

    say = progress or (lambda message: None)
    folder = Path(folder)
    say(f"building the model from {config_dir} (random weights, seed {seed})")
    model = build_hf_model(config_dir, dtype=dtype, seed=seed, random_weights=True)
    say(f"save_pretrained to {folder}")
    model.save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    del model
    say("writing a word-level tokenizer of the model's vocabulary")
    write_tokenizer(folder, config["vocab_size"], config.get("bos_token_id"), config.get("eos_token_id"))
    return folder


def write_tokenizer(folder: Path, vocab_size: int, bos: int | None, eos: int | list | None) -> None:
    """tokenizer.json and tokenizer_config.json: token ``t<i>`` is id i, bos/eos as the config names them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = eos[0] if isinstance(eos, list) else eos
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {name: f"t{i}" for name, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", **special).save_pretrained(str(folder))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rope_export.common.steps import StepLog

    parser = argparse.ArgumentParser(prog="python -m rope_export.bench.scale_peers",
                                     description="write the model folder the scale benchmark's exports all read")
    sub = parser.add_subparsers(dest="command", required=True)
    folder = sub.add_parser("folder", help="config, random weights (seed 0) and a tokenizer, save_pretrained")
    folder.add_argument("config")
    folder.add_argument("output")
    folder.add_argument("--dtype", default="fp16", choices=("fp32", "fp16", "bf16"))
    args = parser.parse_args(argv)
    steps = StepLog(lambda message: print(message, flush=True))
    write_model_folder(args.config, args.output, dtype=args.dtype, progress=steps)
    steps.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
