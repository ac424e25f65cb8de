"""
The claims study's tables, from its result files: every number in RESULTS.md's claims section comes from

    python tools/claims.py results/study/claims_q15.json results/study/claims_q15_noprotect.json \
        results/study/fidelity_q15.json results/study/heads_q15.json

Accuracy rows of all files are paired by problem (every configuration ran on the same problems):
1. each configuration against the full cache: accuracy, the difference with its paired bootstrap 95 % interval and
   McNemar's exact sign test, how often its extracted answer is the full cache's, loops, answer length, eviction
   rounds per answer (mean and median) and the share of answer tokens still held when the answer ended;
2. Random Attention's spread: best minus worst accuracy across the policies run (and finished) both ways (the
   scorers and random; VASE's adversary is a control, not a policy to choose), and
   the interval of the difference; each such policy protected against itself not protected;
3. random against each scorer, both protected; 4. VASE against its variants and snapkv (the attention top-k it
   samples from) at the same setting.
5. fidelity (claims 3 and 5): each policy's teacher-forced KL, top-1 agreement and NLL gap per budget, and its
   per-trace KL against snapkv's at the same budget with the paired bootstrap interval over traces; CriticalKV's
   output perturbation: the mean ||o - o_hat||_1 and the share of (layer, head) pairs below snapkv's;
6. the head-redundancy probe (claim 4): recall and the answer's log-probability against the KV heads kept.
With --partial, the sweeps' progress files beside each file are read too (rows marked with their n so far), and
pairs use the problems both rows have.
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

from cli import Parser, UsageError, output_failed  # noqa: E402
from results import READ_FIX, check_row, one_setting, read_json, tool_rows  # noqa: E402
from stats import bootstrap_diff, interval, min_detectable, outcomes, paired_outcomes, spread_diff  # noqa: E402

SCORERS = ("snapkv", "rkv", "criticalkv", "vase", "epikv", "h2o")


# what each table reads of a row, checked where the rows are read (results.check_row): a damaged row is one line
NEEDS = {"accuracy": ("policy", "budget", "protect", "per_problem"),
         "fidelity": ("policy", "budget", "protect", "kl", "top1", "nll_gap", "tokens", "kl_by_trace"),
         "perturbation": ("policy", "budget", "protect", "l1_window", "better_window", "l1_next", "better_next")}
HEADS = {"probe": ("policy", "budget", "protect", "heads", "recall", "logprob", "recall_by_probe", "gap_tokens")}


def read_rows(paths: list[str], where: dict) -> list[dict]:
    """Every row of the files, checked; each task's rows must share one setting (results.one_setting), since every
    table pairs them."""
    rows = tool_rows(paths, NEEDS, where)
    for r in rows:
        if r["task"] == "probe" and r.get("heads") is not None:
            check_row(r, where[id(r)], HEADS)
    for task in ("accuracy", "fidelity", "perturbation", "probe"):
        if any(r["task"] == task for r in rows):
            one_setting([r for r in rows if r["task"] == task], f"the {task} rows", where=where)
    return rows


def rows_of(every: list[dict], paths: list[str], partial: bool, where: dict) -> list[dict]:
    """Accuracy rows, one per (policy, budget, protect): a job found twice (the full row copied into each file) once.
    With partial, the rows so far of the progress files beside the files too (checked, and of the same setting)."""
    seen, rows = set(), []
    got = [r for r in every if r["task"] == "accuracy"]
    if partial:
        for q in (q for p in map(Path, paths) for q in sorted(p.parent.glob(p.stem + ".progress-*.json"))):
            r = read_json(q, dict, READ_FIX)
            # a fidelity sweep's holds per_trace so far; a progress row holds some of its problems (partial)
            check_row(r, str(q), {"accuracy": NEEDS["accuracy"]}, partial=True)
            if r["task"] == "accuracy":
                got.append(dict(r, partial=True))
                where[id(got[-1])] = str(q)
        one_setting(got, "the accuracy rows and the progress files", where=where)
    for r in got:
        key = (r.get("policy"), r.get("budget"), r.get("protect"), r.get("data"), r.get("model"))
        if r.get("per_problem") and key not in seen:
            seen.add(key)
            rows.append(r)
    return rows


def name(r: dict) -> str:
    protect = {True: ", protected", False: ", not protected"}.get(r["protect"], "")
    return f"{r['policy']}{protect}" + (f" (n = {len(r['per_problem'])} so far)" if r.get("partial") else "")


def compare(r: dict, base: dict) -> str:
    """Δ (r - base) on the problems both hold, its interval, discordant problems (r right / base right), p."""
    _, d, lo, hi, n10, n01, p = paired_outcomes(r, base)
    return f"{d:+.2f} | {interval(lo, hi, 2)} | {n10} / {n01} | {p:.2g}"


def table(rows: list[dict], full: dict) -> list[str]:
    preds = {p["i"]: p["pred"] for p in full["per_problem"]}
    out = ["| configuration | K | accuracy | Δ vs full | 95 % interval | discordant | sign test p | same answer as "
           "full | answered | loops | mean tokens | evictions (mean / median) | answer tokens kept |",
           "|---" * 13 + "|"]
    for r in rows:
        pp = r["per_problem"]
        mean = lambda f: sum(p[f] for p in pp) / len(pp)
        vs = "– | – | – | –" if r is full else compare(r, full)
        same = sum(p["pred"] is not None and p["pred"] == preds.get(p["i"]) for p in pp) / len(pp)
        out.append(f"| {name(r)} | {r['budget'] or '–'} | {mean('correct'):.2f} | {vs} | {same:.2f} | "
                   f"{mean('answered'):.2f} | {mean('loop'):.2f} | {mean('tokens'):.0f} | {mean('evictions'):.1f} / "
                   f"{statistics.median(p['evictions'] for p in pp):.0f} | {mean('kept'):.0%} |")
    return out


def spread(rows: list[dict]) -> list[str]:
    """Policies run both protected and not, both finished: the spread of their accuracies each way, on the problems all
    their rows hold."""
    by = {(r["policy"], r["protect"]): r for r in rows if not r.get("partial")}
    both = [p for p, s in by if s is True and (p, False) in by and p in (*SCORERS, "random")]  # not the adversary
    if len(both) < 2:
        return []
    common = sorted(set.intersection(*(set(outcomes(by[p, s])) for p in both for s in (True, False))))
    acc = lambda s: [[outcomes(by[p, s])[i] for i in common] for p in both]
    on, off, lo, hi = spread_diff(acc(True), acc(False))
    return [f"Spread (best minus worst accuracy) across {', '.join(both)} on the {len(common)} problems all of them "
            f"hold: protected {on:.2f}, not protected {off:.2f}; difference {on - off:+.2f}, paired bootstrap 95 % "
            f"interval {interval(lo, hi, 2)}."]


def pairs(rows: list[dict], title: str, want) -> list[str]:
    lines = [f"| {title} | Δ (first - second) | 95 % interval | discordant | sign test p |", "|---|---|---|---|---|"]
    lines += [f"| {name(a)} - {name(b)} | {compare(a, b)} |" for a in rows for b in rows if want(a, b)]
    return lines if len(lines) > 2 else []


def fidelity(rows: list[dict]) -> list[str]:
    """Claims 3 and 5: fidelity rows by budget, each against snapkv's at its budget on the same traces."""
    fid = sorted((r for r in rows if r.get("task") == "fidelity" and r["policy"] != "full"),
                 key=lambda r: (r["budget"], ORDER.get(r["policy"], 99), r["policy"]))
    if not fid:
        return []
    snap = {r["budget"]: r["kl_by_trace"] for r in fid if r["policy"] == "snapkv"}
    out = ["| policy | K | KL (nats / token) | top-1 agreement | NLL gap | Δ KL vs snapkv | 95 % interval | traces "
           "below snapkv |", "|---" * 8 + "|"]
    for r in fid:
        vs, b = "– | – | –", snap.get(r["budget"])
        if r["policy"] != "snapkv" and b and len(b) == len(r["kl_by_trace"]):
            d, lo, hi = bootstrap_diff(r["kl_by_trace"], b)
            vs = f"{d:+.3f} | {interval(lo, hi)} | {sum(x < y for x, y in zip(r['kl_by_trace'], b))} / {len(b)}"
        out.append(f"| {name(r)} | {r['budget']} | {r['kl']:.3f} | {r['top1']:.3f} | {r['nll_gap']:+.3f} | {vs} |")
    n = {len(r["kl_by_trace"]) for r in fid}
    return out + [f"\n{'/'.join(map(str, n))} traces, {fid[0]['tokens']} answer tokens scored per policy."]


