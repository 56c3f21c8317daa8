"""The pytest wiring: options, markers, which tests are measured, the per-test protocol and
the end of the run."""
