"""
Do the verdicts replicate? The replication table of RESULTS.md, recomputed from the result files:

    python tools/replication.py        # the study's files, as results/study/run.sh and replicate.sh write them

One row per claim, one column per setting: the 1.5B on GSM8K (fp32, K = 192: the claims study's own files), the 0.5B
on GSM8K, the 1.5B on MATH-500, long-trace fidelity on the 1.5B's own long answers; then claim 3's budget curve
(GSM8K, three budgets). Each cell holds its deciding comparisons, a - b over the items both hold: the difference with
its paired bootstrap 95 % interval and the exact sign test (over problems for accuracy, over traces for KL), and a
verdict by one rule for every cell. A directional claim (a above b, or below):
- holds when the interval excludes 0 on the claim's side, does not hold when it excludes 0 on the other side, and is
  not separated when it holds 0.
A claim of parity (a does as well as b):
- in accuracy: holds when a is at most MARGIN below b (the interval's lower end above -MARGIN), does not hold when
  the whole interval is further below, not separated otherwise;
- in KL (lower is better): holds when the interval lies below 0, does not hold when it lies above, not separated
  when it holds 0.
On the margin: a bound so near 0 or the margin that another bootstrap seed could give another verdict (within its
Monte Carlo band, stats.bootstrap); with 12 or fewer items the bootstrap is enumerated exactly, so never there.
Cannot be tested here: the setting lacks the rows the comparison needs. The directional comparisons form one family
for Holm's correction (their sign tests); a parity verdict rests on its interval, not on a test of difference, and
the spread's on its bootstrap interval alone, so neither enters the family.
"""

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

from cli import Parser, UsageError  # noqa: E402
from results import PAIRED, at_least, one_setting, pool_blocks, read_json, tool_rows  # noqa: E402
from stats import EXACT, bootstrap, holm, interval, outcomes, sign_test, spread_diff  # noqa: E402
from tasks import file_hash, is_loop  # noqa: E402
from traces import read_traces  # noqa: E402

STUDY = Path(__file__).resolve().parent.parent / "results" / "study"
TRACES = STUDY.parent.parent / "data" / "reasoning_traces.jsonl"  # the shipped traces, whose n_tokens --long-min reads
FILES = ("claims_q15.json", "claims_q15_noprotect.json", "fidelity_q15.json", "claims_q05.json", "math_q15.json",
         "longfid_q15.json", "curve_q15.json")  # what main reads of --study
MARGIN = 0.06  # a claim of parity in accuracy holds when a is at most this far below b (as --quant's check)
# what one column's rows share
SETTING = PAIRED + ("max_new_tokens", "seed", "batch_size", "refill", "min_tokens", "long")
NEEDS = {"accuracy": ("policy", "budget", "protect", "per_problem"), "fidelity": ("policy", "budget", "buffer",
                                                                                  "kl_by_trace")}


def rows_of(paths: list[Path], task: str, key, longest: tuple[int, str] | None = None) -> dict:
    """key(row) -> row for the rows of `task` in the files that exist (a full-cache row found twice once), each
    checked where it is read (results.tool_rows). The rows of one column must share their setting (model, data, n,
    mode, ...): files that mix two are refused in one line (results.one_setting). longest: (M, traces file): only the
    replayed traces of M tokens or more (results.at_least)."""
    where = {}
    got = [r for r in tool_rows([p for p in paths if p.exists()], NEEDS, where) if r["task"] == task]
    got = pool_blocks(got, where, note=lambda m: print(m, file=sys.stderr))  # a study's blocks of traces, as one
    if longest:
        got = at_least(got, longest[0], *trace_lengths(longest[1]), where)
    one_setting(got, "the rows of one column", SETTING, where)
    rows = {}
    for r in got:
        rows.setdefault(key(r), r)
    return rows


def accuracy_rows(paths: list[Path], by_buffer: bool = False) -> dict:
    """(policy, budget, protect) -> accuracy row; by_buffer: (policy, budget, protect, buffer), so that one budget's
    rows at two recent windows stay apart (the seeds' EPIKV at r = K/4 beside the rest at r = 16)."""
    return rows_of(paths, "accuracy", lambda r: (r["policy"], r["budget"], r["protect"]) + ((r.get("buffer"),)
                                                                                         if by_buffer else ()))


def trace_lengths(path: str) -> tuple[dict[str, int], str]:
    """Each trace's tokens (n_tokens) in a traces file (data/README.md), and the file's hash, which rows record."""
    rows = read_traces(path)
    if any(not isinstance(r.get("n_tokens"), int) for r in rows):
        raise UsageError(f"{path} has a trace without n_tokens: rebuild it (python tools/reasoning_traces.py)")
    return {r["id"]: r["n_tokens"] for r in rows}, file_hash(path)


