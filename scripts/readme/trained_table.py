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

    python3 scripts/readme/trained_table.py results/router-0.5b \
        --trained routed --mis-source routed_mismatch --raw pool_uniform
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--trained", required=True, help="the trained arm's family")
    ap.add_argument("--mis-source", required=True, help="its mis-source control's family")
    ap.add_argument("--raw", required=True, help="the untrained arm (its name)")
    a = ap.parse_args()
    s, source = load(a.run)
    s = s.copy()
    s["bridge"] = [json.loads(j).get("bridge", {}).get("resource") for j in s["arm_json"]]
    s["rest"] = [
        json.dumps({k: v for k, v in json.loads(p).items() if k != "bridge.resource"}, sort_keys=True)
        for p in s["point"]
    ]
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
        if r["bridge"].endswith("_disjoint"):
            continue
        mis = find(a.mis_source, r["bridge"], r["rest"])
        dis = find(a.trained, r["bridge"] + "_disjoint", r["rest"])
        dmis = find(a.mis_source, r["bridge"] + "_disjoint", r["rest"])
        gate = find("zero_init", r["bridge"], "{}")
        gate_t = "–" if gate is None or pd.isna(gate["bit_exact_items"]) else \
            f"{int(gate['bit_exact_items'])}/{int(gate['n_items'])}"
        print(f"| `{r['bridge']}` | {r['rest'] if r['rest'] != '{}' else '–'} | {acc(r)} | {lift(r)} "
              f"| {acc(mis, se=False) if mis is not None else '–'} "
              f"| {acc(dis) if dis is not None else '–'} "
              f"| {acc(dmis, se=False) if dmis is not None else '–'} | {gate_t} |")


if __name__ == "__main__":
    main()
