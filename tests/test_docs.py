"""The README stays a two-minute read that indexes docs/, and no link in them points nowhere.

Links are checked as GitHub renders them: a relative target is a path from the file's own folder, and an
`#anchor` must be the slug GitHub gives one of the target's headings (lower case, punctuation dropped,
spaces to hyphens, `-1`, `-2` … for repeats: github/cmark-gfm's anchor filter, as github.com applies it).
Links inside code blocks and code spans are text, not links. Docstrings state a decision in at most 15 lines
(counted as `ast.get_docstring(node, clean=False)` splits); the evidence lives in the topic pages' Decisions, and
every public source and UNCONFIRMED note the decision records cited when they were folded into those pages
(`docs_sources.txt`) is still cited there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 160
DOCSTRING_MAX_LINES = 15  # the decision in a few lines; the evidence in a docs/ page's Decisions

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


def texts(files: list[Path]) -> Iterator[tuple[Path, str]]:
    """Each readable text file of `files` with its text (binary and deleted files are skipped)."""
    for path in files:
        try:
            yield path, path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue


def pointers_outside(files: list[Path]) -> list[str]:
    return [f"{path}: {outside}" for path, text in texts(files) for outside in OUTSIDE if outside in text]


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


# GitHub owners whose repositories the decisions cite by name (`owner/repo`, `owner/repo#123`)
SOURCE_OWNERS = (
    "Dao-AILab", "GoogleCloudPlatform", "docker", "fsspec", "ggml-org", "google", "hashicorp", "hivellm", "huggingface",
    "iann0036", "modelscope", "pulumi", "pypa", "pytorch", "ray-project", "tobymao", "triton-lang", "vllm-project",
    "willthames",
)  # fmt: skip
_URL = re.compile(r"https?://[^\s)<>`\"']+")
_OWNER_REPO = re.compile(r"(?<![\w./-])((?:" + "|".join(SOURCE_OWNERS) + r")/[\w.-]*\w)(?:\s*#(\d+))?")
_PATH = re.compile(r"(?<![\w./-])([a-z][\w.-]*(?:/[\w.+-]+)+)")
_PATH_SOURCE = re.compile(r"\.(?:go|py|ts|c|tf|yaml|json|md|toml|txt|sh)$")
_ISSUE = re.compile(r"(?<![\w/#])#\d{2,}\b")
_NOTE_WORDS = 8


def _flat(markdown: str) -> str:
    """The text with each link reduced to its text and whitespace to single spaces."""
    return " ".join(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown).split())


def sources(markdown: str) -> set[str]:
    """The public sources `markdown` cites: every URL, `owner/repo` and `owner/repo#N` of `SOURCE_OWNERS`, `#N`
    references, and every path outside this repository's folders (one with a source file's extension, or 3+ parts)."""
    local = {f.relative_to(REPO_ROOT).parts[0] for f in tracked_files()}
    found = {url.rstrip(".,;:") for url in _URL.findall(markdown)}
    text = re.sub(r"\]\([^)]*\)", "]", _URL.sub(" ", markdown))  # a link target is a path in this repository
    for repo, issue in _OWNER_REPO.findall(text):
        found.add(f"{repo}#{issue}" if issue else repo)
    for token in _PATH.findall(text):
        token = token.rstrip("./")
        parts = token.split("/")
        if parts[0] not in local and "<" not in token and (_PATH_SOURCE.search(token) or len(parts) >= 3):
            found.add(token)
    return found | set(_ISSUE.findall(text))


def unconfirmed_notes(markdown: str) -> list[str]:
    """The first words of every UNCONFIRMED note, each within its bullet or paragraph."""
    blocks = re.split(r"\n(?=\s*(?:- |#|\n))", markdown)
    notes = []
    for block in map(_flat, blocks):
        for start in (m.start() for m in re.finditer("UNCONFIRMED", block)):
            notes.append(" ".join(block[start:].split()[:_NOTE_WORDS]))
    return notes


def docs_text() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO_ROOT / "docs").glob("*.md")))


def frozen_sources() -> list[str]:
    lines = (REPO_ROOT / "tests" / "docs_sources.txt").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line and not line.startswith("# ")]


_DOCS_ANCHOR = re.compile(r"(?<![\w/.-])docs/([a-z0-9-]+\.md)#([\w-]+)")


def stale_anchors(files: list[Path]) -> list[str]:
    """Every `docs/PAGE.md#anchor` named in `files` (code, comments, docstrings) whose page or heading is gone."""
    found = []
    for path, text in texts(files):
        for page, anchor in _DOCS_ANCHOR.findall(text):
            target = REPO_ROOT / "docs" / page
            if not target.exists() or anchor not in anchors(target.read_text(encoding="utf-8")):
                found.append(f"{path.name}: docs/{page}#{anchor}")
    return found


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


class TestDecisions:
    def test_every_source_the_records_cited_is_still_cited(self) -> None:
        """The records folded into the topic pages named these sources and open questions; losing one loses the
        evidence for a decision. A line goes only with the claim it supports (and the claim's code)."""
        cited = sources(docs_text())
        notes = _flat(docs_text())
        lost = [line for line in frozen_sources() if line not in cited and line not in notes]
        assert frozen_sources() and lost == [], f"no longer cited under docs/: {lost}"

    def test_the_records_folder_is_gone_and_every_page_has_decisions(self) -> None:
        assert not (REPO_ROOT / "docs" / "decisions").exists(), "decisions live in the topic pages now"
        index = (REPO_ROOT / "docs" / "README.md").read_text(encoding="utf-8")
        pages = [p for p in sorted((REPO_ROOT / "docs").glob("*.md")) if p.name != "README.md"]
        assert [p.name for p in pages if f"]({p.name})" not in index] == [], "a page docs/README.md does not list"
        with_decisions = [p.name for p in pages if "\n## Decisions\n" in p.read_text(encoding="utf-8")]
        assert len(with_decisions) >= 5, with_decisions


class TestLinks:
    @pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
    def test_every_relative_link_resolves(self, doc: Path) -> None:
        assert broken_links(doc, doc.read_text(encoding="utf-8")) == []

    def test_every_docs_anchor_a_file_names_resolves(self) -> None:
        """Docstrings and comments point at a decision as `docs/PAGE.md#anchor`: the heading must still be there."""
        assert stale_anchors(tracked_files()) == []

    def test_no_tracked_file_points_outside_the_repository(self) -> None:
        """A user of the repository has only the repository: every source is cited by its public name."""
        assert pointers_outside(tracked_files()) == []


class TestDocstrings:
    def test_every_docstring_is_at_most_15_lines(self) -> None:
        """A docstring states its decision; sources and history go to a docs/ page's Decisions."""
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

    def test_a_stale_anchor_in_a_comment_is_reported(self, tmp_path: Path) -> None:
        d = "docs" + "/"  # spelled in parts, so this file's own scan does not find them
        (tmp_path / "m.py").write_text(f"# why: {d}ci.md#hashed-locks, {d}ci.md#gone, {d}gone.md#x, {d}ci.md\n")
        assert stale_anchors([tmp_path / "m.py"]) == [f"m.py: {d}ci.md#gone", f"m.py: {d}gone.md#x"]

    def test_links_in_code_are_not_links(self) -> None:
        text = "`[a](gone.md)`\n\n```markdown\n[b](gone.md)\n```\n"
        assert broken_links(REPO_ROOT / "README.md", text) == []

    def test_a_source_or_note_dropped_from_the_pages_is_reported(self) -> None:
        record = (
            "- Read pulumi/pulumi v3.1 `pkg/engine/project.go` and vllm-project/vllm#58144 (PR #9727),\n"
            "  https://example.com/a.html, and `infra/config.py` [here](../costs.md).\n"
            "- UNCONFIRMED: whether the thing holds on a real cluster;\n  check with a cluster.\n"
        )
        assert sources(record) == {
            "pulumi/pulumi", "pkg/engine/project.go", "vllm-project/vllm#58144", "#9727", "https://example.com/a.html"
        }  # fmt: skip
        assert unconfirmed_notes(record) == ["UNCONFIRMED: whether the thing holds on a real"]
        kept = "pulumi/pulumi `pkg/engine/project.go`, vllm-project/vllm#58144 #9727 https://example.com/a.html"
        frozen = [*sorted(sources(record)), *unconfirmed_notes(record)]
        assert [s for s in frozen if s not in sources(kept) and s not in _flat(kept)] == [frozen[-1]]

    def test_github_slugs(self) -> None:
        text = "# What `pulumi destroy` keeps, and `pulumi up` again\n## Guards\n## Guards\n"
        assert anchors(text) == {"what-pulumi-destroy-keeps-and-pulumi-up-again", "guards", "guards-1"}
