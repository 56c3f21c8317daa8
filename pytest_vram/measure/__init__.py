"""Measuring one test: its peak windows and the memory its fixtures own, the scenarios that
drive a backend, and the ``vram`` fixture's handle."""
