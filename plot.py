"""
Figures of eval.py's result files, for people who would rather look than read (`python eval.py plot FILE... --out DIR`).

- fidelity.png: KL(full || policy) against the budget K, one line per policy; accuracy.png likewise for accuracy.
  Error bars are the paired bootstrap 95 % interval against the full cache on the same items (stats.bootstrap_diff):
  over traces for KL (the full cache's KL is 0 on every trace), over problems for accuracy. Rows at a single budget
  (a claims sweep, or the one kept by --budgets K) draw a row per line instead, sorted, against a dashed full cache.
- bench.png: eviction cost (ms per round) and decode cost (ms per step) against the context, one line per policy.
- kept-POLICY-layerL.png: what one layer kept (`generate.py --kept-json`), KV heads x positions, shaded by the share
  of each column's positions still held, with the prompt, the trace and the recent buffer marked.
matplotlib is an extra requirement (requirements-plot.txt): only this file imports it, and only when it draws.
"""

import json
import math
import re
from collections import defaultdict
from pathlib import Path

from cli import UsageError
from results import PAIRED, check_row, differs, parse_json
from stats import bootstrap_diff, outcomes

MARKERS = "osD^v<>ph*"
NEEDS = {"fidelity": ("policy", "budget", "kl"), "accuracy": ("policy", "budget", "accuracy"),  # what the figures
         "bench": ("policy", "context", "batch", "ms_per_step")}  # read of a row, checked by results.check_row


