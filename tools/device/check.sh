#!/usr/bin/env bash
# One call on a GPU machine: configure, build, GPU tests, compute-sanitizer memcheck on a small
# filter, the benchmarks beside their PyTorch peers on the same shapes (forward and backward vs
# SDPA flash, fp32 attention and softmax(X) @ V vs torch), the Python package's tests, and a short
# summary printed last. Full logs go to $OUT (default: outputs/device).
#
#   tools/device/check.sh                      everything, all head dims, sm_90a
#   tools/device/check.sh --quick              head dims 64;128 only (tests needing others skip)
#   tools/device/check.sh --tests 'Backward*' --bench none --sanitize none --pytest none
#   tools/device/check.sh --dry-run            print the commands without running them
#
# Options:
#   --quick               TILEATTN_HEADDIMS=64;128
#   --headdims "LIST"     TILEATTN_HEADDIMS (e.g. "64;128;256"), for the library and the package
#   --arch ARCH           TILEATTN_CUDA_ARCHITECTURES (default 90a)
#   --tests PATTERN       only GPU tests whose ctest name matches (a glob: * and ? work); none: skip
#   --cpu-tests           also run the host and CPU test labels
#   --sanitize FILTER     gtest filter for the compute-sanitizer run; none: skip
#   --bench WHICH         all, none, or a comma list of forward,backward,fp32 (default all)
#   --pytest WHAT         all, none, or a pytest -k expression for tests/python (default all)
#   --pytest-jobs N       run the Python tests as N processes on the one GPU, the test files dealt
#                         round-robin (default 1; the whole suite takes longer than one call alone)
#   --jobs N              build parallelism (default: all cores)
#   --build-dir DIR       (default build-device; the package builds in DIR/pip)
#   --python-bench        also `python -m tileattn.bench.attention --preset h100` (needs --pytest)
#   --overhead            also `python -m tileattn.bench.overhead` (host overhead beside SDPA; needs --pytest),
#                         once as built and once with TILEATTN_TORCH_OPS=0
#   --decode              also `python -m tileattn.bench.decode` (KV-cache decode GB/s beside SDPA; needs --pytest)
#                         and tools/device/read_bandwidth.cu (the card's streaming-read ceiling)
#   --profile             also Nsight Compute (full set) on one forward kernel
#   --profile-smm         also Nsight Compute (full set, SASS stall samples) on the fp32 softmax_matmul
#                         kernels (exact and fast) at 16 x 2048 x 8192 x 512
#   --profile-fwd "SHAPES"  also Nsight Compute on the Hopper forward's kernel beside cuDNN's
#                         (through peers.py), each launch alone at the boosted clock, per shape
#                         B,H,Nq,Nk,D,causal (e.g. "16,32,1024,1024,64,0"); tileattn's with SASS samples
#   --profile-bwd "SHAPES"  the same for the backward's main kernel (e.g. "16,16,1024,1024,128,0")
#   --dry-run             print each step's command and log file instead of running it
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
SANITIZE+=':Sweep/Fp32Forward.*/odd_dims:Sweep/Fp32Forward.*/varlen_with_empty:Sweep/Fp32Forward.*/dqk256_dv32'
SANITIZE+=':Sweep/Fp32Forward.*/headdim_40:Sweep/SoftmaxMatmul*.*/f32_odd_sizes:Sweep/SoftmaxMatmul.*/bf16_padded'
SANITIZE+=':Sweep/Backward.*/bf16_varlen_with_empty_causal:Sweep/Backward.*/f16_len127_gqa_d80'
SANITIZE+=':Sweep/Backward.*/bf16_sq_gt_sk_causal_masked_rows_d96:Sweep/Backward.*/f16_softcap'
SANITIZE+=':VarlenGraphCapture.*:Sweep/ForwardAccuracy.*/pack_varlen_causal_bf16:Sweep/ForwardAccuracy.*/pack_window_softcap_d40_f16:Sweep/ForwardAccuracy.*/decode_window_softcap_d40_bf16:Sweep/ForwardAccuracy.*/decode_d32_mha_f16'
BENCH=all
PYTEST=all
PYTEST_JOBS=1
JOBS=$(nproc)
BUILD=build-device
PROFILE=0
PROFILE_SMM=0
PROFILE_FWD=""
PROFILE_BWD=""
PYBENCH=0
OVERHEAD=0
DECODE_BENCH=0
DRY=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) HEADDIMS="64;128" ;;
    --headdims) HEADDIMS="$2"; shift ;;
    --arch) ARCH="$2"; shift ;;
    --tests) TESTS="$2"; shift ;;
    --cpu-tests) CPU_TESTS=1 ;;
    --sanitize) SANITIZE="$2"; shift ;;
    --bench) BENCH="$2"; shift ;;
    --pytest) PYTEST="$2"; shift ;;
    --pytest-jobs) PYTEST_JOBS="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --build-dir) BUILD="$2"; shift ;;
    --profile) PROFILE=1 ;;
    --profile-smm) PROFILE_SMM=1 ;;
    --profile-fwd) PROFILE_FWD="$2"; shift ;;
    --profile-bwd) PROFILE_BWD="$2"; shift ;;
    --python-bench) PYBENCH=1 ;;
    --overhead) OVERHEAD=1 ;;
    --decode) DECODE_BENCH=1 ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[[ "$BENCH" == all ]] && BENCH=forward,backward,fp32
