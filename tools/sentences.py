"""
Do policies keep the sentences that the reasoning depends on? One line per (policy, K, r, protect) from the fidelity
rows of `eval.py fidelity --traces` on traces with labelled sentences (Thought Anchors' counterfactual importance):

    python tools/sentences.py results/reasoning/fid_k512.json [more files] [--by-layer] [--long-min 6000]

Per trace, averaged over the eviction rounds and the layers (each layer a mean over its KV heads; traces.sentence_share):
the share of the top 10 % sentences' tokens held against the share of all trace tokens held, and Spearman's rho between
a sentence's |importance| and the share of it held; then the mean KL of the 32 predictions after a top sentence against
the others (from the first eviction on); and where the top sentences sit in their traces. Intervals: paired bootstrap
95 % over traces (stats.bootstrap_diff).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: replication.py

from cli import Parser, UsageError  # noqa: E402
from replication import TRACES, trace_lengths  # noqa: E402
from results import at_least, one_setting, pool_blocks, tool_rows  # noqa: E402
from stats import bootstrap_diff, interval  # noqa: E402
from traces import read_traces, top_sentences  # noqa: E402


def paired(rows_of: list[dict], a: str, b: str | None) -> tuple[float, float | None, float | None, int]:
    """Mean of a - b (b None: of a) over the traces where both are defined, with its interval, and their count."""
    pairs = [(s[a], 0.0 if b is None else s[b]) for s in rows_of if s[a] is not None and (b is None or s[b] is not None)]
    if not pairs:
        return float("nan"), None, None, 0
    return (*bootstrap_diff([x for x, _ in pairs], [y for _, y in pairs]), len(pairs))


def line(row: dict) -> str:
    s = [t for t in row["sentences_by_trace"] if t is not None and t["top"] is not None]
    mean = lambda k: sum(t[k] for t in s) / len(s)
    d, lo, hi, n = paired(s, "top", "all")
    rho, rlo, rhi, _ = paired(s, "rho", None)
    k, klo, khi, m = paired(s, "kl_after", "kl_else")
    after = [t["kl_after"] for t in s if t["kl_after"] is not None and t["kl_else"] is not None]
    other = [t["kl_else"] for t in s if t["kl_after"] is not None and t["kl_else"] is not None]
    kl = f"{sum(after) / m:.4f} / {sum(other) / m:.4f}" if m else "–"
    return (f"| {row['policy']} | {row['budget']} | {row['buffer']} | {row['protect']} | {n} | {mean('top'):.3f} | "
            f"{mean('all'):.3f} | {d:+.3f} {interval(lo, hi)} | {rho:+.3f} {interval(rlo, rhi)} | {kl} | "
            f"{k:+.4f} {interval(klo, khi, 4)} |")


def where_top(ids: list[str], path: str) -> str:
    """Where the top sentences sit in their traces: each sentence's middle character as a share of the trace's
    characters, the top 10 % by |importance| (traces.top_sentences) against all sentences, paired over
    the traces. Uniform eviction thins what came first, so a policy that does not read the content holds early
    sentences less."""
    traces = {r["id"]: r for r in read_traces(path)}
    top, every = [], []
    for t in (traces[i] for i in ids if i in traces and traces[i].get("chunks")):
        n, ch = len(t["trace"]), t["chunks"]
        mid = [(c["start"] + c["end"]) / 2 / n for c in ch]
        best = top_sentences([c["importance"] for c in ch])
        top.append(sum(mid[i] for i in best) / len(best))
        every.append(sum(mid) / len(mid))
    if not top:
        return "Where the top sentences sit: no trace of the rows holds labelled sentences in " + path
    d, lo, hi = bootstrap_diff(top, every)
    return (f"Where the top 10 % sentences sit (each sentence's middle, as a share of its trace's characters; "
            f"{len(top)} trace{'s' * (len(top) != 1)}): {sum(top) / len(top):.3f} against "
            f"{sum(every) / len(every):.3f} for all sentences, {d:+.3f} {interval(lo, hi)}, earlier on "
            f"{sum(a < b for a, b in zip(top, every))} of {len(top)}.")


def by_layer(row: dict) -> str:
    """top - all per layer, a mean over the traces: where in depth a policy keeps what matters."""
    s = [t for t in row["sentences_by_trace"] if t is not None and t["top"] is not None]
    L = len(s[0]["top_by_layer"])
    d = []
    for layer in range(L):
        v = [t["top_by_layer"][layer] - t["all_by_layer"][layer] for t in s
             if t["top_by_layer"][layer] is not None and t["all_by_layer"][layer] is not None]
        d.append(f"{sum(v) / len(v):+.3f}" if v else "–")
    return f"| {row['policy']} | {row['budget']} | " + " ".join(d) + " |"


def main(argv=None):
    ap = Parser(description="Which sentences each policy keeps, from eval.py fidelity --traces rows.")
    ap.add_argument("files", nargs="+", metavar="FILE", help="result files of eval.py fidelity --traces")
    ap.add_argument("--by-layer", action="store_true", help="also top - all per layer")
    ap.add_argument("--long-min", type=int, default=None, metavar="M", help="only the traces of M tokens or more")
    ap.add_argument("--traces", default=str(TRACES), metavar="FILE", help="the traces file whose n_tokens "
                    "--long-min reads (default data/reasoning_traces.jsonl)")
    args = ap.parse_args(argv)
    try:
        if args.long_min is not None and args.long_min < 1:
            raise UsageError(f"--long-min {args.long_min}: pass a positive number of tokens")
        rows = [r for r in tool_rows(args.files, {"fidelity": ("policy", "budget", "kl_by_trace")})
                if r["task"] == "fidelity" and r["policy"] != "full"]
        rows = pool_blocks(rows, note=lambda m: print(m, file=sys.stderr))  # a study's blocks of traces, as one
        if args.long_min:
            rows = at_least(rows, args.long_min, *trace_lengths(args.traces))
        rows = [r for r in rows if any(t and t["top"] is not None for t in r.get("sentences_by_trace") or [])]
        if not rows:
            raise UsageError("no row holds sentence measures: pass the --out of eval.py fidelity --traces on traces "
                             "with labelled sentences (data/reasoning_traces.jsonl's Thought Anchors traces)")
        one_setting(rows, "the sentence rows")
    except UsageError as e:
        sys.exit(f"error: {e}")
    rows.sort(key=lambda r: (r["budget"], r["buffer"], str(r["protect"]), r["policy"]))
    print("| policy | K | r | protect | traces | held, top 10 % | held, all | top − all | ρ(importance, held) | "
          "KL after top / elsewhere | after − elsewhere |\n|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(map(line, rows)))
    held = [i for i, t in zip(rows[0]["trace_ids"], rows[0]["sentences_by_trace"]) if t and t["top"] is not None]
    print("\n" + where_top(held, args.traces))  # the traces of the table
    if args.by_layer:
        print("\n| policy | K | top − all, layer 0 … L-1 |\n|---|---|---|")
        print("\n".join(map(by_layer, rows)))


if __name__ == "__main__":
    main()
