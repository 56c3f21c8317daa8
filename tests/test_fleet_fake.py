"""GPU fleets on faked surfaces: pytest-xdist workers on their own GPUs, MIG slices, ROCm.

torch.cuda, pynvml and amdsmi are the fakes of tests/fake_gpu.py; the end-to-end runs load
them from a conftest.py in the pytester directory, so the plugin meets them as on a GPU host.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fake_gpu import FakeAllocator, FakeAmdSmi, FakeNvml, GiB, MiB, gpu, sampler_threads

from pytest_vram.backends.base import BackendUnavailable
from pytest_vram.backends.cuda import amdsmi as amdsmi_source
from pytest_vram.backends.cuda.backend import CudaBackend, worker_device_index
from pytest_vram.backends.cuda.source import SourceUnavailable

pytest_plugins = ["fake_gpu_fixtures"]

TESTS = Path(__file__).parent
A100 = "NVIDIA A100-SXM4-80GB"
SLICE = "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
SLICE_UUID = "MIG-2b1e6f0a-77c4-5d1b-9a3e-0c4d5e6f7a8b"
MI300X = "AMD Instinct MI300X"
SLICE_MEMORY = 9856 * MiB  # what a 1g.10gb slice reports as its total


def uuid(n: int) -> str:
    return f"{n:08x}-0b6a-4c5e-9d7f-2a1b3c4d5e6f"


# -- pytest-xdist: each worker its own GPU --------------------------------------------------


@pytest.mark.parametrize(
    ("worker", "count", "index"),
    [("gw0", 4, 0), ("gw3", 4, 3), ("gw5", 4, 1), ("gw7", 2, 1), ("gw2", 1, 0)],
)
def test_worker_device_index_is_worker_number_modulo_device_count(
    worker: str, count: int, index: int
) -> None:
    assert worker_device_index(count, worker=worker, policy="spread") == index


@pytest.mark.parametrize(
    ("worker", "policy"), [("", "spread"), ("master", "spread"), ("gw3", "current")]
)
def test_worker_device_index_none_outside_xdist_or_opted_out(worker: str, policy: str) -> None:
    assert worker_device_index(4, worker=worker, policy=policy) is None


def test_worker_device_index_rejects_an_unknown_policy() -> None:
    with pytest.raises(BackendUnavailable, match="PYTEST_VRAM_WORKER_GPUS='everywhere'"):
        worker_device_index(4, worker="gw0", policy="everywhere")


def test_fake_cuda_xdist_worker_takes_its_own_gpu(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    fake_nvml: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda.gpus = [gpu(uuid=uuid(n)) for n in range(4)]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw6")
    backend = make_backend()
    assert backend.index == 2
    assert backend.device == torch.device("cuda", 2)
    # device="cuda" in the test lands on the worker's GPU.
    assert fake_cuda.set_device_calls == [2]
    assert torch.cuda.current_device() == 2
    # NVML reads the same GPU, found by its UUID whatever CUDA_VISIBLE_DEVICES renumbered.
    assert fake_nvml.handles == [("uuid", f"GPU-{uuid(2)}")]
    fake_cuda.devices.clear()
    backend.begin_test()
    backend.allocated()
    backend.reset_peak()
    backend.release_cache()
    backend.end_test()
    assert fake_cuda.devices == {2}


def test_fake_cuda_xdist_workers_wrap_around_the_visible_devices(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA_VISIBLE_DEVICES=4,5: torch sees two devices, numbered 0 and 1.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    fake_cuda.gpus = [gpu(uuid=uuid(4)), gpu(uuid=uuid(5))]
    indices = []
    for worker in ("gw0", "gw1", "gw2", "gw3"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        indices.append(make_backend().index)
    assert indices == [0, 1, 0, 1]


def test_fake_cuda_without_xdist_uses_the_current_device(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    fake_cuda.gpus = [gpu(uuid=uuid(n)) for n in range(2)]
    fake_cuda.current = 1
    backend = make_backend()
    assert backend.device == torch.device("cuda", 1)
    assert fake_cuda.set_device_calls == []


def test_fake_cuda_workers_opt_out_keep_the_current_device(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda.gpus = [gpu(uuid=uuid(n)) for n in range(4)]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setenv("PYTEST_VRAM_WORKER_GPUS", "current")
    backend = make_backend()
    assert backend.index == 0
    assert fake_cuda.set_device_calls == []


def test_fake_cuda_an_explicit_index_becomes_the_current_device(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda.gpus = [gpu(uuid=uuid(n)) for n in range(4)]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert make_backend(index=1).index == 1  # not the worker's
    # A test's device="cuda" lands on the device measured.
    assert fake_cuda.set_device_calls == [1]
    assert torch.cuda.current_device() == 1


# -- MIG ------------------------------------------------------------------------------------


@pytest.fixture
def mig_slice(fake_cuda: FakeAllocator, fake_nvml: FakeNvml) -> FakeNvml:
    """One 1g.10gb slice of an A100 visible to CUDA; torch names it as the whole GPU."""
    fake_cuda.gpus = [gpu(name=A100, total=SLICE_MEMORY, uuid=SLICE_UUID[4:])]
    fake_nvml.gpu_uuids = set()  # its UUID is no GPU's
    fake_nvml.slices = {SLICE_UUID: {"name": SLICE, "used": 300 * MiB, "total": SLICE_MEMORY}}
    fake_nvml.used = 40 * GiB  # the whole GPU, all slices together
    return fake_nvml


def test_fake_cuda_mig_slice_is_its_own_device_class(
    make_backend: Callable[..., CudaBackend], mig_slice: FakeNvml
) -> None:
    backend = make_backend()
    assert backend.mig
    assert backend.device_class == SLICE
    assert backend.total_memory() == SLICE_MEMORY  # requires_vram compares with the slice
    assert mig_slice.handles == [("uuid", SLICE_UUID)]
    environment = backend.environment()
    assert environment["device"] == SLICE
    assert environment["mig"] is True
    assert environment["total_memory"] == SLICE_MEMORY


def test_fake_cuda_mig_slice_device_memory_is_the_slices(
    make_backend: Callable[..., CudaBackend], mig_slice: FakeNvml
) -> None:
    backend = make_backend()
    backend.begin_test()
    mig_slice.slices[SLICE_UUID]["used"] = 2 * GiB
    # Above the slice's 300 MiB at the floor; not the parent GPU's 40 GiB.
    assert backend.peak_device() == 2 * GiB - 300 * MiB
    backend.end_test()
    assert backend.nvml_note is None


def test_fake_cuda_mig_slice_from_cuda_visible_devices(
    make_backend: Callable[..., CudaBackend],
    mig_slice: FakeNvml,
    fake_cuda: FakeAllocator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLICE_UUID)
    fake_cuda.gpus = [gpu(name=A100, total=SLICE_MEMORY, uuid=None)]  # torch has no UUID
    backend = make_backend()
    assert backend.device_class == SLICE
    assert mig_slice.handles == [("uuid", SLICE_UUID)]


def test_fake_cuda_mig_name_from_torch_when_it_names_the_slice(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    fake_cuda.gpus = [gpu(name=SLICE, total=SLICE_MEMORY)]
    backend = make_backend()
    assert backend.mig
    assert backend.device_class == SLICE


def test_fake_cuda_mig_without_nvml_names_the_slice_by_its_memory(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLICE_UUID)
    fake_cuda.gpus = [gpu(name=A100, total=SLICE_MEMORY)]
    backend = make_backend()
    assert backend.mig
    assert backend.device_class == f"{A100} MIG 9.62 GiB"
    assert "pynvml" in (backend.nvml_note or "")


def test_fake_cuda_mig_parent_gpu_is_not_sampled(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, fake_nvml: FakeNvml
) -> None:
    # NVML finds only the parent GPU (by index), which is in MIG mode: its used memory is
    # every slice's, so none is sampled, and the device is still named as a slice.
    fake_cuda.gpus = [gpu(name=A100, total=SLICE_MEMORY)]
    fake_nvml.uuid_error = RuntimeError("NVML_ERROR_NOT_FOUND")
    fake_nvml.mig_mode = 1
    before = sampler_threads()
    backend = make_backend()
    assert sampler_threads() == before
    assert backend.peak_device() is None
    assert backend.mig
    assert backend.device_class == f"{A100} MIG 9.62 GiB"
    assert "MIG slice" in (backend.nvml_note or "")
    assert "CUDA_VISIBLE_DEVICES" in (backend.nvml_note or "")


def test_fake_cuda_gpu_with_mig_disabled_is_the_whole_gpu(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, fake_nvml: FakeNvml
) -> None:
    fake_cuda.gpus = [gpu(name=A100, total=80 * GiB)]
    fake_nvml.mig_mode = 0
    backend = make_backend()
    assert not backend.mig
    assert backend.device_class == A100
    assert "mig" not in backend.environment()


# -- ROCm -----------------------------------------------------------------------------------


@pytest.fixture
def rocm(fake_cuda: FakeAllocator, monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """A ROCm build of torch on a host with an MI300X at PCI bus c1."""
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766")
    monkeypatch.setattr(torch.version, "cuda", None)
    fake_cuda.gpus = [
        gpu(name=MI300X, total=192 * GiB, uuid=None, pci_bus_id=0xC1, pci_domain_id=0,
            pci_device_id=0)
    ]  # fmt: skip
    return fake_cuda


def test_fake_rocm_device_class_and_environment(
    make_backend: Callable[..., CudaBackend],
    rocm: FakeAllocator,
    fake_amdsmi: FakeAmdSmi,
    fake_nvml: FakeNvml,
) -> None:
    backend = make_backend()
    assert backend.rocm
    assert backend.device_class == MI300X
    environment = backend.environment()
    assert environment["device"] == MI300X
    assert environment["hip"] == "6.2.41133-dd7f95766"
    assert "cuda" not in environment
    assert environment["driver"] == "6.10.5"
    assert environment["device_memory"] == "amdsmi"
    assert environment["total_memory"] == 192 * GiB
    assert fake_nvml.handles == []  # NVML has nothing to say about an AMD GPU
    assert fake_amdsmi.init_flags == [FakeAmdSmi.AmdSmiInitFlags.INIT_AMD_GPUS]


def test_fake_rocm_amdsmi_samples_the_gpu_at_the_same_pci_address(
    make_backend: Callable[..., CudaBackend], rocm: FakeAllocator, fake_amdsmi: FakeAmdSmi
) -> None:
    fake_amdsmi.bdfs = ["0000:05:00.0", "0000:c1:00.0"]
    fake_amdsmi.used = {"0000:05:00.0": 50 * GiB, "0000:c1:00.0": 3 * GiB}
    before = sampler_threads("pytest-vram-amdsmi")
    backend = make_backend()
    assert len(sampler_threads("pytest-vram-amdsmi") - before) == 1
    backend.begin_test()
    assert backend.peak_device() == 0  # the 3 GiB it held at the floor
    fake_amdsmi.used["0000:c1:00.0"] = 7 * GiB
    assert backend.peak_device() == 4 * GiB
    fake_amdsmi.used["0000:c1:00.0"] = 3 * GiB + 5 * MiB
    backend.reset_peak()
    assert backend.peak_device() == 5 * MiB
    backend.end_test()
    assert {bdf for _, bdf in fake_amdsmi.queries} == {"0000:c1:00.0"}
    assert backend.nvml_note is None


def test_fake_rocm_amdsmi_without_a_pci_address_reads_only_a_lone_gpu(
    make_backend: Callable[..., CudaBackend], rocm: FakeAllocator, fake_amdsmi: FakeAmdSmi
) -> None:
    rocm.gpus = [gpu(name=MI300X, total=192 * GiB, uuid=None, bus=None)]
    fake_amdsmi.bdfs = ["0000:05:00.0", "0000:c1:00.0"]
    fake_amdsmi.used = {"0000:05:00.0": 5 * GiB, "0000:c1:00.0": 3 * GiB}
    backend = make_backend()
    assert backend.peak_device() is None  # amdsmi's first GPU need not be torch's
    assert "no PCI address" in (backend.nvml_note or "")
    assert "amdsmi lists 2" in (backend.nvml_note or "")

    fake_amdsmi.bdfs = ["0000:c1:00.0"]
    assert make_backend().peak_device() == 0
    assert fake_amdsmi.queries[-1] == ("memory_usage", "0000:c1:00.0")


def test_fake_rocm_older_amdsmi_reads_vram_usage_in_mb(
    make_backend: Callable[..., CudaBackend],
    rocm: FakeAllocator,
    fake_amdsmi: FakeAmdSmi,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(FakeAmdSmi, "amdsmi_get_gpu_memory_usage")
    fake_amdsmi.used["0000:c1:00.0"] = 1024 * MiB
    backend = make_backend()
    fake_amdsmi.used["0000:c1:00.0"] = 1536 * MiB + 123  # whole MB only
    assert backend.peak_device() == 512 * MiB
    assert fake_amdsmi.queries[-1] == ("vram_usage", "0000:c1:00.0")


def test_fake_rocm_without_amdsmi_is_a_clear_fallback(
    make_backend: Callable[..., CudaBackend], rocm: FakeAllocator, no_amdsmi: None
) -> None:
    before = sampler_threads("pytest-vram-amdsmi")
    backend = make_backend()
    assert sampler_threads("pytest-vram-amdsmi") == before
    assert backend.peak_device() is None
    assert "amdsmi" in (backend.nvml_note or "")
    assert "driver" not in backend.environment()
    assert backend.device_class == MI300X


def test_fake_rocm_when_amdsmi_init_fails(
    make_backend: Callable[..., CudaBackend], rocm: FakeAllocator, fake_amdsmi: FakeAmdSmi
) -> None:
    fake_amdsmi.init_error = RuntimeError("AMDSMI_STATUS_DRIVER_NOT_LOADED")
    with pytest.raises(SourceUnavailable, match="DRIVER_NOT_LOADED"):
        amdsmi_source.open_source(0)
    assert "DRIVER_NOT_LOADED" in (make_backend().nvml_note or "")


def test_fake_rocm_amdsmi_lists_too_few_gpus(rocm: FakeAllocator, fake_amdsmi: FakeAmdSmi) -> None:
    rocm.gpus = [gpu(name=MI300X, total=192 * GiB, uuid=None, bus=None)] * 3
    with pytest.raises(SourceUnavailable, match="it sees 3 GPUs and amdsmi lists 1"):
        amdsmi_source.open_source(2)


def test_fake_rocm_amdsmi_without_the_gpu_at_torchs_address(
    rocm: FakeAllocator, fake_amdsmi: FakeAmdSmi
) -> None:
    fake_amdsmi.bdfs = ["0000:05:00.0"]  # the GPU at c1 is not amdsmi's to see
    with pytest.raises(SourceUnavailable, match="none at ROCm device 0's PCI address 0000:c1:00"):
        amdsmi_source.open_source(0)


# -- end to end: the plugin on a faked fleet ------------------------------------------------

CONFTEST = f"""
import os, sys
sys.path.insert(0, {str(TESTS)!r})
import pytest, torch
from fake_gpu import FakeAmdSmi, FakeNvml, GiB, MiB, gpu
from fake_gpu_fixtures import install_fake_cuda

