"""Kill ``onnx_files.write`` at every step it takes on disk and classify what a reader then finds there.

Run by tests/files/test_interrupted_writes.py in a process of its own (it forks: one fresh child per step):

    python kill_steps.py FOLDER OLD_LAYOUT NEW_LAYOUT DIRECT_IO SIGNALS

A step is every call that changes the file system: ``os`` ``open`` for writing (and ``open()`` of a file for
writing), ``mkdir``, ``pwrite``, ``ftruncate``, ``link``, ``replace``, ``rename``, ``unlink``, ``rmdir``.
A first child writes undisturbed and records its steps; then for each signal and each step k one child is
sent the signal just before its step k (SIGINT and SIGTERM are raised as the command line raises them,
``cli.signals_as_exceptions``), and the folder is read with onnx.load (each tensor from the file its
``location`` names; a missing or short file fails). After a SIGKILL one more write of the same path runs to
the end, and the folder is listed again (what the killed write left must be gone). Prints one JSON line per
run: step, signal, the child's exit status, what was found ("seed N", "mix: ...", "unreadable: ...",
"absent") and the folder's listing.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import signal
import sys
import traceback
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, os.path.dirname(__file__))
from test_onnx_files import mlp_model  # noqa: E402

from rope_export.cli import signals_as_exceptions  # noqa: E402
from rope_export.files import onnx_files  # noqa: E402

OLD, NEW, AFTER = 1, 2, 3  # seeds of the pair on disk, of the killed write, of the write after a SIGKILL
MUTATORS = ("mkdir", "pwrite", "ftruncate", "link", "replace", "rename", "unlink", "rmdir")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT
_STAGE = re.compile(r"\.m\.onnx\.[A-Za-z0-9_]{8}\.tmp")


LAYERS = 2  # two external weights: a per-tensor folder of two files


def model(seed: int) -> onnx.ModelProto:
    proto = mlp_model(layers=LAYERS, seed=seed)
    proto.doc_string = f"seed {seed}"  # the model's own record of which write it is
    return proto


def _name(arg) -> str:
    """A path argument without the random part of a staging folder's name (the same in every run)."""
    if isinstance(arg, (str, bytes, os.PathLike)):
        return _STAGE.sub(".m.onnx.STAGE.tmp", os.path.basename(os.fsdecode(arg)))
    return "fd"


def install(on_step) -> None:
    """Call ``on_step(description)`` before every call that changes the file system (this process only)."""
    for name in MUTATORS:
        real = getattr(os, name)

        def hooked(*args, _real=real, _name_=name, **kwargs):
            on_step(f"{_name_} {' '.join(_name(a) for a in args[:2])}")
            return _real(*args, **kwargs)

        setattr(os, name, hooked)
    real_open, real_builtin_open = os.open, builtins.open

    def os_open(path, flags, *args, **kwargs):
        if flags & WRITE_FLAGS:
            on_step(f"open {_name(path)}")
        return real_open(path, flags, *args, **kwargs)

    def builtin_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            on_step(f"open {_name(file)}")
        return real_builtin_open(file, mode, *args, **kwargs)

    os.open, builtins.open = os_open, builtin_open


def child(path: Path, layout: str, seed: int, on_step=None) -> int:
    """Fork a child that writes model(seed) to path; returns its exit status (128 + the signal when killed)."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            if on_step is not None:
                install(on_step)
            with signals_as_exceptions():
                onnx_files.write(model(seed), path, external=layout)
            status = 0
        except BaseException as exc:  # noqa: BLE001 - the child reports by its exit status
            signum = getattr(exc, "signum", None)
            status = 128 + signum if signum else 1
            if not signum:
                traceback.print_exc()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def classify(path: Path) -> str:
    """Which write's model and weights a reader finds at ``path``."""
    if not path.exists():
        return "absent"
    try:
        proto = onnx.load(str(path))  # each external tensor from the file its location names
    except Exception as exc:  # noqa: BLE001 - any failure to read is the finding
        return "unreadable: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    seed = int(proto.doc_string.split()[-1])
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    others = [s for s in (OLD, NEW, AFTER) if s != seed]
    want = {t.name: numpy_helper.to_array(t) for t in model(seed).graph.initializer}
    if weights.keys() == want.keys() and all(np.array_equal(weights[k], want[k]) for k in want):
        return f"seed {seed}"
    return f"mix: a model of seed {seed} with weights not its own (seeds {others} are the others)"


def listing(folder: Path) -> list[str]:
    return sorted(_name(p.name) + ("/" if p.is_dir() else "") for p in folder.iterdir())


def main(folder: str, old_layout: str, new_layout: str, direct_io: str, signals: str) -> None:
    os.environ["ROPE_EXPORT_DIRECT_IO"] = direct_io
    folder = Path(folder)
    pristine, work = folder / "pristine", folder / "work"
    pristine.mkdir()
    onnx_files.write(model(OLD), pristine / "m.onnx", external=old_layout)
    shutil.copytree(pristine, work)
    log = folder / "steps.txt"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # written by the child: os.write is no step

    def record(description):
        os.write(fd, (description + "\n").encode())

    if child(work / "m.onnx", new_layout, NEW, record) != 0:
        raise SystemExit("the undisturbed write failed")
    os.close(fd)
    steps = log.read_text().splitlines()
    print(json.dumps({"steps": steps, "found": classify(work / "m.onnx"), "listing": listing(work)}), flush=True)
    for signum in (getattr(signal, name) for name in signals.split(",")):
        for k in range(len(steps)):
            shutil.rmtree(work)
            shutil.copytree(pristine, work)
            count = [0]

            def kill_at_k(description, k=k, signum=signum, count=count):
                if count[0] == k:
                    os.kill(os.getpid(), signum)
                count[0] += 1

            status = child(work / "m.onnx", new_layout, NEW, kill_at_k)
            run = {"signal": signal.Signals(signum).name, "step": k, "before": steps[k],
                   "status": status, "found": classify(work / "m.onnx"), "listing": listing(work)}
            if signum == signal.SIGKILL:
                run["status_after"] = child(work / "m.onnx", new_layout, AFTER)
                run["found_after"], run["listing_after"] = classify(work / "m.onnx"), listing(work)
            print(json.dumps(run), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
