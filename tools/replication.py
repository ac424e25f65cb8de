"""
Do the verdicts replicate (issue 34)? The replication table of RESULTS.md, recomputed from the result files:

    python tools/replication.py                  # the study's files, as results/study/run.sh and replicate.sh write them

One row per claim, one column per setting: the 1.5B on GSM8K (fp32, K = 192: the claims study's own files), the 0.5B
on GSM8K, the 1.5B on MATH-500, long-trace fidelity on the 1.5B's own long answers, and claim 3's budget curve (GSM8K,
three budgets). Each cell holds its deciding comparison: the paired difference with its bootstrap 95 % interval and
the exact sign test (over problems for accuracy, over traces for fidelity), and a verdict by one rule for every cell:
- holds: the difference is on the claim's side and its interval excludes 0;
- does not hold: it is on the other side and its interval excludes 0 (or, for a claim of parity, it excludes a
  margin of 0.06 in accuracy);
- not separated: the interval holds 0 (a claim of parity: holds within the margin);
- cannot be tested here: the setting lacks the rows the comparison needs.
Then every comparison the verdicts rest on, with which of them survive Holm's correction across all of them.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

from stats import bootstrap_diff, holm, interval, outcomes, sign_test, spread_diff  # noqa: E402

STUDY = Path(__file__).resolve().parent.parent / "results" / "study"
MARGIN = 0.06  # a claim of parity holds when the interval lies within +-MARGIN (as for --quant's accuracy check)


def accuracy_rows(paths: list[Path]) -> dict:
    """(policy, budget, protect) -> accuracy row, over files (a full-cache row found twice once)."""
    rows = {}
    for p in paths:
        for r in json.loads(p.read_text()) if p.is_file() else []:
            if r.get("task") == "accuracy" and r.get("per_problem"):
                rows.setdefault((r["policy"], r["budget"], r["protect"]), r)
    return rows


def fidelity_rows(paths: list[Path]) -> dict:
    """(policy, budget, buffer) -> fidelity row."""
    return {(r["policy"], r["budget"], r["buffer"]): r for p in paths if p.is_file()
            for r in json.loads(p.read_text()) if r.get("task") == "fidelity"}


class Cell:
    """One comparison, a - b over the items both hold (problems: right or wrong; traces: KL), for a claim that expects
    a above b, below b, or a at least level with b ("parity": within MARGIN in accuracy, not above b in KL)."""

    def __init__(self, label: str, a: list, b: list, expect: str, kl: bool = False):
        self.label, self.expect, self.kl, self.n = label, expect, kl, len(a)
        self.d, self.lo, self.hi = bootstrap_diff(a, b)
        # the sign test: problems where only one is right; traces where one is lower
        self.n10, self.n01, self.p = sign_test([x < y for x, y in zip(a, b)], [y < x for x, y in zip(a, b)]) if kl \
            else sign_test(a, b)

    @property
    def verdict(self) -> str:
        if self.lo is None:
            return "not separated"
        above, below = self.lo > 0, self.hi < 0
        if self.expect == "parity":  # worse: lower accuracy, or higher KL
            worse, fine = (above, below) if self.kl else (below, self.lo > -MARGIN)
            return "does not hold" if worse else "holds" if fine else "not separated"
        yes, no = (above, below) if self.expect == "above" else (below, above)
        return "holds" if yes else "does not hold" if no else "not separated"

    def __str__(self):
        what = "traces lower" if self.kl else "discordant"
        return (f"{self.label} {self.d:+.3f} {interval(self.lo, self.hi)}, {what} {self.n10} / {self.n01}, "
                f"p = {self.p:.2g}")


def acc_cell(rows: dict, a: tuple, b: tuple, expect: str) -> Cell | None:
    if a not in rows or b not in rows:
        return None
    x, y = outcomes(rows[a]), outcomes(rows[b])
    common = sorted(set(x) & set(y))
    return Cell(f"{a[0]} − {b[0]}", [x[i] for i in common], [y[i] for i in common], expect)


def kl_cell(rows: dict, a: tuple, b: tuple, expect: str) -> Cell | None:
    if a not in rows or b not in rows:
        return None
    return Cell(f"KL {a[0]} − {b[0]} (K = {a[1]}, r = {a[2]})", rows[a]["kl_by_trace"], rows[b]["kl_by_trace"],
                expect, kl=True)


def spread_cell(rows: dict, K) -> str | None:
    """Random Attention's bunching: spread across snapkv, vase and random, protected minus not."""
    pols = [p for p in ("snapkv", "vase", "random", "criticalkv") if (p, K, True) in rows and (p, K, False) in rows]
    if len(pols) < 2:
        return None
    common = sorted(set.intersection(*(set(outcomes(rows[p, K, s])) for p in pols for s in (True, False))))
    acc = lambda s: [[outcomes(rows[p, K, s])[i] for i in common] for p in pols]
    on, off, lo, hi = spread_diff(acc(True), acc(False))
    verdict = "holds" if hi < 0 else "does not hold" if lo > 0 else "not separated"
    return f"spread over {', '.join(pols)}: protected {on:.2f}, not {off:.2f}, difference {on - off:+.2f} " \
           f"{interval(lo, hi)} (n = {len(common)}): **{verdict}**"


