"""Every Dockerfile in the repository passes hadolint, and hadolint catches a careless one."""

from __future__ import annotations

from pathlib import Path

from tests.lint.conftest import dockerfiles, run_tool, tool

CARELESS = """\
FROM ubuntu:latest
MAINTAINER someone@example.com
RUN apt-get update && apt-get install -y curl
"""


class TestHadolint:
    def test_the_repository_dockerfiles_pass(self) -> None:
        files = dockerfiles()
        assert files, "no Dockerfile found: trainer/ and serving/ each ship one"
        result = run_tool(tool("hadolint"), "--no-color", *map(str, files))
        assert result.returncode == 0, result.stdout + result.stderr

    def test_latest_tag_unpinned_apt_and_maintainer_fail(self, tmp_path: Path) -> None:
        dockerfile = tmp_path / "Dockerfile"
        dockerfile.write_text(CARELESS)
        result = run_tool(tool("hadolint"), "--no-color", str(dockerfile), cwd=tmp_path)
        assert result.returncode == 1, result.stdout + result.stderr
        for rule, phrase in (
            ("DL3007", "latest"),  # FROM …:latest
            ("DL4000", "MAINTAINER is deprecated"),
            ("DL3008", "Pin versions in apt get install"),
            ("DL3015", "Avoid additional packages by specifying `--no-install-recommends`"),
        ):
            line = next((ln for ln in result.stdout.splitlines() if rule in ln), "")
            assert phrase in line, f"{rule} not reported as expected:\n{result.stdout}"
