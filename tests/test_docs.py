"""The documentation stays true to the code: the generated configuration reference is current, the README stays
short and keeps the two commands CI runs, and no relative link points at a missing file."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _config_docs():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_from_the_code():
    module = _config_docs()
    assert (ROOT / "docs" / "configuration.md").read_text() == module.render(), (
        "docs/configuration.md is out of date: run `python scripts/config_docs.py`"
    )


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; detail belongs under docs/"


def test_readme_keeps_the_two_commands():
    lines = {line.strip() for line in README.read_text().splitlines()}
    assert "./scripts/serve" in lines
    assert "./scripts/test" in lines


def test_relative_links_point_at_files():
    broken = []
    for page in [README, *DOCS]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)
