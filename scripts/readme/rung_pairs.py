#!/usr/bin/env python3
"""README's paired comparisons within a LoRA ladder, seed by seed: each rung
against the lower rungs and each answer-disjoint adapter against its plain
twin, on the same eval items, from the runs' item rows.

A reader only: the rows are the sweep's `items/cell-*.parquet`; a bridged
arm is told apart by the bridge resource it reads
(`arm_json.bridge.resource`, `lora_q`, `lora_q@seed=1`, ...); a resource
without a `@seed=` suffix is seed 0. For two adapters at one seed it prints
the accuracy difference (second minus first), the items only the second
answers (gained) and only the first answers (lost), and the exact two-sided
McNemar p (a binomial sum over the discordant items). The report pairs
families (`--pair`), not points of one family, which is why these pairings
live here. It then counts the items every plain adapter of every seed
answers, the items none does, and per rung the items it answers at every
seed.

    python3 scripts/readme/rung_pairs.py results/ladder-1.5b results/ladder-1.5b-seeds

`--family` names the trained family (default `bridged`); `--rungs` the
plain adapters in ladder order (default `lora_q lora_kv lora_qkv`).
"""
import argparse
import glob
import json
import os
import sys
from math import comb

import pandas as pd


def mcnemar_p(gained, lost):
    """Exact two-sided McNemar p: twice the smaller binomial tail at 1/2."""
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(gained, lost) + 1)) / 2**n
    return min(1.0, 2 * tail)


def split_seed(resource):
    """`lora_q@seed=1` -> (`lora_q`, 1); `lora_q` -> (`lora_q`, 0)."""
    name, _, seed = resource.partition("@seed=")
    return name, int(seed) if seed else 0


def load(runs, family):
    """Correctness by (adapter, seed) and item id, over the given runs."""
    frames = []
    for run in runs:
        files = sorted(glob.glob(os.path.join(run, "items", "cell-*.parquet")))
        if not files:
            sys.exit(f"{run}: no items/cell-*.parquet")
        for f in files:
            d = pd.read_parquet(f, columns=["family", "arm_json", "item_id", "correct"])
            frames.append(d[d["family"] == family])
    rows = pd.concat(frames, ignore_index=True)
    if rows.empty:
        sys.exit(f"no rows of family {family!r} in {', '.join(runs)}")
    keys = [split_seed(json.loads(j)["bridge"]["resource"]) for j in rows["arm_json"]]
    rows["adapter"] = [k[0] for k in keys]
    rows["seed"] = [k[1] for k in keys]
    dup = rows.duplicated(["adapter", "seed", "item_id"])
    if dup.any():
        sys.exit(f"{dup.sum()} item rows appear twice (the same adapter, seed and item)")
    # 1.0 / 0.0 where an adapter has the item's row, NaN where it has not
    # (a run in progress): pairings and counts use the items both have.
    rows["correct"] = rows["correct"].astype(float)
    return rows.pivot_table(index="item_id", columns=["adapter", "seed"],
                            values="correct", aggfunc="first", dropna=False)


def pair(table, first, second, seed):
    a, b = table[(first, seed)], table[(second, seed)]
    both = a.notna() & b.notna()
    a, b = a[both].astype(bool), b[both].astype(bool)
    gained, lost = int((b & ~a).sum()), int((a & ~b).sum())
    diff = (b.mean() - a.mean())
    return (f"seed {seed}: {second} vs {first} (n = {both.sum()}): {diff:+.3f}; "
            f"{gained} gained / {lost} lost (p {mcnemar_p(gained, lost):.2g})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (the seed-0 run and the seeds run)")
    ap.add_argument("--family", default="bridged")
    ap.add_argument("--rungs", nargs="+", default=["lora_q", "lora_kv", "lora_qkv"])
    args = ap.parse_args()
    table = load(args.runs, args.family)
    seeds = sorted({s for _, s in table.columns})
    have = set(table.columns)
    print("## rungs")
    for seed in seeds:
        for i, lower in enumerate(args.rungs):
            for upper in args.rungs[i + 1:]:
                if (lower, seed) in have and (upper, seed) in have:
                    print(pair(table, lower, upper, seed))
    print("## answer-disjoint against plain")
    for seed in seeds:
        for rung in args.rungs:
            twin = rung + "_disjoint"
            if (rung, seed) in have and (twin, seed) in have:
                print(pair(table, rung, twin, seed))
    plain = [c for c in table.columns if c[0] in args.rungs]
    complete = table[plain].dropna().astype(bool)
    print(f"## items (of {len(complete)} with every plain adapter's row, "
          f"{len(plain)} adapters)")
    print(f"answered by all: {int(complete.all(axis=1).sum())}; "
          f"by none: {int((~complete).all(axis=1).sum())}")
    for rung in args.rungs:
        cols = [c for c in plain if c[0] == rung]
        print(f"{rung} at all {len(cols)} seeds: {int(complete[cols].all(axis=1).sum())}")


if __name__ == "__main__":
    main()
