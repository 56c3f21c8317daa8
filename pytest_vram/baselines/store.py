"""All baseline files of a directory, by device class.

A file's name is the slug of its ``device:`` field (``NVIDIA H100 80GB HBM3`` lives in
``nvidia-h100-80gb-hbm3.yaml``); the store finds a device class's file by that name, so a file
can neither hide under another name nor be replaced by a new file of the same name.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from pytest_vram.baselines.errors import BaselineFileError
from pytest_vram.baselines.file import BaselineFile

__all__ = ["BaselineStore", "check_name", "file_name_for"]


@functools.lru_cache(maxsize=64)  # asked twice per measured test
def file_name_for(device_class: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3.yaml``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_class.lower()).strip("-")
    return f"{slug or 'device'}.yaml"


class BaselineStore:
    """All baseline files of a directory, by device class.

    A device class's file is found by its name, so two spellings of one device class that
    share a file name (``NVIDIA A100-SXM4-80GB``, ``nvidia a100 sxm4 80gb``) share the file.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: The loaded files, by their ``device:`` field.
        self.files: dict[str, BaselineFile] = {}

    @classmethod
    def load(cls, directory: Path) -> BaselineStore:
        """Read every ``*.yaml`` file of ``directory``; BaselineFileError names a bad one."""
        store = cls(directory)
        if not directory.is_dir():
            return store
        by_name: dict[str, BaselineFile] = {}
        for path in sorted(directory.glob("*.yaml")):
            loaded = BaselineFile.read(path)
            expected = file_name_for(loaded.device)
            other = by_name.get(expected)
            if other is not None:
                raise BaselineFileError(
                    f"{other.path} and {path} both hold the baselines of device "
                    f"{loaded.device!r}: one would hide the other; merge them into {expected} "
                    "and delete the other"
                )
            by_name[expected] = loaded
        for expected, loaded in by_name.items():
            check_name(loaded, expected)
            store.files[loaded.device] = loaded
        return store

    def get(self, device: str) -> BaselineFile | None:
        """The loaded file that holds ``device``'s baselines, if any."""
        found = self.files.get(device)
        if found is not None:
            return found
        name = file_name_for(device)
        for loaded in self.files.values():
            if loaded.path.name == name:
                return loaded
        return None

    def file_for(self, device: str) -> BaselineFile:
        """``device``'s file, a new empty one where the directory has none."""
        found = self.get(device)
        if found is None:
            found = self.files[device] = BaselineFile(
                self.directory / file_name_for(device), device
            )
        return found

    def entry(self, device: str, nodeid: str) -> dict[str, int] | None:
        if not self.files:  # a run without baseline files: asked for every measured test
            return None
        baseline = self.get(device)
        return None if baseline is None else baseline.entries.get(nodeid)

    def replace(self, baseline: BaselineFile) -> None:
        """Put ``baseline`` (a fresh read of one of the store's files) in its place."""
        for device, loaded in list(self.files.items()):
            if loaded.path.name == baseline.path.name:
                del self.files[device]
        self.files[baseline.device] = baseline


def check_name(baseline: BaselineFile, expected: str | None = None) -> None:
    """A file must be named for its device: else the store would look for the device's
    figures in another file, report every test new and, on an update, write that other file."""
    expected = expected or file_name_for(baseline.device)
    if baseline.path.name != expected:
        raise BaselineFileError(
            f"{baseline.path}: its device field is {baseline.device!r}, whose baselines belong "
            f"in {expected}: rename the file to {expected}, or fix its device field"
        )
