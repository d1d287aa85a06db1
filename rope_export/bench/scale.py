"""Scale benchmark: a real-size transformers model through every step, against a plain export.

``rope-export bench --sections scale`` builds a Llama config of a real model's shape (random fp16
weights), then runs each step in its own process, so that each peak RSS is that step's alone
(``os.wait4``'s ``ru_maxrss``) and the wall time includes start-up, as a user sees it:

0. ``model folder`` (only when onnxruntime-genai's builder is installed): the config's model with
   random weights (seed 0) and a tokenizer, ``save_pretrained``; every export below reads it
   (``rope_export.bench.scale_peers``);
1. ``plain export``: what a user does without rope-export: ``from_config`` (``from_pretrained`` of
   the folder), a plain ``torch.onnx.export(..., dynamo=True)`` of the same causal LM with the same
   inputs and dynamic dims, ``ONNXProgram.save(..., external_data=True)``;
2. ``export --hf``: ``rope-export export --hf CONFIG --dtype DTYPE`` (one rotary node per tensor),
   then ``file copy``: ``cp`` of the weights it wrote, the disk's speed for its write rate;
   ``genai builder``: onnxruntime-genai's model builder on the same folder and dtype, when installed;
3. ``lower <target>`` for every target, on the file of step 2;
4. ``fuse``: ``rope-export fuse`` on the plain export of step 1;
5. ``check``: ``rope-export check`` of the file of step 2 against transformers (the model rebuilt from
   the config and seed the file records), every runner, with its own step log (``--summary-json``);
   onnxruntime runs in pieces where one session would not fit (``rope_export.check.pieces``).

Sizes (``SIZES``): ``1b`` (Llama-3.2-1B shape, 2.47 GB), ``8b`` (Llama-3.1-8B shape, 16.1 GB;
behind ``--scale-sizes 8b``), and ``2gb`` (three Llama-3.1-8B layers with tied embeddings,
2.36 GB: the smallest honest > 2 GB case, used by the slow test). Before a size runs, its memory
and disk plan (``memory_plan``: each step's peak on paper) is compared with what the machine has
free, and the size is skipped, with the reason, when it does not fit. Reported, not asserted: peak
RSS of ``export --hf`` <= 1.3x the weight bytes and <= the plain export's, wall time <= 1.2x the
plain export's; with the builder, wall time and peak RSS <= the builder's.

``python -m rope_export.bench.scale plain CONFIG_DIR OUT.onnx`` runs step 1 alone.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rope_export.bench.scale_peers import (
    BUILDER,
    COPY,
    FULL_TRACE,
    MOBIUS,
    PACKAGE,
    PEERS,
    builder_command,
    builder_missing,
    copy_command,
    mobius_command,
    mobius_missing,
)
from rope_export.bench.scale_ratios import RSS_GOAL, TIME_GOAL, goals, ratios  # noqa: F401 - the section's API
from rope_export.check.runners import PIECE_LIMIT
from rope_export.common.bounds import format_bytes
from rope_export.files.onnx_files import data_files

TARGETS = ("trt-plugin", "onnx", "ort", "decomposed")
CHECK_FULL = "check full trace"  # rope-export check of the --trace full file

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
          "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 131072, "vocab_size": 128256,
          "num_attention_heads": 32, "num_key_value_heads": 8, "bos_token_id": 128000, "eos_token_id": 128001}
_LLAMA_8B = {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "head_dim": 128,
             "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0}}
SIZES: dict[str, dict] = {
    # deep and narrow: SmolLM-135M's shape (30 layers, hidden 576, 9 heads, 3 kv heads, tied), where the cost is layers
    "135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "head_dim": 64,
             "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
             "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
             "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
    "1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
           "tie_word_embeddings": True, "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0}},
    "8b": {**_LLAMA_8B, "num_hidden_layers": 32, "tie_word_embeddings": False},
    "2gb": {**_LLAMA_8B, "num_hidden_layers": 3, "tie_word_embeddings": True},
}
SIZE_NAMES = {"135m": "SmolLM-135M shape (30 layers, hidden 576)", "1b": "Llama-3.2-1B shape",
              "8b": "Llama-3.1-8B shape", "2gb": "3 Llama-3.1-8B layers, tied embeddings"}

def write_config(size: str, folder: Path) -> Path:
    """``folder/config.json`` of ``size``; returns the folder."""
    if size not in SIZES:
        raise ValueError(f"unknown scale size {size!r}; choose from {', '.join(SIZES)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SIZES[size], indent=2) + "\n")
    return folder


def weight_plan(size: str, dtype: str = "fp16") -> dict:
    """Parameters, weight bytes and the largest tensor of ``size``, counted on the meta device (no memory)."""
    import torch
    import transformers

    from rope_export.exporting.core import DTYPES

    config = transformers.AutoConfig.for_model(**SIZES[size])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    params = list(model.parameters())  # tied parameters once
    item = DTYPES[dtype].itemsize
    return {"parameters": sum(p.numel() for p in params), "weight_bytes": sum(p.numel() for p in params) * item,
            "largest_tensor_bytes": max(p.numel() for p in params) * item, "vocab": config.vocab_size,
            "dtype": dtype}


BUILDER_RSS = 1.3  # onnxruntime-genai's builder over the weights (1.27x measured on a 1.1B fp32 model, issue 26)
RUNTIME = 1.5e9  # Python, torch, transformers, onnx/onnxruntime and the graph, in every step's process
CHECK_TOKENS = 2 * (3 * 16 + 128 + 2 * 16)  # tokens of check's default cases (batch 2): logits kept per token


def memory_plan(plan: dict, dtype: str = "fp16") -> dict[str, float]:
    """Each step's peak RSS on paper (bytes), from the weight plan.

    * export: the weights once, one tensor in flight, the runtime;
    * check, reference phase: the transformers model (the weights once, one tensor's worth of
      initialization), its activations at the short default cases (a few MB), the outputs kept for
      the comparison (logits of every case: ``CHECK_TOKENS`` x vocab, twice: expected and actual);
    * check, runner phase: onnxruntime in pieces of at most ``runners.PIECE_LIMIT`` once one session
      (3x the half-precision weights) does not fit, plus the runtime and those outputs;
    * lower and fuse: the graph and the runtime (the weights stay on disk).
    """
    weights, largest = plan["weight_bytes"], plan["largest_tensor_bytes"]
    outputs = 2 * CHECK_TOKENS * plan["vocab"] * _itemsize(dtype)
    reference = weights + largest + RUNTIME + outputs
    runners = min(3 * weights, PIECE_LIMIT) + RUNTIME + outputs
    return {"export": weights + largest + RUNTIME, "check reference": reference, "check runners": runners,
            "lower": RUNTIME, BUILDER: BUILDER_RSS * weights + RUNTIME}


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def fits(plan: dict) -> str:
    """'' when this machine has the memory and disk for the plan now, else why not."""
    steps = memory_plan(plan, plan.get("dtype", "fp16"))
    step, need_memory = max(steps.items(), key=lambda item: item[1])
    available = _mem_available()
    if available is not None and need_memory > available:
        return (f"needs about {format_bytes(need_memory)} of memory (its largest step, {step}: "
                f"{', '.join(f'{k} {format_bytes(v)}' for k, v in steps.items())}); {format_bytes(available)} "
                "available now")
    copies = 4 if plan.get("builder") else 3  # plain + ours + one lowered, fused or copied file (+ the model folder)
    need_disk = copies * plan["weight_bytes"] + 1e9
    free = shutil.disk_usage(plan["work"]).free
    if need_disk > free:
        return (f"needs about {format_bytes(need_disk)} of disk in {plan['work']} ({copies} copies of the weights); "
                f"{format_bytes(free)} free")
    return ""


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- one step, one process ------------------------------------------------------------------

def run_step(name: str, argv: list[str], log: Path, outputs: list[Path] = (), *, cwd: Path | None = None,
             cold: bool = False) -> dict:
    """Run ``argv`` in a child process (in ``cwd``); its wall time, peak RSS (``ru_maxrss``), exit code and files.

    The page cache's dirty pages are written out first (``sync``, not timed): a step that writes gigabytes
    would otherwise slow the next one down while the kernel writes them back. ``cold``: the page cache is
    dropped too (root only: ``/proc/sys/vm/drop_caches``), so the step reads its libraries and the checkpoint
    from disk, as a user's first command after copying a model does."""
    from rope_export.files.onnx_files import output_files

    if hasattr(os, "sync"):
        os.sync()
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    files = [{"path": str(p), "bytes": n} for path in outputs for p, n in output_files(path)]
    return {"step": name, "command": shlex.join(argv), "seconds": time.perf_counter() - start, "peak_rss": peak,
            "returncode": proc.returncode, "files": files, "log": str(log)}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rope_export.cli", *args]


