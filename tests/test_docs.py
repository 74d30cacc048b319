"""The user docs (README.md, docs/*.md; docs/history/ is the measurement log) speak to users: no issue numbers,
no sections of documents users never see, no paths outside the project, no names of the team's development tools."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INTERNAL = {
    "an issue number": re.compile(r"\bissues? #?[0-9]", re.I),
    "a section sign (reference sections)": re.compile("§"),
    "a path outside the checkout": re.compile(r"\.\./shared"),
    "a development machine kind": re.compile(r"nvidia-h[12]00(-x[0-9])?\b"),
    "a development tool": re.compile(r"\b(farm-studio|device tool)\b"),
}


def internal_references(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pattern in INTERNAL.items() for m in pattern.finditer(text)]


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_name_nothing_internal(doc):
    assert internal_references(doc.read_text()) == []


def test_the_check_finds_each_kind_of_internal_reference():
    text = "fixed in issue 14 (reference §5.1); fixtures in ../shared/fixtures; ran on nvidia-h100-x1 via farm-studio"
    assert len(internal_references(text)) == 5
