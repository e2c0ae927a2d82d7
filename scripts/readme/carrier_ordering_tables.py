#!/usr/bin/env python3
"""README's carrier-ordering tables from a run's report.

Reads the arm table of `report.md` (or `report-interim.md`, over the cells
finished) written by `cargo xtask report`, and prints: per layer l the
accuracy of h, K+V, V and K at one layer and as a suffix (every layer from
l) with the displaced-h control (± SE where the arm is off the floor by
more than a rounding step; conditional accuracy in brackets where the arm
is more than 0.1 above the floor); then the ordering differences h − V,
V − K (one layer and suffix) and K+V − V (suffix), each the report's paired
lift over the arm's declared control with its 95% interval and items
gained / lost; then the range of each control family over the layers.

    python3 scripts/readme/carrier_ordering_tables.py results/carrier-ordering-1.5b/report.md 4,8,12,16,20,24
"""
import re
import sys


def main():
    md = open(sys.argv[1]).read()
    layers = [int(x) for x in sys.argv[2].split(",")]
    rows = {}
    for line in md.splitlines():
        if not line.startswith("| `"):
            continue
        c = [x.strip() for x in line.strip("|").split("|")]
        acc, se = (float(x) for x in c[2].split(" ± "))
        rows[c[0].strip("`")] = dict(n=int(c[1]), acc=acc, se=se, cond=c[5], lift=c[11])
    floor = rows["floor"]["acc"]

    def cell(arm, se=True, cond=True):
        r = rows[arm]
        s = f"{r['acc']:.3f}"
        if se and abs(r["acc"] - floor) > 0.0125:
            s += f" ± {r['se']:.3f}"
        if cond and r["acc"] - floor > 0.1:
            s += f" ({float(r['cond'].split(' ')[0]):.2f})"
        return s

    def minus(x):
        return x.replace("-", "−")

    def diff(arm):
        m = re.match(r"([+-]\d\.\d+) \[([+-]\d\.\d+), ([+-]\d\.\d+)\] vs `[^`]+`; \+(\d+)/−(\d+) items", rows[arm]["lift"])
        d, lo, hi, gained, lost = m.groups()
        tiny = int(gained) + int(lost) < 4 and abs(float(d)) < 0.03
        if float(d) == 0 or tiny:
            return f"{minus(d)}; {gained} / {lost}"
        return f"{minus(d)} [{minus(lo)}, {minus(hi)}]; {gained} / {lost}"

    print("| l | h, one layer | K+V, one layer | V, one layer | K, one layer | h, suffix | K+V, suffix "
          "| V, suffix | K, suffix | h displaced (control) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for l in layers:
        s = f"suffix:{l}"
        print(f"| {l} | {cell(f'h_single@layers={l}')} | {cell(f'kv_single@layers={l}')} "
              f"| {cell(f'v_single@layers={l}')} | {cell(f'k_single@layers={l}')} "
              f"| {cell(f'h_suffix@layers={s}', se=False)} | {cell(f'kv_suffix@layers={s}')} "
              f"| {cell(f'v_suffix@layers={s}')} | {cell(f'k_suffix@layers={s}')} "
              f"| {cell(f'h_displaced@layers={l}', cond=False)} |")
    print()
    print("| l | h − V, one layer | V − K, one layer | h − V, suffix | V − K, suffix | K+V − V, suffix |")
    print("| --- | --- | --- | --- | --- | --- |")
    for l in layers:
        s = f"suffix:{l}"
        print(f"| {l} | {diff(f'h_single@layers={l}')} | {diff(f'v_single@layers={l}')} "
              f"| {diff(f'h_suffix@layers={s}')} | {diff(f'v_suffix@layers={s}')} | {diff(f'kv_suffix@layers={s}')} |")
    print()
    for fam in ["h_mismatch", "kv_mismatch", "v_mismatch", "k_mismatch", "kv_displaced", "v_displaced", "k_displaced"]:
        xs = [rows[f"{fam}@layers={l}"]["acc"] for l in layers]
        print(f"{fam}: {min(xs):.3f}-{max(xs):.3f} over l = {layers}: {xs}")
    print(f"floor {rows['floor']}\nnative {rows['native']}")


if __name__ == "__main__":
    main()
