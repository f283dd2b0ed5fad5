"""The documentation stays true to the code: the generated configuration reference is current, the README stays a
user's page, relative links resolve, and the code keeps to its size and citation rules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
SOURCE_MAX_LINES = 600
CODE_DIRS = ("tandem", "services")
GENERATED = (ROOT / "tandem" / "v1",)  # protoc output (make proto): not written by hand


def source_files() -> list[Path]:
    """Every hand-written file under tandem/ and services/ (no generated code, no bytecode)."""
    files = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo", ".so"):
                continue
            if any(path.is_relative_to(g) for g in GENERATED):
                continue
            files.append(path)
    return files


def test_configuration_reference_is_current() -> None:
    check = subprocess.run(
        [sys.executable, "tools/config_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr or check.stdout


def test_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_source_files_are_small() -> None:
    offenders = []
    for path in source_files():
        n = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
        if n > SOURCE_MAX_LINES:
            offenders.append(f"{path.relative_to(ROOT)} ({n} lines)")
    assert not offenders, f"files over {SOURCE_MAX_LINES} lines under tandem/ and services/: " + ", ".join(offenders)


def test_code_cites_no_benchmark_folders() -> None:
    """Code states what and why in a line; the runs behind a default live in docs/decisions/, not in the code."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in source_files()
        if "docs/benchmarks/" in path.read_text(encoding="utf-8", errors="replace")
    ]
    assert not offenders, "files under tandem/ and services/ citing docs/benchmarks/: " + ", ".join(offenders)


# ---- relative links in the Markdown pages ----------------------------------------------------------------------------

FENCE = re.compile(r"^( {0,3})(```+|~~~+).*?^\1\2[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def link_targets(text: str) -> list[str]:
    """The link and image targets of a Markdown text, outside code blocks and code spans."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = [m.group(1) for m in INLINE_LINK.finditer(text)] + [m.group(1) for m in REFERENCE_DEF.finditer(text)]
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in targets]


def test_link_extraction() -> None:
    text = (
        'See [a](docs/a.md#part), ![plot](img/p.png "title"), [web](https://example.org/x), [top](#top),\n'
        "`[not](in-code.md)`\n\n[ref]: <docs/b c.md>\n\n```\n[not](in-fence.md)\n```\n"
    )
    assert link_targets(text) == ["docs/a.md#part", "img/p.png", "https://example.org/x", "#top", "docs/b c.md"]


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    missing = []
    for target in link_targets(page.read_text(encoding="utf-8")):
        if not target or target.startswith("#") or SCHEME.match(target) or target.startswith("//"):
            continue
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not path:
            continue
        resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
        if not resolved.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: " + ", ".join(missing)
