#!/usr/bin/env bash
# The main job: build tileattn (Release) and run tileattn-bench on its default problem,
# forward and backward, on the best backend present. Extra arguments go to tileattn-bench
# (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target tileattn-bench
exec build/bench/tileattn-bench "$@"
