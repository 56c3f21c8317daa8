"""Measured tests start from seeded generators, so that an identical rerun measures alike."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import zlib

import pytest

from pytest_vram.wiring.seeding import Seeder, seed_for, seed_generators

DRAWS = """
import random
import numpy as np
import torch

def test_draws(vram):
    steps = random.randint(1, 1000) + int(np.random.randint(0, 1000))
    x = torch.ones(steps * 64 + int(torch.randint(0, 1000, ()).item()))
"""


def test_each_test_has_its_own_seed_the_same_in_every_run() -> None:
    assert seed_for(0, "t.py::a") == seed_for(0, "t.py::a")
    assert len({seed_for(0, "t.py::a"), seed_for(0, "t.py::b"), seed_for(1, "t.py::a")}) == 3


def test_seeding_repeats_python_numpy_and_torch_draws() -> None:
    np = pytest.importorskip("numpy")
    import numpy.random  # noqa: F401 - seeded where imported
    import torch

    seed_generators(7)
    first = (random.random(), np.random.rand(), torch.rand(()).item())
    seed_generators(7)
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == first
    seed_generators(8)
    assert random.random() != first[0]


@pytest.mark.parametrize("seed", [0, 7, 2**40])
@pytest.mark.parametrize("nodeid", ["t.py::a", "tests/t.py::test[\u00e9-1]", ""])
def test_a_seeded_test_draws_what_plain_seeding_with_its_seed_draws(seed: int, nodeid: str) -> None:
    np = pytest.importorskip("numpy")
    import numpy.random  # noqa: F401 - seeded where imported
    import torch

    random.gauss(0, 1), np.random.randn(), torch.randn(3)  # each keeps a normal draw in hand
    Seeder(seed).start(nodeid)
    seeded = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.gauss(0, 1), np.random.randn(), torch.randn(3)
    expected = seed_for(seed, nodeid)
    assert expected == zlib.crc32(f"{seed}:{nodeid}".encode())
    random.seed(expected)
    np.random.seed(expected % 2**32)
    torch.manual_seed(expected)
    plain = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    assert seeded[0] == plain[0]
    assert all(np.array_equal(a, b) for a, b in zip(seeded[1], plain[1], strict=True))
    assert torch.equal(seeded[2], plain[2])


FIRST_IMPORT = """
import sys
from pytest_vram.wiring.seeding import Seeder, seed_for

assert "numpy.random" not in sys.modules
seeder = Seeder(0)
seeder.start("t.py::a")
import numpy as np

drawn = np.random.rand()  # numpy.random is imported here, by the test
np.random.seed(seed_for(0, "t.py::a") % 2**32)
assert drawn == np.random.rand(), "made by the test, the generator starts from the test's seed"
assert not any(type(f).__name__ == "PatchOnImport" for f in sys.meta_path)
seeder.start("t.py::b")  # imported now: seeded directly
drawn = np.random.rand()
np.random.seed(seed_for(0, "t.py::b") % 2**32)
assert drawn == np.random.rand()
print("ok")
"""


def test_numpy_generator_made_during_a_test_starts_from_the_tests_seed() -> None:
    pytest.importorskip("numpy")
    # A fresh interpreter: here numpy.random may have been imported already.
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_seeder_leaves_no_import_hook_behind() -> None:
    before = list(sys.meta_path)
    seeder = Seeder(3)
    seeder.start("t.py::a")
    seeder.close()
    assert sys.meta_path == before


def peak(pytester: pytest.Pytester, *args: str) -> int:
    result = pytester.runpytest_subprocess(
        "--vram-backend=cpu", "--vram-report", "--vram-json=out.json", *args
    )
    assert result.ret == 0, result.outlines
    return json.loads((pytester.path / "out.json").read_text())["tests"][0]["peak_allocated"]


@pytest.mark.slow
def test_a_rerun_of_a_test_that_draws_from_unseeded_generators_measures_alike(
    pytester: pytest.Pytester,
) -> None:
    pytest.importorskip("numpy")
    pytester.makepyfile(test_draws=DRAWS)
    assert peak(pytester) == peak(pytester) == peak(pytester, "--vram-seed=0")
    assert peak(pytester, "--vram-seed=1") != peak(pytester)
    pytester.runpytest_subprocess("--vram-backend=cpu", "--vram-update-baselines")
    result = pytester.runpytest_subprocess(
        "--vram-backend=cpu", "--vram-report", "--vram-tolerance=0B"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["vram: each test that opted in starts from its own seed, derived from 0 (--vram-seed)"]
    )


SEQUENCE = """
import random

from pytest_vram.wiring.seeding import seed_for

def test_first(vram):
    random.seed(99)

def test_second(vram):
    random_at_start = random.random()
    random.seed(99)
    after_seed_99 = random.random()
    random.seed(seed_for(0, "test_sequence.py::test_second"))
    after_its_seed = random.random()
    assert random_at_start == ({expected})
"""


@pytest.mark.parametrize(
    ("option", "expected"),
    [("--vram-seed=off", "after_seed_99"), ("--vram-seed=0", "after_its_seed")],
)
def test_seed_off_leaves_the_generators_alone(
    pytester: pytest.Pytester, option: str, expected: str
) -> None:
    # test_second reads the generator before touching it: with seeding off it goes on from
    # test_first's seed, with seeding on it starts from --vram-seed.
    pytester.makepyfile(test_sequence=SEQUENCE.format(expected=expected))
    result = pytester.runpytest("--vram-backend=cpu", "--vram-report", option, "-p", "no:randomly")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("seed", ["-1", "lots", "１"])
def test_a_bad_seed_is_a_usage_error(pytester: pytest.Pytester, seed: str) -> None:
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest(f"--vram-seed={seed}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--vram-seed / vram_seed: * is not a seed*"])
