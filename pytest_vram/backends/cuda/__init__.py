"""A real GPU: PyTorch's caching allocator, and NVML or amdsmi for the device's own figure."""
