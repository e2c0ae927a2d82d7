#!/usr/bin/env python3
"""README's trained-bridge rows from a run's summary: each trained arm beside
its mis-source control, its answer-disjoint twin and the untrained arm.

A reader only: every figure is a column of `summary.parquet` (or, for a
run in progress, `summary-interim.parquet`, written by `cargo xtask report
--interim`), computed by `tolerable-stats`. The trained family's arms are
told apart by the bridge resource they read (`arm_json.bridge.resource`);
the answer-disjoint twin of resource `r` is `r_disjoint`, read by the same
family at otherwise the same point; the mis-source control is the
`--mis-source` family's arm reading the same resource at the same point;
the zero-init gate is the `zero_init` family's arm reading the same
resource (its bit-exact count against the untrained arm).

With `--seeds RUN` (repeatable: the runs of the same bridges at other
seeds, whose resources are named `<name>@seed=<k>`), a second table gives
each bridge over every seed found: the mean and sample SD of the trained
arm's accuracy across seeds with each seed's value, the same for its
mis-source control and its answer-disjoint twin, and the zero-init gate's
bit-exact count summed over seeds. Each bridge's seed is its spec's, read
from the run's `run.json`; a grid's `<name>@seed=<k>` names one bridge of
a family `<name>` across runs.

    python3 scripts/readme/trained_table.py results/router-0.5b \
        --trained routed --mis-source routed_mismatch --raw pool_uniform \
        [--seeds results/router-0.5b-seeds]
"""
import argparse
import json
import os
import sys

import pandas as pd


def load(run):
    for f in ("summary.parquet", "summary-interim.parquet"):
        p = os.path.join(run, f)
        if os.path.exists(p):
            return pd.read_parquet(p), f
    sys.exit(f"{run}: neither summary.parquet nor summary-interim.parquet "
             f"(run `cargo xtask report --interim {run}` on a run in progress)")


def base_of(bridge):
    """The bridge family a resource belongs to: `lora_q@seed=1` -> `lora_q`."""
    return bridge.partition("@seed=")[0] if isinstance(bridge, str) else None


def twin(bridge):
    """The answer-disjoint twin's resource name: `r_disjoint`, before any seed suffix."""
    base = base_of(bridge)
    return base + "_disjoint" + bridge[len(base):]


def annotate(s, run):
    s = s.copy()
    with open(os.path.join(run, "run.json")) as f:
        specs = {k: v["spec"] for k, v in json.load(f)["resources"].items()}
    s["bridge"] = [json.loads(j).get("bridge", {}).get("resource") for j in s["arm_json"]]
    s["base"] = [base_of(b) for b in s["bridge"]]
    s["seed"] = [specs[b]["seed"] if isinstance(b, str) else None for b in s["bridge"]]
    s["rest"] = [
        json.dumps({k: v for k, v in json.loads(p).items() if k != "bridge.resource"}, sort_keys=True)
        for p in s["point"]
    ]
    return s


