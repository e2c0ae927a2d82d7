#!/usr/bin/env python3
"""README's paired comparisons within a LoRA ladder, seed by seed: each rung
against the lower rungs and each answer-disjoint adapter against its plain
twin, on the same eval items.

A reader only: the pairings are rows of each run's `pairs.parquet`, written
by `cargo xtask report RUN --pair A:B` with both sides naming one arm
(`bridged@bridge.resource=lora_kv:bridged@bridge.resource=lora_q`;
`tolerable-stats` computes the difference, the items gained and lost and
the exact McNemar p). A run whose pairs file lacks a wanted pair stops the
script with the report command that writes them (it keeps the run's
earlier pairs, which a report with `--pair` would otherwise drop). The
closing counts (items every plain adapter of every seed answers, items
none does, and per rung the items it answers at every seed) are tallies of
the runs' item rows.

    python3 scripts/readme/rung_pairs.py results/ladder-1.5b results/ladder-1.5b-seeds

`--family` names the trained family (default `bridged`); `--rungs` the
plain adapters in ladder order (default `lora_q lora_kv lora_qkv`). A
bridge resource without a `@seed=` suffix is seed 0.
"""
import argparse
import glob
import json
import os
import shlex
import sys

import pandas as pd

from trained_table import base_of


def adapter_seed(arm_json):
    """An arm's bridge as (adapter, seed): `lora_q@seed=1` -> (`lora_q`, 1),
    `lora_q` -> (`lora_q`, 0)."""
    resource = json.loads(arm_json)["bridge"]["resource"]
    seed = resource.partition("@seed=")[2]
    return base_of(resource), int(seed) if seed else 0


def wanted_pairs(run, family, rungs):
    """The (arm, against, what, seed) pairings of a run, from its summary's
    arms: each rung against each lower rung, each twin against its plain
    adapter, at each seed the run holds."""
    path = os.path.join(run, "summary.parquet")
    if not os.path.exists(path):
        sys.exit(f"{run} has no summary.parquet: the run has unfinished cells; its pairings "
                 f"come from its report once every cell is written")
    summary = pd.read_parquet(path)
    # The run's own arm names, by (adapter, seed).
    arms = {adapter_seed(j): a for a, j in
            summary.loc[summary["family"] == family, ["arm", "arm_json"]].itertuples(index=False)}
    out = []
    for seed in sorted({s for _, s in arms}):
        have = lambda n: (n, seed) in arms
        arm = lambda n: arms[(n, seed)]
        for i, lower in enumerate(rungs):
            for upper in rungs[i + 1:]:
                if have(lower) and have(upper):
                    out.append((arm(upper), arm(lower), f"{upper} vs {lower}", seed))
        for rung in rungs:
            if have(rung) and have(rung + "_disjoint"):
                out.append((arm(rung + "_disjoint"), arm(rung), f"{rung}_disjoint vs {rung}", seed))
    return out


def fmt_p(p):
    return f"{p:.2g}"


def read_pairs(run, wanted):
    path = os.path.join(run, "pairs.parquet")
    pairs = pd.read_parquet(path) if os.path.exists(path) else None
    have = set() if pairs is None else set(zip(pairs["family"], pairs["against_family"]))
    missing = [(a, b) for a, b, _, _ in wanted if (a, b) not in have]
    if missing:
        keep = [] if pairs is None else sorted(have)
        args = " ".join(f"--pair {shlex.quote(a + ':' + b)}" for a, b in keep + missing)
        sys.exit(f"{run}: pairs.parquet lacks {len(missing)} of the ladder's pairings; write them with\n"
                 f"  cargo xtask report {run} {args}")
    return pairs.set_index(["family", "against_family"])


def tally(runs, family, rungs):
    """Correctness by (adapter, seed) and item id over the runs' item rows."""
    frames = []
    for run in runs:
        for f in sorted(glob.glob(os.path.join(run, "items", "cell-*.parquet"))):
            d = pd.read_parquet(f, columns=["family", "arm_json", "item_id", "correct"])
            frames.append(d[d["family"] == family])
    rows = pd.concat(frames, ignore_index=True)
    keys = [adapter_seed(j) for j in rows["arm_json"]]
    rows["adapter"] = [k[0] for k in keys]
    rows["seed"] = [k[1] for k in keys]
    rows = rows[rows["adapter"].isin(rungs)]
    rows["correct"] = rows["correct"].astype(float)
    table = rows.pivot_table(index="item_id", columns=["adapter", "seed"],
                             values="correct", aggfunc="first", dropna=False)
    # Items some adapter has no row for are left out (none in a finished run).
    complete = table.dropna().astype(bool)
    print(f"## items (of {len(complete)} with every plain adapter's row, "
          f"{complete.shape[1]} adapters)")
    print(f"answered by all: {int(complete.all(axis=1).sum())}; "
          f"by none: {int((~complete).all(axis=1).sum())}")
    for rung in rungs:
        cols = [c for c in complete.columns if c[0] == rung]
        print(f"{rung} at all {len(cols)} seeds: {int(complete[cols].all(axis=1).sum())}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (the seed-0 run and the seeds run)")
    ap.add_argument("--family", default="bridged")
    ap.add_argument("--rungs", nargs="+", default=["lora_q", "lora_kv", "lora_qkv"])
    args = ap.parse_args()
    lines = []
    for run in args.runs:
        wanted = wanted_pairs(run, args.family, args.rungs)
        pairs = read_pairs(run, wanted)
        for a, b, what, seed in wanted:
            r = pairs.loc[(a, b)]
            lines.append((seed, what, f"seed {seed}: {what} (n = {int(r['n_items'])}): "
                          f"{r['diff']:+.3f}; {int(r['gained'])} gained / {int(r['lost'])} lost "
                          f"(p {fmt_p(r['mcnemar_p'])})"))
    print("## rungs and answer-disjoint twins")
    for _, _, line in sorted(lines, key=lambda x: (x[0], "disjoint" in x[1])):
        print(line)
    tally(args.runs, args.family, args.rungs)


if __name__ == "__main__":
    main()
