"""The release's checks and notes, run by .github/workflows/release.yml and by CI.

    python scripts/release.py check DIST --tag vX.Y.Z   # the built wheel and sdist
    python scripts/release.py notes --tag vX.Y.Z        # the version's CHANGELOG.md section

``check`` reads the version from the tag and fails, naming each problem, unless
pyproject.toml, ``pytest_vram.__version__``, the files' names and their metadata all carry it,
CHANGELOG.md has a dated section for it, and the wheel and the sdist hold what a release
needs: the licence, the full metadata, the package with its C++ source and entry points, and
(the sdist) the tests, suites and baselines that test it. ``notes`` prints that section, the
GitHub release's text. Exit status 1 on a problem, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import email
import re
import sys
import tarfile
import zipfile
from email.message import Message
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A tag is v and a version: v1.2.3, v1.2.3rc1, v1.2.3.post1.
TAG = re.compile(r"v(\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?)")
# `## [1.2.3] - 2026-12-06`, Keep a Changelog's heading of a released version.
SECTION = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\S+))?\s*$", re.M)
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

# What the wheel's metadata must say besides the version.
CLASSIFIERS = ("Framework :: Pytest", "Development Status :: ")
PROJECT_URLS = ("Homepage", "Changelog", "Issues")
WHEEL_FILES = (
    "pytest_vram/__init__.py",
    "pytest_vram/plugin.py",
    "pytest_vram/backends/cpu/allocator.cpp",
)
SDIST_FILES = (
    "LICENSE",
    "CHANGELOG.md",
    "README.md",
    "pyproject.toml",
    "pytest_vram/plugin.py",
    "pytest_vram/backends/cpu/allocator.cpp",
    "tests/conftest.py",
    "suites/gpt.py",
    "baselines/sim.yaml",
)


class ReleaseError(Exception):
    """What makes a release wrong, one problem per line."""


def tag_version(tag: str) -> str:
    """The version a tag names: ``v0.1.0`` is ``0.1.0``."""
    match = TAG.fullmatch(tag)
    if match is None:
        raise ReleaseError(f"tag {tag!r} is not v and a version (v1.2.3, v1.2.3rc1)")
    return match.group(1)


def project_version(root: Path = ROOT) -> str:
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^version = "([^"]+)"$', text, flags=re.M)
    if match is None:
        raise ReleaseError("pyproject.toml has no version")
    return match.group(1)


def package_version(root: Path = ROOT) -> str:
    text = (root / "pytest_vram" / "version.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.M)
    if match is None:
        raise ReleaseError("pytest_vram/version.py has no __version__")
    return match.group(1)


def changelog_section(text: str, version: str) -> str:
    """The body of ``version``'s section in a Keep a Changelog file; it must be dated."""
    headings = list(SECTION.finditer(text))
    for index, heading in enumerate(headings):
        if heading.group("version") != version:
            continue
        if not DATE.fullmatch(heading.group("date") or ""):
            raise ReleaseError(
                f"CHANGELOG.md: [{version}] has no date (## [{version}] - YYYY-MM-DD)"
            )
        end = headings[index + 1].start() if index + 1 < len(headings) else len(text)
        # The link references at the end of the file are not the section's.
        body = re.split(r"^\[[^\]]+\]: ", text[heading.end() : end], maxsplit=1, flags=re.M)[0]
        body = body.strip()
        if not body:
            raise ReleaseError(f"CHANGELOG.md: [{version}] lists no change")
        return body + "\n"
    raise ReleaseError(f"CHANGELOG.md has no section for {version} (## [{version}] - YYYY-MM-DD)")


