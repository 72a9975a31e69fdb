#!/usr/bin/env bash
# Runs every test: builds the library, the C++ tests and the Python extension in one CMake build
# (pip install . with a persistent build directory), then the GoogleTest suite through CTest and
# the Python suite through pytest. GPU tests skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh --python
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
python3 -m pip install --no-build-isolation --no-deps -q . \
  -C build-dir=build/pip -C cmake.define.TILEATTN_BUILD_TESTS=ON -C cmake.define.TILEATTN_CHECK_PTXAS=ON
ctest --test-dir build/pip --output-on-failure --no-tests=error -j "$(nproc)"
python3 -m pytest -q tests/python