def _tail(log: str, lines: int = 3) -> str:
    text = Path(log).read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


def run_size(size: str, work: Path, *, dtype: str = "fp16", reps: int = 1, keep: bool = False, check: bool = True,
             builder: bool = True, full_trace: bool = False, package: bool = True, cold: bool = False,
             check_args: tuple[str, ...] = (), say: Callable[[str], None] = lambda message: None,
             after_step: Callable[[str, list[Path]], None] | None = None) -> dict:
    """Every step of the scale benchmark on ``size`` in ``work``; the JSON-ready result.

    ``builder``: also run the graph builders (onnxruntime-genai's, mobius) that are installed (then every export
    reads one ``save_pretrained`` folder, ``scale_peers``); a row says why when one cannot run.
    ``full_trace``: also ``export --hf --trace full`` (its own row, its file checked too when ``check``).
    ``package``: also ``package genai --hf`` (a genai folder, as the builder writes). ``cold``: drop the page cache
    before each step (``run_step``). ``check_args`` are added to the ``rope-export check`` command.
    ``after_step(name, outputs)`` is called after each step, before its outputs may be removed
    (the slow test inspects the files there; the check step's output is its report folder)."""
    work.mkdir(parents=True, exist_ok=True)
    missing = {BUILDER: builder_missing(), MOBIUS: mobius_missing()} if builder else \
        {peer: "left out (--scale-no-builder)" for peer in PEERS}
    peers = [peer for peer in PEERS if not missing[peer]]
    plan = {**weight_plan(size, dtype), "work": str(work), "builder": bool(peers)}
    result = {"size": size, "shape": SIZE_NAMES[size], **plan, "memory_plan": memory_plan(plan, dtype), "steps": [],
              "cold": cold}
    why_not = fits(plan)
    if why_not:
        return {**result, "status": "skipped", "reason": why_not}
    config = write_config(size, work / f"{size}-config")
    model, plain, full = work / "model.onnx", work / "plain.onnx", work / "model.full.onnx"
    folder, packaged = work / f"{size}-model", work / "genai"
    steps = result["steps"]

    def step(name: str, argv: list[str], outputs=(), cwd: Path | None = None) -> dict:
        say(f"scale {size}: {name}")
        log = work / f"{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}.log"
        record = run_step(name, argv, log, list(outputs), cwd=cwd, cold=cold)
        steps.append(record)
        if record["returncode"] != 0:
            raise RuntimeError(f"{name} failed (exit {record['returncode']}): {_tail(record['log'])}")
        say(f"scale {size}: {name}: {record['seconds']:.0f} s, peak RSS {format_bytes(record['peak_rss'])}")
        if after_step is not None:
            after_step(name, list(outputs))
        return record

    try:
        step("warm-up", [sys.executable, "-c", "import torch, transformers, onnxscript, onnx_ir, rope_export.hf"])
        source = config
        if peers:  # the builders read weights (and a tokenizer): every export of this run reads that folder
            step("model folder", [sys.executable, "-m", "rope_export.bench.scale_peers", "folder", str(config),
                                  str(folder), "--dtype", dtype])
            source = folder
        for rep in range(reps):  # the exports take turns; their order reverses every repetition
            runs = _exports(source, work, dtype, full_trace, package, peers)
            for name, argv, output in runs if rep % 2 == 0 else runs[::-1]:
                record = step(name, argv, [output], cwd=work if name in PEERS else None)
                if name in ("export --hf", FULL_TRACE):
                    record["note"] = _trace_of(work / f"{_SUMMARIES[name]}.summary.json")
                if check and rep == 0 and name == FULL_TRACE:  # the full trace's file checked like the default's
                    reports = work / "check-full-report"
                    checked = step(CHECK_FULL, check_command(full, reports, work / "check-full.summary.json",
                                                             check_args), [reports])
                    checked["note"] = check_note(reports / "check.json")
                if name == "export --hf" and rep == 0:  # the disk's speed, on the bytes just written
                    _copy_step(step, steps, model, work)
                if not keep and name not in ("plain export", "export --hf"):
                    _remove(output) if output.suffix == ".onnx" else shutil.rmtree(output, ignore_errors=True)
                    shutil.rmtree(work / "cache_dir", ignore_errors=True)  # the builder's default cache
        steps += [{"step": peer, "skipped": missing[peer]} for peer in PEERS if missing[peer]]
        _later_steps(step, steps, model, plain, work, keep, check, check_args)
        for name in ("export.summary.json", "plain.summary.json", "check.summary.json", "full.summary.json"):
            if (work / name).is_file():
                result[name.split(".")[0] + "_steps"] = json.loads((work / name).read_text())["steps"]
    except RuntimeError as exc:
        return {**result, "status": "failed", "reason": str(exc)}
    finally:
        if not keep:
            for path in (model, plain, full):
                _remove(path)
            for path in (folder, packaged, work / "builder", work / "mobius"):
                shutil.rmtree(path, ignore_errors=True)
    return {**result, "status": "measured", "ratios": ratios(result)}


