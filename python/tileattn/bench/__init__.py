"""Benchmarks, run as modules on a CUDA machine:

    python -m tileattn.bench.softmax_matmul
    python -m tileattn.bench.attention [--impl pytorch_sdpa|tileattn] [--preset h100]
"""
