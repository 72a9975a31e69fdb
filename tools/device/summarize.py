"""Tables for tools/device/check.sh's summary, from the CSVs the benchmarks and tests leave.

  summarize.py forward  TILEATTN_CSV PEER_CSV     bench_attention --pass forward beside peers.py forward
  summarize.py backward TILEATTN_CSV PEER_CSV     the same for the backward, with the deterministic cost
  summarize.py fp32     TILEATTN_CSV PEER_CSV     bench_fp32 (accuracy and timing rows) beside peers.py fp32
  summarize.py margins  GTEST_XML_DIR             the 2x-rule comparisons closest to their bound

A missing or truncated file leaves its cells as '-' / nan, so a partial run still summarises.
"""
import csv
import glob
import os
import io
import sys
import xml.etree.ElementTree as ET

SHAPE = ("batch", "heads", "seqlen_q", "seqlen_k", "headdim", "causal", "heads_kv")
NAN = float("nan")


def read_csv_blocks(path):
    """Rows of each CSV block in a file (a block starts at a header line), as dicts."""
    try:
        text = open(path).read()
    except FileNotFoundError:
        return []
    blocks = []
    for line in text.splitlines():
        if line.startswith(("impl,", "accuracy,case,")) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    rows = []
    for block in blocks:
        rows.extend(csv.DictReader(io.StringIO("\n".join(block))))
    return rows


def by_shape(paths):
    rows = {}
    for path in paths:
        for r in read_csv_blocks(path):
            if all(k in r for k in SHAPE[:6]):  # heads_kv: absent from older logs
                rows.setdefault(tuple(r.get(k) for k in SHAPE), {})[r["impl"]] = r
    return rows


def tflops(impls, name):
    try:
        return float(impls[name]["tflops"])
    except (KeyError, TypeError, ValueError):
        return NAN


def best_peer(*tflops_values):
    known = [x for x in tflops_values if x == x]
    return max(known) if known else NAN


def ratio(a, b):
    return a / b if a == a and b == b and b > 0 else NAN


def forward(paths):
    print("forward, bf16 (TFLOP/s; tileattn / SDPA flash, and / the faster of flash and cuDNN; decoding rows "
          "also GB/s)")
    print(f"{'B':>3} {'H':>3} {'Nq':>6} {'Nk':>6} {'D':>4} {'causal':>6} {'tileattn':>9} {'sdpa_flash':>10} "
          f"{'cudnn':>6} {'/flash':>6} {'/best':>6}  {'ms':>8}")
    for key, impls in by_shape(paths).items():
        t, s = impls.get("tileattn"), impls.get("sdpa_flash")
        tf, sf, cf = tflops(impls, "tileattn"), tflops(impls, "sdpa_flash"), tflops(impls, "sdpa_cudnn")
        extra = f"  {t['gbps']} GB/s vs {s['gbps'] if s else '-'}" if key[2] in ("1", "4") and t else ""
        print(f"{key[0]:>3} {key[1]:>3} {key[2]:>6} {key[3]:>6} {key[4]:>4} {key[5]:>6} {tf:9.1f} {sf:10.1f} "
              f"{cf:6.1f} {ratio(tf, sf):6.2f} {ratio(tf, best_peer(sf, cf)):6.2f}  {t['ms'] if t else '-':>8}{extra}")


def backward(paths):
    print("backward, bf16 (TFLOP/s, 2.5x forward FLOPs; tileattn / SDPA flash, and / the faster of flash and "
          "cuDNN; det cost = deterministic time / atomic-dQ time)")
    print(f"{'B':>3} {'H':>3} {'N':>6} {'D':>4} {'causal':>6} {'tileattn':>9} {'det':>7} {'sdpa_flash':>10} "
          f"{'cudnn':>6} {'/flash':>6} {'/best':>6} {'det cost':>8}")
    for key, impls in by_shape(paths).items():
        t, d, s = tflops(impls, "tileattn"), tflops(impls, "tileattn_det"), tflops(impls, "sdpa_flash")
        c = tflops(impls, "sdpa_cudnn")
        print(f"{key[0]:>3} {key[1]:>3} {key[2]:>6} {key[4]:>4} {key[5]:>6} {t:9.1f} {d:7.1f} {s:10.1f} "
              f"{c:6.1f} {ratio(t, s):6.2f} {ratio(t, best_peer(s, c)):6.2f} {ratio(t, d):7.2f}x")


def fp32(paths):
    accuracy, cases = [], {}
    for path in paths:
        for r in read_csv_blocks(path):
            if "max_abs" in r:
                accuracy.append(r)
            elif "ms" in r:
                cases.setdefault(r["case"], []).append(r)
    print("fp32 attention and softmax(X) @ V: ms (TFLOP/s) [extra MiB beyond inputs and output]")
    for case, rows in cases.items():
        cells = [f"{r['impl']} {r['ms']} ({r['tflops']})" + (f" [{r['extra_mib']}]" if r["extra_mib"] != "0" else "")
                 for r in rows]
        print(f"  {case}: " + "; ".join(cells))
    if accuracy:
        print("accuracy against the float64 oracle (max abs, rel l2):")
        for r in accuracy:
            print(f"  {r['case']}: {r['max_abs']} {r['rel_l2']}")


def margins(directory):
    rows = []
    log = os.path.join(directory, "margins.tsv")  # one line per comparison (gpu_test_util.cuh)
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 6:
                    rows.append((float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]), parts[4],
                                 parts[5]))
    for path in [] if rows else glob.glob(directory + "/*.xml"):
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError:
            continue
        for case in root.iter("testcase"):
            props = {}
            for p in case.iter("property"):  # tests also record text properties: keep the numbers
                try:
                    props[p.get("name")] = float(p.get("value"))
                except (TypeError, ValueError):
                    pass
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


def main():
    commands = {"forward": forward, "backward": backward, "fp32": fp32}
    if len(sys.argv) == 3 and sys.argv[1] == "margins":
        margins(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] in commands:
        commands[sys.argv[1]](sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