def claims(acc: dict, fid: dict, K, Kf: list) -> dict:
    """The deciding comparisons of each claim in one setting: claim -> its cells (Cells, a spread line, or None)."""
    P = lambda p: (p, K, True)  # protected accuracy rows
    full = ("full", None, None)
    # EPIKV at the study's r and at its authors' window min(128, K / 4), against snapkv at the study's r
    epikv = [(k, r, w) for k, r in Kf for w in dict.fromkeys([r, max(r, min(128, k // 4))])]
    return {
        "RA 1: protecting the prompt bunches the policies": [spread_cell(acc, K)],
        "RA 2: protected random does as well as the scorers": [acc_cell(acc, P("random"), P("snapkv"), "parity"),
                                                                acc_cell(acc, P("random"), P("vase"), "parity")],
        "VASE 1: evicting the widest values collapses accuracy": [
            acc_cell(acc, P("vase-adversary"), full, "below"), acc_cell(acc, P("vase-adversary"), P("random"), "below")],
        "VASE 2: the reserve and sampling beat attention top-k": [
            acc_cell(acc, P("vase"), P("snapkv"), "above"), acc_cell(acc, P("vase"), P("vase-noreserve"), "above")],
        "CriticalKV: value-aware stage 2 improves on SnapKV": [acc_cell(acc, P("criticalkv"), P("snapkv"), "above")]
        + [kl_cell(fid, ("criticalkv", k, r), ("snapkv", k, r), "below") for k, r in Kf],
        "EPIKV: residual movement matches attention scorers": [
            kl_cell(fid, ("epikv", k, w), ("snapkv", k, r), "parity") for k, r, w in epikv],
    }


CURVE = (160, 192, 256)  # claim 3's budgets; its policies against snapkv at each
CURVE_CLAIMS = (("criticalkv", "above"), ("vase", "above"), ("random", "parity"))


def main(argv=None):
    ap = argparse.ArgumentParser(description="The replication table from the study's result files.",
                                 allow_abbrev=False)  # no prefixes of flags, as cli.Parser (not imported: it loads torch)
    ap.add_argument("--study", default=str(STUDY), help="the folder of the result files (default results/study)")
    args = ap.parse_args(argv)
    d = Path(args.study)
    columns = {  # name -> (accuracy rows, fidelity rows, accuracy budget, fidelity (budget, buffer)s)
        "1.5B, GSM8K (fp32, K = 192)": (accuracy_rows([d / "claims_q15.json", d / "claims_q15_noprotect.json"]),
                                        fidelity_rows([d / "fidelity_q15.json"]), 192, [(192, 16)]),
        "0.5B, GSM8K (int4, K = 208)": (accuracy_rows([d / "claims_q05.json"]), {}, 208, []),
        "1.5B, MATH-500 (int4, K = 416)": (accuracy_rows([d / "math_q15.json"]), {}, 416, []),
        "long traces (int4, fidelity)": ({}, fidelity_rows([d / "longfid_q15.json"]), None, [(512, 64), (256, 64)]),
    }
    cells = {name: claims(*spec) for name, spec in columns.items()}
    curve = accuracy_rows([d / "curve_q15.json"])
    budget = {k: [c for p, e in CURVE_CLAIMS if (c := acc_cell(curve, (p, k, True), ("snapkv", k, True), e))]
              for k in CURVE}
    every = [c for col in cells.values() for cs in col.values() for c in cs if isinstance(c, Cell)]
    every += [c for k in CURVE for c in budget[k]]
    survive = {id(c): ok for c, ok in zip(every, holm([c.p for c in every]))}
    mark = lambda c: f"{c}: **{c.verdict}**" + (", survives Holm" if survive[id(c)] else "")
    print("| claim | " + " | ".join(columns) + " |\n|---" + "|---" * len(columns) + "|")
    for claim in cells[next(iter(columns))]:
        row = ["; ".join(mark(c) if isinstance(c, Cell) else c for c in cells[name][claim] if c)
               or "cannot be tested here" for name in columns]
        print(f"| {claim} | " + " | ".join(row) + " |")
    print("\nClaim 3 by accuracy (1.5B, int4, the first 100 GSM8K problems whose prompt fits K = 160, protected):")
    for k in CURVE:
        accs = ", ".join(f"{p} {sum(outcomes(curve[p, k, True]).values())}" for p in ("snapkv", "criticalkv", "vase",
                                                                                        "random") if (p, k, True) in curve)
        if accs:
            print(f"- K = {k}: {accs} of 100; " + "; ".join(map(mark, budget[k])))
    kept = sum(survive.values())
    print(f"\n{len(every)} comparisons; {kept} stay significant under Holm's correction across all of them "
          "(alpha = 0.05).")


if __name__ == "__main__":
    main()
