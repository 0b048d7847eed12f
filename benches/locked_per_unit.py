#!/usr/bin/env python3
"""Locked instructions per node (per declared access for `many_reads`) of one
shape of the scheduler benchmark, counted by callgrind on `examples/node_cost`.

    cargo build --release --example node_cost
    python3 benches/locked_per_unit.py chain 100000
    python3 benches/locked_per_unit.py tree 14 --binary /tmp/node_cost_old
    python3 benches/locked_per_unit.py random_dag 20000

A locked instruction (`lock`-prefixed, or `xchg` with memory) is an atomic
read-modify-write: a reference count, a lock taken or let go, a
compare-and-swap. On some machines each costs several nanoseconds even when
no other core holds the line (`cargo run --release --example line_cost`
measures it), so their count per node is a floor under the time per node
that instruction counts alone do not show.

Method, as for the instruction counts in docs/per-node-overhead.md:
callgrind runs the shape 6 times and 1 time (`--dump-instr=yes`); the
executions of the locked instructions of the second run are subtracted from
the first's and divided by the units of 5 runs, so that the setup is left
out. Prints the total (and all instructions per unit, counted the same way),
the share of each object (the binary, the C library's allocator) and the
functions with at least 0.2 per unit. Needs valgrind and objdump.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile


def run(binary, shape, size, reps, out, only=None):
    cmd = [
        "valgrind", "--tool=callgrind", "--dump-instr=yes", "--compress-pos=no",
        "--compress-strings=no", f"--callgrind-out-file={out}",
    ]
    if only:
        cmd += ["--collect-atstart=no", f"--toggle-collect={only}"]
    cmd += [binary, shape, str(size), str(reps)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) in all", res.stdout)
    if not m:
        sys.exit(f"no unit count in node_cost's output: {res.stdout!r}")
    return int(m.group(1))


def costs(path):
    """{(object, address): executions} and {(object, address): function}."""
    cost, func = collections.Counter(), {}
    obj = fn = None
    after_call = False
    with open(path) as f:
        for line in f:
            if line.startswith("ob="):
                obj = line[3:].strip()
            elif line.startswith("fn="):
                fn = line[3:].strip()
            elif line.startswith("calls="):
                after_call = True  # the next line is the call's inclusive cost
            elif line.startswith("0x"):
                if after_call:
                    after_call = False
                    continue
                parts = line.split()
                key = (obj, int(parts[0], 16))
                cost[key] += int(parts[2]) if len(parts) > 2 else 0
                func[key] = fn
    return cost, func


def locked_addresses(obj):
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", obj], capture_output=True, text=True
    ).stdout
    found = set()
    for line in out.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(.*)", line)
        if m:
            ins = m.group(2)
            if ins.startswith("lock ") or (ins.startswith("xchg") and "(" in ins):
                found.add(int(m.group(1), 16))
    return found


def summary(path):
    """Instructions executed in all (callgrind's summary line)."""
    with open(path) as f:
        for line in f:
            if line.startswith("summary:"):
                return int(line.split()[1])
    return 0


def locked(path):
    cost, func = costs(path)
    by_obj, by_fn, by_addr = collections.Counter(), collections.Counter(), collections.Counter()
    cache = {}
    for (obj, addr), n in cost.items():
        if not obj or not obj.startswith("/") or not os.path.exists(obj):
            continue
        if obj not in cache:
            cache[obj] = locked_addresses(obj)
        if addr in cache[obj]:
            by_obj[os.path.basename(obj)] += n
            by_fn[func[(obj, addr)]] += n
            by_addr[(os.path.basename(obj), addr, func[(obj, addr)])] += n
    return by_obj, by_fn, by_addr


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=["chain", "wide", "tree", "random_dag", "many_reads", "tensor_op"])
    p.add_argument("size", type=int)
    p.add_argument("--binary", default="target/release/examples/node_cost")
    p.add_argument(
        "--only", metavar="FUNCTION",
        help="count only within calls of this function (callgrind's --toggle-collect,"
        " wildcards allowed), e.g. '*Add for &lazyflow::tensor::Tensor>::add'"
        " for the frontend's part of tensor_op",
    )
    p.add_argument(
        "--addresses", action="store_true",
        help="also list each locked instruction's address with its count per unit",
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        u6 = run(a.binary, a.shape, a.size, 6, f"{d}/six", a.only)
        u1 = run(a.binary, a.shape, a.size, 1, f"{d}/one", a.only)
        units = u6 - u1
        obj6, fn6, addr6 = locked(f"{d}/six")
        obj1, fn1, addr1 = locked(f"{d}/one")
        instructions = (summary(f"{d}/six") - summary(f"{d}/one")) / units
    unit = {"many_reads": "access", "tensor_op": "op"}.get(a.shape, "node")
    total = (sum(obj6.values()) - sum(obj1.values())) / units
    print(
        f"{a.shape} {a.size}: {total:.2f} locked instructions per {unit}"
        f" ({instructions:.0f} instructions in all)"
    )
    for obj in sorted(obj6):
        print(f"  {obj}: {(obj6[obj] - obj1.get(obj, 0)) / units:.2f}")
    rows = sorted(((fn6[f] - fn1.get(f, 0)) / units, f) for f in fn6)
    for v, f in reversed(rows):
        if v >= 0.2:
            print(f"  {v:6.2f}  {f[:100]}")
    if a.addresses:
        rows = sorted(((addr6[k] - addr1.get(k, 0)) / units, k) for k in addr6)
        for v, (obj, addr, f) in reversed(rows):
            if v >= 0.05:
                print(f"  {v:6.2f}  {obj} {addr:#x}  {f[:80]}")


if __name__ == "__main__":
    main()