def fidelity_rows(paths: list[Path], by_protect: bool = False, loops: bool = False,
                  longest: tuple[int, str] | None = None) -> dict:
    """(policy, budget, buffer) -> fidelity row; by_protect: (policy, budget, buffer, protect), so that a policy's
    protected and unprotected rows stay apart (tools/seeds.py). A long trace that loops (looping) is left out of every
    row's kl_by_trace unless loops; a row left with no trace is left out (its cells read 'not run'). The packed
    conversations are read with loops: they hold several short answers, the loop check is for long ones. longest:
    (M, traces file): the traces of M tokens or more only (rows_of)."""
    rows = rows_of(paths, "fidelity", lambda r: (r["policy"], r["budget"], r["buffer"]) + ((r["protect"],)
                                                                                        if by_protect else ()), longest)
    loop = looping(paths)
    if loops or not any(loop):
        return rows
    kept = lambda r: [x for x, lp in zip(r["kl_by_trace"], loop) if not lp]
    return {k: {**r, "kl_by_trace": kept(r), "n": len(kept(r))} for k, r in rows.items() if kept(r)}


def looping(paths: list[Path]) -> list[bool]:
    """Per trace of the fidelity rows in paths, whether it loops (tasks.is_loop on its generated tokens): the traces
    that eval.py saved beside the first file that has them (FILE.traces.json, the model's own answers); [] where none
    is saved (another model's traces, checked when eval.py read them)."""
    for p in paths:
        saved = Path(f"{p}.traces.json")
        if saved.is_file():
            return [is_loop(t["ids"][t["prompt_len"] :]) for t in read_json(saved, dict)["traces"]]
    return []


def loop_line(paths: list[Path], loops: bool) -> str | None:
    """The footer that says how many of a long-trace column's traces loop, and what became of them."""
    loop = looping(paths)
    if not any(loop):
        return None
    what = "kept in the verdicts (--loops)" if loops else "left out of the verdicts (--loops keeps them)"
    return f"{sum(loop)} of the {len(loop)} long traces loop (tasks.is_loop): {what}"


class Cell:
    """One comparison, a - b over the items both hold (problems: right or wrong; traces: KL), for a claim that expects
    a "above" b, "below" b, or at "parity" with it (see the module's rules)."""

    def __init__(self, label: str, a: list, b: list, expect: str, kl: bool = False):
        self.label, self.expect, self.kl, self.n = label, expect, kl, len(a)
        self.d, self.lo, self.hi, self.band = bootstrap(a, b)
        # the sign test: problems where only one is right; traces where one is lower
        self.n10, self.n01, self.p = sign_test([x < y for x, y in zip(a, b)], [y < x for x, y in zip(a, b)]) if kl \
            else sign_test(a, b)

    def rule(self, lo: float, hi: float) -> str:
        """The verdict of an interval [lo, hi] by the module's rules."""
        if self.expect == "parity" and not self.kl:
            return "holds" if lo > -MARGIN else "does not hold" if hi < -MARGIN else "not separated"
        above, below = lo > 0, hi < 0
        yes, no = (above, below) if self.expect == "above" else (below, above)  # parity in KL: below is better
        return "holds" if yes else "does not hold" if no else "not separated"

    @property
    def verdict(self) -> str:
        return settle(self, Cell.rule)  # a subclass with a rule of its own gives its own verdict (seeds.Parity)

    def __str__(self):
        what = "traces lower" if self.kl else "discordant"
        return (f"{self.label} {self.d:+.3f} {interval(self.lo, self.hi)}, {what} {self.n10} / {self.n01}, "
                f"p = {self.p:.2g} (n = {self.n})")


def settle(cell, rule) -> str:
    """A cell's verdict, rule(cell, lo, hi), where its interval's Monte Carlo error cannot change it: "on the margin"
    when a bound lies so near the margin (or 0) that another bootstrap seed could give another verdict, i.e. the rule
    gives two verdicts within the bounds' bands (stats.bootstrap: zero-wide, so never, for 12 or fewer items, whose
    bootstrap is exact). One item: no interval, "not separated"."""
    if cell.lo is None:
        return "not separated"
    band = getattr(cell, "band", None) or ((cell.lo, cell.lo), (cell.hi, cell.hi))
    got = {rule(cell, lo, hi) for lo in band[0] for hi in band[1]}
    return got.pop() if len(got) == 1 else "on the margin"