for b in ${BENCH//,/ }; do
  case "$b" in forward|backward|fp32|none) ;; *) echo "check.sh: unknown benchmark $b" >&2; exit 2 ;; esac
done
bench_on() { [[ ",$BENCH," == *",$1,"* ]]; }

SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
now() { date +%s; }
# cuda_tool NAME: the path of a CUDA tool (on PATH or in /usr/local/cuda/bin), or nothing.
cuda_tool() { command -v "$1" || ls "/usr/local/cuda/bin/$1" 2>/dev/null || true; }
# run LOGFILE CMD...: stdout and stderr to LOGFILE; with --dry-run only says what it would do.
run() {
  local log=$1
  shift
  if [[ $DRY -eq 1 ]]; then
    echo "+ $* > $log" >&2
    return 0
  fi
  "$@" > "$log" 2>&1
}
# Shapes: B*N = 16k tokens, hidden 2048 (H = 2048 / D), D in {64, 128}, N in {1k, 4k, 16k}.
GRID=()
for D in 64 128; do
  for N in 1024 4096 16384; do
    for C in 0 1; do GRID+=("$((16384 / N)),$((2048 / D)),$N,$N,$D,$C"); done
  done
done
# The training-step issue's other shapes, as the Python preset has them: GQA 32/8 at D = 128 and
# the wide head dims at N = 4k (where the build has their buckets).
for C in 0 1; do
  GRID+=("4,32,4096,4096,128,$C,8")
  [[ ";$HEADDIMS;" == *";192;"* ]] && GRID+=("4,16,4096,4096,192,$C")
  [[ ";$HEADDIMS;" == *";256;"* ]] && GRID+=("4,8,4096,4096,256,$C")
done
DECODE=("1,16,1,32768,128,0" "8,16,4,8192,128,0")  # forward only: split-KV

if [[ $DRY -eq 0 ]]; then
  note "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  note "nvcc: $(nvcc --version | tail -1); cmake: $(cmake --version | head -1); python: $(python3 --version 2>&1)"
fi

# ---- configure and build ------------------------------------------------------------------
GENERATOR="Unix Makefiles"
command -v ninja > /dev/null && GENERATOR=Ninja
t0=$(now)
run "$LOG/configure.log" cmake -S . -B "$BUILD" -G "$GENERATOR" -DCMAKE_BUILD_TYPE=Release -DTILEATTN_CUDA=ON \
  -DTILEATTN_CUDA_ARCHITECTURES="$ARCH" -DTILEATTN_HEADDIMS="$HEADDIMS" -DTILEATTN_BUILD_PYTHON=OFF
