#!/usr/bin/python3
"""Turns a Google Benchmark JSON report of attn_bench into docs material.

    bench/report.py RESULTS.json TABLE.md [PLOT.png]

Writes a Markdown table (times, GFLOP/s and our speed-up over the built-in
and over at::scaled_dot_product_attention per shape) and, when a plot is
asked for, a plot of GFLOP/s against T for each implementation (B = 1),
which needs matplotlib (Debian: python3-matplotlib).
"""
import collections
import json
import re
import sys

NAME = re.compile(r"^(?P<group>[a-z0-9_]+)/(?P<impl>[a-z_]+)/T:(?P<T>\d+)/B:(?P<B>\d+)/causal:(?P<causal>\d)")


IMPLS = ("ours", "ours_need_weights", "ours_window", "ours_kv_cache", "ours_recompute",
         "attn_default", "builtin", "builtin_need_weights", "aten_sdpa", "naive")
# Speed-up columns: (slower, faster) pairs, shown where a group has both.
RATIOS = (("builtin", "ours"), ("aten_sdpa", "ours"), ("aten_sdpa", "attn_default"),
          ("ours", "ours_window"), ("ours_recompute", "ours_kv_cache"))


def load(path):
    with open(path) as f:
        report = json.load(f)
    rows = collections.defaultdict(dict)
    for bench in report["benchmarks"]:
        match = NAME.match(bench["name"])
        if not match:
            continue
        key = (match["group"], int(match["T"]), int(match["B"]), int(match["causal"]))
        rows[key][match["impl"]] = {
            "ms": bench["real_time"],
            "gflops": bench["GFLOP/s"],
            "peak_mib": bench.get("peak_MiB", 0.0),
        }
    return report["context"], rows


def table(context, rows):
    sgemm = float(context["sgemm_1024_GFLOP/s"])
    device = context.get("device", "cpu")
    groups = sorted({key[0] for key in rows})
    where = (f"Device: {device}. " if device != "cpu" else
             f"Threads: {context['threads']} (ATen and BLAS). ")
    lines = [
        f"{where}LibTorch {context['libtorch']}. "
        f"CPU sgemm 1024³ in the same run: {sgemm:.1f} GFLOP/s.",
        "",
    ]
    for group in groups:
        impls = [impl for impl in IMPLS
                 if any(impl in row for key, row in rows.items() if key[0] == group)]
        header = ["T", "B", "causal"] + [f"{impl} ms (GFLOP/s; peak MiB)" for impl in impls]
        ratios = [(slow, fast) for slow, fast in RATIOS if slow in impls and fast in impls]
        header += [f"{fast} vs {slow}" for slow, fast in ratios]
        has_ours = "ours" in impls
        if device == "cpu" and has_ours:
            header += ["ours % of sgemm"]
        lines += [f"### {group}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for key in sorted(k for k in rows if k[0] == group):
            row = rows[key]
            cells = [str(key[1]), str(key[2]), "yes" if key[3] else "no"]
            for impl in impls:
                r = row.get(impl)
                cells.append(f"{r['ms']:.1f} ({r['gflops']:.1f}; {r['peak_mib']:.0f})" if r else "—")
            for slow, fast in ratios:
                a, b = row.get(slow), row.get(fast)
                cells.append(f"{a['ms'] / b['ms']:.2f}× faster" if a and b else "—")
            ours = row.get("ours")
            if device == "cpu" and has_ours:
                cells.append(f"{100 * ours['gflops'] / sgemm:.0f} %" if ours else "—")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(context, rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Groups measured at a single length (the memory case) have no curve.
    groups = [g for g in sorted({key[0] for key in rows})
              if len({key[1] for key in rows if key[0] == g}) > 1]
    colours = dict(zip(IMPLS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    columns = min(4, len(groups))
    rows_of_plots = (len(groups) + columns - 1) // columns
    fig, axes = plt.subplots(rows_of_plots, columns, figsize=(6 * columns, 4.5 * rows_of_plots),
                             squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, group in zip(axes.flat, groups):
        for causal, style in ((0, "-"), (1, "--")):
            series = collections.defaultdict(list)
            for key in sorted(k for k in rows if k[0] == group and k[2] == 1 and k[3] == causal):
                for impl, r in rows[key].items():
                    series[impl].append((key[1], r["gflops"]))
            for impl in IMPLS:
                points = series.get(impl)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                            color=colours[impl], label=f"{impl}{' (causal)' if causal else ''}")
        ax.axhline(float(context["sgemm_1024_GFLOP/s"]), color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        dtype = "bfloat16" if "bfloat16" in group else "float16" if "float16" in group else "float32"
        ax.set_xlabel(f"T (sequence length); B = 1, E = 512, H = 8, {dtype}")
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"{group}, {context['threads']} threads (grey line: sgemm)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    context, rows = load(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        f.write(table(context, rows))
    if len(sys.argv) == 4:
        plot(context, rows, sys.argv[3])


if __name__ == "__main__":
    main()