def _metadata_problems(metadata: Message, version: str, where: str) -> list[str]:
    problems = []
    if metadata["Name"] != "pytest-vram":
        problems.append(f"{where}: Name is {metadata['Name']!r}")
    if metadata["Version"] != version:
        problems.append(f"{where}: Version is {metadata['Version']!r}, the tag says {version}")
    if metadata["License-Expression"] != "MIT":
        problems.append(f"{where}: License-Expression is {metadata['License-Expression']!r}")
    if "LICENSE" not in (metadata.get_all("License-File") or []):
        problems.append(f"{where}: no License-File: LICENSE")
    if not (metadata.get_all("Author") or metadata.get_all("Author-email")):
        problems.append(f"{where}: no author")
    classifiers = metadata.get_all("Classifier") or []
    for wanted in CLASSIFIERS:
        if not any(classifier.startswith(wanted) for classifier in classifiers):
            problems.append(f"{where}: no classifier {wanted!r}")
    if not any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers):
        problems.append(f"{where}: no classifier for a Python version")
    urls = {url.split(",")[0].strip() for url in metadata.get_all("Project-URL") or []}
    for wanted in PROJECT_URLS:
        if wanted.lower() not in {url.lower() for url in urls}:
            problems.append(f"{where}: no Project-URL {wanted}")
    if metadata.get_content_type() != "text/plain" or not metadata.get_payload():
        problems.append(f"{where}: no long description")
    if metadata["Description-Content-Type"] != "text/markdown":
        problems.append(f"{where}: the description is not Markdown")
    return problems


def check_wheel(wheel: Path, version: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"pytest_vram-{version}.dist-info"
        if f"{info}/METADATA" not in names:
            return [f"{wheel.name}: no {info}/METADATA"]
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    problems = _metadata_problems(metadata, version, wheel.name)
    if f"{info}/licenses/LICENSE" not in names:
        problems.append(f"{wheel.name}: no {info}/licenses/LICENSE")
    problems += [f"{wheel.name}: no {name}" for name in WHEEL_FILES if name not in names]
    strays = sorted(n for n in names if n.split("/")[0] in ("tests", "suites", "baselines"))
    if strays:
        problems.append(f"{wheel.name}: carries {strays[0]} and {len(strays) - 1} more")
    for line in ("vram = pytest_vram.plugin", "pytest-vram = pytest_vram.cli:main"):
        if line not in entry_points:
            problems.append(f"{wheel.name}: no entry point {line!r}")
    return problems


def check_sdist(sdist: Path, version: str) -> list[str]:
    top = f"pytest_vram-{version}"
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        member = archive.extractfile(f"{top}/PKG-INFO") if f"{top}/PKG-INFO" in names else None
        metadata = email.message_from_bytes(member.read()) if member else None
    if metadata is None:
        return [f"{sdist.name}: no {top}/PKG-INFO"]
    problems = _metadata_problems(metadata, version, sdist.name)
    problems += [f"{sdist.name}: no {name}" for name in SDIST_FILES if f"{top}/{name}" not in names]
    if any("__pycache__" in name or name.endswith(".pyc") for name in names):
        problems.append(f"{sdist.name}: carries compiled Python files")
    return problems


def check(dist: Path, tag: str, root: Path = ROOT) -> list[str]:
    """Every problem of the release of ``tag`` from the files in ``dist``."""
    version = tag_version(tag)
    problems = []
    for where, found in (
        ("pyproject.toml", project_version(root)),
        ("pytest_vram.__version__", package_version(root)),
    ):
        if found != version:
            problems.append(f"{where} says {found}, the tag {tag}")
    try:
        changelog_section((root / "CHANGELOG.md").read_text(encoding="utf-8"), version)
    except ReleaseError as error:
        problems.append(str(error))
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    expected = ([f"pytest_vram-{version}-py3-none-any.whl"], [f"pytest_vram-{version}.tar.gz"])
    found = ([path.name for path in wheels], [path.name for path in sdists])
    if found != expected or len(list(dist.iterdir())) != 2:
        names = sorted(path.name for path in dist.iterdir())
        return [*problems, f"{dist} holds {names}, not one wheel and one sdist of {version}"]
    return problems + check_wheel(wheels[0], version) + check_sdist(sdists[0], version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="release.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser("check", help="check the built wheel and sdist")
    checking.add_argument("dist", type=Path, help="the folder python -m build wrote")
    checking.add_argument("--tag", required=True, help="the release's tag, v and the version")
    noting = commands.add_parser("notes", help="print the version's CHANGELOG.md section")
    noting.add_argument("--tag", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "notes":
            text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
            sys.stdout.write(changelog_section(text, tag_version(args.tag)))
            return 0
        problems = check(args.dist, args.tag)
    except ReleaseError as error:
        print(f"release.py: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"release.py: {problem}", file=sys.stderr)
    if not problems:
        print(f"release.py: {args.dist} is the release of {tag_version(args.tag)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
