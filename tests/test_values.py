"""Outcome parity on the simulated device: a test that passes under plain pytest passes under
``--vram-report`` too, computing its values on the CPU where it reads them, with the figures it
would have shape-only."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

# What becomes of any test the simulated device runs, opted in or not.
pytestmark = pytest.mark.usefixtures("every_test_simulated")


# Ordinary tests of PyTorch code, written for the CPU, that read values in every way a suite
# does. Each passes under plain pytest.
ORDINARY = """
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


@pytest.fixture(scope="session")
def table():
    return torch.arange(12.0).view(3, 4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_shapes_only(model):
    assert model(torch.randn(5, 4)).shape == (5, 2)


def test_item_and_value_asserts(model):
    loss = model(torch.randn(5, 4)).pow(2).mean()
    loss.backward()
    assert loss.item() >= 0
    assert torch.isfinite(loss).all()
    assert all(p.grad is not None for p in model.parameters())


def test_allclose_and_numpy(table):
    assert torch.allclose(table.sum(0), torch.tensor([12.0, 15.0, 18.0, 21.0]))
    np.testing.assert_allclose(table.numpy()[2], [8.0, 9.0, 10.0, 11.0])
    assert table.tolist()[0] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader(workers):
    data = TensorDataset(torch.arange(16.0).view(8, 2), torch.arange(8))
    loader = DataLoader(data, batch_size=2, shuffle=True, num_workers=workers)
    seen = sorted(int(i) for _, labels in loader for i in labels)
    assert seen == list(range(8))


def test_torch_compile():
    f = torch.compile(lambda x: torch.sin(x) * 2)
    x = torch.linspace(0, 1, 16)
    assert torch.allclose(f(x), torch.sin(x) * 2)


def test_fork_rng_and_seeds():
    torch.manual_seed(3)
    first = torch.rand(4)
    with torch.random.fork_rng():
        torch.rand(100)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4), first)


@pytest.mark.parametrize("n", [1, 3])
def test_parametrized(n):
    assert torch.ones(n).sum().item() == n


def test_data_dependent_shape():
    x = torch.tensor([0.0, 1.0, -2.0, 3.0])
    assert x[x > 0].numel() == 2
    assert torch.nonzero(x).shape == (3, 1)


def test_raises_on_values():
    with pytest.raises(RuntimeError):
        torch.linalg.cholesky(-torch.eye(3))


def test_threads():
    results = []
    worker = threading.Thread(target=lambda: results.append(torch.ones(3).sum().item()))
    worker.start()
    worker.join()
    assert results == [3.0]


def test_module_fixture_after_values(model):
    assert model[0].weight.shape == (8, 4)


@pytest.mark.xfail(reason="a known failure", strict=True)
def test_expected_failure():
    assert torch.zeros(1).item() == 1.0


def test_genuine_failure():
    assert torch.tensor([2.0, 2.0]).sum().item() == 5.0
"""


def outcomes(pytester: pytest.Pytester, *options: str) -> dict[str, str]:
    """Per test its outcome in a pytest run of its own (torch.compile's Inductor registers
    itself once per process, which pytester's in-process runs would repeat)."""
    junit = pytester.path / "outcomes.xml"
    pytester.runpytest_subprocess(f"--junitxml={junit}", *options)
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif skipped is not None:
            outcome = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            outcome = "passed"
        found.setdefault(case.get("name"), outcome)
    return found


@pytest.mark.slow
def test_ordinary_tests_have_the_same_outcomes_as_without_the_plugin(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_ordinary=ORDINARY)
    plain = outcomes(pytester, "-p", "no:vram")
    assert plain["test_genuine_failure"] == "failed"
    assert plain["test_expected_failure"] == "xfailed"
    assert sum(o == "passed" for o in plain.values()) == 13
    measured = outcomes(pytester, "--vram-report", "-p", "no:cacheprovider")
    assert measured == plain
    assert outcomes(pytester, "--vram-report", "-n", "2") == plain


@pytest.mark.slow
def test_every_test_is_reported_once_with_figures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ordinary=ORDINARY)
    result = pytester.runpytest_subprocess("--vram-report", "--vram-json", "figures.json", "-rA")
    result.assert_outcomes(passed=13, failed=1, xfailed=1)
    records = json.loads(Path(pytester.path, "figures.json").read_text())["tests"]
    assert len(records) == 15
    assert len({r["nodeid"] for r in records}) == 15
    assert all(r["backend"] == "sim" for r in records)
    assert sum(r["peak_allocated"] > 0 for r in records) >= 13  # a thread's tensors are unseen
    # The real failure is reported as a plain run reports it, values and all.
    result.stdout.fnmatch_lines(["*assert 4.0 == 5.0*"])
    assert result.stdout.str().count("E       assert 4.0 == 5.0") == 1


