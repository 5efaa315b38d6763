"""The documentation site (mkdocs.yml): every page of docs/ is in its nav, the API reference names every
public name of ``aqr``, and ``mkdocs build --strict`` passes, and fails on a broken reference (as in
.ci/run). The build tests need the ``docs`` extra and skip without it."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aqr

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"


def _config() -> dict:
    yaml = pytest.importorskip("yaml")
    if not CONFIG.is_file():
        pytest.skip("mkdocs.yml is not in this checkout")
    return yaml.safe_load(CONFIG.read_text(encoding="utf-8"))


def _pages(nav: list) -> list[str]:
    out = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out.extend(_pages(value) if isinstance(value, list) else [value])
    return out


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_every_page_of_docs_is_in_the_nav() -> None:
    pages = _pages(_config()["nav"])
    on_disk = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(pages) == on_disk and pages[0] == "index.md" and "api.md" in pages


def test_the_api_reference_names_every_public_name() -> None:
    _config()
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = [_resolve(d) for d in re.findall(r"^::: ([\w.]+)$", text, flags=re.M)]
    for name in aqr.__all__:
        assert any(obj is getattr(aqr, name) for obj in documented), name
    for package in ("methods", "models"):
        assert getattr(aqr, package) in documented, package


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    _config()
    done = _build(CONFIG, tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()
    assert 'id="aqr.adapt.model.AQR"' in (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("broken", ["::: aqr.core.qmap.no_such_function", "[`AQR`][aqr.adapt.model.NoSuchClass]",
                                    "[a page](no_such_page.md)", "[a file](../no_such_file.md)"])
def test_a_broken_reference_fails_the_build(tmp_path: Path, broken: str) -> None:
    yaml = pytest.importorskip("yaml")
    config = _config()
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# A page\n\n{broken}\n", encoding="utf-8")
    config.update(docs_dir=str(docs), nav=["index.md"], hooks=[str(ROOT / h) for h in config.get("hooks", [])])
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            python = plugin["mkdocstrings"]["handlers"]["python"]
            python["paths"] = [str(ROOT / p) for p in python["paths"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    name = re.search(r"no_such_\w+|NoSuchClass", broken).group(0)
    assert re.search(rf"^(WARNING|ERROR) .*{name}", output, flags=re.M), output[-3000:]  # the build names it
