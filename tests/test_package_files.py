"""The files a package is expected to carry: LICENSE (and pip metadata that points at it), CITATION.cff
(valid, the paper preferred, the package's version), CHANGELOG.md (Keep a Changelog, an Unreleased
section) and py.typed (declared as package data). The installed wheel's copies are checked by
tests/test_install.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aqr._version import __version__

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _read(name: str) -> str:
    path = ROOT / name
    if not path.is_file():
        pytest.skip(f"{name} is not in this checkout")
    return path.read_text(encoding="utf-8")


def test_the_license_is_the_mit_license_pyproject_names() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    text = _read("LICENSE")
    assert text.startswith("MIT License\n") and "Permission is hereby granted, free of charge" in text
    assert re.search(r"^Copyright \(c\) \d{4} \S", text, flags=re.M)


def test_the_citation_file_cites_the_paper_and_the_software() -> None:
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load(_read("CITATION.cff"))
    for key in ("cff-version", "message", "title", "authors", "version"):
        assert cff.get(key), key
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert str(cff["version"]) == __version__
    assert cff["license"] == _pyproject()["project"]["license"]
    paper = cff["preferred-citation"]
    assert paper["title"] == "Test Time Adaptation Using Adaptive Quantile Recalibration"
    assert [a["family-names"] for a in paper["authors"]] == ["Mehrbod", "Vianna", "Nanfack", "Wolf", "Belilovsky"]
    assert all(a.get("given-names") for a in paper["authors"])


def test_the_changelog_keeps_an_unreleased_section() -> None:
    text = _read("CHANGELOG.md")
    assert text.startswith("# Changelog\n") and "Keep a Changelog" in text
    sections = re.findall(r"^## \[([^\]]+)\]", text, flags=re.M)
    assert sections and sections[0] == "Unreleased"
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^### (Added|Changed|Deprecated|Removed|Fixed|Security)$", unreleased, flags=re.M)


def test_py_typed_ships_as_package_data() -> None:
    assert (ROOT / "src" / "aqr" / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["aqr"]
