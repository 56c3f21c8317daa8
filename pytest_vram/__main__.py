"""``python -m pytest_vram``: the ``pytest-vram`` command."""

import sys

from pytest_vram.cli import main

sys.exit(main())
