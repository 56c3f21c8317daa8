"""The GitHub Actions workflows: they parse, and run what the CI guide says they run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))


def _triggers(workflow: dict[str, Any]) -> dict[str, Any]:
    # YAML 1.1 reads a bare `on` key as the boolean True.
    triggers = workflow.get("on", workflow.get(True))
    if isinstance(triggers, str):
        return {triggers: None}
    if isinstance(triggers, list):
        return dict.fromkeys(triggers)
    return triggers


def _steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def _runs(workflow: dict[str, Any]) -> list[str]:
    return [" ".join(step["run"].split()) for step in _steps(workflow) if "run" in step]


def _pytest_commands(workflow: dict[str, Any]) -> list[list[str]]:
    commands = []
    for run in _runs(workflow):
        for part in run.split("&&"):
            words = shlex.split(part)
            if words[:1] == ["pytest"]:
                commands.append(words)
    return commands


def test_all_three_workflows_exist() -> None:
    assert {path.name for path in FILES} >= {"cpu.yml", "gpu.yml", "update-baselines.yml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_structure(path: Path) -> None:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(workflow.get("name"), str)
    assert _triggers(workflow)
    assert workflow["jobs"]
    for job in workflow["jobs"].values():
        assert job["runs-on"]
        assert job["steps"]
        assert "timeout-minutes" in job
        for step in job["steps"]:
            assert ("uses" in step) != ("run" in step), step
            if "uses" in step:
                action, _, version = step["uses"].partition("@")
                assert version, f"{action} is not pinned to a version"
    assert _steps(workflow)[0]["uses"].startswith("actions/checkout@")


def test_cpu_workflow() -> None:
    workflow = _load("cpu.yml")
    assert {"push", "pull_request"} <= set(_triggers(workflow))
    job = workflow["jobs"]["test"]
    assert job["runs-on"] == "ubuntu-latest"
    steps = job["steps"]
    setup = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python@"))
    assert str(setup["with"]["python-version"]) == "3.11"
    runs = _runs({"jobs": {"test": job}})
    torch = next(
        i
        for i, run in enumerate(runs)
        if run == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    )
    package = runs.index("pip install -e .[test]")
    tests = runs.index("pytest tests --run-slow")
    suites = runs.index("pytest suites --vram-report")
    # The CPU wheel first, or installing the package pulls the CUDA build of torch.
    assert torch < package < tests < suites


def test_gpu_workflow() -> None:
    workflow = _load("gpu.yml")
    assert {"push", "pull_request"} <= set(_triggers(workflow))
    (job,) = workflow["jobs"].values()
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    # Fork pull requests must not run on the self-hosted runner.
    assert "head.repo.full_name == github.repository" in job["if"]
    (command,) = _pytest_commands(workflow)
    assert command[:3] == ["pytest", "suites", "--vram-report"]
    assert "--vram-backend=cuda" in command
    assert "--junitxml=reports/junit.xml" in command
    for option, path in (
        ("--vram-json", "reports/vram.json"),
        ("--vram-html", "reports/vram.html"),
        ("--vram-markdown", "reports/vram.md"),
    ):
        assert command[command.index(option) + 1] == path
    upload = next(s for s in _steps(workflow) if "upload-artifact" in s.get("uses", ""))
    assert upload["uses"].startswith("actions/upload-artifact@")
    assert upload["if"] == "always()"  # the reports matter most when the tests fail
    assert upload["with"]["path"].rstrip("/") == "reports"
    # The plugin writes the job summary; the workflow must not write it a second time.
    assert not any("GITHUB_STEP_SUMMARY" in run for run in _runs(workflow))


def test_update_baselines_workflow() -> None:
    workflow = _load("update-baselines.yml")
    assert set(_triggers(workflow)) == {"workflow_dispatch"}
    (job,) = workflow["jobs"].values()
    assert "gpu" in job["runs-on"]
    assert workflow["permissions"] == {"contents": "write", "pull-requests": "write"}
    (command,) = _pytest_commands(workflow)
    assert command == ["pytest", "suites", "--vram-backend=cuda", "--vram-update-baselines"]
    steps = _steps(workflow)
    measure = next(i for i, s in enumerate(steps) if "--vram-update-baselines" in s.get("run", ""))
    open_pr = next(
        i
        for i, s in enumerate(steps)
        if s.get("uses", "").startswith("peter-evans/create-pull-request@")
    )
    assert measure < open_pr
    assert steps[open_pr]["with"]["add-paths"].rstrip("/") == "baselines"


def test_cpu_workflow_runs_the_suites_from_the_built_wheel() -> None:
    job = _load("cpu.yml")["jobs"]["wheel"]
    runs = _runs({"jobs": {"wheel": job}})
    build = next(i for i, run in enumerate(runs) if "python -m build" in run)
    torch = next(i for i, run in enumerate(runs) if run.startswith("pip install torch=="))
    wheel = runs.index("pip install dist/pytest_vram-*.whl")
    suites = next(i for i, run in enumerate(runs) if run.startswith("pytest suites"))
    assert build < wheel and torch < wheel < suites
    assert not any("-e ." in run for run in runs)


@pytest.mark.skipif(tomllib is None, reason="tomllib is new in Python 3.11")
def test_cpu_workflow_tests_the_supported_version_corners() -> None:
    job = _load("cpu.yml")["jobs"]["versions"]
    corners = job["strategy"]["matrix"]["include"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    floors = dict(
        re.fullmatch(r"([\w-]+)>=([\d.]+)", dep).groups()
        for dep in project["dependencies"]
        if dep.split(">=")[0] in ("torch", "pytest")
    )
    oldest = min(corners, key=lambda c: tuple(int(x) for x in c["python"].split(".")))
    # The declared floors are what the oldest corner installs.
    assert project["requires-python"] == f">={oldest['python']}"
    assert oldest["torch"].startswith(floors["torch"])
    assert oldest["pytest"].startswith(floors["pytest"])
    runs = _runs({"jobs": {"versions": job}})
    assert "pip install torch==${{ matrix.torch }}" in runs[0]
    assert any("pytest==${{ matrix.pytest }}" in run for run in runs)
    assert runs[-1] == "pytest tests --run-slow"


# -- the workflows a user copies into a project of theirs ----------------------------------------

USER_WORKFLOWS = ROOT / "docs" / "workflows"
USER_FILES = sorted(USER_WORKFLOWS.glob("*.yml"))


def _user(name: str) -> dict[str, Any]:
    return yaml.safe_load((USER_WORKFLOWS / name).read_text(encoding="utf-8"))


def test_user_workflows_exist() -> None:
    assert {path.name for path in USER_FILES} == {
        "vram-cpu.yml",
        "vram-gpu.yml",
        "vram-update-baselines.yml",
    }


@pytest.mark.parametrize("path", USER_FILES, ids=lambda p: p.name)
def test_user_workflow_structure(path: Path) -> None:
    test_structure(path)


@pytest.mark.parametrize("path", USER_FILES, ids=lambda p: p.name)
def test_user_workflow_installs_torch_then_pytest_vram(path: Path) -> None:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    spec = workflow["env"]["PYTEST_VRAM"]
    assert re.match(r"pytest-vram\b", spec), spec
    runs = _runs(workflow)
    torch = next(i for i, run in enumerate(runs) if run.startswith("pip install torch=="))
    (plugin,) = (i for i, run in enumerate(runs) if run == 'pip install "$PYTEST_VRAM"')
    tests = next(i for i, run in enumerate(runs) if "pytest " in run and "pip" not in run)
    # torch first, or pip resolves torch from PyPI: on Linux a CUDA build of several GB.
    assert torch < plugin < tests
    # In a user's repository `-e .[test]` installs the user's package, not pytest-vram.
    assert not any(".[test]" in run for run in runs)


@pytest.mark.parametrize("path", USER_FILES, ids=lambda p: p.name)
def test_user_workflow_options_exist(path: Path, pytestconfig: pytest.Config) -> None:
    (command,) = _pytest_commands(yaml.safe_load(path.read_text(encoding="utf-8")))
    takes_value = False
    for word in command[1:]:
        if takes_value:
            takes_value = False
            continue
        assert word.startswith("-"), f"{path.name} names test paths; testpaths should: {word}"
        option, equals, _ = word.partition("=")
        # ValueError for an option that does not exist; a flag's default is a bool.
        default = pytestconfig.getoption(option)
        takes_value = not equals and not isinstance(default, bool)
    if "--vram-backend=cuda" not in command:
        assert not any(word.startswith("--vram-backend") for word in command)


def test_user_cpu_workflow() -> None:
    workflow = _user("vram-cpu.yml")
    assert {"push", "pull_request"} <= set(_triggers(workflow))
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    assert any("download.pytorch.org/whl/cpu" in run for run in _runs(workflow))
    (command,) = _pytest_commands(workflow)
    assert "--vram-report" in command and "--junitxml=reports/junit.xml" in command
    _check_reports(workflow, "reports/junit.xml")
    # Files known to read values compute from their first test in the next run too.
    (cache,) = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/cache@")]
    assert ".pytest_cache" in cache["with"]["path"].split()


def test_user_gpu_workflow() -> None:
    workflow = _user("vram-gpu.yml")
    (job,) = workflow["jobs"].values()
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    assert "head.repo.full_name == github.repository" in job["if"]
    (command,) = _pytest_commands(workflow)
    assert {"--vram-report", "--vram-backend=cuda", "--junitxml=reports/junit.xml"} <= set(command)
    for option in ("--vram-json", "--vram-html", "--vram-markdown"):
        assert command[command.index(option) + 1].startswith("reports/")
    _check_reports(workflow, "reports/junit.xml")


def test_user_update_baselines_workflow() -> None:
    workflow = _user("vram-update-baselines.yml")
    assert set(_triggers(workflow)) == {"workflow_dispatch"}
    (job,) = workflow["jobs"].values()
    assert "gpu" in job["runs-on"]
    (command,) = _pytest_commands(workflow)
    assert command == [
        "pytest",
        "--vram-backend=cuda",
        "--vram-update-baselines",
        "--vram-prune-baselines",
    ]
    steps = _steps(workflow)
    open_pr = next(
        s for s in steps if s.get("uses", "").startswith("peter-evans/create-pull-request@")
    )
    assert open_pr["with"]["add-paths"].rstrip("/") == "baselines"


def _check_reports(workflow: dict[str, Any], junit: str) -> None:
    steps = _steps(workflow)
    publish = next(s for s in steps if "action-junit-report" in s.get("uses", ""))
    assert publish["if"] == "always()" and publish["with"]["report_paths"] == junit
    assert workflow["permissions"]["checks"] == "write"
    upload = next(s for s in steps if "upload-artifact" in s.get("uses", ""))
    assert upload["if"] == "always()"  # the reports matter most when the tests fail
    assert upload["with"]["path"].rstrip("/") == "reports"
    # The plugin writes the job summary; the workflow must not write it a second time.
    assert not any("GITHUB_STEP_SUMMARY" in run for run in _runs(workflow))


def test_ci_guide_shows_the_user_workflows_as_they_are() -> None:
    guide = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    for path in USER_FILES:
        text = path.read_text(encoding="utf-8").rstrip("\n")
        assert f"```yaml\n{text}\n```" in guide, f"docs/ci.md does not show {path.name} as it is"
