"""The GitHub Actions workflows: they parse, and run what the CI guide says they run."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

WORKFLOWS = Path(__file__).resolve().parent.parent / ".github" / "workflows"
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
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    steps = _steps(workflow)
    setup = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python@"))
    assert str(setup["with"]["python-version"]) == "3.11"
    runs = _runs(workflow)
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
