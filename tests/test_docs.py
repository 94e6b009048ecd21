"""The README stays a two-minute read that indexes docs/, and no link in them points nowhere.

Links are checked as GitHub renders them: a relative target is a path from the file's own folder, and an
`#anchor` must be the slug GitHub gives one of the target's headings (lower case, punctuation dropped,
spaces to hyphens, `-1`, `-2` … for repeats: github/cmark-gfm's anchor filter, as github.com applies it).
Links inside code blocks and code spans are text, not links. Docstrings state a decision in at most 15 lines
(counted as `ast.get_docstring(node, clean=False)` splits); the evidence lives in docs/decisions/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 160
DOCSTRING_MAX_LINES = 15  # the decision in a few lines; the evidence in docs/decisions/

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


# spelled in parts, so this file does not name them itself (and can be scanned like every other)
_UP, _NOTES = "../" + "shared", "shared/" + "CLOUD"
OUTSIDE = (_UP, _NOTES, "CLOUD" + "-FACTS", "SEEDS" + ".md")


def tracked_files() -> list[Path]:
    """Every text file git tracks."""
    import subprocess

    names = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return [REPO_ROOT / n for n in names.splitlines()]


def pointers_outside(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        found += [f"{path}: {outside}" for outside in OUTSIDE if outside in text]
    return found


def long_docstrings(files: list[Path], limit: int = DOCSTRING_MAX_LINES) -> list[str]:
    """Every module, class and function docstring of `files` over `limit` lines, as "path:line name: N lines"."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in [
            tree,
            *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)),
        ]:
            doc = ast.get_docstring(node, clean=False)
            lines = len(doc.splitlines()) if doc else 0
            if lines > limit:
                where = f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}"
                found.append(f"{where}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '<module>')}: {lines} lines")
    return found


def doc_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def _prose(markdown: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", markdown))


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(source: Path, markdown: str) -> list[str]:
    """Every relative link of `markdown` (read from `source`) whose file or anchor does not exist."""
    broken = []
    for target in _LINK.findall(_prose(markdown)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists() or not resolved.is_relative_to(REPO_ROOT):
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(REPO_ROOT)}")
    return broken


class TestReadme:
    def test_readme_is_short(self) -> None:
        lines = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
        assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move the depth to docs/"

    def test_readme_shows_the_quick_start_and_indexes_every_docs_page(self) -> None:
        readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
        assert "make demo" in readme and "make test" in readme and "make plan" in readme
        linked = {(REPO_ROOT / target.partition("#")[0]).resolve() for target in _LINK.findall(_prose(readme))}
        pages = [p for p in (REPO_ROOT / "docs").glob("*.md") if p.name != "README.md"]
        assert pages, "docs/ has no pages"
        assert not [p.name for p in pages if p.resolve() not in linked], "a docs page the README does not link"

    def test_measurements_live_in_bench_results(self) -> None:
        """No dated timing in the README or docs/: those are bench/RESULTS.md's (they go stale with the machine)."""
        for doc in doc_files():
            for line in _prose(doc.read_text(encoding="utf-8")).splitlines():
                timed = re.search(r"\d+ ?(s|min)\b.*\b20\d\d-\d\d-\d\d|\b20\d\d-\d\d-\d\d\b.*\d+ ?(s|min)\b", line)
                assert not timed, f"{doc.relative_to(REPO_ROOT)}: {line.strip()}"


class TestDecisionRecords:
    def test_every_record_is_listed_in_the_index(self) -> None:
        folder = REPO_ROOT / "docs" / "decisions"
        index = (folder / "README.md").read_text(encoding="utf-8")
        records = sorted(p.name for p in folder.glob("*.md") if p.name != "README.md")
        assert records and [r for r in records if f"]({r})" not in index] == []


class TestLinks:
    @pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
    def test_every_relative_link_resolves(self, doc: Path) -> None:
        assert broken_links(doc, doc.read_text(encoding="utf-8")) == []

    def test_no_tracked_file_points_outside_the_repository(self) -> None:
        """A user of the repository has only the repository: every source is cited by its public name."""
        assert pointers_outside(tracked_files()) == []


class TestDocstrings:
    def test_every_docstring_is_at_most_15_lines(self) -> None:
        """A docstring states its decision; sources and history go to a record in docs/decisions/."""
        python = [p for p in tracked_files() if p.suffix == ".py" and p.exists()]
        assert python and long_docstrings(python) == []


class TestTheCheckCanFail:
    """The checks report what is broken (and only that), and leave code and external URLs alone."""

    def test_a_docstring_of_16_lines_is_reported(self, tmp_path: Path) -> None:
        def docstring(lines: int, indent: str) -> str:
            return (
                '"""Line 1.\n' + "".join(f"{indent}line {n}\n" for n in range(2, lines)) + f'{indent}line {lines}."""'
            )

        source = (
            f"{docstring(15, '')}\n\n\n"  # the module's: 15 lines, allowed
            f"class Long:\n    {docstring(16, '    ')}\n\n\n"
            f"async def longer() -> None:\n    {docstring(20, '    ')}\n"
        )
        (tmp_path / "m.py").write_text(source)
        assert long_docstrings([tmp_path / "m.py"]) == [
            f"{tmp_path / 'm.py'}:18 Long: 16 lines",
            f"{tmp_path / 'm.py'}:37 longer: 20 lines",
        ]

    def test_a_pointer_outside_is_reported(self, tmp_path: Path) -> None:
        (tmp_path / "a.py").write_text(f"# facts from {_UP}/notes.md\n")
        (tmp_path / "b.md").write_text("See the facts file, section 3.\n")
        assert pointers_outside([tmp_path / "a.py", tmp_path / "b.md"]) == [f"{tmp_path / 'a.py'}: {_UP}"]

    def test_a_missing_file_a_missing_anchor_and_a_link_out_of_the_repo_are_reported(self) -> None:
        source = REPO_ROOT / "docs" / "costs.md"
        text = (
            "See [gone](gone.md), [no such heading](ci.md#no-such-heading),\n"
            "[outside](../../etc/hosts) and [fine](ci.md#one-time-setup), [web](https://example.com/x.md)."
        )
        broken = broken_links(source, text)
        assert len(broken) == 3, broken
        assert broken[0].startswith("gone.md:") and "#no-such-heading" in broken[1] and "hosts" in broken[2]

    def test_links_in_code_are_not_links(self) -> None:
        text = "`[a](gone.md)`\n\n```markdown\n[b](gone.md)\n```\n"
        assert broken_links(REPO_ROOT / "README.md", text) == []

    def test_github_slugs(self) -> None:
        text = "# What `pulumi destroy` keeps, and `pulumi up` again\n## Guards\n## Guards\n"
        assert anchors(text) == {"what-pulumi-destroy-keeps-and-pulumi-up-again", "guards", "guards-1"}