def acc_cell(rows: dict, a: tuple, b: tuple, expect: str, cell=Cell) -> Cell | None:
    """a - b in accuracy over the problems both rows hold; None where a row is missing. cell: Cell or a subclass
    with its own rule (tools/seeds.py's two-sided parity)."""
    if a not in rows or b not in rows:
        return None
    x, y = outcomes(rows[a]), outcomes(rows[b])
    common = sorted(set(x) & set(y))
    return cell(f"{a[0]} − {b[0]}", [x[i] for i in common], [y[i] for i in common], expect)


def kl_cell(rows: dict, a: tuple, b: tuple, expect: str, cell=Cell) -> Cell | None:
    """KL(a) - KL(b) per trace, keys (policy, budget, buffer, ...); None where a row is missing."""
    if a not in rows or b not in rows:
        return None
    return cell(f"KL {a[0]} − {b[0]} (K = {a[1]}, r = {a[2]})", rows[a]["kl_by_trace"], rows[b]["kl_by_trace"],
                expect, kl=True)


def spread_line(rows: dict, K, policies=("snapkv", "vase", "random", "criticalkv"), tail=()) -> str | None:
    """Random Attention's bunching: the spread (best minus worst accuracy) across the policies run both protected and
    not at budget K (of `policies`), protected minus not, on the problems all of them hold. tail: the rest of the
    rows' key after (policy, budget, protect), e.g. (16,) for rows keyed by buffer too."""
    key = lambda p, s: (p, K, s, *tail)
    pols = [p for p in policies if key(p, True) in rows and key(p, False) in rows]
    if len(pols) < 2:
        return None
    common = sorted(set.intersection(*(set(outcomes(rows[key(p, s)])) for p in pols for s in (True, False))))
    acc = lambda s: [[outcomes(rows[key(p, s)])[i] for i in common] for p in pols]
    on, off, lo, hi = spread_diff(acc(True), acc(False))
    verdict = "not separated" if lo is None or lo <= 0 <= hi else "holds" if hi < 0 else "does not hold"
    return (f"spread over {', '.join(pols)}: protected {on:.2f}, not {off:.2f}, difference {on - off:+.2f} "
            f"{interval(lo, hi)} (n = {len(common)}): **{verdict}** (bootstrap only)")


