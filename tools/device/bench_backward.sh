#!/usr/bin/env bash
# Backward benchmark on a GPU machine, after a build (tools/device/check.sh or by hand):
# tileattn's backward (dQ by atomics, and deterministic) beside PyTorch SDPA's flash backward on
# the grid B*N = 16k tokens, hidden 2048 (H = 2048 / D), D in {64, 128}, N in {1k, 4k, 16k},
# causal and not, bf16. CSVs and the table go to $OUT (default: outputs/device).
#
#   tools/device/bench_backward.sh [BUILD_DIR] [ARCH]     (defaults: build-device, 90a)
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/device}
BUILD=${1:-build-device}
ARCH=${2:-90a}
mkdir -p "$OUT"

SHAPES=()
for D in 64 128; do
  for N in 1024 4096 16384; do
    for C in 0 1; do SHAPES+=("$((16384 / N)),$((2048 / D)),$N,$N,$D,$C"); done
  done
done

nvcc -O3 -std=c++17 -arch=sm_${ARCH%%;*} -Iinclude tools/device/bench_backward.cu "$BUILD/libtileattn.a" \
  -lpthread -o "$BUILD/bench_backward" > "$OUT/bench_bwd_build.log" 2>&1 || echo "backward bench build failed (see bench_bwd_build.log)"
if [[ -x "$BUILD/bench_backward" ]]; then
  "$BUILD/bench_backward" "${SHAPES[@]}" > "$OUT/bench_bwd_tileattn.csv" 2> "$OUT/bench_bwd_tileattn.err"
fi
python3 tools/device/sdpa_bwd_peer.py "${SHAPES[@]}" > "$OUT/bench_bwd_sdpa.csv" 2> "$OUT/bench_bwd_sdpa.err"
python3 - "$OUT/bench_bwd_tileattn.csv" "$OUT/bench_bwd_sdpa.csv" <<'PY'
import csv, sys
rows = {}
for path in sys.argv[1:]:
    try:
        for r in csv.DictReader(open(path)):
            key = tuple(r[k] for k in ("batch", "heads", "seqlen_q", "seqlen_k", "headdim", "causal"))
            rows.setdefault(key, {})[r["impl"]] = r
    except FileNotFoundError:
        pass
print("backward, bf16 (TFLOP/s, 2.5x forward FLOPs)")
print(f"{'B':>3} {'H':>3} {'N':>6} {'D':>4} {'causal':>6} {'tileattn':>9} {'det':>7} {'sdpa_flash':>10} {'ratio':>6} {'det cost':>8}")
for key, impls in rows.items():
    get = lambda name: float(impls[name]["tflops"]) if name in impls else float("nan")
    t, d, s = get("tileattn"), get("tileattn_det"), get("sdpa_flash")
    ratio = t / s if s == s and s > 0 else float("nan")
    cost = t / d if d == d and d > 0 else float("nan")
    print(f"{key[0]:>3} {key[1]:>3} {key[2]:>6} {key[4]:>4} {key[5]:>6} {t:9.1f} {d:7.1f} {s:10.1f} {ratio:6.2f} {cost:7.2f}x")
PY
