"""The simulated CUDA device: fake and computing modes, values on demand, simulated ranks."""