rc=$?
t1=$(now)
note "configure: rc=$rc $((t1 - t0))s (archs $ARCH, head dims $HEADDIMS)"
if [[ $rc -ne 0 ]]; then tail -30 "$LOG/configure.log"; exit 1; fi
# Without tests only the library is needed (the harnesses link it); with neither, nothing (the
# Python package builds its own).
TARGETS=()
[[ "$TESTS" == none && $CPU_TESTS -eq 0 ]] && TARGETS=(--target tileattn)
if [[ ${#TARGETS[@]} -gt 0 && "$BENCH" == none && $PROFILE -eq 0 && $PROFILE_SMM -eq 0 && -z "$PROFILE_FWD$PROFILE_BWD" ]]; then
  note "build: skipped (no C++ test, benchmark or profile asked for)"
else
  run "$LOG/build.log" cmake --build "$BUILD" -j "$JOBS" "${TARGETS[@]}"
  rc=$?
  note "build: rc=$rc $(( $(now) - t1 ))s with -j$JOBS"
  if [[ $rc -ne 0 ]]; then grep -E "error|Error" "$LOG/build.log" | head -40; exit 1; fi
fi

# ---- benchmark harnesses and the Python package, built while the GPU tests run -------------
# They are waited for before the benchmarks, so no compile competes with timed runs.
BG=()
NVCC_FLAGS=(-O3 -std=c++20 "-arch=sm_${ARCH%%;*}" -Iinclude -Isrc)
build_harness() {
  run "$LOG/$1_build.log" nvcc "${NVCC_FLAGS[@]}" "tools/device/$1.cu" "$BUILD/libtileattn.a" -lpthread \
    -o "$BUILD/$1"
}
if bench_on forward || bench_on backward || [[ $PROFILE -eq 1 || -n "$PROFILE_FWD$PROFILE_BWD" ]]; then
  build_harness bench_attention & BG+=($!)
fi
if bench_on fp32 || [[ $PROFILE_SMM -eq 1 ]]; then
  build_harness bench_fp32 & BG+=($!)
fi
# Installed into a target folder: leaves the machine's site-packages alone (and needs no
# externally-managed override); PYTHONPATH points the tests at it.
PYTARGET="$BUILD/pip-target"
if [[ "$PYTEST" != none ]]; then
  [[ $DRY -eq 0 ]] && rm -rf "$PYTARGET"
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS run "$LOG/pip_install.log" python3 -m pip install --no-build-isolation --no-deps \
    --target "$PYTARGET" . -C build-dir="$BUILD/pip" -C cmake.define.TILEATTN_CUDA=ON \
    -C cmake.define.TILEATTN_CUDA_ARCHITECTURES="$ARCH" -C cmake.define.TILEATTN_HEADDIMS="$HEADDIMS" &
  PIP_PID=$!
fi

# ---- tests --------------------------------------------------------------------------------
glob_to_regex() { printf '%s' "$1" | sed -e 's/[.]/\\./g' -e 's/[*]/.*/g' -e 's/[?]/./g'; }
if [[ "$TESTS" != none ]]; then
  t0=$(now)
  mkdir -p "$LOG/gtest"
  GTEST_OUTPUT="xml:$(realpath "$LOG")/gtest/" TILEATTN_MARGIN_LOG="$(realpath "$LOG")/gtest/margins.tsv" \
    run "$LOG/ctest_gpu.log" ctest --test-dir "$BUILD" -L gpu --timeout 300 \
    -R "$(glob_to_regex "$TESTS")" -j 8 --output-on-failure --output-junit "$(realpath "$LOG")/ctest_gpu.xml"
  rc=$?
  note "gpu tests: rc=$rc $(( $(now) - t0 ))s: $(grep -E 'tests passed|tests failed' "$LOG/ctest_gpu.log" 2>/dev/null | tail -1)"
  note "  skipped: $(grep -c 'Skipped' "$LOG/ctest_gpu.log" 2>/dev/null)"
  grep -E '^\s+[0-9]+ - .*(Failed|SEGFAULT|Timeout|Exception)' "$LOG/ctest_gpu.log" 2>/dev/null | head -40 | tee -a "$SUMMARY"
  # Margins of the 2x rule recorded by the tests (gpu_test_util.cuh).
  python3 tools/device/summarize.py margins "$LOG/gtest" | tee -a "$SUMMARY"
fi
if [[ $CPU_TESTS -eq 1 ]]; then
  t0=$(now)
  run "$LOG/ctest_cpu.log" ctest --test-dir "$BUILD" -L 'cpu|host' -j "$JOBS" --output-on-failure
  rc=$?
  note "cpu/host tests: rc=$rc $(( $(now) - t0 ))s: $(grep -E 'tests passed|tests failed' "$LOG/ctest_cpu.log" 2>/dev/null | tail -1)"
  grep -E '^\s+[0-9]+ - .*(Failed|SEGFAULT|Timeout|Exception)' "$LOG/ctest_cpu.log" 2>/dev/null | head -20 | tee -a "$SUMMARY"
fi

# ---- compute-sanitizer --------------------------------------------------------------------
if [[ "$SANITIZE" != none ]]; then
  SAN=$(cuda_tool compute-sanitizer)
  [[ $DRY -eq 1 ]] && SAN=${SAN:-compute-sanitizer}
  if [[ -z "$SAN" ]]; then
    note "sanitizer: compute-sanitizer not found"
  else
    t0=$(now)
    run "$LOG/sanitizer.log" "$SAN" --tool memcheck --print-limit 8 --error-exitcode 3 \
      "$BUILD/tests/tileattn_cuda_tests" --gtest_filter="$SANITIZE"
    rc=$?
    note "sanitizer (memcheck): rc=$rc $(( $(now) - t0 ))s: $(grep -E 'ERROR SUMMARY' "$LOG/sanitizer.log" 2>/dev/null | tail -1); $(grep -E '^\[  PASSED|^\[  FAILED' "$LOG/sanitizer.log" 2>/dev/null | tr '\n' ' ')"
    grep -E "^========= (Invalid|Program hit|Misaligned|    at|Address)" "$LOG/sanitizer.log" 2>/dev/null | head -12 | tee -a "$SUMMARY"
  fi
fi

t0=$(now)
for pid in "${BG[@]}"; do wait "$pid"; done
if [[ "$PYTEST" != none ]]; then
  wait "$PIP_PID"
  PIP_RC=$?
  note "python package build: rc=$PIP_RC (waited $(( $(now) - t0 ))s after the tests)"
  [[ $PIP_RC -ne 0 ]] && grep -iE "error" "$LOG/pip_install.log" | head -20 | tee -a "$SUMMARY"
fi

# ---- benchmarks ---------------------------------------------------------------------------
# bench_attention (forward, backward) and bench_fp32 beside peers.py on the same shapes.
bench_section() {  # NAME HARNESS_ARGS... -- PEER_ARGS...
  local name=$1 t0
  t0=$(now)
  shift
  local harness=() peer=()
  while [[ $1 != -- ]]; do harness+=("$1"); shift; done
  shift
  peer=("$@")
  local bin="$BUILD/${harness[0]}"
  if [[ $DRY -eq 1 ]]; then
    echo "+ $bin ${harness[*]:1} > $LOG/bench_${name}_tileattn.csv" >&2
    echo "+ python3 tools/device/peers.py ${peer[*]} > $LOG/bench_${name}_peer.csv" >&2
    return
  fi
  if [[ -x "$bin" ]]; then
    "$bin" "${harness[@]:1}" > "$LOG/bench_${name}_tileattn.csv" 2> "$LOG/bench_${name}_tileattn.err"
    rc=$?
    [[ $rc -ne 0 ]] && note "$name benchmark: tileattn harness rc=$rc: $(tail -1 "$LOG/bench_${name}_tileattn.err")"
  else
    note "$name benchmark: harness build failed (logs/${harness[0]}_build.log)"
  fi
  python3 tools/device/peers.py "${peer[@]}" > "$LOG/bench_${name}_peer.csv" 2> "$LOG/bench_${name}_peer.err"
  rc=$?
  [[ $rc -ne 0 ]] && note "$name benchmark: peers.py rc=$rc: $(tail -1 "$LOG/bench_${name}_peer.err")"
  note "$name benchmark: $(( $(now) - t0 ))s"
}
if bench_on forward; then
  bench_section forward bench_attention --pass forward "${GRID[@]}" "${DECODE[@]}" -- forward "${GRID[@]}" "${DECODE[@]}"
fi
if bench_on backward; then
  bench_section backward bench_attention --pass backward "${GRID[@]}" -- backward "${GRID[@]}"
fi
if bench_on fp32; then
  bench_section fp32 bench_fp32 -- fp32
fi

# ---- Python package tests -----------------------------------------------------------------
# With --pytest-jobs N, N processes share the GPU, each over every N-th test file.
if [[ "$PYTEST" != none ]]; then
  t0=$(now)
  PYTEST_K=()
  [[ "$PYTEST" != all ]] && PYTEST_K=(-k "$PYTEST")
  mapfile -t PYFILES < <(ls tests/python/test_*.py)
  PIDS=()
  for ((j = 0; j < PYTEST_JOBS; ++j)); do
    SHARD=()
    for ((f = j; f < ${#PYFILES[@]}; f += PYTEST_JOBS)); do SHARD+=("${PYFILES[f]}"); done
    [[ ${#SHARD[@]} -eq 0 ]] && continue
    PYTHONPATH="$(realpath -m "$PYTARGET")${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
      run "$LOG/pytest_$j.log" python3 -m pytest -q "${SHARD[@]}" -p no:cacheprovider "${PYTEST_K[@]}" \
      --durations=5 --junitxml="$(realpath "$LOG")/pytest_$j.xml" &
    PIDS+=($!)
  done
  rc=0
  for pid in "${PIDS[@]}"; do wait "$pid" || rc=$?; done
  note "python tests: rc=$rc $(( $(now) - t0 ))s in $PYTEST_JOBS process(es):"
  for log in "$LOG"/pytest_*.log; do
    note "  $(basename "$log"): $(grep -E '(passed|failed|error)' "$log" 2>/dev/null | tail -1)"
    grep -E '^(FAILED|ERROR) ' "$log" 2>/dev/null | head -20 | tee -a "$SUMMARY"
  done
fi

# ---- the Python layer's benchmark preset (tileattn beside every PyTorch peer) ----------------
if [[ $PYBENCH -eq 1 && "$PYTEST" != none ]]; then
  t0=$(now)
  PYTHONPATH="$(realpath -m "$PYTARGET")${PYTHONPATH:+:$PYTHONPATH}" \
    run "$LOG/python_preset.log" python3 -m tileattn.bench.attention --preset h100 --passes 20 \
    --csv "$(realpath -m "$LOG")/python_preset.csv"
  note "python preset: rc=$? $(( $(now) - t0 ))s (logs/python_preset.log, .csv)"
fi

# ---- host overhead of a tiny call, beside SDPA ------------------------------------------------
if [[ $OVERHEAD -eq 1 && "$PYTEST" != none ]]; then
  t0=$(now)
  PYTHONPATH="$(realpath -m "$PYTARGET")${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    run "$LOG/overhead.log" python3 -m tileattn.bench.overhead --csv "$(realpath -m "$LOG")/overhead.csv"
  note "overhead: rc=$? $(( $(now) - t0 ))s"
  cat "$LOG/overhead.log" | tee -a "$SUMMARY"
  # The same bench with the operators registered in Python (the package's fallback), for an A/B.
  TILEATTN_TORCH_OPS=0 PYTHONPATH="$(realpath -m "$PYTARGET")${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    run "$LOG/overhead_python_ops.log" python3 -m tileattn.bench.overhead \
    --csv "$(realpath -m "$LOG")/overhead_python_ops.csv"
  note "overhead, Python registration (TILEATTN_TORCH_OPS=0):"
  cat "$LOG/overhead_python_ops.log" | tee -a "$SUMMARY"
fi

# ---- decode bandwidth over a key/value cache, beside SDPA ------------------------------------
if [[ $DECODE_BENCH -eq 1 && "$PYTEST" != none ]]; then
  t0=$(now)
  PYTHONPATH="$(realpath -m "$PYTARGET")${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    run "$LOG/decode.log" python3 -m tileattn.bench.decode --csv "$(realpath -m "$LOG")/decode.csv"
  note "decode: rc=$? $(( $(now) - t0 ))s"
  cat "$LOG/decode.log" | tee -a "$SUMMARY"
  # The card's streaming-read ceiling in the same call: what a decode figure can approach.
  run "$LOG/read_bandwidth_build.log" nvcc -O3 -std=c++20 -arch=sm_$ARCH tools/device/read_bandwidth.cu \
    -o "$BUILD/read_bandwidth" && run "$LOG/read_bandwidth.csv" "$BUILD/read_bandwidth"
  note "read ceiling: $(grep -E '^(best|copy)' "$LOG/read_bandwidth.csv" 2>/dev/null | tr '\n' ' ')"
fi

# ---- profile ------------------------------------------------------------------------------
if [[ $PROFILE -eq 1 && -x "$BUILD/bench_attention" ]]; then
  NCU=$(cuda_tool ncu)
  if [[ -n "$NCU" ]]; then
    run "$LOG/ncu_hd128.txt" "$NCU" --set full -k regex:fwd_kernel_sm90 -c 1 "$BUILD/bench_attention" --pass forward \
      1,16,16384,16384,128,0
    note "profile: rc=$? (logs/ncu_hd128.txt)"
  fi
  CUOBJDUMP=$(cuda_tool cuobjdump)
  OBJ=$(find "$BUILD" -name 'fwd_sm90_nv_bfloat16_hd128.cu.o' | head -1)
  [[ -n "$CUOBJDUMP" && -n "$OBJ" ]] && run "$LOG/sass_fwd_bf16_hd128.txt" "$CUOBJDUMP" -sass "$OBJ"
fi

if [[ $PROFILE_SMM -eq 1 && -x "$BUILD/bench_fp32" ]]; then
  NCU=$(cuda_tool ncu)
  if [[ -n "$NCU" ]]; then
    for mode in fast exact; do
      run "$LOG/ncu_smm_$mode.txt" "$NCU" --set full --import-source no --clock-control none \
        -k regex:softmax_matmul.*sm90 -c 1 -o "$LOG/ncu_smm_$mode" "$BUILD/bench_fp32" smm_f32 "$mode"
      note "profile smm $mode: rc=$? (logs/ncu_smm_$mode.*)"
      "$NCU" --import "$LOG/ncu_smm_$mode.ncu-rep" --page details > "$LOG/ncu_smm_${mode}_details.txt" 2>&1
      "$NCU" --import "$LOG/ncu_smm_$mode.ncu-rep" --page source --csv --print-source sass \
        > "$LOG/ncu_smm_${mode}_sass.csv" 2>&1
      "$NCU" --import "$LOG/ncu_smm_$mode.ncu-rep" --page raw --csv > "$LOG/ncu_smm_${mode}_raw.csv" 2>&1
      grep -E "Duration|Throughput|Pipe|Issue Slots|Bank|L2 Hit|Registers|Eligible|Warp Cycles" \
        "$LOG/ncu_smm_${mode}_details.txt" | head -40 | tee -a "$SUMMARY"
    done
  fi
fi

# --profile-fwd / --profile-bwd: Nsight Compute's full set on tileattn's main kernel and cuDNN's, the third
# launch of each (neither a first call), each alone at the boosted clock: cycles compare,
# sustained-load clocks do not show. Both kernels are also sampled per SASS instruction (full set;
# the source page as CSV), to show where their warps stall, and every metric is kept (raw page).
profile_beside() {
  local pass=$1 ours=$2 theirs=$3 shapes=$4 shape tag who rep
  local NCU
  NCU=$(cuda_tool ncu)
  [[ -n "$NCU" ]] || return 0
  for shape in $shapes; do
    tag=${pass}_${shape//,/_}
    run "$LOG/ncu_${tag}_tileattn.txt" "$NCU" --set full --import-source no --clock-control none -k "regex:$ours" \
      --launch-skip 2 -c 1 -o "$LOG/ncu_${tag}_tileattn" "$BUILD/bench_attention" --pass "$pass" "$shape"
    run "$LOG/ncu_${tag}_cudnn.txt" "$NCU" --set full --import-source no --clock-control none -k "regex:$theirs" \
      --launch-skip 2 -c 1 -o "$LOG/ncu_${tag}_cudnn" python3 tools/device/peers.py "$pass" "$shape"
    # Both kernels' sections, every metric (pipe utilisation, instruction mix) and SASS samples.
    for who in tileattn cudnn; do
      rep="$LOG/ncu_${tag}_${who}.ncu-rep"
      if [[ $DRY -eq 0 && -f "$rep" ]]; then
        "$NCU" --import "$rep" --page details >> "$LOG/ncu_${tag}_${who}.txt" 2>&1
        "$NCU" --import "$rep" --page raw --csv > "$LOG/ncu_${tag}_${who}_raw.csv" 2>&1
        "$NCU" --import "$rep" --page source --csv --print-source sass > "$LOG/ncu_${tag}_${who}_sass.csv" 2>&1
        rm -f "$rep"
      fi
      note "profile $pass $who $shape: $(grep -E '^ +(Duration|Elapsed Cycles|Issue Slots Busy) ' \
        "$LOG/ncu_${tag}_${who}.txt" 2>/dev/null | sed -E 's/^ +//; s/ +/ /g' | paste -sd ';')"
    done
  done
}
if [[ -x "$BUILD/bench_attention" || $DRY -eq 1 ]]; then
  [[ -n "$PROFILE_FWD" ]] && profile_beside forward 'fwd_kernel_sm90' 'sdpa_sm90.*fprop|fprop.*sm90' "$PROFILE_FWD"
  [[ -n "$PROFILE_BWD" ]] && profile_beside backward 'bwd_kernel_sm90' 'sdpa_sm90.*bprop' "$PROFILE_BWD"
fi

# ---- summary tables, last -----------------------------------------------------------------
for b in forward backward fp32; do
  if bench_on "$b"; then
    echo | tee -a "$SUMMARY"
    python3 tools/device/summarize.py "$b" "$LOG/bench_${b}_tileattn.csv" "$LOG/bench_${b}_peer.csv" | tee -a "$SUMMARY"
  fi
done

tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOG"
echo
echo "==== summary (logs in $OUT/logs.tar.gz) ===="
cat "$SUMMARY"
