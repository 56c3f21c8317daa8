"""The release's checks (scripts/release.py): the version read from the tag, the CHANGELOG
section that becomes the release notes, and what a wheel must carry. The build itself and the
checks on it run in tests/test_packaging.py::test_wheel_and_sdist."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "release.py"

spec = importlib.util.spec_from_file_location("release_script", SCRIPT)
release = importlib.util.module_from_spec(spec)
spec.loader.exec_module(release)

CHANGELOG = """# Changelog

## [Unreleased]

### Fixed

- something not released yet

## [1.2.0] - 2027-01-31

### Added

- a feature

## [1.1.0] - 2026-12-24

- the first

[Unreleased]: https://github.com/OWNER/pytest-vram/compare/v1.2.0...HEAD
[1.2.0]: https://github.com/OWNER/pytest-vram/releases/tag/v1.2.0
"""


@pytest.mark.parametrize(
    ("tag", "version"),
    [("v0.1.0", "0.1.0"), ("v1.2.3rc1", "1.2.3rc1"), ("v2.0.0.post1", "2.0.0.post1")],
)
def test_the_version_is_read_from_the_tag(tag: str, version: str) -> None:
    assert release.tag_version(tag) == version


@pytest.mark.parametrize("tag", ["0.1.0", "v0.1", "release-0.1.0", "v0.1.0-beta", "refs/tags/v1"])
def test_a_tag_that_names_no_version_is_refused(tag: str) -> None:
    with pytest.raises(release.ReleaseError, match="is not v and a version"):
        release.tag_version(tag)


def test_the_notes_are_the_versions_section() -> None:
    assert release.changelog_section(CHANGELOG, "1.2.0") == "### Added\n\n- a feature\n"
    # The last section ends before the link references.
    assert release.changelog_section(CHANGELOG, "1.1.0") == "- the first\n"


def test_a_version_without_a_dated_section_is_refused() -> None:
    with pytest.raises(release.ReleaseError, match=r"no section for 1\.3\.0"):
        release.changelog_section(CHANGELOG, "1.3.0")
    with pytest.raises(release.ReleaseError, match="has no date"):
        release.changelog_section(CHANGELOG.replace("[1.2.0] - 2027-01-31", "[1.2.0]"), "1.2.0")


def test_this_versions_changelog_section_is_there() -> None:
    version = release.project_version()
    assert release.package_version() == version
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert release.changelog_section(text, version).strip()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "notes", "--tag", f"v{version}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, release.changelog_section(text, version))


def test_a_wheel_without_the_licence_or_the_metadata_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "pytest_vram-0.1.0-py3-none-any.whl"
    info = "pytest_vram-0.1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            f"{info}/METADATA",
            "Metadata-Version: 2.4\nName: pytest-vram\nVersion: 0.1.0\nLicense: MIT\n"
            "Classifier: Framework :: Pytest\n\nThe description.\n",
        )
        archive.writestr(f"{info}/entry_points.txt", "[pytest11]\nvram = pytest_vram.plugin\n")
        archive.writestr("pytest_vram/plugin.py", "")
        archive.writestr("tests/test_x.py", "")
    problems = release.check_wheel(wheel, "0.1.0")
    text = "\n".join(problems)
    for missing in (
        "License-Expression",
        "License-File",
        f"{info}/licenses/LICENSE",
        "no author",
        "Development Status",
        "Project-URL Homepage",
        "pytest_vram/backends/cpu/allocator.cpp",
        "carries tests/test_x.py",
        "pytest-vram = pytest_vram.cli:main",
    ):
        assert missing in text, text


def test_check_names_a_dist_of_another_version(tmp_path: Path) -> None:
    (tmp_path / "pytest_vram-0.0.9-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "pytest_vram-0.0.9.tar.gz").write_bytes(b"")
    version = release.project_version()
    problems = release.check(tmp_path, f"v{version}")
    assert problems == [
        f"{tmp_path} holds ['pytest_vram-0.0.9-py3-none-any.whl', 'pytest_vram-0.0.9.tar.gz'],"
        f" not one wheel and one sdist of {version}"
    ]
    tagged = release.check(tmp_path, "v9.9.9")
    assert "pyproject.toml says" in tagged[0] and "the tag v9.9.9" in tagged[0]