def claims(acc: dict, fid: dict, K, Kf: list) -> dict:
    """The deciding comparisons of each claim in one setting: claim -> its cells (Cells, a spread line, or None).
    K: the accuracy rows' budget; Kf: the fidelity rows' (budget, buffer)s."""
    P = lambda p: (p, K, True)  # protected accuracy rows
    full = ("full", None, None)
    kl = lambda a, b, expect: [kl_cell(fid, (a, k, r), (b, k, r), expect) for k, r in Kf]
    # EPIKV also at its authors' window min(128, K / 4), against snapkv at the study's r
    epikv = [kl_cell(fid, ("epikv", k, w), ("snapkv", k, r), "parity") for k, r in Kf
             for w in dict.fromkeys([r, max(r, min(128, k // 4))])]
    return {
        "RA 1: protecting the prompt bunches the policies": [spread_line(acc, K)],
        "RA 2: protected random does as well as the scorers": [acc_cell(acc, P("random"), P("snapkv"), "parity"),
                                                                acc_cell(acc, P("random"), P("vase"), "parity"),
                                                                *kl("random", "snapkv", "parity")],
        "VASE 1: evicting the widest values collapses accuracy": [
            acc_cell(acc, P("vase-adversary"), full, "below"), acc_cell(acc, P("vase-adversary"), P("random"), "below"),
            *kl("vase-adversary", "vase", "above")],
        "VASE 2: the reserve and sampling beat attention top-k": [
            acc_cell(acc, P("vase"), P("snapkv"), "above"), acc_cell(acc, P("vase"), P("vase-noreserve"), "above"),
            *kl("vase", "snapkv", "below"), *kl("vase", "vase-noreserve", "below"),  # the reserve, by fidelity
            *kl("vase", "vase-topk", "below")],  # the sampled fill against a top-k fill
        "CriticalKV: value-aware stage 2 improves on SnapKV": [acc_cell(acc, P("criticalkv"), P("snapkv"), "above"),
                                                                *kl("criticalkv", "snapkv", "below")],
        "EPIKV: residual movement matches attention scorers": epikv,
    }


CURVE = (160, 192, 256)  # claim 3's budgets; its policies against snapkv at each
CURVE_CLAIMS = (("criticalkv", "above"), ("vase", "above"), ("random", "parity"))


def machines(rows: dict) -> str:
    """Where the problems of rows ran: each machine with its count of problems ("not recorded": rows made before
    rows recorded it, 3 December 2026). Greedy decoding can part at a rounding between two CPUs, so a pairing across
    machines holds that noise too (RESULTS.md measures it)."""
    count = Counter(p.get("made_on", "not recorded") for r in rows.values() for p in r.get("per_problem", []))
    return ", ".join(f"{m}: {n}" for m, n in sorted(count.items())) or "no rows"


def study_folder(path: str, files: tuple, whose: str, writer: str) -> Path:
    """--study as a folder that holds at least one of `files`, else a one-line UsageError naming the fix."""
    d = Path(path)
    if not d.is_dir():
        raise UsageError(f"--study {d} is not a folder: pass the folder of the study's result files (default {STUDY})")
    if not any((d / f).is_file() for f in files):
        raise UsageError(f"--study {d} holds none of {whose} result files ({', '.join(files)}): pass the folder that "
                         f"{writer} wrote")
    return d


def main(argv=None):
    ap = Parser(description="The replication table from the study's result files.")
    ap.add_argument("--study", default=str(STUDY), help="the folder of the result files (default results/study)")
    ap.add_argument("--loops", action="store_true", help="keep the long traces that loop in the verdicts")
    args = ap.parse_args(argv)
    try:
        d = study_folder(args.study, FILES, "the study's", "results/study/run.sh and replicate.sh")
        columns = {  # name -> (accuracy rows, fidelity rows, accuracy budget, fidelity (budget, buffer)s)
            "1.5B, GSM8K (fp32, K = 192)": (accuracy_rows([d / "claims_q15.json", d / "claims_q15_noprotect.json"]),
                                            fidelity_rows([d / "fidelity_q15.json"], loops=True), 192, [(192, 16)]),
            "0.5B, GSM8K (int4, K = 208)": (accuracy_rows([d / "claims_q05.json"]), {}, 208, []),
            "1.5B, MATH-500 (int4, K = 416)": (accuracy_rows([d / "math_q15.json"]), {}, 416, []),
            "long traces (int4, fidelity)": ({}, fidelity_rows([d / "longfid_q15.json"], loops=args.loops), None,
                                             [(512, 64), (288, 64)]),  # 288: random's longest prompt fits (220)
        }
        curve = accuracy_rows([d / "curve_q15.json"])
    except UsageError as e:
        sys.exit(f"error: {e}")
    cells = {name: claims(*spec) for name, spec in columns.items()}
    budget = {k: [c for p, e in CURVE_CLAIMS if (c := acc_cell(curve, (p, k, True), ("snapkv", k, True), e))]
              for k in CURVE}
    every = [c for col in cells.values() for cs in col.values() for c in cs if isinstance(c, Cell)]
    every += [c for k in CURVE for c in budget[k]]
    family = [c for c in every if c.expect != "parity"]
    survive = {id(c): ok for c, ok in zip(family, holm([c.p for c in family]))}
    mark = lambda c: f"{c}: **{c.verdict}**" + ({True: ", survives Holm", False: ", not after Holm"}.get(
        survive.get(id(c)), "") if c.verdict == "holds" else "")
    print("| claim | " + " | ".join(columns) + " |\n|---" + "|---" * len(columns) + "|")
    for claim in cells[next(iter(columns))]:
        row = ["; ".join(mark(c) if isinstance(c, Cell) else c for c in cells[name][claim] if c)
               or "cannot be tested here" for name in columns]
        print(f"| {claim} | " + " | ".join(row) + " |")
    print("\nWhere the accuracy rows' problems ran:")
    for name, acc in [(name, acc) for name, (acc, *_) in columns.items()] + [("claim 3's curve", curve)]:
        if acc:
            print(f"- {name}: {machines(acc)}")
    print("\nClaim 3 by accuracy (1.5B, int4, the first 100 GSM8K problems whose prompt fits K = 160, protected):")
    for k in CURVE:
        accs = ", ".join(f"{p} {sum(outcomes(curve[p, k, True]).values())} / {len(outcomes(curve[p, k, True]))}"
                         for p in ("snapkv", "criticalkv", "vase", "random") if (p, k, True) in curve)
        if accs:
            print(f"- K = {k}: {accs}; " + "; ".join(map(mark, budget[k])))
    said = loop_line([d / "longfid_q15.json"], args.loops)
    if said:
        print(f"\nLong traces: {said}.")
    print(f"\n{len(every)} comparisons: {len(family)} directional, {sum(survive.values())} of them significant after "
          f"Holm's correction across those {len(family)} (alpha = 0.05); {len(every) - len(family)} of parity.")
    print(f"Intervals over {EXACT} or fewer items (traces) are exact bootstraps, every resample enumerated; over more, "
          "10,000 resamples, and a verdict that a bound's Monte Carlo error could flip reads \"on the margin\".")


if __name__ == "__main__":
    main()
