#!/usr/bin/env bash
# A same-call A/B on a GPU machine: the library as it was (the base) and as it is (the working
# tree) built side by side, bench_attention run on both in alternating rounds, and a table of
# each shape's TFLOP/s per round and the median ratio new / base. Full output goes to $OUT
# (default: outputs/ab).
#
#   git diff HEAD > ab_base.diff              (in the repository root; it travels with the tree)
#   tools/device/ab.sh [options] [B,H,Nq,Nk,D,causal[,Hkv] ...]
#
# The base is a copy of the tree with ab_base.diff reverse-applied (where there is no such file
# and git works, HEAD itself). Shapes default to check.sh's grid (B·N = 16k tokens, H = 2048 / D,
# D in {64, 128}, N in {1k, 4k, 16k}, causal or not).
#
# Options:
#   --pass forward|backward   (default forward); forward,backward times both on the same builds
#   --dtype bf16|f32|f32_fast element type of every shape (default bf16; f32 is the exact mode)
#   --headdims "LIST"         TILEATTN_HEADDIMS of both builds (default "64;128")
#   --rounds N                alternating rounds (default 3)
#   --env NAME=V1,V2,...      also time the new build once per value of the environment variable
#                             NAME (a temporary override the working tree reads), as variants
#   --jobs N                  build parallelism per build (default: half the cores, all under --no-base)
#   --base-patch FILE         the patch that turns the base into the working tree (default ab_base.diff)
#   --no-base                 build and time the working tree only, on all the cores; ratios are then
#                             over its plain run, and the control is one of its --env variants
#   --tests FILTER            also build the new tree's GPU tests and run those matching the gtest
#                             filter after the timing (log: tests.log)
set -uo pipefail

cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=$(realpath -m "${OUT:-outputs/ab}")
mkdir -p "$OUT"
PASS=forward
DTYPE=bf16
HEADDIMS="64;128"
ROUNDS=3
ENV_NAME=""
ENV_VALUES=()
JOBS=""
PATCH=ab_base.diff
NO_BASE=0
TESTS=""
SHAPES=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --pass) PASS="$2"; shift ;;
    --dtype) DTYPE="$2"; shift ;;
    --headdims) HEADDIMS="$2"; shift ;;
    --rounds) ROUNDS="$2"; shift ;;
    --env) ENV_NAME="${2%%=*}"; IFS=, read -ra ENV_VALUES <<< "${2#*=}"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --base-patch) PATCH="$2"; shift ;;
    --no-base) NO_BASE=1 ;;
    --tests) TESTS="$2"; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) echo "ab.sh: unknown option $1" >&2; exit 2 ;;
    *) SHAPES+=("$1") ;;
  esac
  shift
