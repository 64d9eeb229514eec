#!/usr/bin/env python3
"""Compares two builds of one Google Benchmark program, row by row.

    bench/interleave.py BASE_BINARY NEW_BINARY [--rounds N] [--filter REGEX]
                        [-- EXTRA BENCHMARK ARGUMENTS]

Runs the base and the new binary in turn, N rounds (base, new, new, base,
... so that neither always runs first), one process per run, with the
caller's environment (set no thread variables to measure what users get).
Prints, per row, the median real time of each (in the row's own unit), new / base, and the base's
own spread ((max - min) / median over its rounds): a ratio further from 1
than the spread is a difference the run can tell from noise. Rows that a
binary skips (a benchmark that reports an error) are named as skipped.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile


def run(binary, benchmark_filter, extra):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [binary, f"--benchmark_filter={benchmark_filter}",
             f"--benchmark_out={out.name}", "--benchmark_out_format=json", *extra],
            check=True, stdout=subprocess.DEVNULL)
        report = json.load(open(out.name))
    return {b["name"]: b["real_time"] for b in report["benchmarks"]
            if b.get("run_type", "iteration") == "iteration" and not b.get("error_occurred")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--filter", default=".")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()

    times = {"base": {}, "new": {}}
    for round_ in range(args.rounds):
        order = ("base", "new") if round_ % 2 == 0 else ("new", "base")
        for which in order:
            binary = args.base if which == "base" else args.new
            for name, ms in run(binary, args.filter, args.extra).items():
                times[which].setdefault(name, []).append(ms)
            print(f"round {round_ + 1}/{args.rounds}: {which} done", file=sys.stderr)

    width = max((len(n) for n in times["base"]), default=10)
    print(f"{'row':<{width}} {'base':>9} {'new':>9} {'new/base':>8} {'spread':>7}")
    for name, base in times["base"].items():
        new = times["new"].get(name)
        if not new or len(new) != len(base):
            print(f"{name:<{width}} (skipped by one of the binaries)")
            continue
        b, n = statistics.median(base), statistics.median(new)
        spread = (max(base) - min(base)) / b
        print(f"{name:<{width}} {b:9.3f} {n:9.3f} {n / b:8.3f} {spread:7.1%}")


if __name__ == "__main__":
    main()
