#!/usr/bin/env bash
# The property-based fuzzer (tests/python/test_fuzz.py) on a GPU machine: the CUDA fuzzers with a
# larger budget than CI's, then a few cases under compute-sanitizer memcheck. Logs go to
# $OUT/logs (default OUT: outputs/device); a summary is appended to $OUT/summary.txt and printed.
#
#   tools/device/fuzz.sh                          install the package (CUDA), fuzz 420 s, memcheck 6 cases
#   tools/device/fuzz.sh --pytarget DIR           use the package already installed in DIR (check.sh's)
#   tools/device/fuzz.sh --seconds 120 --memcheck-cases 0 --seed 1234
#
# Options:
#   --pytarget DIR        a `pip install --target` folder holding a CUDA build of tileattn (skips the install)
#   --build-dir DIR       where to install when no --pytarget is given (default build-device; DIR/pip-fuzz)
#   --arch ARCH           TILEATTN_CUDA_ARCHITECTURES for the install (default 90a)
#   --headdims "LIST"     TILEATTN_HEADDIMS for the install (default: all)
#   --seconds N           budget of the CUDA valid-input fuzzer (default 420; refusals get N/20)
#   --memcheck-cases N    cases run under compute-sanitizer memcheck (default 6; 0: skip)
#   --seed S              TILEATTN_FUZZ_SEED (default: fresh; printed either way)
#   --enable LIST         TILEATTN_FUZZ_ENABLE (case families still off by default in test_fuzz.py)
#   --dry-run             print the commands instead of running them
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/device}
LOG="$OUT/logs"
mkdir -p "$LOG"

PYTARGET=""
BUILD=build-device
ARCH=90a
HEADDIMS=""
SECONDS_BUDGET=420
MEMCHECK_CASES=6
SEED=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
ENABLE=""
DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --pytarget) PYTARGET="$2"; shift ;;
    --build-dir) BUILD="$2"; shift ;;
    --arch) ARCH="$2"; shift ;;
    --headdims) HEADDIMS="$2"; shift ;;
    --seconds) SECONDS_BUDGET="$2"; shift ;;
    --memcheck-cases) MEMCHECK_CASES="$2"; shift ;;
    --seed) SEED="$2"; shift ;;
    --enable) ENABLE="$2"; shift ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

SUMMARY="$OUT/summary.txt"
note() { echo "$*" | tee -a "$SUMMARY"; }
now() { date +%s; }
run() {
  local log=$1
  shift
  if [[ $DRY -eq 1 ]]; then
    echo "+ $* > $log" >&2
    return 0
  fi
  "$@" > "$log" 2>&1
}

if [[ -z "$PYTARGET" ]]; then
  PYTARGET="$BUILD/pip-fuzz-target"
  t0=$(now)
  [[ $DRY -eq 0 ]] && rm -rf "$PYTARGET"
  DEFINES=(-C cmake.define.TILEATTN_CUDA=ON -C cmake.define.TILEATTN_CUDA_ARCHITECTURES="$ARCH")
  [[ -n "$HEADDIMS" ]] && DEFINES+=(-C cmake.define.TILEATTN_HEADDIMS="$HEADDIMS")
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) run "$LOG/fuzz_pip_install.log" python3 -m pip install --no-build-isolation \
    --no-deps --target "$PYTARGET" . -C build-dir="$BUILD/pip-fuzz" "${DEFINES[@]}"
  rc=$?
  note "fuzz: package install rc=$rc $(( $(now) - t0 ))s"
  if [[ $rc -ne 0 ]]; then grep -iE "error" "$LOG/fuzz_pip_install.log" | head -20; exit 1; fi
fi
export PYTHONPATH="$(realpath -m "$PYTARGET")${PYTHONPATH:+:$PYTHONPATH}"
export TILEATTN_FUZZ_SEED="$SEED" TILEATTN_FUZZ_ENABLE="$ENABLE" PYTHONUNBUFFERED=1
FAILED=0

# ---- the fuzzers on the GPU -----------------------------------------------------------------
t0=$(now)
TILEATTN_FUZZ_SECONDS="$SECONDS_BUDGET" run "$LOG/fuzz_calls.log" python3 -m pytest -q -s -p no:cacheprovider \
  tests/python/test_fuzz.py -k test_fuzz_calls_cuda
rc=$?
[[ $rc -ne 0 ]] && FAILED=1
note "fuzz (cuda, valid inputs): rc=$rc $(( $(now) - t0 ))s: $(grep -E 'cases in' "$LOG/fuzz_calls.log" 2>/dev/null | tail -1)"
grep -E -A1 'TILEATTN_FUZZ_CASE=' "$LOG/fuzz_calls.log" 2>/dev/null | head -20 | tee -a "$SUMMARY"
grep -qE 'skipped' "$LOG/fuzz_calls.log" 2>/dev/null && ! grep -qE 'passed|failed' "$LOG/fuzz_calls.log" 2>/dev/null && \
  note "fuzz: the CUDA fuzzer was skipped (no device, or the package was built without CUDA)" && FAILED=1

t0=$(now)
TILEATTN_FUZZ_SECONDS=$(( SECONDS_BUDGET / 20 + 1 )) run "$LOG/fuzz_refusals.log" python3 -m pytest -q -s \
  -p no:cacheprovider tests/python/test_fuzz.py -k test_fuzz_refusals_cuda
rc=$?
[[ $rc -ne 0 ]] && FAILED=1
note "fuzz (cuda, invalid inputs): rc=$rc $(( $(now) - t0 ))s: $(grep -E 'cases in' "$LOG/fuzz_refusals.log" 2>/dev/null | tail -1)"
grep -E -A1 'TILEATTN_FUZZ_CASE=' "$LOG/fuzz_refusals.log" 2>/dev/null | head -20 | tee -a "$SUMMARY"

# ---- a sample under compute-sanitizer ---------------------------------------------------------
# PyTorch's caching allocator hands out pieces of larger blocks, where an access past a tensor's
# end stays inside memory the sanitizer considers valid; without the cache every tensor is its own
# allocation. A fresh seed's first cases differ from the run above.
if [[ "$MEMCHECK_CASES" -gt 0 ]]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  [[ $DRY -eq 1 ]] && SAN=${SAN:-compute-sanitizer}
  if [[ -z "$SAN" ]]; then
    note "fuzz memcheck: compute-sanitizer not found"
  else
    t0=$(now)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 TILEATTN_FUZZ_CASES="$MEMCHECK_CASES" TILEATTN_FUZZ_SEED=$(( SEED + 1 )) \
      run "$LOG/fuzz_memcheck.log" "$SAN" --tool memcheck --target-processes all --print-limit 8 --error-exitcode 3 \
      python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k test_fuzz_calls_cuda
    rc=$?
    [[ $rc -ne 0 ]] && FAILED=1
    note "fuzz memcheck ($MEMCHECK_CASES cases, seed $(( SEED + 1 ))): rc=$rc $(( $(now) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$LOG/fuzz_memcheck.log" 2>/dev/null | tail -1)"
    grep -E "^========= (Invalid|Program hit|Misaligned|    at|Address)" "$LOG/fuzz_memcheck.log" 2>/dev/null | head -12 | tee -a "$SUMMARY"
  fi
fi
note "fuzz: TILEATTN_FUZZ_SEED=$SEED (replay a case with TILEATTN_FUZZ_SEED and TILEATTN_FUZZ_CASE)"
exit $FAILED
