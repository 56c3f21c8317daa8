"""Shared pieces of the reference suites: the GPT's import path and small model fixtures."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
