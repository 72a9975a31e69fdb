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
#   --profile             also Nsight Compute (basic set) on one forward kernel
#
# $OUT gets summary.txt and logs.tar.gz (the device tool returns at most 8 files).
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/device}
LOG="$OUT/logs"
mkdir -p "$LOG"

HEADDIMS="32;64;96;128;192;256"
ARCH=90a
TESTS="*"
CPU_TESTS=0
SANITIZE='Sweep/ForwardAccuracy.*/len17_bf16:Sweep/ForwardAccuracy.*/d20_f16:Sweep/ForwardAccuracy.*/varlen_causal_bf16:Sweep/ForwardAccuracy.*/split_varlen_f16:Sweep/ForwardAccuracy.*/padded_split_bf16:Sweep/ForwardAccuracy.*/window_33_17_f16:ForwardApi.*'
BENCH=all
JOBS=$(nproc)
BUILD=build-device
PROFILE=0

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
    --profile) PROFILE=1 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
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
t0=$(now)
cmake -S . -B "$BUILD" -G "$GENERATOR" -DCMAKE_BUILD_TYPE=Release -DTILEATTN_CUDA=ON \
  -DTILEATTN_CUDA_ARCHITECTURES="$ARCH" -DTILEATTN_HEADDIMS="$HEADDIMS" -DTILEATTN_BUILD_PYTHON=OFF \
  > "$LOG/configure.log" 2>&1
rc=$?
t1=$(now)
note "configure: rc=$rc $((t1 - t0))s (archs $ARCH, head dims $HEADDIMS)"
if [[ $rc -ne 0 ]]; then tail -30 "$LOG/configure.log"; exit 1; fi
cmake --build "$BUILD" -j "$JOBS" > "$LOG/build.log" 2>&1
rc=$?
t2=$(now)
note "build: rc=$rc $((t2 - t1))s with -j$JOBS"
if [[ $rc -ne 0 ]]; then grep -E "error|Error" "$LOG/build.log" | head -40; exit 1; fi

# ---- tests --------------------------------------------------------------------------------
glob_to_regex() { printf '%s' "$1" | sed -e 's/[.]/\\./g' -e 's/[*]/.*/g' -e 's/[?]/./g'; }
if [[ "$TESTS" != none ]]; then
  t0=$(now)
  mkdir -p "$LOG/gtest"
  GTEST_OUTPUT="xml:$(realpath "$LOG")/gtest/" ctest --test-dir "$BUILD" -L gpu -R "$(glob_to_regex "$TESTS")" -j 8 --output-on-failure \
    --output-junit "$(realpath "$LOG")/ctest_gpu.xml" > "$LOG/ctest_gpu.log" 2>&1
  rc=$?
  note "gpu tests: rc=$rc $(( $(now) - t0 ))s: $(grep -E 'tests passed|tests failed' "$LOG/ctest_gpu.log" | tail -1)"
  note "  skipped: $(grep -c 'Skipped' "$LOG/ctest_gpu.log")"
  grep -E '^\s+[0-9]+ - .*(Failed|SEGFAULT|Timeout|Exception)' "$LOG/ctest_gpu.log" | head -40 | tee -a "$SUMMARY"
  # Margins of the 2x rule recorded by the tests (gpu_test_util.cuh).
  python3 - "$LOG/gtest" <<'PY' | tee -a "$SUMMARY"
import glob, sys, xml.etree.ElementTree as ET
rows = []
for path in glob.glob(sys.argv[1] + "/*.xml"):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        continue
    for case in root.iter("testcase"):
        props = {p.get("name"): float(p.get("value")) for p in case.iter("property")}
        for what in sorted({k[:-len("_naive_err")] for k in props if k.endswith("_naive_err")}):
            err, naive = props.get(what + "_err"), props[what + "_naive_err"]
            bound = props.get(what + "_bound")
            rows.append((err / bound if bound else 0.0, err, naive, bound, what,
                         case.get("classname") + "." + case.get("name")))
if rows:
    rows.sort(reverse=True)
    print(f"2x rule: {len(rows)} comparisons, closest to their bound (err/bound):")
    for r in rows[:8]:
        print(f"  {r[0]:5.2f}  err={r[1]:.3g} naive={r[2]:.3g} bound={r[3]:.3g}  {r[4]}  {r[5]}")
PY
fi
if [[ $CPU_TESTS -eq 1 ]]; then
  t0=$(now)
  ctest --test-dir "$BUILD" -L 'cpu|host' -j "$JOBS" --output-on-failure > "$LOG/ctest_cpu.log" 2>&1
  rc=$?
  note "cpu/host tests: rc=$rc $(( $(now) - t0 ))s: $(grep -E 'tests passed|tests failed' "$LOG/ctest_cpu.log" | tail -1)"
  grep -E '^\s+[0-9]+ - .*(Failed|SEGFAULT|Timeout|Exception)' "$LOG/ctest_cpu.log" | head -20 | tee -a "$SUMMARY"
fi

# ---- compute-sanitizer --------------------------------------------------------------------
if [[ "$SANITIZE" != none ]]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ -z "$SAN" ]]; then
    note "sanitizer: compute-sanitizer not found"
  else
    t0=$(now)
    "$SAN" --tool memcheck --error-exitcode 3 "$BUILD/tests/tileattn_cuda_tests" --gtest_filter="$SANITIZE" \
      > "$LOG/sanitizer.log" 2>&1
    rc=$?
    note "sanitizer (memcheck): rc=$rc $(( $(now) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$LOG/sanitizer.log" | tail -1); $(grep -E '^\[  PASSED|^\[  FAILED' "$LOG/sanitizer.log" | tr '\n' ' ')"
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
    -lpthread -o "$BUILD/bench_forward" > "$LOG/bench_build.log" 2>&1 || note "bench build failed (see bench_build.log)"
  if [[ -x "$BUILD/bench_forward" ]]; then
    "$BUILD/bench_forward" "${SHAPES[@]}" > "$LOG/bench_tileattn.csv" 2> "$LOG/bench_tileattn.err"
  fi
  python3 tools/device/sdpa_peer.py "${SHAPES[@]}" > "$LOG/bench_sdpa.csv" 2> "$LOG/bench_sdpa.err"
  python3 - "$LOG/bench_tileattn.csv" "$LOG/bench_sdpa.csv" <<'PY' | tee -a "$SUMMARY"
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

# ---- profile ------------------------------------------------------------------------------
if [[ $PROFILE -eq 1 && -x "$BUILD/bench_forward" ]]; then
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
  if [[ -n "$NCU" ]]; then
    "$NCU" --set full -k regex:fwd_kernel_sm80 -c 1 "$BUILD/bench_forward" 1,16,16384,16384,128,0 \
      > "$LOG/ncu_hd128.txt" 2>&1
    note "profile: rc=$? (logs/ncu_hd128.txt)"
  fi
  CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
  OBJ=$(find "$BUILD" -name 'fwd_sm80_nv_bfloat16_hd128.cu.o' | head -1)
  [[ -n "$CUOBJDUMP" && -n "$OBJ" ]] && "$CUOBJDUMP" -sass "$OBJ" > "$LOG/sass_fwd_bf16_hd128.txt" 2>&1
fi

tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOG"
echo
echo "==== summary (logs in $OUT/logs.tar.gz) ===="
cat "$SUMMARY"
