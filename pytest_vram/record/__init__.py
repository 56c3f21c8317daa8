"""The figures a test stores, the per-test record that collects them, and the status order."""
