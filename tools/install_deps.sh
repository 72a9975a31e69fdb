#!/usr/bin/env bash
# Installs what building and testing tileattn needs on a fresh Debian machine: a C++ toolchain,
# CMake >= 3.25, Ninja and GoogleTest from apt (only what is missing), and the Python packages
# in requirements-dev.txt from PyPI. The CUDA toolkit is optional: with nvcc on PATH the CUDA
# backend is compiled too.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev libgmock-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing with apt: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if [ "${1:-}" = "--python" ]; then
  python3 -m pip install -q -r requirements-dev.txt
fi
