#!/usr/bin/env bash
# One call on a GPU machine: configure, build, GPU tests, compute-sanitizer memcheck on a small
# filter, the forward benchmark beside PyTorch SDPA (flash backend) on the same shapes, and a
# short summary printed last. Full logs go to $OUT (default: outputs/device).
#
#   tools/device/check.sh                      everything, all head dims, sm_90a
#   tools/device/check.sh --quick              head dims 64;128 only (tests needing others skip)
#   tools/device/check.sh --tests 'Backward*' --bench none --sanitize none
#
# Options:
#   --quick               TILEATTN_HEADDIMS=64;128
#   --headdims "LIST"     TILEATTN_HEADDIMS (e.g. "64;128;256")
#   --arch ARCH           TILEATTN_CUDA_ARCHITECTURES (default 90a)
#   --tests PATTERN       only GPU tests whose ctest name matches (a glob: * and ? work); none: skip
#   --cpu-tests           also run the host and CPU test labels
#   --sanitize FILTER     gtest filter for the compute-sanitizer run; none: skip
#   --bench all|none      forward benchmark + SDPA peer (default all)
#   --jobs N              build parallelism (default: all cores)
#   --build-dir DIR       (default build-device)
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/device}
mkdir -p "$OUT"

HEADDIMS="32;64;96;128;192;256"
ARCH=90a
TESTS="*"
CPU_TESTS=0
SANITIZE='Sweep/ForwardAccuracy.*/len17_bf16:Sweep/ForwardAccuracy.*/d20_f16:Sweep/ForwardAccuracy.*/varlen_causal_bf16:Sweep/ForwardAccuracy.*/split_varlen_f16:Sweep/ForwardAccuracy.*/padded_split_bf16:Sweep/ForwardAccuracy.*/window_33_17_f16:ForwardApi.*'
BENCH=all
JOBS=$(nproc)
BUILD=build-device

while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) HEADDIMS="64;128" ;;
    --headdims) HEADDIMS="$2"; shift ;;
    --arch) ARCH="$2"; shift ;;
    --tests) TESTS="$2"; shift ;;
    --cpu-tests) CPU_TESTS=1 ;;
    --sanitize) SANITIZE="$2"; shift ;;
    --bench) BENCH="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --build-dir) BUILD="$2"; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
now() { date +%s; }

note "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
note "nvcc: $(nvcc --version | tail -1); cmake: $(cmake --version | head -1)"

# ---- configure and build ------------------------------------------------------------------
GENERATOR="Unix Makefiles"
command -v ninja > /dev/null && GENERATOR=Ninja
EXTRA=()
# GoogleTest: the system's, else a copy carried next to the tree (build-deps/gtest).
if [[ -d build-deps/gtest ]]; then EXTRA+=("-DGTEST_ROOT=$PWD/build-deps/gtest"); fi
t0=$(now)
# CMake < 3.26 lacks nvcc's C++20 flag; naming it is harmless on newer versions.
cmake -S . -B "$BUILD" -G "$GENERATOR" -DCMAKE_BUILD_TYPE=Release -DTILEATTN_CUDA=ON \
  -DTILEATTN_CUDA_ARCHITECTURES="$ARCH" -DTILEATTN_HEADDIMS="$HEADDIMS" -DTILEATTN_BUILD_PYTHON=OFF \
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 \
  "${EXTRA[@]}" > "$OUT/configure.log" 2>&1
rc=$?
t1=$(now)
note "configure: rc=$rc $((t1 - t0))s (archs $ARCH, head dims $HEADDIMS)"
if [[ $rc -ne 0 ]]; then tail -30 "$OUT/configure.log"; exit 1; fi
cmake --build "$BUILD" -j "$JOBS" > "$OUT/build.log" 2>&1
rc=$?
t2=$(now)
note "build: rc=$rc $((t2 - t1))s with -j$JOBS"
if [[ $rc -ne 0 ]]; then grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; fi

# ---- tests --------------------------------------------------------------------------------
glob_to_regex() { printf '%s' "$1" | sed -e 's/[.]/\\./g' -e 's/[*]/.*/g' -e 's/[?]/./g'; }
if [[ "$TESTS" != none ]]; then
  t0=$(now)
  ctest --test-dir "$BUILD" -L gpu -R "$(glob_to_regex "$TESTS")" -j 8 --output-on-failure \
    --output-junit "$PWD/$OUT/ctest_gpu.xml" > "$OUT/ctest_gpu.log" 2>&1
  rc=$?
  note "gpu tests: rc=$rc $(( $(now) - t0 ))s: $(grep -E 'tests passed|tests failed' "$OUT/ctest_gpu.log" | tail -1)"
  note "  skipped: $(grep -c 'Skipped' "$OUT/ctest_gpu.log")"
  grep -E '^\s+[0-9]+ - .*(Failed|SEGFAULT|Timeout|Exception)' "$OUT/ctest_gpu.log" | head -40 | tee -a "$SUMMARY"
