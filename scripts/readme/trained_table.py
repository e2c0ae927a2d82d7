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

With `--seeds`, a second table gives each bridge over its training seeds
from the run's `seeds.parquet` (`cargo xtask report RUN --seeds OTHER`
combines the run with the runs of the same bridges at other seeds; the
mean and sample SD are `tolerable-stats`'): the trained arm's mean ± SD
with each seed's value, the same for its mis-source control and its
answer-disjoint twin, and the zero-init gate's bit-exact count summed over
seeds; `--conditional` adds to each cell the conditional accuracy's mean ±
SD with each seed's value.

A sender pool's untrained arm varies with the pool's N: `--raw` then names
its family, read at each trained arm's point, and `--also` adds a control
family read like the mis-source one (the masked-answer pool); a zero-init
gate is printed on the row of the point it is held at (its `expect` arm's):

    python3 scripts/readme/trained_table.py results/sender-pool-0.5b \
        --trained pool_bridged --mis-source pool_bridged_distractors \
        --also pool_bridged_masked --raw pool_raw

A trained router's rows, over its seeds:

    cargo xtask report results/router-0.5b --seeds results/router-0.5b-seeds
    python3 scripts/readme/trained_table.py results/router-0.5b \
        --trained routed --mis-source routed_mismatch --raw pool_uniform [--seeds [--conditional]]
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


def point_rest(point):
    """A point without its bridge resource, the `rest` that rows are matched on."""
    return json.dumps({k: v for k, v in json.loads(point).items() if k != "bridge.resource"},
                      sort_keys=True)


def annotate(s):
    s = s.copy()
    s["bridge"] = [json.loads(j).get("bridge", {}).get("resource") for j in s["arm_json"]]
    s["base"] = [base_of(b) for b in s["bridge"]]
    s["rest"] = [point_rest(p) for p in s["point"]]
    return s


def on_gate_row(gate_t, gate_point, row_point):
    """The gate cell of a row: a zero-init gate is one arm at one point (a
    pool's N = 4), so it is printed on that point's row only ("–" on the
    others); a gate held at no particular point is printed on every row."""
    return gate_t if gate_point is None or gate_point == row_point else "–"


def over_seeds(run, a, gate_rest):
    """The second table: each bridge's figures across seeds, as `cargo xtask
    report RUN --seeds OTHER` combined them (`seeds.parquet`)."""
    for f in ("seeds.parquet", "seeds-interim.parquet"):
        if os.path.exists(os.path.join(run, f)):
            s = pd.read_parquet(os.path.join(run, f))
            break
    else:
        sys.exit(f"{run}: no seeds.parquet (run `cargo xtask report {run} --seeds <other run>`)")

    def cell(family, bridge, point):
        m = s[(s["family"] == family) & (s["bridge"] == bridge) & (s["point"] == point)]
        if m.empty:
            return "–", 0
        r = m.iloc[0]
        each = ", ".join(f"{x:.3f}" for x in r["accuracy"])
        if pd.isna(r["accuracy_sd"]):
            return f"{r['accuracy_mean']:.3f} (seed {int(r['seeds'][0])} only)", 1
        t = f"{r['accuracy_mean']:.3f} ± {r['accuracy_sd']:.3f} ({each})"
        if a.conditional:
            t += "; " + conditional(r)
        return t, int(r["n_seeds"])

    def conditional(r):
        """The conditional accuracy over the seeds (on the items the native
        reference answers): mean ± SD (each seed's), from the columns a
        report writes since 2026-12-07."""
        if "cond_accuracy_sd" not in r.index:
            sys.exit(f"{run}: seeds.parquet predates the conditional accuracy's spread; "
                     f"run `cargo xtask report {run} --seeds ...` again")
        if pd.isna(r["cond_accuracy_sd"]):
            return "cond. –"
        each = ", ".join(f"{x:.2f}" for x in r["cond_accuracy"])
        return f"cond. {r['cond_accuracy_mean']:.2f} ± {r['cond_accuracy_sd']:.2f} ({each})"

    seeds = sorted({int(x) for v in s["seeds"] for x in v})
    print(f"\nOver seeds ({f}: mean ± SD across seeds; each seed's value, seeds in order "
          + ", ".join(str(x) for x in seeds) + "):\n")
    extra = "".join(f" `{f}` |" for f in a.also)
    print("| bridge | point | seeds | trained | mis-source control |" + extra
          + " answer-disjoint | its mis-source | zero-init = untrained, bit-exact |")
    print("| --- " * (8 + len(a.also)) + "|")
    t = s[(s["family"] == a.trained) & ~s["bridge"].str.endswith("_disjoint")]
    for bridge, point in t[["bridge", "point"]].itertuples(index=False):
        tr, k = cell(a.trained, bridge, point)
        gate = s[(s["family"] == "zero_init") & (s["bridge"] == bridge)]
        gate_t = "–" if gate.empty or gate["bit_exact_items"].isna().any() else \
            f"{int(gate['bit_exact_items'].sum())}/{int(gate['n_items_total'].sum())}"
        gate_t = on_gate_row(gate_t, gate_rest(base_of(bridge)), point_rest(point))
        print(f"| `{bridge}` | {point if point != '{}' else '–'} | {k} | {tr} "
              f"| {cell(a.mis_source, bridge, point)[0]} | "
              + "".join(f"{cell(f, bridge, point)[0]} | " for f in a.also)
              + f"{cell(a.trained, twin(bridge), point)[0]} "
              f"| {cell(a.mis_source, twin(bridge), point)[0]} | {gate_t} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--trained", required=True, help="the trained arm's family")
    ap.add_argument("--mis-source", required=True, help="its mis-source control's family")
    ap.add_argument("--raw", required=True,
                    help="the untrained arm (its name), or its family when it varies with the "
                         "trained arm's point (a pool's N): then a column beside each row")
    ap.add_argument("--also", action="append", default=[],
                    help="another control family read at the same resource and point "
                         "(a pool's masked-holder control); repeatable")
    ap.add_argument("--seeds", action="store_true",
                    help="also the table across seeds, from the run's seeds.parquet")
    ap.add_argument("--conditional", action="store_true",
                    help="with --seeds: each cell also gives the conditional accuracy "
                         "(on the items native answers) as mean ± SD (each seed's)")
    a = ap.parse_args()
    if a.conditional and not a.seeds:
        ap.error("--conditional needs --seeds")
    s, source = load(a.run)
    s = annotate(s)
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
        same = s["bridge"].isna() if bridge is None else s["bridge"] == bridge
        m = s[(s["family"] == family) & same & (s["rest"] == rest)]
        return None if m.empty else m.iloc[0]

    def gate_rest(bridge):
        """The point of the arm the bridge's zero-init gate is held equal to
        (its `expect`), or None when the run does not say."""
        g = find("zero_init", bridge, "{}")
        if g is None:
            return None
        e = json.loads(g["arm_json"]).get("expect", {}).get("arm")
        m = s[s["arm"] == e]
        return None if e is None or m.empty else m.iloc[0]["rest"]

    def fmt_p(p):
        return "1" if p >= 0.9995 else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")

    def lift(r):
        if pd.isna(r["lift"]):
            return "–"
        return (f"{r['lift']:+.3f} [{r['lift_lo']:+.3f}, {r['lift_hi']:+.3f}] over `{r['strongest_control']}`; "
                f"{int(r['lift_gained'])} / {int(r['lift_lost'])}, p {fmt_p(r['lift_mcnemar_p'])}")

    raw_family = a.raw not in by_name.index
    if raw_family and not (s["family"] == a.raw).any():
        sys.exit(f"{a.run}: `{a.raw}` is neither an arm nor a family of {source}")
    head = f"{a.run} ({source}): n = {n}; floor {by_name.loc['floor', 'accuracy']:.3f}, " \
           f"native {by_name.loc['native', 'accuracy']:.3f}"
    print(head + (f"; untrained family `{a.raw}` beside each point\n" if raw_family
                  else f", untrained `{a.raw}` {acc(by_name.loc[a.raw])}\n"))
    extra = "".join(f" `{f}` |" for f in a.also)
    print("| bridge | point |" + (" untrained |" if raw_family else "")
          + " trained | over its strongest control (gained / lost, McNemar) "
          "| mis-source control |" + extra + " answer-disjoint | its mis-source | zero-init = untrained, bit-exact |")
    print("| --- " * (8 + raw_family + len(a.also)) + "|")
    for _, r in s[s["family"] == a.trained].iterrows():
        if r["base"].endswith("_disjoint"):
            continue
        mis = find(a.mis_source, r["bridge"], r["rest"])
        dis = find(a.trained, twin(r["bridge"]), r["rest"])
        dmis = find(a.mis_source, twin(r["bridge"]), r["rest"])
        gate = find("zero_init", r["bridge"], "{}")
        gate_t = "–" if gate is None or pd.isna(gate["bit_exact_items"]) else \
            f"{int(gate['bit_exact_items'])}/{int(gate['n_items'])}"
        gate_t = on_gate_row(gate_t, gate_rest(r["bridge"]), r["rest"])
        untrained = ""
        if raw_family:
            u = find(a.raw, None, r["rest"])
            untrained = f"{acc(u) if u is not None else '–'} | "
        also = "".join(
            f"{acc(x, se=False) if x is not None else '–'} | "
            for x in (find(f, r["bridge"], r["rest"]) for f in a.also))
        print(f"| `{r['bridge']}` | {r['rest'] if r['rest'] != '{}' else '–'} | {untrained}{acc(r)} | {lift(r)} "
              f"| {acc(mis, se=False) if mis is not None else '–'} | {also}"
              f"{acc(dis) if dis is not None else '–'} "
              f"| {acc(dmis, se=False) if dmis is not None else '–'} | {gate_t} |")
    if a.seeds:
        over_seeds(a.run, a, gate_rest)


if __name__ == "__main__":
    main()
