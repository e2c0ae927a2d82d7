#!/usr/bin/env python3
"""README's activation-augmentation table from a run's item rows.

For each layer l and scale a: the uniform pool (with items gained / lost
against the distractors-only pool at the same point), the distractors-only
pool, and the single holder (= the oracle router) with its accuracy ± SE,
conditional accuracy on the items the native reference gets right, and its
items gained / lost against the distractors-only pool with the exact
(two-sided binomial) McNemar p. Reads `results/<run>/items/*.parquet` only,
so it also works on a run in progress (over the cells finished).

    python3 scripts/readme/act_augment_table.py results/act-augment-1.5b 4,14,24

The report pairs an arm only with its strongest declared control, so the
pairing here is the script's own; `--check RUN` compares it with every
paired lift in a finished run's summary.parquet (computed by
`tolerable-stats`) and fails on any difference:

    python3 scripts/readme/act_augment_table.py --check results/carrier-ordering-1.5b
"""
import glob
import math
import sys
from math import comb

import pandas as pd


def outcomes(run):
    """Item x arm table of correctness over the finished cells."""
    files = sorted(glob.glob(f"{run}/items/*.parquet"))
    if not files:
        sys.exit(f"{run}: no finished cells (items/*.parquet)")
    df = pd.concat([pd.read_parquet(f) for f in files])
    return df.pivot_table(index="item_id", columns="arm", values="correct", aggfunc="first").astype(bool), len(files)


def mcnemar(piv, a, b):
    """Items gained and lost by arm a against arm b, and the exact two-sided McNemar p."""
    gained = int((piv[a] & ~piv[b]).sum())
    lost = int((~piv[a] & piv[b]).sum())
    m = gained + lost
    if m == 0:
        return gained, lost, 1.0
    k = min(gained, lost)
    return gained, lost, min(1.0, 2 * sum(comb(m, i) for i in range(k + 1)) / 2**m)


def check(run):
    piv, _ = outcomes(run)
    summary = pd.read_parquet(f"{run}/summary.parquet")
    checked = 0
    for _, r in summary.iterrows():
        if pd.isna(r["strongest_control"]) or pd.isna(r["lift_mcnemar_p"]):
            continue
        g, l, p = mcnemar(piv, r["arm"], r["strongest_control"])
        if (g, l) != (r["lift_gained"], r["lift_lost"]) or abs(p - r["lift_mcnemar_p"]) > 1e-9 * r["lift_mcnemar_p"]:
            sys.exit(f"{r['arm']} vs {r['strongest_control']}: {g}/{l}, p {p} here; "
                     f"{r['lift_gained']}/{r['lift_lost']}, p {r['lift_mcnemar_p']} in the summary")
        checked += 1
    print(f"{run}: {checked} paired lifts, all equal to the summary's")


def main():
    if sys.argv[1] == "--check":
        return check(sys.argv[2])
    run, layers = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    piv, n_files = outcomes(run)
    n = len(piv)
    native = piv["native"]

    def acc(arm):
        p = piv[arm].mean()
        return p, math.sqrt(p * (1 - p) / n), piv[arm][native].mean()

    def fmt_p(p):
        return "1" if p >= 0.9995 else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")

    floor, nat = acc("floor"), acc("native")
    print(f"n = {n} items ({n_files} cells); floor {floor[0]:.3f} ± {floor[1]:.3f}, "
          f"native {nat[0]:.3f} ± {nat[1]:.3f}, native right on {int(native.sum())}\n")
    print("| layer | a | uniform pool (items gained / lost against the distractors-only pool) "
          "| distractors-only pool | single holder = oracle router "
          "| single holder against the distractors-only pool (gained / lost, exact McNemar) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for l in layers:
        for a in [0.5, 1.0, 2.0, 4.0]:
            point = f"alpha={a},layers={l}"
            uni, dis, hol = f"pool_uniform@{point}", f"pool_distractors@{point}", f"holder_add@{point}"
            pu, pd_, ph = acc(uni), acc(dis), acc(hol)
            gu, gh = mcnemar(piv, uni, dis), mcnemar(piv, hol, dis)
            u = f"{pu[0]:.3f}" + (f" ± {pu[1]:.3f}" if pu[0] - floor[0] > 0.0125 else "")
            h = f"{ph[0]:.3f} ± {ph[1]:.3f} (cond. {ph[2]:.2f})"
            print(f"| {l} | {a:g} | {u} ({gu[0]} / {gu[1]}) | {pd_[0]:.3f} | {h} | {gh[0]} / {gh[1]}, p {fmt_p(gh[2])} |")


if __name__ == "__main__":
    main()