CUDA_WRITTEN = """
import torch
from torch import nn


def test_training_on_cuda(vram):
    model = nn.Linear(64, 64).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"loss {loss.item():.4f}")
    assert loss.item() > 0
    assert torch.cuda.max_memory_allocated() > 0
    assert torch.cuda.get_rng_state().numel() > 0
"""


def test_cuda_written_code_computes_on_the_simulated_device(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cuda=CUDA_WRITTEN)
    result = pytester.runpytest("--vram-report", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*loss 0.*", "*test_training_on_cuda*sim*"])
    cache = pytester.path / ".pytest_cache" / "v" / "vram" / "needs_values"
    assert json.loads(cache.read_text()) == ["test_cuda.py"]


SIDE_EFFECTS = """
import pytest, torch
from pathlib import Path
from pytest_vram import max_vram


def note(name):
    with open(Path(__file__).parent / "runs.txt", "a") as runs:
        runs.write(name + "\\n")


def test_reads_a_value():
    note("reads")
    assert torch.rand(4, device="cuda").sum().item() >= 0.0  # values no one knows


@max_vram("1KiB")
def test_over_budget():
    note("budget")
    x = torch.empty(4096, device="cuda")
"""


def test_values_are_computed_once_a_file_is_known_to_need_them(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_side=SIDE_EFFECTS)
    runs = pytester.path / "runs.txt"
    # Without the rerun that records a failing test's peak lines: the runs are values on
    # demand's alone.
    pytester.runpytest("--vram-report", "--vram-peak-lines=no").assert_outcomes(passed=1, failed=1)
    # Shape-only first, then computing; a budget failure is the same computing: not rerun.
    assert runs.read_text().split() == ["reads", "reads", "budget"]
    runs.unlink()
    pytester.runpytest("--vram-report", "--vram-peak-lines=no").assert_outcomes(passed=1, failed=1)
    assert runs.read_text().split() == ["reads", "budget"]
    runs.unlink()
    result = pytester.runpytest("--vram-report", "--cache-clear", "--vram-sim-compute=never")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*test_side.py:*: reads a tensor's value*=never*=always*"])


NEIGHBOURS = {
    "test_a_reads": """
import torch
from notes import note


def test_reads():
    note("a")
    assert torch.rand(4, device="cuda").sum().item() >= 0.0
""",
    "test_b_reads": """
import torch
from notes import note


def test_reads():
    note("b")
    assert torch.rand(4, device="cuda").sum().item() >= 0.0
""",
    "test_c_large": """
import torch
from notes import note


def test_large():
    note("large")
    weights = torch.empty(1536 << 20, dtype=torch.uint8, device="cuda")  # 1.5 GiB
    assert weights.shape == (1536 << 20,)


def test_small():
    note("small")
    assert torch.ones(4, device="cuda").shape == (4,)
""",
    "notes": """
from pathlib import Path


def note(name):
    with open(Path(__file__).parent / "runs.txt", "a") as runs:
        runs.write(name + "\\n")
""",
}


def runs_of(pytester: pytest.Pytester, *args: str, passed: int) -> list[str]:
    """Which tests' code ran, in order, in one ``--vram-report`` run."""
    runs = pytester.path / "runs.txt"
    runs.unlink(missing_ok=True)
    pytester.runpytest("--vram-report", "-p", "no:randomly", *args).assert_outcomes(passed=passed)
    return runs.read_text().split()


def test_a_file_after_one_that_computed_computes_on_a_guess(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**{k: v for k, v in NEIGHBOURS.items() if k != "test_c_large"})
    # The first file tries shape-only; the next, run after one that computed, computes at once.
    assert runs_of(pytester, passed=2) == ["a", "a", "b"]
    assert runs_of(pytester, passed=2) == ["a", "b"]
    cache = json.loads((pytester.path / ".pytest_cache/v/vram/needs_values").read_text())
    assert cache == ["test_a_reads.py"]  # a guess that held is no evidence


def test_a_guess_that_holds_too_much_runs_again_shape_only(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**NEIGHBOURS)
    # test_c_large's first test computes on a guess, past the budget: shape-only, as its file.
    first = runs_of(pytester, passed=4)
    assert first == ["a", "a", "b", "large", "large", "small"]
    cache = json.loads((pytester.path / ".pytest_cache/v/vram/shape_only").read_text())
    assert cache == ["test_c_large.py"]
    # Remembered: shape-only from the start, with the figures of the first run.
    pytester.makeini("[pytest]\nvram_baseline_dir = baselines")
    assert runs_of(pytester, "--vram-update-baselines", passed=4) == ["a", "b", "large", "small"]
    result = pytester.runpytest("--vram-report", "-p", "no:randomly", "--cache-clear")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*test_c_large.py::test_large*1.50 GiB*ok*"])


MODE_CHECK = """
import torch
from torch._subclasses.fake_tensor import FakeTensor
from notes import note


def test_passes_shape_only_alone():
    note("fake")
    assert isinstance(torch.ones(1, device="cuda"), FakeTensor)
"""


def test_a_test_that_fails_on_a_guess_runs_as_without_it(pytester: pytest.Pytester) -> None:
    files = {k: v for k, v in NEIGHBOURS.items() if k in ("test_a_reads", "notes")}
    pytester.makepyfile(**files, test_b_mode=MODE_CHECK)
    # Failed on the guess, passed shape-only: reported as it passes without the guess.
    assert runs_of(pytester, passed=2) == ["a", "a", "fake", "fake"]
    cache = json.loads((pytester.path / ".pytest_cache/v/vram/shape_only").read_text())
    assert cache == ["test_b_mode.py"]
    assert runs_of(pytester, passed=2) == ["a", "fake"]


FAILS_A_SUBTEST = """
import unittest

import torch
from notes import note


class TestSolver(unittest.TestCase):
    def test_cases(self):
        note("b")
        for n in range(3):
            with self.subTest(n=n):
                note(f"b{n}")
                self.assertNotEqual(torch.ones(2, device="cuda").sum().item(), 2.0 * (n == 1))

    def test_next(self):
        note("c")
        self.assertGreaterEqual(torch.randn(2, device="cuda").abs().sum().item(), 0.0)
"""


@pytest.mark.skipif(
    pytest.version_tuple < (9,) and importlib.util.find_spec("pytest_subtests") is None,
    reason=f"pytest {pytest.__version__} stops a unittest test at its first failing subTest "
    "(pytest 9, or pytest-subtests, reports each)",
)
def test_a_subtest_that_fails_on_a_guess_is_not_computed_a_third_time(
    pytester: pytest.Pytester,
) -> None:
    files = {k: v for k, v in NEIGHBOURS.items() if k in ("test_a_reads", "notes")}
    pytester.makepyfile(**files, test_b_solver=FAILS_A_SUBTEST)
    computed = pytester.runpytest("--vram-report", "-p", "no:randomly", "--vram-sim-compute=always")
    runs = pytester.path / "runs.txt"
    runs.unlink()
    result = pytester.runpytest("--vram-report", "-p", "no:randomly", "--cache-clear")
    # The guess computes every subtest; shape-only (the sum of ones is known without
    # computing) fails at n=1, a failure that may want values; the guess's run, what
    # computing gives, stands: no third run. The file stays on a guess: its next test
    # computes at once, and the file is not remembered as shape-only.
    assert runs.read_text().split() == ["a", "a", "b", "b0", "b1", "b2", "b", "b0", "b1", "c"]
    assert result.parseoutcomes() == computed.parseoutcomes() == {"failed": 1, "passed": 3}
    shape_only = pytester.path / ".pytest_cache/v/vram/shape_only"
    assert not shape_only.exists() or "test_b_solver.py" not in shape_only.read_text()
    result.stdout.fnmatch_lines(["*SUBFAIL*(n=1)*test_b_solver.py::TestSolver::test_cases*"])
    assert result.stdout.str().count("SUBFAIL") == computed.stdout.str().count("SUBFAIL")


@pytest.mark.slow
def test_an_xdist_controller_remembers_what_its_workers_found(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(**NEIGHBOURS)
    result = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly", "-n", "1")
    result.assert_outcomes(passed=4)
    cache = pytester.path / ".pytest_cache/v/vram"
    assert json.loads((cache / "needs_values").read_text()) == ["test_a_reads.py"]
    assert json.loads((cache / "shape_only").read_text()) == ["test_c_large.py"]


SAME_STEP = """
import sys
sys.path.insert(0, {suites!r})
import torch
from gpt import GPT, GPTConfig, training_step


def step(vram, read):
    with torch.device("cuda"):
        model = GPT(GPTConfig(num_layers=2))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 1024, (2, 129), device="cuda")
    for _ in range(2):
        training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    if read:
        assert torch.isfinite(model.lm_head.weight).all()


def test_shape_only(vram):
    step(vram, read=False)


def test_reads_values(vram):
    step(vram, read=True)
"""


def figures(path: Path) -> dict[str, tuple[int, int]]:
    tests = json.loads(path.read_text())["tests"]
    return {r["nodeid"].split("::")[1]: (r["peak_allocated"], r["peak_reserved"]) for r in tests}


def test_figures_do_not_depend_on_reading_values(pytester: pytest.Pytester) -> None:
    suites = str(Path(__file__).resolve().parents[1] / "suites")
    pytester.makepyfile(test_step=SAME_STEP.format(suites=suites))
    runs = {}
    for compute in ("auto", "always"):
        result = pytester.runpytest(
            "--vram-report", f"--vram-sim-compute={compute}", "--vram-json", f"{compute}.json"
        )
        result.assert_outcomes(passed=2)
        runs[compute] = figures(pytester.path / f"{compute}.json")
    shape_only = runs["auto"]["test_shape_only"]
    assert shape_only[0] > 30 << 20
    # Shape-only, computing because it read a value, computing because told to: one figure.
    assert runs["auto"]["test_reads_values"] == shape_only
    assert runs["always"] == {"test_shape_only": shape_only, "test_reads_values": shape_only}


GUARDED = """
import pytest, torch

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
def test_on_the_gpu():
    x = torch.ones(8, device="cuda")
    assert x.sum().item() == 8.0
"""


def test_collection_time_gpu_guards(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_guarded=GUARDED)
    pytester.runpytest("--vram-report").assert_outcomes(skipped=1)
    pytester.runpytest("--vram-sim-cuda-available").assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nvram_sim_cuda_available = true\n")
    pytester.runpytest().assert_outcomes(passed=1)


LOADER = """
import torch
from torch.utils.data import DataLoader, TensorDataset


def test_measured(vram):
    data = TensorDataset(torch.arange(16.0).view(8, 2), torch.arange(8))
    loader = DataLoader(data, batch_size=2, shuffle=True, num_workers=2)
    assert sorted(int(i) for _, labels in loader for i in labels) == list(range(8))
"""


@pytest.mark.slow
def test_a_measured_loader_with_workers_leaves_nothing_behind(pytester: pytest.Pytester) -> None:
    # Its shape-only attempt stops inside the loader's iterator, half-built: withdrawn quietly.
    pytester.makepyfile(test_loader=LOADER)
    result = pytester.runpytest_subprocess("--vram-report", "-W", "error", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    assert "Unraisable" not in result.stdout.str()


# A root conftest that decides its devices when pytest imports it, before any hook of the
# session runs.
DEVICES_CONFTEST = """
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)
"""

ON_EACH_DEVICE = """
import torch


def test_ones(device):
    assert torch.ones(3, device=device).sum().item() == 3.0
"""


def test_a_root_conftest_sees_the_simulated_device(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(DEVICES_CONFTEST)
    pytester.makepyfile(test_devices=ON_EACH_DEVICE)
    result = pytester.runpytest("--vram-sim-cuda-available", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_ones?cuda? PASSED*"])
    pytester.makeini("[pytest]\nvram_sim_cuda_available = true\n")
    pytester.runpytest().assert_outcomes(passed=2)
    # Without the option the conftest finds no GPU, and the real torch answers after it.
    pytester.makeini("[pytest]\n")
    pytester.runpytest().assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nvram_sim_cuda_available = true\nvram_backend = cpu\n")
    pytester.runpytest().assert_outcomes(passed=1)


FAILURES = """
import pytest, torch
from pytest_vram import max_vram

@pytest.fixture(scope="module")
def weights():
    return torch.randn(256, 256, device="cuda")

def test_genuine_failure(weights):
    big = weights @ weights
    assert big.sum().item() == 12345.0

def test_needs_values(weights):
    assert (weights.abs() >= 0).all()

def test_shape_only(weights):
    y = weights @ weights
    assert y.shape == (256, 256)

@max_vram("1KiB")
def test_over_budget():
    torch.empty(1 << 20, device="cuda")

def test_error_in_shape_only_with_tensors_alive(weights):
    kept = [weights * i for i in range(4)]
    raise RuntimeError("gone")

@pytest.mark.parametrize("n", [64, 128])
def test_after_failures(weights, n):
    assert (weights[:n] @ weights[:, :n]).shape == (n, n)
"""


def entries(path: Path) -> dict[str, dict[str, int]]:
    return yaml.safe_load(path.read_text())["tests"]


@pytest.mark.slow
def test_figures_after_failures_do_not_depend_on_order(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_failures=FAILURES)
    found = {}
    runs = {
        "serial": [],
        "xdist": ["-n", "2"],
        "alone": ["-p", "no:cacheprovider", "-k", "after_failures or needs_values"],
    }
    for name, options in runs.items():
        baselines = pytester.path / f"baselines-{name}"
        result = pytester.runpytest_subprocess(
            "--vram-update-baselines", "--vram-baseline-dir", str(baselines), *options
        )
        found[name] = entries(baselines / "sim.yaml")
        if name != "alone":
            result.assert_outcomes(passed=4, failed=3)
    assert len(found["serial"]) == 4  # the failed tests' figures are not stored
    assert found["serial"] == found["xdist"]
    assert found["alone"] == {k: v for k, v in found["serial"].items() if k in found["alone"]}
    assert len(found["alone"]) == 3


GENERATE = """
import pytest, torch


transformers = pytest.importorskip("transformers")


def test_greedy_generate_matches_a_manual_loop():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    tokens = prompt
    with torch.no_grad():
        for _ in range(4):
            next_token = model(tokens).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    assert out.tolist() == tokens.tolist()
"""


@pytest.mark.slow
def test_hugging_face_generate_has_the_same_outcome(pytester: pytest.Pytester) -> None:
    pytest.importorskip("transformers")
    pytester.makepyfile(test_generate=GENERATE)
    plain = outcomes(pytester, "-p", "no:vram")
    assert plain == {"test_greedy_generate_matches_a_manual_loop": "passed"}
    assert outcomes(pytester, "--vram-report") == plain


def test_a_figure_sim_cannot_measure_is_not_checked_computing_too(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import torch
        from pytest_vram import max_vram

        @max_vram("1KiB", metric="device")
        def test_reads_values():
            assert torch.ones(4096, device="cuda").sum().item() == 4096.0
        """
    )
    result = pytester.runpytest("--vram-report", "--vram-json", "figures.json")
    result.assert_outcomes(passed=1)
    record = json.loads((pytester.path / "figures.json").read_text())["tests"][0]
    assert record["peak_allocated"] == 16384 + 512  # the ones and their sum
    assert any("not checked" in message for message in record["messages"])