def perturbation(rows: list[dict]) -> list[str]:
    per = [r for r in rows if r.get("task") == "perturbation"]
    out = ["| policy | K | ‖o − ô‖₁ over the window | heads below snapkv | ‖o − ô‖₁ up to the next round | heads below "
           "snapkv |", "|---" * 6 + "|"]
    f = lambda v, pct=False: "–" if v is None else f"{v:.0%}" if pct else f"{v:.4f}"
    out += [f"| {name(r)} | {r['budget']} | {f(r['l1_window'])} | {f(r['better_window'], True)} | {f(r['l1_next'])} | "
            f"{f(r['better_next'], True)} |" for r in per]
    return out if per else []


def best_set(r: dict) -> str:
    """The head set that recalls most often (the authors' curve reports their carrier heads, not an average)."""
    if len(r.get("sets", [])) < 2:
        return "–"
    i = max(range(len(r["sets"])), key=lambda j: (r["recall_by_set"][j], r["logprob_by_set"][j]))
    return f"heads {r['sets'][i]}: {r['recall_by_set'][i]:.0%}, {r['logprob_by_set'][i]:.2f}"


def heads(rows: list[dict]) -> list[str]:
    """Claim 4: the planted fact kept in k of each layer's KV heads."""
    got = sorted((r for r in rows if r.get("task") == "probe" and r.get("heads") is not None), key=lambda r: r["heads"])
    out = ["| KV heads that keep the fact | recall (mean over head sets) | answer log-probability | probes every set "
           "recalls | best head set: recall, log-probability |", "|---|---|---|---|---|"]
    out += [f"| {r['heads']} | {r['recall']:.0%} | {r['logprob']:.2f} | "
            f"{sum(x == 1 for x in r['recall_by_probe'])} / {len(r['recall_by_probe'])} | {best_set(r)} |" for r in got]
    return out + [f"\n{len(got[0]['recall_by_probe'])} probes, the question about {got[0]['gap_tokens']:.0f} tokens "
                  "after the fact."] if got else []