_SUMMARIES = {"export --hf": "export", FULL_TRACE: "full"}


def _exports(source: Path, work: Path, dtype: str, full_trace: bool, package: bool, peers: list[str]) -> list:
    """(row, argv, output) of every export of one repetition, default flags on every side but the dtype."""
    plain = work / "plain.onnx"
    runs = [("plain export", [sys.executable, "-m", __name__, "plain", str(source), str(plain), "--dtype", dtype,
                              "--summary-json", str(work / "plain.summary.json")], plain),
            ("export --hf", _cli("export", "--hf", str(source), "--dtype", dtype, "-o", str(work / "model.onnx"),
                                 "--summary-json", str(work / "export.summary.json")), work / "model.onnx")]
    if full_trace:
        runs.append((FULL_TRACE, _cli("export", "--hf", str(source), "--dtype", dtype, "--trace", "full", "-o",
                                      str(work / "model.full.onnx"), "--summary-json", str(work / "full.summary.json")),
                     work / "model.full.onnx"))
    if package:
        runs.append((PACKAGE, _cli("package", "genai", "--hf", str(source), "--dtype", dtype, "-o",
                                   str(work / "genai")), work / "genai"))
    if BUILDER in peers:
        runs.append((BUILDER, builder_command(source, work / "builder", dtype), work / "builder"))
    if MOBIUS in peers:
        runs.append((MOBIUS, mobius_command(source, work / "mobius", dtype), work / "mobius"))
    return runs


