"""The backends of one session: made on first use, one at a time watching."""

from __future__ import annotations

from typing import Any

from pytest_vram.backends import Backend, create_backend, resolve_name
from pytest_vram.options import Settings
from pytest_vram.version import __version__

__all__ = ["BackendPool"]


class BackendPool:
    """Makes each backend the first time a measured test needs it and remembers what it says
    about itself (its environment and notes) for the reports."""

    def __init__(self, settings: Settings, hook: Any = None) -> None:
        self.settings = settings
        self._hook = hook
        self.backends: dict[str, Backend] = {}
        #: Per backend name: the environment baselines and reports record.
        self.environments: dict[str, dict[str, Any]] = {}
        #: Per backend name: the key of its baseline file.
        self.device_classes: dict[str, str] = {}
        self.notes: list[str] = []
        #: Per name a test asked for (``auto`` included): its backend, once made.
        self._asked: dict[str, Backend] = {}

    def get(self, name: str) -> Backend:
        """The backend ``name`` (``auto`` resolved); raise BackendUnavailable when it cannot
        run here."""
        backend = self._asked.get(name)
        if backend is not None:
            return backend
        asked, name = name, resolve_name(name)
        backend = self.backends.get(name)
        if backend is None:
            backend = create_backend(
                name,
                cpu_counter=self.settings.cpu_counter,
                sim_capacity=self.settings.sim_capacity,
                sim_gpu=self.settings.sim_gpu,
                sim_host_tensors=self.settings.sim_host_tensors,
            )
            self.notes += backend.notes()
            self.backends[name] = backend
            self.device_classes[name] = self._device_class(backend)
            self.environments[name] = self._environment(backend)
        self._asked[asked] = backend
        return backend

    def _device_class(self, backend: Backend) -> str:
        if self._hook is not None:
            named = self._hook.pytest_vram_device_class(backend=backend)
            if named:
                return str(named)
        return backend.device_class

    def _environment(self, backend: Backend) -> dict[str, Any]:
        environment = backend.environment()
        environment["device"] = self.device_classes[backend.name]
        environment["pytest_vram"] = __version__
        if self._hook is not None:
            # Other plugins add fields: a CI job id, a driver build, a cluster name.
            self._hook.pytest_vram_update_environment(environment=environment, backend=backend)
        return environment

    def pause_all(self, keep: Backend | None = None) -> None:
        """Backends may go on watching after a test ends; stop all (but ``keep``) before other
        code runs, so that an unmeasured test runs exactly as without the plugin."""
        for backend in self.backends.values():
            if backend is not keep:
                backend.pause()

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends.clear()
        self._asked.clear()
