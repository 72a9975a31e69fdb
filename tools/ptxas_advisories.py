#!/usr/bin/env python3
"""What ptxas says about the Hopper kernels: registers, spills and its wgmma advisories, per kernel.

    python3 tools/ptxas_advisories.py [--check] [--nvcc NVCC] -I DIR [-I DIR ...] SOURCE.cu ...
    python3 tools/ptxas_advisories.py --launch NVCC ARGS...     (CMake's CUDA compiler launcher)

ptxas's C75xx notes mean it changed the wgmma sequence a kernel asked for: it serialised the
products (C7510, C7511, C7515) or fenced the accumulators itself (C7519, an injected
warpgroup.arrive). Each cost the kernels 1-7% where it appeared (docs/perf-log.md, 2026-12-07
seventh and eighth), and nothing else reports them: ptxas prints them only with -v, as notes.
The first form compiles each source for sm_90a alone (device code, the library's flags) and
prints every kernel's line; --check exits 1 on any advisory. The second runs a compile command
with ptxas's report added, passes its messages on without the report, and fails the compile on
any advisory (the build option TILEATTN_CHECK_PTXAS).
"""
import argparse
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

FLAGS = ["-std=c++20", "-arch=sm_90a", "-O3", "--expt-relaxed-constexpr", "-DTILEATTN_WITH_CUDA=1", "-cubin"]
REPORT = ["-Xptxas", "-v"]
ENTRY = re.compile(r"Compiling entry function '(\S+)'")
ADVISORY = re.compile(r"\((C75\d\d)\).*function '(\S+)'")
SPILLS = re.compile(r"(\d+) bytes spill stores")
REGISTERS = re.compile(r"Used (\d+) registers")


def parse(stderr):
    """{kernel: {"registers", "spills", "advisories": {code: count}}} from ptxas -v's report."""
    kernels = defaultdict(lambda: {"registers": 0, "spills": 0, "advisories": defaultdict(int)})
    current = None
    for line in stderr.splitlines():
        if m := ADVISORY.search(line):
            kernels[m.group(2)]["advisories"][m.group(1)] += 1
        elif m := ENTRY.search(line):
            current = m.group(1)
            kernels[current]  # listed even without notes
        elif current and (m := SPILLS.search(line)):
            kernels[current]["spills"] = int(m.group(1))
        elif current and (m := REGISTERS.search(line)):
            kernels[current]["registers"] = int(m.group(1))
    return kernels


def flagged(kernels):
    """'kernel: C75xx xN, ...' for each kernel with advisories."""
    return [f"{name}: " + ", ".join(f"{code} x{n}" for code, n in sorted(k["advisories"].items()))
            for name, k in sorted(kernels.items()) if k["advisories"]]


def is_report_line(line):
    return line.startswith("ptxas info") or line.startswith("    ") and ("bytes" in line or "Used" in line)


def launch(command):
    run = subprocess.run(command + REPORT, capture_output=True, text=True)
    sys.stdout.write(run.stdout)
    sys.stderr.write("".join(line + "\n" for line in run.stderr.splitlines() if not is_report_line(line)))
    if run.returncode != 0:
        return run.returncode
    notes = flagged(parse(run.stderr))
    if notes:
        sys.stderr.write("error: ptxas changed the wgmma sequence of these kernels (tools/ptxas_advisories.py):\n  " +
                         "\n  ".join(notes) + "\n")
        return 1
    return 0


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--launch":
        return launch(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("-I", dest="includes", action="append", default=[])
    parser.add_argument("--check", action="store_true", help="exit 1 if any kernel has a C75xx advisory")
    parser.add_argument("sources", nargs="+")
    args = parser.parse_args()
    notes = []
    for source in args.sources:
        with tempfile.TemporaryDirectory() as tmp:
            run = subprocess.run([args.nvcc, *FLAGS, *REPORT, *[f"-I{d}" for d in args.includes], "-o",
                                  f"{tmp}/out.cubin", source], capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(f"{source}: nvcc failed\n{run.stderr[-4000:]}")
            return run.returncode
        kernels = parse(run.stderr)
        for name, k in sorted(kernels.items()):
            print(f"{k['registers']:4d} regs {k['spills']:5d} B spilled  {name}")
        notes += flagged(kernels)
    if notes:
        print(f"\n{len(notes)} kernel(s) with wgmma advisories:\n  " + "\n  ".join(notes))
    return 1 if args.check and notes else 0


if __name__ == "__main__":
    sys.exit(main())
