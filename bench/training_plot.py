#!/usr/bin/env python3
"""The README's benchmark table and plot, from attn_training_bench outputs.

    bench/training_plot.py OUT.svg LABEL=OUTPUT.md [LABEL=OUTPUT.md ...]

Each OUTPUT.md is one run of attn_training_bench (its whole output, as
docs/benchmarks/ keeps it) and LABEL names it ("LibTorch 1.13"). Prints a
Markdown table of built-in time ÷ attn's per module shape, forward and
forward + backward, one column per run, and writes the same ratios as a bar
chart to OUT.svg (plain SVG, no plotting library).
"""
import re
import sys

ROW = re.compile(r"^\| (?P<case>[a-z0-9_]+ E=\d+ H=\d+ B=\d+ T=\d+(?: causal)?) (?P<mode>fwd\+bwd|fwd) \| "
                 r"[^|]+\| [^|]+\| (?P<ratio>[\d.]+)× \|")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def ratios_of(path):
    """{(case, mode): built-in ÷ attn} for the module rows of one run."""
    found = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            match = ROW.match(line)
            if match:
                found[(match.group("case"), match.group("mode"))] = float(match.group("ratio"))
    return found


def table(runs, cases):
    header = "| shape | " + " | ".join("forward, %s" % label for label, _ in runs) + " | " + \
        " | ".join("forward + backward, %s" % label for label, _ in runs) + " |"
    lines = [header, "|---" * (1 + 2 * len(runs)) + "|"]
    for case in cases:
        cells = ["%.2f×" % r[(case, mode)] for mode in ("fwd", "fwd+bwd") for _, r in runs]
        lines.append("| %s | %s |" % (case, " | ".join(cells)))
    return "\n".join(lines)


def svg(runs, cases):
    bars = [(label, mode) for mode in ("fwd", "fwd+bwd") for label, _ in runs]
    bar_height, gap, left, width = 7, 8, 300, 380
    top = 30
    group = bar_height * len(bars) + gap
    height = top + group * len(cases) + 30 + 16 * len(bars)
    largest = max(r[(c, m)] for _, r in runs for c in cases for m in ("fwd", "fwd+bwd"))
    scale = width / max(largest, 1.0)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" '
           'font-size="11">' % (left + width + 60, height),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="16" font-size="13">built-in time ÷ attn\'s (longer is faster; '
           'the line is 1×)</text>' % left]
    for n, case in enumerate(cases):
        y0 = top + n * group
        out.append('<text x="%d" y="%d" text-anchor="end">%s</text>'
                   % (left - 6, y0 + group / 2, case))
        for b, (label, mode) in enumerate(bars):
            ratio = dict(runs)[label][(case, mode)]
            y = y0 + b * bar_height
            out.append('<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>'
                       % (left, y, ratio * scale, bar_height - 1, COLORS[b % len(COLORS)]))
            out.append('<text x="%.1f" y="%d" font-size="8">%.2f</text>'
                       % (left + ratio * scale + 3, y + bar_height - 1, ratio))
    axis_bottom = top + group * len(cases)
    out.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="black"/>'
               % (left + scale, top - 4, left + scale, axis_bottom))
    for b, (label, mode) in enumerate(bars):
        y = axis_bottom + 20 + 16 * b
        out.append('<rect x="%d" y="%d" width="12" height="10" fill="%s"/>'
                   % (left, y - 9, COLORS[b % len(COLORS)]))
        out.append('<text x="%d" y="%d">%s, %s</text>'
                   % (left + 18, y, label, "forward" if mode == "fwd" else "forward + backward"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    runs = []
    for argument in sys.argv[2:]:
        label, _, path = argument.partition("=")
        runs.append((label, ratios_of(path)))
    cases = [case for case, mode in runs[0][1] if mode == "fwd"]
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write(svg(runs, cases))
    print(table(runs, cases))


if __name__ == "__main__":
    main()
