"""The lock, the tested range and the drift lane's report (scripts/versions.py, rope_export.hf.versions)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from rope_export.hf import versions

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import versions as lock_tool  # noqa: E402

LOCK = ROOT / "requirements" / "lock.txt"
OLDEST = ROOT / "requirements" / "oldest.txt"


def _lower_bounds() -> dict[str, str]:
    """name -> the version after '>=' of every requirement in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    return {lock_tool.canonical(name): version
            for name, version in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;<]*)', text)}


def test_every_installed_package_is_the_locked_version():
    """make test installs with --constraint requirements/lock.txt: what runs here is what the lock says."""
    if os.environ.get("ROPE_EXPORT_NO_LOCK"):
        pytest.skip("the drift lane / oldest lane installs without the lock on purpose (ROPE_EXPORT_NO_LOCK)")
    lock = lock_tool.read_pins(LOCK)
    assert lock["torch"].startswith("2.13.0") and "transformers" in lock
    off = {name: (version, lock.get(name)) for name, version in lock_tool.installed().items()
           if lock.get(name) != version}
    assert not off, f"installed (version, locked version) differ from the lock: {off}; run make test (or make lock)"


def test_the_lower_bounds_are_the_oldest_versions_tested():
    """pyproject.toml's '>=' bounds equal requirements/oldest.txt, which make test-oldest installs."""
    oldest, bounds = lock_tool.read_pins(OLDEST), _lower_bounds()
    runtime = ("torch", "numpy", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "polygraphy", "rich", "transformers")
    for name in runtime:
        assert name in bounds, f"pyproject.toml has no lower bound for {name}"
        assert name in oldest and Version(oldest[name]) == Version(bounds[name]), \
            f"{name}: pyproject.toml says >={bounds[name]}, requirements/oldest.txt says {oldest.get(name)}"


def test_the_tested_transformers_range_is_the_oldest_bound_and_the_locked_version():
    assert versions.TESTED == (lock_tool.read_pins(OLDEST)["transformers"], lock_tool.read_pins(LOCK)["transformers"])


@pytest.mark.parametrize(("version", "tested"), [
    (versions.TESTED[0], True), (versions.TESTED[1], True),
    ("4.0.0", False), ("99.0.0", False), (versions.TESTED[1] + ".dev0", False), (versions.TESTED[1] + "rc1", False),
])
def test_a_version_outside_the_tested_range_gets_one_line(version, tested):
    note = versions.untested_note(version)
    if tested:
        assert note is None
    else:
        assert note is not None and "\n" not in note
        assert version in note and versions.TESTED[0] in note and versions.TESTED[1] in note


def test_the_installed_transformers_is_judged():
    installed = metadata.version("transformers")
    assert versions.installed_version() == installed
    assert (versions.untested_note() is None) == versions.is_tested(installed)


def test_changes_lists_what_moved_between_two_locks():
    old = {"a": "1.0", "b": "2.0", "gone": "3"}
    new = {"a": "1.0", "b": "2.1", "new": "0.1"}
    assert lock_tool.changes(old, new) == [("b", "2.0", "2.1"), ("gone", "3", "-"), ("new", "-", "0.1")]


def test_read_pins_reads_a_written_lock(tmp_path):
    lock = tmp_path / "lock.txt"
    lock_tool.write_lock({"torch": "2.13.0+cpu", "onnx": "1.23.2"}, lock)
    assert lock_tool.read_pins(lock) == {"torch": "2.13.0+cpu", "onnx": "1.23.2"}
    assert lock.read_text().startswith("#")


def test_the_drift_report_names_the_failed_tests_of_a_real_pytest_run(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "def test_good():\n    assert 1\n\ndef test_bad():\n    assert 1 == 2, 'drifted'\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--junitxml={junit}", "-o", "addopts=", str(tmp_path / "test_two.py")],
                   cwd=tmp_path, capture_output=True, check=False)
    broken = lock_tool.failures(junit)
    assert [name for name, _ in broken] == ["test_two::test_bad"]
    assert "drifted" in broken[0][1]
    assert lock_tool.failures(tmp_path / "missing.xml")[0][0] == "(no test report)"


def test_export_hf_on_an_untested_transformers_warns_in_one_line_and_its_error_says_so(tmp_path, capsys, monkeypatch):
    """The real CLI on a real config; only the installed version it reads is another."""
    transformers = pytest.importorskip("transformers")
    from rope_export import cli

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path / "llama")
    transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4).save_pretrained(tmp_path / "gpt2")
    monkeypatch.setattr(versions, "installed_version", lambda: "99.1.0")

    assert cli.main(["export", "--hf", str(tmp_path / "llama"), "-o", str(tmp_path / "llama.onnx")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "untested" in line]
    assert warnings == [f"warning: {versions.untested_note('99.1.0')}"]

    assert cli.main(["export", "--hf", str(tmp_path / "gpt2"), "-o", str(tmp_path / "gpt2.onnx")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("rope-export export: error: gpt2 performs no rotary position embedding")
    assert error.endswith(f"({versions.untested_note('99.1.0')})")
    assert not (tmp_path / "gpt2.onnx").exists()


def _torch_table() -> dict[str, int]:
    """docs/versions.md's torch table: release -> failed tests."""
    text = (ROOT / "docs" / "versions.md").read_text()
    table = text.split("<!-- torch-table: begin -->")[1].split("<!-- torch-table: end -->")[0]
    header, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
                     if line.startswith("|") and not line.startswith("|---")]
    failed = header.index("failed")
    return {row[0]: int(row[failed]) for row in rows}


def test_the_torch_range_is_the_releases_that_passed():
    """pyproject.toml's torch range holds every release of docs/versions.md's torch table that passed, and no
    later minor release (untested); a release that failed is outside it."""
    from packaging.specifiers import SpecifierSet

    results = _torch_table()
    assert {"2.13.0", "2.14.1", "2.15.0"} <= set(results), results
    declared = SpecifierSet(re.search(r'"torch([<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1))
    passed = [Version(v) for v, failed in results.items() if failed == 0]
    assert passed and all(v in declared for v in passed), (declared, results)
    assert all(Version(v) not in declared for v, failed in results.items() if failed), (declared, results)
    newest = max(passed)
    assert Version(f"{newest.major}.{newest.minor + 1}.0") not in declared, declared
    assert lock_tool.read_pins(LOCK)["torch"].split("+")[0] in results  # the lock's torch is in the table