ORDER = {p: k for k, p in enumerate(("full", "snapkv", "rkv", "criticalkv", "epikv", "vase", "vase-topk",
                                    "vase-noreserve", "vase-adversary", "random"))}


def main(argv=None):
    ap = Parser(description="Print the claims study's tables from its result files.")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--partial", action="store_true", help="also read the unfinished sweeps' progress files")
    args = ap.parse_args(argv)
    try:
        tables(args)
    except UsageError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # `| head` (quietly), or `> /dev/full` (one line)
        output_failed(e)


def tables(args):
    where = {}  # id(row) -> 'FILE row N', for the messages
    every = read_rows(args.files, where)
    if not any(r["task"] in (*NEEDS, "probe") for r in every):  # else no table at all, rc 0
        raise UsageError(f"{', '.join(args.files)} hold no accuracy, fidelity, perturbation or probe rows: "
                         f"{READ_FIX}")
    rows = rows_of(every, args.files, args.partial, where)
    full = next((r for r in rows if r["policy"] == "full"), None)
    if full is None and rows:
        raise UsageError("no full-cache accuracy row in these files: the table is paired against it; pass the file "
                         "that holds it")
    for lines in (fidelity(every), perturbation(every), heads(every)):
        if lines:
            print("\n".join(lines) + "\n")
    if not rows:
        return
    rows.sort(key=lambda r: (r["policy"] != "full", r["protect"] is False, ORDER.get(r["policy"], 99)))
    n = len(full["per_problem"])
    print("\n".join(table(rows, full)))
    print(f"\nn = {n} problems: no difference below {min_detectable(n):.2f} can reach p < 0.05.\n")
    print("\n".join(spread(rows)))
    print()
    print("\n".join(pairs(rows, "protected - not protected", lambda a, b: a["policy"] == b["policy"]
                          and a["protect"] is True and b["protect"] is False)))
    print()
    scorer = lambda r: r["policy"] in SCORERS or r["policy"].startswith("vase")
    print("\n".join(pairs(rows, "scorer - random, both protected", lambda a, b: scorer(a) and b["policy"] == "random"
                          and a["protect"] is True and b["protect"] is True)))
    print()
    vase_vs = lambda a, b: a["protect"] == b["protect"] and (
        (a["policy"] == "vase" and b["policy"].startswith("vase-")) or
        (a["policy"].startswith("vase") and b["policy"] == "snapkv"))
    print("\n".join(pairs(rows, "VASE - its variants and attention top-k", vase_vs)))


if __name__ == "__main__":
    main()