_patch = pytest.MonkeyPatch()
alloc = install_fake_cuda(_patch)
scenario = os.environ["FAKE_GPU_SCENARIO"]
nvml = FakeNvml()
sys.modules["pynvml"] = nvml
if scenario == "fleet":
    alloc.gpus = [gpu(uuid=f"{{n:08x}}-0b6a-4c5e-9d7f-2a1b3c4d5e6f") for n in range(2)]
elif scenario == "mig":
    alloc.gpus = [gpu(name={A100!r}, total={SLICE_MEMORY}, uuid={SLICE_UUID[4:]!r})]
    nvml.gpu_uuids = set()
    nvml.slices = {{{SLICE_UUID!r}: {{"name": {SLICE!r}, "used": 0, "total": {SLICE_MEMORY}}}}}
elif scenario == "rocm":
    _patch.setattr(torch.version, "hip", "6.2.41133")
    _patch.setattr(torch.version, "cuda", None)
    alloc.gpus = [gpu(name={MI300X!r}, total=192 * GiB, uuid=None, bus=0xC1)]
    sys.modules["amdsmi"] = FakeAmdSmi(used=3 * GiB)
"""


def run_fake_fleet(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, scenario: str, *args: str
) -> pytest.RunResult:
    monkeypatch.setenv("FAKE_GPU_SCENARIO", scenario)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makeconftest(CONFTEST)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


@pytest.mark.slow
def test_fake_cuda_xdist_run_puts_each_worker_on_its_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        """
        import os, time, torch
        import pytest

        @pytest.mark.parametrize("n", range(8))
        def test_where(vram, n, tmp_path_factory):
            time.sleep(0.05)  # so that both workers get tests
            worker = os.environ["PYTEST_XDIST_WORKER"]
            line = f"{worker} {vram.device} {torch.cuda.current_device()}\\n"
            with open(os.environ["WHERE_FILE"], "a") as f:
                f.write(line)
        """
    )
    where = pytester.path / "where.txt"
    monkeypatch.setenv("WHERE_FILE", str(where))
    result = run_fake_fleet(
        pytester, monkeypatch, "fleet", "-n", "2", "--vram-backend=auto", "--junitxml=out.xml"
    )
    result.assert_outcomes(passed=8)
    lines = where.read_text().split()
    seen = {(lines[i], lines[i + 1], lines[i + 2]) for i in range(0, len(lines), 3)}
    assert seen == {("gw0", "cuda:0", "0"), ("gw1", "cuda:1", "1")}
    devices = {
        p.get("value")
        for p in ET.parse(pytester.path / "out.xml").getroot().iter("property")
        if p.get("name") == "vram_device"
    }
    assert devices == {"NVIDIA H100 80GB HBM3"}


@pytest.mark.slow
def test_fake_cuda_mig_run_keys_baselines_and_requires_vram_by_the_slice(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        """
        from pytest_vram import requires_vram

        def test_measured(vram):
            assert vram.backend == "cuda"

        @requires_vram("9GiB")
        def test_fits_the_slice(vram):
            pass

        @requires_vram("20GB")
        def test_needs_more_than_the_slice(vram):
            pass
        """
    )
    result = run_fake_fleet(
        pytester, monkeypatch, "mig", "--vram-update-baselines", "-rs", "--vram-json=out.json"
    )
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*requires_vram(18.63 GiB (20GB)): the cuda device has 9.62 GiB*"])
    baseline = pytester.path / "baselines" / "nvidia-a100-sxm4-80gb-mig-1g-10gb.yaml"
    assert baseline.exists(), sorted(p.name for p in (pytester.path / "baselines").iterdir())
    text = baseline.read_text()
    assert SLICE in text
    assert "test_measured" in text
    document = json.loads((pytester.path / "out.json").read_text())
    assert {test["device"] for test in document["tests"]} == {SLICE}


@pytest.mark.slow
def test_fake_rocm_run_records_hip_and_amdsmi(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        """
        def test_measured(vram):
            assert vram.backend == "cuda"
        """
    )
    result = run_fake_fleet(
        pytester, monkeypatch, "rocm", "--vram-update-baselines", "--junitxml=out.xml"
    )
    result.assert_outcomes(passed=1)
    text = (pytester.path / "baselines" / "amd-instinct-mi300x.yaml").read_text()
    assert "hip: 6.2.41133" in text
    assert "device_memory: amdsmi" in text
    root = ET.parse(pytester.path / "out.xml").getroot()
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["vram_device"] == MI300X
    assert props["vram_peak_device"] == "0"  # nothing above the 3 GiB of its floor
    assert props["vram_env_hip"] == "6.2.41133"
    assert "vram_env_cuda" not in props