fi
if [[ $CPU_TESTS -eq 1 ]]; then
  t0=$(now)
  ctest --test-dir "$BUILD" -L 'cpu|host' -j "$JOBS" --output-on-failure > "$OUT/ctest_cpu.log" 2>&1
  rc=$?
  note "cpu/host tests: rc=$rc $(( $(now) - t0 ))s: $(grep -E 'tests passed|tests failed' "$OUT/ctest_cpu.log" | tail -1)"
  grep -E '^\s+[0-9]+ - .*(Failed|SEGFAULT|Timeout|Exception)' "$OUT/ctest_cpu.log" | head -20 | tee -a "$SUMMARY"
fi

# ---- compute-sanitizer --------------------------------------------------------------------
if [[ "$SANITIZE" != none ]]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ -z "$SAN" ]]; then
    note "sanitizer: compute-sanitizer not found"
  else
    t0=$(now)
    "$SAN" --tool memcheck --error-exitcode 3 "$BUILD/tests/tileattn_cuda_tests" --gtest_filter="$SANITIZE" \
      > "$OUT/sanitizer.log" 2>&1
    rc=$?
    note "sanitizer (memcheck): rc=$rc $(( $(now) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1); $(grep -E '^\[  PASSED|^\[  FAILED' "$OUT/sanitizer.log" | tr '\n' ' ')"
  fi
fi

# ---- benchmark ----------------------------------------------------------------------------
if [[ "$BENCH" != none ]]; then
  SHAPES=()
  for D in 64 128; do
    for N in 1024 4096 16384; do
      for C in 0 1; do SHAPES+=("$((16384 / N)),$((2048 / D)),$N,$N,$D,$C"); done
    done
  done
  SHAPES+=("1,16,1,32768,128,0" "8,16,4,8192,128,0")  # decoding: split-KV
  nvcc -O3 -std=c++17 -arch=sm_${ARCH%%;*} -Iinclude tools/device/bench_forward.cu "$BUILD/libtileattn.a" \
    -lpthread -o "$BUILD/bench_forward" > "$OUT/bench_build.log" 2>&1 || note "bench build failed (see bench_build.log)"
  if [[ -x "$BUILD/bench_forward" ]]; then
    "$BUILD/bench_forward" "${SHAPES[@]}" > "$OUT/bench_tileattn.csv" 2> "$OUT/bench_tileattn.err"
  fi
  python3 tools/device/sdpa_peer.py "${SHAPES[@]}" > "$OUT/bench_sdpa.csv" 2> "$OUT/bench_sdpa.err"
  python3 - "$OUT/bench_tileattn.csv" "$OUT/bench_sdpa.csv" <<'PY' | tee -a "$SUMMARY"
import csv, sys
rows = {}
for path in sys.argv[1:]:
    try:
        for r in csv.DictReader(open(path)):
            key = tuple(r[k] for k in ("batch", "heads", "seqlen_q", "seqlen_k", "headdim", "causal"))
            rows.setdefault(key, {})[r["impl"]] = r
    except FileNotFoundError:
        pass
print("forward, bf16 (TFLOP/s; decoding rows also GB/s)")
print(f"{'B':>3} {'H':>3} {'Nq':>6} {'Nk':>6} {'D':>4} {'causal':>6} {'tileattn':>9} {'sdpa_flash':>10} {'ratio':>6}  {'ms':>8}")
for key, impls in rows.items():
    t, s = impls.get("tileattn"), impls.get("sdpa_flash")
    tf = float(t["tflops"]) if t else float("nan")
    sf = float(s["tflops"]) if s else float("nan")
    extra = f"  {t['gbps']} GB/s vs {s['gbps'] if s else '-'}" if key[2] in ("1", "4") and t else ""
    print(f"{key[0]:>3} {key[1]:>3} {key[2]:>6} {key[3]:>6} {key[4]:>4} {key[5]:>6} {tf:9.1f} {sf:10.1f} "
          f"{tf / sf if sf == sf and sf > 0 else float('nan'):6.2f}  {t['ms'] if t else '-':>8}{extra}")
PY
fi

echo
echo "==== summary (logs in $OUT) ===="
cat "$SUMMARY"
