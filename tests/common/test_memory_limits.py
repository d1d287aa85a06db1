"""The memory pre-check counts what the process may really allocate, and an allocation that fails anyway is one line,
exit 2, naming the size (issue 40).

A preset of 10**6 heads (16 GB of float32 weights) passed the pre-check on a machine with 20 GB available but a
process limited by ``ulimit -v``, and ended in torch's "can't allocate memory" as an internal error. Each case runs
the command line in a child process under a real RLIMIT_AS.
"""

from __future__ import annotations

import ast
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

LIMIT = 4 * 10**9  # the child's address-space limit: more than Python with torch maps, less than one q/k/v/o matrix

CHILD = textwrap.dedent("""
    import sys
    from rope_export.common import bounds
    if sys.argv[1] == "no-precheck":  # the pre-check fooled: the allocation itself fails in torch
        bounds.memory_limits = lambda: []
    from rope_export.cli import main
    raise SystemExit(main(sys.argv[2:]))
""")


def run_limited(args: list[str], mode: str = "") -> subprocess.CompletedProcess:
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    return subprocess.run([sys.executable, "-c", CHILD, mode, *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)


def huge_heads_preset(tmp_path: Path) -> Path:
    tiny = (Path(__file__).parents[2] / "models" / "tiny.toml").read_text()
    path = tmp_path / "huge-heads.toml"
    path.write_text(tiny.replace("num_heads = 4", "num_heads = 1000000").replace("num_kv_heads = 2",
                                                                                  "num_kv_heads = 1000000"))
    return path


def test_the_address_space_limit_is_counted():
    code = "from rope_export.common import bounds; print(bounds.memory_limits())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT)))
    assert "address-space limit (ulimit -v) of 4.00 GB" in result.stdout, result.stdout + result.stderr
    limits = ast.literal_eval(result.stdout)
    room = next(n for n, what in limits if "ulimit -v" in what)
    assert 0 < room < LIMIT  # less what the process maps already


def test_a_preset_of_a_million_heads_is_refused_before_it_is_built(tmp_path):
    result = run_limited(["export", "--preset", str(huge_heads_preset(tmp_path)), "-o", str(tmp_path / "m.onnx")])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("rope-export export: error: the attention block "
                                                                       "would allocate 16.38 GB")
    assert "this process may still map under its address-space limit (ulimit -v) of 4.00 GB" in result.stderr
    assert not (tmp_path / "m.onnx").exists()


def test_an_allocation_that_fails_anyway_is_one_line_naming_its_size(tmp_path):
    result = run_limited(["export", "--preset", str(huge_heads_preset(tmp_path)), "-o", str(tmp_path / "m.onnx")],
                         "no-precheck")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("rope-export export: error: could not allocate 4.10 GB"), result.stderr
    assert "use smaller sizes" in result.stderr and "internal error" not in result.stderr
