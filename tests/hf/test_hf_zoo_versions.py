"""docs/versions.md's transformers version table is the one rendered from what the zoo recorded per version."""

from __future__ import annotations

from pathlib import Path

from hf_zoo_versions import DETAILS, DOC, counts, doc_table, load, render_details, render_table

from rope_export.hf import versions


def test_the_version_table_and_its_details_are_rendered_from_the_records():
    results = load()
    assert doc_table(Path(DOC).read_text()) == render_table(results), \
        "docs/versions.md's version table is not the one rendered from tests/hf/hf_zoo_versions.json"
    assert Path(DETAILS).read_text() == render_details(results)


def test_the_tested_range_was_run_through_the_zoo():
    """Both ends of the tested range (and so the locked version) have zoo results, and the newest ran whole."""
    results = load()
    oldest, newest = versions.TESTED
    assert oldest in results and newest in results, f"run make hf-zoo-version for {oldest} / make hf-zoo"
    assert results[newest]["run"] == "whole"
    assert counts(results[newest]["types"])["pass"] >= 100


def test_counts_separate_types_a_release_lacks_from_failures():
    types = {"a": {"status": "pass", "reason": ""}, "b": {"status": "refused", "reason": "why"},
             "c": {"status": "fail", "reason": "the tiny config does not build: KeyError: 'c'"},
             "d": {"status": "fail", "reason": "AssertionError: max error 3"}}
    assert counts(types) == {"pass": 1, "refused": 1, "fail": 1, "absent": 1}
