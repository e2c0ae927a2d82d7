#!/usr/bin/env python3
"""README's activation-augmentation table from a finished run's files.

For each layer l and scale a: the uniform pool (with items gained / lost
against the distractors-only pool at the same point), the distractors-only
pool, and the single holder (= the oracle router) with its accuracy ± SE,
conditional accuracy on the items the native reference gets right, and its
items gained / lost against the distractors-only pool with the exact
(two-sided binomial) McNemar p. A reader only: accuracies come from the
run's `summary.parquet`, the pairings from its `pairs.parquet`, both
written by `cargo xtask report` (`tolerable-stats` computes every figure):

    cargo xtask report results/act-augment-1.5b \
        --pair holder_add:pool_distractors --pair pool_uniform:pool_distractors
    python3 scripts/readme/act_augment_table.py results/act-augment-1.5b 4,14,24
"""
import os
import sys

import pandas as pd


def main():
    run, layers = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    for f in ("summary.parquet", "pairs.parquet"):
        if not os.path.exists(f"{run}/{f}"):
            sys.exit(f"{run}/{f} is missing: run `cargo xtask report {run} "
                     "--pair holder_add:pool_distractors --pair pool_uniform:pool_distractors` "
                     "on the finished run first")
    summary = pd.read_parquet(f"{run}/summary.parquet").set_index("arm")
    pairs = pd.read_parquet(f"{run}/pairs.parquet").set_index(["arm", "against"])

    def acc(arm):
        r = summary.loc[arm]
        return r["accuracy"], r["se"], r["cond_accuracy"]

    def pair(arm, against):
        if (arm, against) not in pairs.index:
            sys.exit(f"{run}/pairs.parquet has no row of `{arm}` against `{against}`")
        r = pairs.loc[(arm, against)]
        return int(r["gained"]), int(r["lost"]), r["mcnemar_p"]

    def fmt_p(p):
        return "1" if p >= 0.9995 else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")

    floor, nat = acc("floor"), acc("native")
    n = int(summary.loc["floor", "n_items"])
    print(f"n = {n} items; floor {floor[0]:.3f} ± {floor[1]:.3f}, "
          f"native {nat[0]:.3f} ± {nat[1]:.3f}, native right on {int(summary.loc['native', 'n_correct'])}\n")
    print("| layer | a | uniform pool (items gained / lost against the distractors-only pool) "
          "| distractors-only pool | single holder = oracle router "
          "| single holder against the distractors-only pool (gained / lost, exact McNemar) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for l in layers:
        for a in [0.5, 1.0, 2.0, 4.0]:
            point = f"alpha={a},layers={l}"
            uni, dis, hol = f"pool_uniform@{point}", f"pool_distractors@{point}", f"holder_add@{point}"
            pu, pd_, ph = acc(uni), acc(dis), acc(hol)
            gu, gh = pair(uni, dis), pair(hol, dis)
            u = f"{pu[0]:.3f}" + (f" ± {pu[1]:.3f}" if pu[0] - floor[0] > 0.0125 else "")
            h = f"{ph[0]:.3f} ± {ph[1]:.3f} (cond. {ph[2]:.2f})"
            print(f"| {l} | {a:g} | {u} ({gu[0]} / {gu[1]}) | {pd_[0]:.3f} | {h} | {gh[0]} / {gh[1]}, p {fmt_p(gh[2])} |")


if __name__ == "__main__":
    main()
