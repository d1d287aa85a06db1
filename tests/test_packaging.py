"""The wheel ships every package folder and the presets (pyproject lists packages explicitly)."""

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "rope_export").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found | {"rope_export.models"} == set(config["packages"])
    assert config["package-dir"]["rope_export.models"] == "models"
    assert config["package-data"]["rope_export.models"] == ["*.toml"]


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "models").glob("*.toml")))
def test_presets_are_importable_as_package_data(name):
    from importlib import resources

    assert (resources.files("rope_export.models") / f"{name}.toml").is_file()