def style(names: list[str], plt) -> dict[str, dict]:
    """A colour and marker per line, stable across the figures of one call: 'full' black, the others from a
    20-colour map, so that up to 20 policies stay apart."""
    colors = plt.get_cmap("tab20").colors
    others = sorted({n for n in names if not n.startswith("full")})
    out = {n: dict(color=colors[(2 * i) % 20 + (2 * i) // 20 % 2], marker=MARKERS[i % len(MARKERS)])
           for i, n in enumerate(others)}
    out |= {n: dict(color="black", marker="o" if n == "full" else "x") for n in names if n.startswith("full")}
    return out


def pyplot():
    """matplotlib's pyplot, drawing to files only (no display needed); one line if it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("eval.py plot needs matplotlib, which the core does not: pip install -r "
                         "requirements-plot.txt") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -----------------------------------------------------------------------------
# reading: result rows (a JSON list) or one kept map (a JSON object), each checked with a one-line error


def read(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """The rows and the kept maps in the files, in order."""
    rows, maps = [], []
    for p in map(Path, paths):
        if not p.is_file():
            raise UsageError(f"{p} is not a file: pass result files of eval.py (its --out) or of generate.py "
                             "--kept-json")
        obj = parse_json(p)  # None where it is not JSON
        if isinstance(obj, list):
            for i, row in enumerate(obj):
                check_row(row, f"{p} row {i + 1}", NEEDS)
            rows += [r for r in obj if r["task"] in NEEDS]  # what the figures draw; a probe row has no figure
        elif isinstance(obj, dict) and obj.get("kind") == "kept":
            maps.append(check_map(obj, p))
        else:
            raise UsageError(f"{p} is neither a result file of eval.py (a JSON list of rows) nor a map of "
                             "generate.py --kept-json: pass one of those")
    return rows, maps


def check_map(m: dict, where: Path) -> dict:
    integer = lambda v: isinstance(v, int) and not isinstance(v, bool)
    ok = (all(integer(m.get(k)) for k in ("positions", "prompt_len", "buffer", "layer"))
          # the policy names the PNG (kept-POLICY-layerL.png): a name, never a path; the budget titles it
          and isinstance(m.get("policy"), str) and re.fullmatch(r"[\w.+-]+", m["policy"]) is not None
          and "budget" in m and (m["budget"] is None or integer(m["budget"]) and m["budget"] >= 1)
          and isinstance(m.get("heads"), list) and m["heads"]
          and all(isinstance(h, list) and all(integer(x) and 0 <= x < m["positions"] for x in h) for h in m["heads"]))
    if not ok:
        raise UsageError(f"{where}: a kept map needs policy (a name), budget (K, or null for the full cache), "
                         "positions, prompt_len, buffer, layer and heads (per KV head the positions it holds): write "
                         "it again with generate.py --kept-json")
    n, P, r = m["positions"], m["prompt_len"], m["buffer"]
    twice = [h for h, held in enumerate(m["heads"]) if len(set(held)) < len(held)]
    bad = ("it holds no positions" if n < 1 else f"its prompt ({P} tokens) is not within its {n} positions"
           if not 0 <= P <= n else f"its buffer {r} is not within its {n} positions" if not 0 <= r <= n
           else f"its layer is {m['layer']}" if m["layer"] < 0 else f"KV head {twice[0]} holds a position twice"
           if twice else None)
    if bad:
        raise UsageError(f"{where}: not a map generate.py --kept-json writes ({bad}): write it again with "
                         "generate.py --kept-json")
    return m


# -----------------------------------------------------------------------------
# the series: what each figure draws, as data (the tests read them)


def labels(rows: list[dict], fields=("model", "data", "n", "max_new_tokens", "buffer", "protect")) -> list[str]:
    """A line's name: the policy, plus any setting in which that policy's rows differ, e.g. 'random protect=True'
    beside 'random protect=False'; protect is named on every line once any two rows differ in it."""
    differ = lambda rs, k: len({json.dumps(r.get(k)) for r in rs}) > 1
    every = differ([r for r in rows if r["policy"] != "full"], "protect")
    vary = {p: [k for k in fields if differ([r for r in rows if r["policy"] == p], k)
                or k == "protect" and every and p != "full"] for p in {r["policy"] for r in rows}}
    return [" ".join([r["policy"]] + [f"{k}={r.get(k)}" for k in vary[r["policy"]]]) for r in rows]


def budget_series(rows: list[dict], task: str) -> dict[str, list[tuple]]:
    """label -> [(K, value, lo, hi)] by K, for fidelity (value: KL, the mean over traces) or accuracy rows. lo and
    hi bound the paired 95 % interval against the full cache; None where no full-cache row holds the same items."""
    rows = [r for r in rows if r.get("task") == task]
    full = [r for r in rows if r["policy"] == "full"]
    series = defaultdict(dict)
    for r, name in zip(rows, labels(rows)):
        if r["policy"] == "full":
            continue
        if task == "fidelity":  # the full cache's KL is 0 on every trace
            kl = r.get("kl_by_trace") or [r["kl"]]
            value, lo, hi = bootstrap_diff(kl, [0.0] * len(kl))  # no interval (None) of one trace
        else:
            value, lo, hi = r["accuracy"], None, None
            base = next((f for f in full if same_problems(f, r)), None)
            mine, ref = outcomes(r), outcomes(base) if base else {}
            common = sorted(set(mine) & set(ref))
            if common:  # the policy's accuracy on the common problems = the base's + the paired difference
                a, b = [mine[i] for i in common], [ref[i] for i in common]
                shift = lambda x: None if x is None else sum(b) / len(b) + x  # None: one problem, no interval
                value, lo, hi = map(shift, bootstrap_diff(a, b))
        series[name][r["budget"]] = (r["budget"], value, lo, hi)  # a later row of the same line and K wins
    return {name: [pts[k] for k in sorted(pts)] for name, pts in series.items()}


def same_problems(full: dict, row: dict) -> bool:
    """Whether row pairs with this full-cache row: one model, mode, data file and n (results.PAIRED), one cap."""
    return not differs(full, row, PAIRED + ("max_new_tokens",))


def bench_series(rows: list[dict]) -> dict[str, list[tuple]]:
    """label -> [(context, evict ms per round or None, ms per step)] by context, from bench rows that ran."""
    rows = [r for r in rows if r.get("task") == "bench" and "error" not in r]
    batches = {r["batch"] for r in rows}
    series = defaultdict(dict)
    for r in rows:
        name = r["policy"] + (", eager" if r.get("eager") else "") + (f", batch {r['batch']}" if len(batches) > 1
                                                                        else "")
        series[name][r["context"]] = (r["context"], r.get("evict_ms"), r["ms_per_step"])
    return {name: [pts[k] for k in sorted(pts)] for name, pts in series.items()}


def kept_image(m: dict, columns: int = 160) -> tuple[list[list[float]], int]:
    """Per KV head, the share of each column's positions still held: [H_kv][cols], and positions per column."""
    n = m["positions"]
    per = max(1, math.ceil(n / columns))
    cols = math.ceil(n / per)
    image = []
    for held in m["heads"]:
        count = [0] * cols
        for p in held:
            count[p // per] += 1
        image.append([c / min(per, n - i * per) for i, c in enumerate(count)])  # the last column may be shorter
    return image, per


# -----------------------------------------------------------------------------
# drawing


def draw(paths: list[str], out: str, budgets: list[int] | None = None) -> list[Path]:
    """Every figure the files hold, written into out as PNGs; returns their paths. budgets: draw only the rows at
    these K (the full cache's too, which has none), e.g. one budget of a sweep, as a row per line."""
    rows, maps = read(paths)
    if budgets:
        rows = [r for r in rows if r.get("budget") is None or r["budget"] in budgets]
    lines = {task: budget_series(rows, task) for task in ("fidelity", "accuracy")}
    bench = bench_series(rows)
    if not any(lines.values()) and not bench and not maps:
        at = f" at --budgets {','.join(map(str, budgets))}" if budgets else ""
        raise UsageError(f"nothing to draw in {', '.join(paths)}{at}: plot draws fidelity, accuracy and bench rows "
                         "of eval.py (beyond the full cache's), and maps of generate.py --kept-json")
    plt = pyplot()
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --out {out}: {e.strerror}") from None
    written = []

    def save(fig, name: str):
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    names = [n for series in [*lines.values(), bench] for n in series]
    looks = style(names, plt)
    for task, ylabel in (("fidelity", "KL(full ‖ policy) per token"), ("accuracy", "accuracy")):
        series = lines[task]
        if not series:
            continue
        full = [r for r in rows if r.get("task") == task and r["policy"] == "full"]
        budgets = sorted({p[0] for pts in series.values() for p in pts})
        if len(budgets) == 1:  # one budget: a row per line, sorted by value, rather than points stacked on one K
            ref = 0.0 if task == "fidelity" else full[-1]["accuracy"] if full else None
            save(forest(plt, task, series, looks, ylabel, budgets[0], ref), f"{task}.png")
            continue
        fig, ax = plt.subplots(figsize=(8.5, 4.2))
        bars = False
        for name, pts in series.items():
            k, v, lo, hi = zip(*pts)
            err = None if None in lo else [[a - b for a, b in zip(v, lo)], [b - a for a, b in zip(v, hi)]]
            bars |= err is not None
            ax.errorbar(k, v, yerr=err, ms=4, capsize=3, label=name, **looks[name])
        if task == "accuracy" and full:
            ax.axhline(full[-1]["accuracy"], color="black", ls="--", lw=1, label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget K (cache slots right after an eviction)")
        ax.set_ylabel(ylabel)
        items = "traces (points: their mean)" if task == "fidelity" else "problems"
        ax.set_title(f"{task} against the full cache: " + (f"bars = paired bootstrap 95 % interval over {items}"
                     if bars else "no per-item results in these rows, so no intervals"), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        save(fig, f"{task}.png")

    if bench:
        fig, (ev, st) = plt.subplots(1, 2, figsize=(10, 3.8))
        for name, pts in bench.items():
            c, e, ms = zip(*pts)
            if None not in e:
                ev.plot(c, e, ms=4, label=name, **looks[name])
            st.plot(c, ms, ms=4, label=name, **looks[name])
        contexts = sorted({p[0] for pts in bench.values() for p in pts})
        for ax, title in ((ev, "eviction: ms per round"), (st, "decode: ms per step, evictions included")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.set_xlabel("context (position of the decoded token)")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        ev.set_ylim(bottom=0)
        st.set_yscale("log")  # the eager reference grows past every other line
        st.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        save(fig, "bench.png")

    for m in maps:
        image, per = kept_image(m)
        n, P, r = m["positions"], m["prompt_len"], m["buffer"]
        fig, (band, ax) = plt.subplots(2, 1, figsize=(8, 1.2 + 0.35 * len(image)), sharex=True,
                                       gridspec_kw={"height_ratios": [1, max(2, len(image))]})
        for a, b, what, color in ((0, P, "prompt", "tab:blue"), (P, n - r, "trace", "tab:gray"),
                                  (n - r, n, "recent buffer", "tab:orange")):
            if b > a:
                band.axvspan(a, b, color=color, alpha=0.5)
                band.text((a + b) / 2, 0.5, what, ha="center", va="center", fontsize=8)
        band.set_yticks([])
        ax.imshow(image, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest",
                  extent=(0, len(image[0]) * per, len(image) - 0.5, -0.5))
        ax.set_yticks(range(len(image)), [f"head {h}" for h in range(len(image))])
        ax.set_xlim(0, n)
        ax.set_xlabel(f"position (1 column = {per} positions; black = all kept, white = all evicted)")
        K = "full cache" if m["budget"] is None else f"K = {m['budget']}, r = {r}"
        band.set_title(f"{m['policy']} ({K}): what layer {m['layer']} holds after {n} tokens", fontsize=9)
        save(fig, f"kept-{m['policy']}-layer{m['layer']}.png")
    return written


def forest(plt, task: str, series: dict[str, list[tuple]], looks: dict, xlabel: str, K: int, full: float | None):
    """One budget's lines as rows, best at the top, each point with its paired 95 % interval (when the rows hold
    per-item results) and a dashed line at the full cache (its accuracy, or KL 0; none without a full-cache row)."""
    pts = sorted(((name, *p[0][1:]) for name, p in series.items()), key=lambda t: t[1], reverse=task == "accuracy")
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.32 * len(pts)))
    for y, (name, v, lo, hi) in enumerate(pts):
        err = None if lo is None else [[v - lo], [hi - v]]
        ax.errorbar([v], [y], xerr=err, capsize=3, ms=5, ls="none", **looks[name])
    if full is not None:
        ax.axvline(full, color="black", ls="--", lw=1)
    ax.set_yticks(range(len(pts)), [p[0] for p in pts], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel + ("  (dashed: the full cache)" if task == "accuracy" and full is not None else ""))
    bars = "bars = paired bootstrap 95 % interval" if any(p[2] is not None for p in pts) else "no per-item results"
    ax.set_title(f"{task} against the full cache at K = {K}: {bars}", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    return fig
