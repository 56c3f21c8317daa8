"""The host as the device: its allocator wrapped by one that counts."""
