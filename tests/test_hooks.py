"""The plugin's own hooks: a conftest names the device class and adds environment fields."""

from __future__ import annotations

import json

import pytest
import yaml


def test_a_conftest_names_the_device_class_and_adds_environment_fields(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(
        """
        def pytest_vram_device_class(backend):
            return f"ci-pool-a ({backend.name})"

        def pytest_vram_update_environment(environment, backend):
            environment["runner"] = "pool-a-17"
        """
    )
    pytester.makepyfile("import torch\n\ndef test_one(vram):\n    x = torch.ones(256)\n")
    result = pytester.runpytest(
        "--vram-backend=cpu", "--vram-update-baselines", "--vram-json=out.json"
    )
    result.assert_outcomes(passed=1)
    (path,) = (pytester.path / "baselines").glob("*.yaml")
    assert path.name == "ci-pool-a-cpu.yaml"
    stored = yaml.safe_load(path.read_text())
    assert stored["device"] == "ci-pool-a (cpu)"
    assert stored["environment"]["runner"] == "pool-a-17"
    assert stored["environment"]["device"] == "ci-pool-a (cpu)"
    document = json.loads((pytester.path / "out.json").read_text())
    assert document["tests"][0]["device"] == "ci-pool-a (cpu)"
    # The next run compares with that file.
    result = pytester.runpytest("--vram-backend=cpu", "--vram-report")
    result.stdout.fnmatch_lines(["*1 measured test: 1 ok*"])


def test_no_hook_keeps_the_default_device_class(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        def pytest_vram_device_class(backend):
            return None
        """
    )
    pytester.makepyfile("import torch\n\ndef test_one(vram):\n    x = torch.ones(256)\n")
    pytester.runpytest("--vram-backend=cpu", "--vram-update-baselines").assert_outcomes(passed=1)
    assert (pytester.path / "baselines" / "cpu.yaml").is_file()