done
JOBS=${JOBS:-$(( $(nproc) / (NO_BASE ? 1 : 2) ))}
if [[ ${#SHAPES[@]} -eq 0 ]]; then
  for D in 64 128; do
    for N in 1024 4096 16384; do
      for C in 0 1; do SHAPES+=("$((16384 / N)),$((2048 / D)),$N,$N,$D,$C"); done
    done
  done
fi

# The base tree: a copy without build outputs, the patch reverse-applied (or HEAD exported).
BASE=$(mktemp -d)
if ((NO_BASE)); then
  :
elif [[ -f "$PATCH" ]]; then
  tar --exclude='./build*' --exclude=./outputs -cf - . | tar -xf - -C "$BASE"
  (cd "$BASE" && patch -s -R -p1 < "$ROOT/$PATCH") || { echo "ab.sh: $PATCH does not reverse-apply" >&2; exit 1; }
elif git rev-parse --git-dir > /dev/null 2>&1; then
  git archive HEAD | tar -xf - -C "$BASE"
else
  echo "ab.sh: no $PATCH and no git: nothing to compare with" >&2
  exit 1
fi

build() {  # SOURCE_DIR NAME [TARGET...]: the library, bench_attention and TARGETs in SOURCE_DIR/build-ab
  local src=$1 name=$2
  shift 2
  (cd "$src" &&
    cmake -S . -B build-ab -G Ninja -DCMAKE_BUILD_TYPE=Release -DTILEATTN_CUDA=ON -DTILEATTN_CUDA_ARCHITECTURES=90a \
      -DTILEATTN_HEADDIMS="$HEADDIMS" -DTILEATTN_BUILD_PYTHON=OFF &&
    cmake --build build-ab -j "$JOBS" --target tileattn "$@" &&
    nvcc -O3 -std=c++20 -arch=sm_90a -Iinclude -Isrc tools/device/bench_attention.cu build-ab/libtileattn.a -lpthread \
      -o build-ab/bench_attention) > "$OUT/build_$name.log" 2>&1
  local rc=$?
  echo "build $name: rc=$rc (log: build_$name.log)"
  return $rc
}
if ((NO_BASE)); then
  build "$ROOT" new ${TESTS:+tileattn_cuda_tests} || exit 1
else
  build "$BASE" base & BASE_PID=$!
  build "$ROOT" new ${TESTS:+tileattn_cuda_tests} || exit 1
  wait $BASE_PID || exit 1
fi

# variant NAME BINARY [ENV=VALUE]: one timed pass of every shape, CSV rows prefixed with the variant and round,
# a file per pass (the harness's columns differ between passes).
rm -f "$OUT"/ab_*.csv
variant() {
  local name=$1 bin=$2 round=$3 out csv
  shift 3
  local pass
  for pass in ${PASS//,/ }; do
    csv="$OUT/ab_$pass.csv"
    out=$(env "$@" "$bin" --pass "$pass" --dtype "$DTYPE" "${SHAPES[@]}")
    [[ -f "$csv" ]] || echo "variant,round,pass,$(head -1 <<< "$out")" > "$csv"  # the harness's own columns
    tail -n +2 <<< "$out" | sed "s/^/$name,$round,$pass,/" >> "$csv"
  done
}
for ((r = 1; r <= ROUNDS; ++r)); do
  ((NO_BASE)) || variant base "$BASE/build-ab/bench_attention" "$r"
  variant new "$ROOT/build-ab/bench_attention" "$r"
  for v in "${ENV_VALUES[@]}"; do variant "new:$ENV_NAME=$v" "$ROOT/build-ab/bench_attention" "$r" "$ENV_NAME=$v"; done
done

python3 - "$OUT"/ab_*.csv <<'EOF' | tee "$OUT/summary.txt"
import csv, statistics, sys
from collections import defaultdict
rows = [r for path in sys.argv[1:] for r in csv.DictReader(open(path))]
shape_key = ("batch", "heads", "seqlen_q", "seqlen_k", "headdim", "causal", "heads_kv")
variants, shapes, tf = [], [], defaultdict(list)
for r in rows:
    # the pass first; the default and deterministic backward apart
    s = ({"forward": "fwd", "backward": "bwd"}[r["pass"]],) + tuple(r.get(k) or "-" for k in shape_key) + (r["impl"],)
    if r["variant"] not in variants: variants.append(r["variant"])
    if s not in shapes: shapes.append(s)
    tf[(r["variant"], s)].append(float(r["tflops"]))
ref = variants[0]  # the base, or the working tree itself under --no-base
print(f"TFLOP/s per round; ratio: median over rounds of variant / {ref}")
print("pass,shape (B,H,Nq,Nk,D,causal,Hkv,impl)".ljust(44) + "".join(v[:22].rjust(24) for v in variants) +
      "".join((f"/{ref[:4]} " + v[:12]).rjust(20) for v in variants[1:]))
for s in shapes:
    cells = ["/".join(f"{x:.1f}" for x in tf[(v, s)]).rjust(24) for v in variants]
    ratios = []
    for v in variants[1:]:
        pairs = [a / b for a, b in zip(tf[(v, s)], tf[(ref, s)]) if b > 0]
        ratios.append((f"{statistics.median(pairs):.3f}" if pairs else "-").rjust(20))
    print(",".join(s).ljust(44) + "".join(cells) + "".join(ratios))
EOF
rm -rf "$BASE"

if [[ -n "$TESTS" ]]; then
  "$ROOT/build-ab/tests/tileattn_cuda_tests" --gtest_filter="$TESTS" > "$OUT/tests.log" 2>&1
  echo "tests ($TESTS): rc=$? $(grep -E '^\[  PASSED  \]' "$OUT/tests.log")"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/tests.log" | head -20
fi