def over_seeds(frames, a):
    """The second table: each bridge's figures across the seeds of every run given."""
    s = pd.concat(frames, ignore_index=True)
    s = s[s["bridge"].notna()]
    dup = s[s.duplicated(["family", "base", "seed", "rest"], keep=False)]
    if not dup.empty:
        sys.exit("the same bridge at the same seed in two runs: "
                 + ", ".join(sorted(set(dup["arm"]))))

    def cell(family, base, rest):
        m = s[(s["family"] == family) & (s["base"] == base) & (s["rest"] == rest)].sort_values("seed")
        if m.empty:
            return "–", 0
        v = m["accuracy"].tolist()
        each = ", ".join(f"{x:.3f}" for x in v)
        if len(v) == 1:
            return f"{v[0]:.3f} (seed {int(m['seed'].iloc[0])} only)", 1
        sd = pd.Series(v).std(ddof=1)
        return f"{sum(v) / len(v):.3f} ± {sd:.3f} ({each})", len(v)

    print("\nOver seeds (mean ± SD across seeds; each seed's value, seeds in order "
          + ", ".join(str(int(x)) for x in sorted(s["seed"].unique())) + "):\n")
    print("| bridge | point | seeds | trained | mis-source control | answer-disjoint | its mis-source "
          "| zero-init = untrained, bit-exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    t = s[(s["family"] == a.trained) & ~s["base"].str.endswith("_disjoint")]
    for base, rest in t[["base", "rest"]].drop_duplicates().itertuples(index=False):
        tr, k = cell(a.trained, base, rest)
        gate = s[(s["family"] == "zero_init") & (s["base"] == base)]
        gate_t = "–" if gate.empty or gate["bit_exact_items"].isna().any() else \
            f"{int(gate['bit_exact_items'].sum())}/{int(gate['n_items'].sum())}"
        print(f"| `{base}` | {rest if rest != '{}' else '–'} | {k} | {tr} "
              f"| {cell(a.mis_source, base, rest)[0]} "
              f"| {cell(a.trained, base + '_disjoint', rest)[0]} "
              f"| {cell(a.mis_source, base + '_disjoint', rest)[0]} | {gate_t} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--trained", required=True, help="the trained arm's family")
    ap.add_argument("--mis-source", required=True, help="its mis-source control's family")
    ap.add_argument("--raw", required=True, help="the untrained arm (its name)")
    ap.add_argument("--seeds", action="append", default=[],
                    help="a run of the same bridges at other seeds (repeatable)")
    a = ap.parse_args()
    s, source = load(a.run)
    s = annotate(s, a.run)
    by_name = s.set_index("arm")
    n = int(by_name.loc["floor", "n_items"])

    def acc(r, se=True):
        t = f"{r['accuracy']:.3f}"
        if se:
            t += f" ± {r['se']:.3f}"
        if not pd.isna(r["cond_accuracy"]):
            t += f" (cond. {r['cond_accuracy']:.2f})"
        return t

    def find(family, bridge, rest):
        m = s[(s["family"] == family) & (s["bridge"] == bridge) & (s["rest"] == rest)]
        return None if m.empty else m.iloc[0]

    def fmt_p(p):
        return "1" if p >= 0.9995 else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")

    def lift(r):
        if pd.isna(r["lift"]):
            return "–"
        return (f"{r['lift']:+.3f} [{r['lift_lo']:+.3f}, {r['lift_hi']:+.3f}] over `{r['strongest_control']}`; "
                f"{int(r['lift_gained'])} / {int(r['lift_lost'])}, p {fmt_p(r['lift_mcnemar_p'])}")

    raw = by_name.loc[a.raw]
    print(f"{a.run} ({source}): n = {n}; floor {by_name.loc['floor', 'accuracy']:.3f}, "
          f"native {by_name.loc['native', 'accuracy']:.3f}, untrained `{a.raw}` {acc(raw)}\n")
    print("| bridge | point | trained | over its strongest control (gained / lost, McNemar) "
          "| mis-source control | answer-disjoint | its mis-source | zero-init = untrained, bit-exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for _, r in s[s["family"] == a.trained].iterrows():
        if r["base"].endswith("_disjoint"):
            continue
        mis = find(a.mis_source, r["bridge"], r["rest"])
        dis = find(a.trained, twin(r["bridge"]), r["rest"])
        dmis = find(a.mis_source, twin(r["bridge"]), r["rest"])
        gate = find("zero_init", r["bridge"], "{}")
        gate_t = "–" if gate is None or pd.isna(gate["bit_exact_items"]) else \
            f"{int(gate['bit_exact_items'])}/{int(gate['n_items'])}"
        print(f"| `{r['bridge']}` | {r['rest'] if r['rest'] != '{}' else '–'} | {acc(r)} | {lift(r)} "
              f"| {acc(mis, se=False) if mis is not None else '–'} "
              f"| {acc(dis) if dis is not None else '–'} "
              f"| {acc(dmis, se=False) if dmis is not None else '–'} | {gate_t} |")
    if a.seeds:
        frames = [s]
        for run in a.seeds:
            o, f = load(run)
            print(f"\n{run} ({f}): n = {int(o.set_index('arm').loc['floor', 'n_items'])}")
            frames.append(annotate(o, run))
        over_seeds(frames, a)


if __name__ == "__main__":
    main()
