"""The copyable pull-request workflows' own commands on a real regression: a transformer step
whose activation checkpointing a pull request turns off. The comment names the categories and
the lines of the model that grew, with their bytes.

The scripts are read from docs/workflows/vram-pr.yml and vram-pr-comment.yml and run with bash
in a git repository of a small project, as the runner would (the install steps aside).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "docs" / "workflows"

TEST_FILE = """
import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig

from pytest_vram import max_vram

CONFIG = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2)
CHECKPOINTING = True


def train_step(model, optimizer, tokens, targets):
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@max_vram("200MB")
def test_training_step_fits_its_budget(vram):
    model = GPT(CONFIG, checkpointing=CHECKPOINTING).to(vram.device)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 129), device=vram.device)
    step = lambda: train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])  # noqa: E731
    step()  # the first step creates AdamW's moments
    vram.single_step(step)
"""


def _step(workflow: str, job: str, name: str) -> str:
    data = yaml.safe_load((WORKFLOWS / workflow).read_text(encoding="utf-8"))
    (step,) = [s for s in data["jobs"][job]["steps"] if s.get("name") == name]
    return step["run"]


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


def _bash(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # GitHub runs `run:` scripts with bash -e -o pipefail.
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
        cwd=cwd,
        env={**os.environ, "PYTEST_ADDOPTS": "-p no:randomly", **env},
        capture_output=True,
        text=True,
        check=False,
    )


def make_pull_request(root: Path) -> tuple[Path, Path]:
    """A project at its base (baselines recorded, checkpointing on) and its head (off)."""
    base = root / "base"
    base.mkdir()
    shutil.copy(ROOT / "suites" / "gpt.py", base / "gpt.py")
    (base / "test_train.py").write_text(TEST_FILE, encoding="utf-8")
    _git(base, "init", "-q")
    subprocess.run(
        ["pytest", "-q", "--vram-update-baselines"],
        cwd=base,
        check=True,
        capture_output=True,
        env={**os.environ, "PYTEST_ADDOPTS": "-p no:randomly"},
    )
    _git(base, "add", ".")
    _git(base, "commit", "-q", "-m", "base")
    head = root / "head"
    shutil.copytree(base, head)
    source = (head / "test_train.py").read_text(encoding="utf-8")
    (head / "test_train.py").write_text(
        source.replace("CHECKPOINTING = True", "CHECKPOINTING = False"), encoding="utf-8"
    )
    _git(head, "commit", "-q", "-am", "turn checkpointing off")
    return base, head


def run_workflow_commands(base: Path, head: Path) -> tuple[int, str]:
    """vram-pr.yml's measuring and second pass, then vram-pr-comment.yml's compare: the exit
    status and the comment."""
    tests = _step("vram-pr.yml", "measure", "Tests")
    for side, checkout in (("base", base), ("head", head)):
        done = _bash(tests, checkout, SIDE=side)
        assert done.returncode == 0, done.stdout + done.stderr
    reports = base.parent / "reports"
    reports.mkdir()
    for side, checkout in (("base", base), ("head", head)):
        shutil.copy(checkout / "reports" / f"{side}.json", reports / f"{side}.json")
    # The second pass, in the base's checkout, with the head's report downloaded into it.
    shutil.copy(reports / "head.json", base / "reports" / "head.json")
    done = _bash(_step("vram-pr.yml", "base-lines", "The base's lines"), base)
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.copy(base / "reports" / "base-lines.json", reports / "base-lines.json")
    # The comment job: its script up to the GitHub calls.
    post = _step("vram-pr-comment.yml", "comment", "Post, update or delete the comment")
    compare = post.split("\npr=$(", 1)[0]
    done = _bash(compare, base.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.returncode, (base.parent / "comment.md").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_comment_names_the_categories_and_lines_that_grew(tmp_path: Path) -> None:
    base, head = make_pull_request(tmp_path)
    _, comment = run_workflow_commands(base, head)
    assert "**1 test grew beyond the tolerance (5%).**" in comment
    section = comment.split("#### What changed at the peak\n", 1)[1]
    assert re.search(r"activations \+\d+\.\d\d MiB", section), section
    assert "Modules that grew: `blocks." in section
    grown = re.findall(r"^- `(gpt\.py:\d+)` `([^`]+)`: \+(\S+ \S+) \((\w+)\)$", section, re.M)
    assert grown, section
    # The lines that grew are the model's forward, whose activations checkpointing dropped.
    assert all(category == "activations" for *_, category in grown)
