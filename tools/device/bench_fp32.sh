#!/usr/bin/env bash
# One device call for the fp32 attention and softmax(X) @ V work: build and GPU tests through
# check.sh (falling back to a test binary of just these suites when another suite does not
# build), then tools/device/bench_fp32.cu beside its PyTorch peers, merged into one table.
# Logs go to $OUT (default outputs/device).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/device}
BUILD=${BUILD:-build-device}
mkdir -p "$OUT"
SANITIZE='Sweep/Fp32Forward.*/odd_dims:Sweep/Fp32Forward.*/varlen_with_empty:Sweep/Fp32Forward.*/dqk256_dv32'
SANITIZE+=':Sweep/Fp32Forward.*/headdim_40:Sweep/SoftmaxMatmul*.*/f32_odd_sizes:Sweep/SoftmaxMatmul.*/bf16_padded'

OUT="$OUT" tools/device/check.sh --quick --build-dir "$BUILD" --tests '*Fp32*|*SoftmaxMatmul*' --bench none \
  --sanitize none > "$OUT/check_fp32.log" 2>&1
tail -25 "$OUT/check_fp32.log"

if [[ ! -x "$BUILD/tests/tileattn_cuda_tests" ]]; then
  echo "== full test binary missing: building tileattn and the fp32/softmax_matmul suites alone"
  cmake --build "$BUILD" -j "$(nproc)" --target tileattn tileattn_test_support > "$OUT/build_lib.log" 2>&1 ||
    { grep -E "error" "$OUT/build_lib.log" | head -20; }
  nvcc -O2 -std=c++20 -arch=sm_90a --expt-relaxed-constexpr -Isrc -Itests -Iinclude \
    tests/cuda/fp32_forward_test.cu tests/cuda/softmax_matmul_test.cu "$BUILD/tests/libtileattn_test_support.a" \
    "$BUILD/libtileattn.a" -lgtest -lgtest_main -lpthread -o "$BUILD/fp32_tests" > "$OUT/build_fp32_tests.log" 2>&1 &&
    "$BUILD/fp32_tests" --gtest_brief=1 > "$OUT/fp32_tests.log" 2>&1
  tail -40 "$OUT/fp32_tests.log"
fi
BIN="$BUILD/tests/tileattn_cuda_tests"
[[ -x "$BIN" ]] || BIN="$BUILD/fp32_tests"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
"$SAN" --tool memcheck --print-limit 8 "$BIN" --gtest_filter="$SANITIZE" > "$OUT/sanitizer_fp32.log" 2>&1
echo "== memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_fp32.log" | tail -1)"
grep -E "^========= (Invalid|Program hit|Misaligned|    at|Address)|^\[  (PASSED|FAILED) " "$OUT/sanitizer_fp32.log" | head -30

nvcc -O3 -std=c++20 -arch=sm_90a -Iinclude -Isrc tools/device/bench_fp32.cu "$BUILD/libtileattn.a" -lpthread \
  -o "$BUILD/bench_fp32" > "$OUT/bench_fp32_build.log" 2>&1 || tail -20 "$OUT/bench_fp32_build.log"
"$BUILD/bench_fp32" > "$OUT/bench_fp32.csv" 2> "$OUT/bench_fp32.err"
python3 tools/device/peers_fp32.py > "$OUT/peers_fp32.csv" 2> "$OUT/peers_fp32.err"
tail -n 5 "$OUT/bench_fp32.err" "$OUT/peers_fp32.err"
python3 - "$OUT/bench_fp32.csv" "$OUT/peers_fp32.csv" <<'PY'
import sys
for path in sys.argv[1:]:
    print(f"== {path}")
    for line in open(path):
        print("  " + line.rstrip().replace(",", "  "))
PY
