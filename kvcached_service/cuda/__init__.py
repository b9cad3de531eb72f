"""CUDA driver access. `driver` is the only module that calls into libcuda."""