def _copy_step(step, steps: list, model: Path, work: Path) -> None:
    copied = work / "copy.data"
    data = [d for d in data_files(model) if d.is_file()]
    if data:
        step(COPY, copy_command(data[0], copied), [copied])
        copied.unlink(missing_ok=True)
    else:
        steps.append({"step": COPY, "skipped": "the weights are inside the .onnx (32 MB or less)"})


def _later_steps(step, steps: list, model: Path, plain: Path, work: Path, keep: bool, check: bool,
                 check_args: tuple[str, ...]) -> None:
    """lower (every target) and check on the default export's file, fuse on the plain export."""
    for target in TARGETS:
        lowered = work / f"model.{target}.onnx"
        step(f"lower {target}", _cli("lower", str(model), "-t", target, "-o", str(lowered)), [lowered])
        if not keep:
            _remove(lowered)
    fused = work / "plain.fused.onnx"
    record = step("fuse", _cli("fuse", str(plain), "-o", str(fused)), [fused])
    record["note"] = _tail(record["log"], 1)
    if not keep:
        _remove(fused)
    if check:
        reports = work / "check-report"
        record = step("check", check_command(model, reports, work / "check.summary.json", check_args), [reports])
        record["note"] = check_note(reports / "check.json")
    else:
        steps.append({"step": "check", "skipped": "left out (--scale-no-check)"})


def _trace_of(summary: Path) -> str:
    try:
        return "trace " + json.loads(summary.read_text()).get("trace", "?")
    except (OSError, ValueError):
        return "no summary"


