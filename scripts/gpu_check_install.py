"""The GPU check's install stage: the wheels in a virtual environment, without an index.

    python scripts/gpu_check_install.py unpack WHEEL...   # where the environment has no pip
    python scripts/gpu_check_install.py verify [--checkout DIR]

Run with the virtual environment's interpreter. ``unpack`` puts pure-Python wheels into its
site-packages as pip would without scripts (the ``pytest11`` entry point lives in the
wheel's metadata, so the plugin registers all the same). ``verify`` checks that pytest-vram
and junitparser import from the virtual environment, not from a checkout or the system, that
the plugin's entry point is there, and that every requirement of pytest-vram is installed at a
version it accepts: on a machine without an index, nothing missing can be fetched later. With
``--checkout``, it also checks that the installed package is the checkout's, file for file: a
wheel built before the checkout changed would test other code. Exit status 1, with each
problem, when something is wrong.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion

INSTALLED = ("pytest_vram", "junitparser")


def unpack(wheel: Path, site: Path) -> str:
    """Unpack a pure-Python wheel into ``site``; its distribution's name."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        if any(name.split("/")[0].endswith(".data") for name in names):
            raise ValueError(f"{wheel}: has a .data folder: install it with pip")
        for name in names:
            if name.startswith("/") or ".." in Path(name).parts:
                raise ValueError(f"{wheel}: unsafe path in the wheel: {name}")
        archive.extractall(site)
    return wheel.name.split("-")[0]


def requirement_problems(distribution: str) -> tuple[list[str], list[str]]:
    """Each run-time requirement of ``distribution``, as a line; and the unmet ones."""
    lines, problems = [], []
    for text in metadata.requires(distribution) or []:
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            problems.append(f"{distribution} requires {text!r}, which does not parse: {exc}")
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or another platform's
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} ({requirement.specifier or 'any'}) is missing")
            continue
        try:
            accepted = requirement.specifier.contains(version, prereleases=True)
        except InvalidVersion:
            accepted = False
        line = f"{requirement.name} {version} ({requirement.specifier or 'any version'})"
        lines.append(line)
        if not accepted:
            problems.append(f"{line}: this version is not accepted")
    return lines, problems


def stale_files(installed: Path, checkout: Path) -> list[str]:
    """The package files (Python and C++ sources) that differ between an installed package and
    a checkout's, or that only one of them has; paths relative to the package."""

    def sources(root: Path) -> dict[str, bytes]:
        return {
            path.relative_to(root).as_posix(): path.read_bytes()
            for path in sorted(root.rglob("*"))
            if path.suffix in (".py", ".cpp") and "__pycache__" not in path.parts
        }

    ours, theirs = sources(installed), sources(checkout)
    return sorted(
        name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name)
    )


def verify(checkout: Path | None = None) -> list[str]:
    """Problems with the install, printing what was found."""
    problems = []
    prefix = Path(sys.prefix).resolve()
    for name in INSTALLED:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"{name} does not import: {exc}")
            continue
        where = Path(module.__file__ or "").resolve()
        print(f"{name} {metadata.version(name)} from {where.parent}")
        if prefix not in where.parents:
            problems.append(f"{name} imports from {where}, outside this environment ({prefix})")
    try:
        entry_points = metadata.distribution("pytest-vram").entry_points
    except metadata.PackageNotFoundError:
        return [*problems, "pytest-vram is not installed"]
    if not any(ep.group == "pytest11" and ep.name == "vram" for ep in entry_points):
        problems.append("pytest-vram has no pytest11 entry point 'vram'")
    lines, unmet = requirement_problems("pytest-vram")
    print("requirements:", "; ".join(lines))
    problems += unmet
    if checkout is not None and not problems:
        import pytest_vram

        stale = stale_files(Path(pytest_vram.__file__).parent, checkout / "pytest_vram")
        if stale:
            shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
            problems.append(
                f"the wheel is not the checkout's pytest_vram ({shown} differ): run "
                "bash scripts/gpu-check.sh --prepare again"
            )
        else:
            print(f"the installed package is {checkout / 'pytest_vram'}, file for file")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    verifying = commands.add_parser("verify")
    verifying.add_argument("--checkout", type=Path, help="the repository the wheel was built from")
    unpacking = commands.add_parser("unpack")
    unpacking.add_argument("wheels", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "unpack":
        site = Path(sysconfig.get_paths()["purelib"])
        try:
            for wheel in args.wheels:
                print(f"unpacked {unpack(wheel, site)} into {site}")
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            print(f"install: {exc}", file=sys.stderr)
            return 1
        return 0
    problems = verify(args.checkout)
    for problem in problems:
        print(f"install: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