def check_command(model: Path, reports: Path, summary: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """``rope-export check`` of the exported file against transformers (from the config and seed it records)."""
    return _cli("check", str(model), "--report", str(reports), "--summary-json", str(summary), *extra)


def check_note(report_json: Path) -> str:
    """What the check found, in one line: each runner's status and largest error, how onnxruntime ran."""
    try:
        report = json.loads(report_json.read_text())
    except (OSError, ValueError):
        return "no check.json"
    parts = []
    for r in report.get("runners", []):
        sweep = (r.get("rotary_sweep") or {}).get("status")
        if r["status"] == "skipped" and sweep in (None, "skipped"):  # cannot run here at all (no GPU, no TensorRT)
            continue
        text = f"{r['runner']} {r['status']}"
        if r.get("max_abs_error") is not None:
            text += f" (max abs {r['max_abs_error']:.2g}"
            pieces = re.search(r"run in (\d+) pieces", r.get("reason", ""))
            text += f", {pieces.group(1)} pieces)" if pieces else ")"
        ratios = [s["ratio_to_pytorch"] for stats in r.get("cases", {}).values() for s in stats
                  if s.get("ratio_to_pytorch") is not None]
        if ratios:
            text += f", worst {max(ratios):.2f}x PyTorch's own fp error"
        layers = r.get("error_by_layer") or {}
        if layers:
            first = layers.get("first_outside")
            text += (f", leaves PyTorch's envelope at layer {first}" if first is not None else
                     f", within PyTorch's envelope at all {len(layers.get('errors', []))} layers")
        if sweep:
            text += f", nodes alone {sweep}"
        parts.append(text)
    verdict = "passed" if report.get("passed") else "FAILED"
    return f"{verdict} against {report.get('reference', '?').split(' (')[0]}: " + "; ".join(parts)


def _remove(path: Path) -> None:
    from rope_export.files.onnx_files import remove

    remove(path)


def run_section(sizes: tuple[str, ...], work: Path, *, dtype: str = "fp16", reps: int = 1, keep: bool = False,
                check: bool = False, builder: bool = True, full_trace: bool = False, package: bool = True,
                cold: bool = False, say: Callable[[str], None] = lambda message: None) -> dict:
    results = []
    for size in sizes:
        results.append(run_size(size, Path(work) / size, dtype=dtype, reps=reps, keep=keep, check=check,
                                builder=builder, full_trace=full_trace, package=package, cold=cold, say=say))
        if results[-1]["status"] != "measured":
            say(f"scale {size}: {results[-1]['status']}: {results[-1]['reason']}")
    return {"title": "real-size model, each step in its own process", "sizes": results, "work": str(work)}


# -- the plain export (step 1), run as its own process ---------------------------------------

def plain_export(config_dir: str | os.PathLike, output: str | os.PathLike, *, dtype: str = "fp16", seed: int = 0,
                 progress: Callable[[str], None] | None = None) -> None:
    """What a user writes without rope-export: from_config, torch.onnx.export(dynamo=True), save with external data.

    Same wrapper, example inputs, names and dynamic dims as ``export --hf``, no rotary hook."""
    import torch
    import transformers

    from rope_export.exporting.core import DTYPES
    from rope_export.hf import CausalLMWithCache, hf_example_inputs, hf_io_names
    from rope_export.hf.loading import weights_beside

    say = progress or (lambda message: None)
    if weights_beside(config_dir) is not None:  # a checkpoint folder: what a user loads
        say("loading the model (transformers from_pretrained)")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(config_dir), local_files_only=True,
                                                                  attn_implementation="eager",
                                                                  dtype=DTYPES[dtype]).eval()
    else:
        say("building the model (transformers from_config)")
        config = transformers.AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                              dtype=DTYPES[dtype]).eval()
    inputs = hf_example_inputs(model)
    layers = (len(inputs) - 2) // 2
    batch, seq = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("seq", min=1, max=2**20)
    past = torch.export.Dim("past", min=0, max=2**20)
    names_in, names_out = hf_io_names(layers)
    say("torch.onnx.export(..., dynamo=True)")
    with torch.no_grad():
        program = torch.onnx.export(CausalLMWithCache(model, layers).eval(), inputs, dynamo=True, opset_version=23,
                                    input_names=names_in, output_names=names_out,
                                    dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq},
                                                    tuple({0: batch, 2: past} for _ in range(2 * layers))))
    say("ONNXProgram.save(..., external_data=True)")
    program.save(str(output), external_data=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rope_export.common.steps import StepLog

    parser = argparse.ArgumentParser(prog="python -m rope_export.bench.scale", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plain = sub.add_parser("plain", help="the plain torch.onnx.export of a transformers config (step 1)")
    plain.add_argument("config")
    plain.add_argument("output")
    plain.add_argument("--dtype", default="fp16", choices=("fp32", "fp16", "bf16"))
    plain.add_argument("--summary-json", default=None)
    args = parser.parse_args(argv)
    steps = StepLog(lambda message: print(message, flush=True))
    plain_export(args.config, args.output, dtype=args.dtype, progress=steps)
    steps.finish()
    if args.summary_json:
        steps.write_json(args.summary_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
