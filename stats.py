"""
Paired statistics and the Markdown tables eval.py prints (Random Attention's way: every configuration runs on the
same problems or traces, so any two rows compare item by item).

- accuracy: a paired bootstrap 95 % interval of the difference over problems, and McNemar's exact sign test on the
  problems where exactly one of the two is right; `min_detectable` says what n problems can show at all;
- fidelity: per-trace KL differences against a base policy, mean +- standard error.
Pure functions of result rows: plot.py draws the same intervals; `holm` corrects a study's set of comparisons
(tools/replication.py); `loss_ratio` compares two policies' losses against the full cache (tools/seeds.py).
"""

import functools
import json
import math

import torch


EXACT = 12  # up to this many items a bootstrap is enumerated exactly (every multiset of n draws: C(2n-1, n),
# 1,352,078 at n = 12); past it, `resamples` draws, whose Monte Carlo error `band` states
Z95 = 1.96


def same_length(*lists):
    """Paired lists must hold one value per item each: torch would broadcast a list of 1 against one of 12, and zip
    would cut the longer one, each giving a verdict on the wrong items. Callers check rows first (results.check_row,
    one_setting) and say which row; this is the last guard."""
    if len({len(x) for x in lists}) > 1:
        raise ValueError(f"paired lists of different lengths {[len(x) for x in lists]}: a pair holds the same items")


@functools.cache
def multisets(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every bootstrap resample of n items as counts, and its chance: C [M, n] (how often each item is drawn, each
    row summing to n) and p [M] = n! / (c_1! ... c_n!) / n^n, the multinomial chance of drawing those counts. e.g.
    n = 2: counts (2, 0), (1, 1), (0, 2) with chances 1/4, 1/2, 1/4. Built part by part: a row with `left` draws
    still to place gets one child per count 0 .. left for its next item."""
    rows, left = torch.zeros(1, 0, dtype=torch.int8), torch.tensor([n])
    for _ in range(n - 1):
        k = left + 1  # children per row
        parent = torch.repeat_interleave(torch.arange(len(left)), k)
        c = torch.arange(int(k.sum())) - torch.repeat_interleave(k.cumsum(0) - k, k)  # 0 .. left within each parent
        rows, left = torch.cat([rows[parent], c[:, None].to(torch.int8)], 1), left[parent] - c
    C = torch.cat([rows, left[:, None].to(torch.int8)], 1)  # [M, n]
    logp = math.lgamma(n + 1) - torch.lgamma(C.double() + 1).sum(1) - n * math.log(n)
    return C, logp.exp()


def resampled(x: torch.Tensor, resamples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The means of every bootstrap resample of x's items, x [n, k] (k values per item, resampled together): exactly
    (all multisets, with their chances p) up to EXACT items, else `resamples` random draws (p None: equal chances).
    Returns (means [M, k], p [M] or None)."""
    n = x.shape[0]
    if n <= EXACT:
        C, p = multisets(n)
        return C.double() @ x / n, p
    g = torch.Generator().manual_seed(seed)
    return x[torch.randint(n, (resamples, n), generator=g)].mean(1), None


def percentiles(v: torch.Tensor, p: torch.Tensor | None) -> tuple[tuple[float, float], tuple[tuple, tuple]]:
    """The 2.5 and 97.5 percentiles of resampled values v [M], and each one's Monte Carlo band: with chances p (exact),
    the inverse of the cumulative distribution and a band of zero width; with random draws (p None), torch.quantile's
    interpolated order statistic, and the order statistics within 1.96 binomial standard deviations of its rank, where
    the percentile of a rerun with another seed falls about 95 % of the time (distribution-free). nan values (0 / 0)
    are left out."""
    keep = ~v.isnan()
    v, p = v[keep], None if p is None else p[keep]
    order = v.argsort()
    v = v[order]
    bounds, bands = [], []
    for q in (0.025, 0.975):
        if p is not None:
            cdf = p[order].cumsum(0) / p.sum()
            at = min(int(torch.searchsorted(cdf, torch.tensor(q, dtype=cdf.dtype))), len(v) - 1)
            bounds.append(v[at].item())
            bands.append((v[at].item(), v[at].item()))
        else:
            M = len(v)
            rank, spread = q * (M - 1), Z95 * math.sqrt(M * q * (1 - q))
            bounds.append(torch.quantile(v, torch.tensor(q, dtype=v.dtype)).item())
            bands.append((v[max(0, math.floor(rank - spread))].item(), v[min(M - 1, math.ceil(rank + spread))].item()))
    return tuple(bounds), tuple(bands)


def bootstrap(a: list[float], b: list[float], resamples: int = 10_000, seed: int = 0
              ) -> tuple[float, float | None, float | None, tuple | None]:
    """bootstrap_diff, and the Monte Carlo band of each bound ((lo_min, lo_max), (hi_min, hi_max)), zero-wide where
    the interval is exact (n <= EXACT), None over one item: the tables call a bound within its band of a margin "on
    the margin" rather than give a verdict that another seed could flip."""
    same_length(a, b)
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)  # [n], e.g. in {-1, 0, 1}
    if len(d) < 2:
        return d.mean().item(), None, None, None
    (lo, hi), band = percentiles(*(lambda m, p: (m[:, 0], p))(*resampled(d[:, None], resamples, seed)))
    return d.mean().item(), lo, hi, band


def bootstrap_diff(a: list[float], b: list[float], resamples: int = 10_000, seed: int = 0
                   ) -> tuple[float, float | None, float | None]:
    """Mean of a minus mean of b over the same items, with its paired bootstrap 95 % interval: resample the items
    with replacement (an item keeps both of its values) and take the 2.5 and 97.5 percentiles. Items are problems
    (a, b: right or wrong, so the difference is one of accuracy) or traces (a, b: per-trace KL). Up to EXACT items
    every resample is enumerated with its chance (no seed moves the interval); past that, `resamples` draws. Of one
    item the interval is undefined (None, None): every resample is that item, so a zero-width interval would look
    certain."""
    return bootstrap(a, b, resamples, seed)[:3]


def spread_diff(a: list[list[bool]], b: list[list[bool]], resamples: int = 10_000, seed: int = 0
                ) -> tuple[float, float, float | None, float | None]:
    """Random Attention's bunching: the spread (best minus worst accuracy) across the policies of a, the same across
    those of b, and the paired bootstrap 95 % interval of spread(a) - spread(b) (None, None over one problem, as in
    bootstrap_diff). a and b hold one list of outcomes per policy, all over the same problems; a resample draws
    problems, each keeping every policy's outcome."""
    A = torch.tensor(a, dtype=torch.float64)  # [policies in a, n]
    B = torch.tensor(b, dtype=torch.float64)  # [policies in b, n]
    same_length(*a, *b)
    spread = lambda acc: (acc.max(-1).values - acc.min(-1).values)  # over policies
    if A.shape[1] < 2:
        return spread(A.mean(-1)).item(), spread(B.mean(-1)).item(), None, None
    means, p = resampled(torch.cat([A, B]).T, resamples, seed)  # [M, policies in a + b]: an item keeps every outcome
    d = spread(means[:, : len(A)]) - spread(means[:, len(A) :])  # [M]
    (lo, hi), _ = percentiles(d, p)
    return spread(A.mean(-1)).item(), spread(B.mean(-1)).item(), lo, hi


def loss_ratio(la: list[float], lb: list[float], resamples: int = 10_000, seed: int = 0
               ) -> tuple[float | None, float | None, float | None, float | None, float | None]:
    """CriticalKV's "halves the compression loss": the ratio mean(la) / mean(lb) of two policies' losses against the
    full cache over the same items, with its paired bootstrap 95 % interval (a resample draws items, each keeping
    both of its losses), and the interval of the denominator mean(lb) alone: (ratio, lo, hi, den_lo, den_hi).
    In accuracy a problem's loss is full - policy (1: only the full cache is right, -1: only the policy); in
    fidelity a trace's KL against the full cache. When the denominator's interval reaches 0 (b may lose nothing), or
    over one item, no ratio to it means anything: ratio, lo and hi are None. e.g. the full cache right on 10
    problems, b wrong on 4 of them, a on 2 of those 4: 0.2 / 0.4 = 0.5."""
    same_length(la, lb)
    if len(la) < 2:
        return None, None, None, None, None
    x = torch.tensor([la, lb], dtype=torch.float64).T  # [n, 2]: an item keeps both of its losses
    means, p = resampled(x, resamples, seed)  # [M, 2]
    num, den = means[:, 0], means[:, 1]
    (den_lo, den_hi), _ = percentiles(den, p)
    if den_lo <= 0 <= den_hi:
        return None, None, None, den_lo, den_hi
    # note: a denominator of 0 is left in at most 2.5 % of resamples: x / 0 is +-inf (kept, at the tail), 0 / 0 nan
    (lo, hi), _ = percentiles(num / den, p)
    return (x[:, 0].mean() / x[:, 1].mean()).item(), lo, hi, den_lo, den_hi


def interval(lo: float | None, hi: float | None, digits: int = 3) -> str:
    """A 95 % interval as the tables print it: '[-0.420, -0.220]', or 'undefined (n = 1)' where bootstrap_diff
    had a single item."""
    return "undefined (n = 1)" if lo is None else f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"


def mean_se(d: list[float], digits: int = 4) -> str:
    """Mean ± standard error: '+0.0061 ± 0.0020'; the standard error of one value is undefined, and the table says
    so, '+0.0061 ± undefined (n = 1)', rather than print nan."""
    t = torch.tensor(d, dtype=torch.float64)
    se = f"{t.std().item() / math.sqrt(len(t)):.{digits}f}" if len(t) > 1 else "undefined (n = 1)"
    return f"{t.mean().item():+.{digits}f} ± {se}"


def sign_test(a: list[bool], b: list[bool]) -> tuple[int, int, float]:
    """McNemar's exact test: on the problems where exactly one of a and b is right (n10 for a, n01 for b), is a
    50/50 split plausible? Two-sided p = 2 P[Binomial(n10 + n01, 1/2) <= min(n10, n01)], at most 1."""
    n10 = sum(x and not y for x, y in zip(a, b))
    n01 = sum(y and not x for x, y in zip(a, b))
    n = n10 + n01
    p = 2 * sum(math.comb(n, i) for i in range(min(n10, n01) + 1)) / 2**n
    return n10, n01, min(1.0, p)


def holm(ps: list[float], alpha: float = 0.05) -> list[bool]:
    """Which of m comparisons stay significant under Holm's step-down correction: sorted by p, the k-th smallest
    (k = 0, 1, ...) must be at most alpha / (m - k), and so must every smaller one. e.g. [0.01, 0.04, 0.03], alpha 0.05:
    0.01 < 0.05 / 3 holds, 0.03 > 0.05 / 2 fails, so only the first survives."""
    keep, order = [False] * len(ps), sorted(range(len(ps)), key=lambda i: ps[i])
    for k, i in enumerate(order):
        if ps[i] > alpha / (len(ps) - k):
            break
        keep[i] = True
    return keep


def min_detectable(n: int, alpha: float = 0.05) -> float:
    """The smallest accuracy difference n problems can show at all: k discordant problems, all one way, are
    significant from k = 6 on at alpha = 0.05 (p = 2 / 2^k), so no difference below k / n can be."""
    k = next(k for k in range(1, 64) if 2 / 2**k < alpha)
    return k / n if n else float("nan")


def outcomes(row: dict) -> dict[int, bool]:
    return {o["i"]: o["correct"] for o in row.get("per_problem", [])}


def paired_outcomes(r: dict, base: dict) -> tuple[float, float, float, int, int, float, int] | None:
    """r against base on the problems both hold: (r's accuracy, Δ, its bootstrap interval lo, hi, the discordant
    problems n10 (r right only), n01 (base right only), the sign test's p); None when they share no problem."""
    got, ref = outcomes(r), outcomes(base)
    common = sorted(set(got) & set(ref))
    if not common:
        return None
    a, b = [got[i] for i in common], [ref[i] for i in common]
    return sum(a) / len(a), *bootstrap_diff(a, b), *sign_test(a, b)


def paired_accuracy(rows: list[dict], base: dict) -> str:
    """Each accuracy row against `base` on the problems both answered: the difference, its paired bootstrap 95 %
    interval, the discordant problems (row right only / base right only) and the exact sign test's p. Markdown."""
    lines = ["| policy | K | protect | accuracy | Δ vs " + base["policy"] + " | 95 % interval | discordant | p |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        got = None if r is base else paired_outcomes(r, base)
        if got:
            acc, d, lo, hi, n10, n01, p = got
            lines.append(f"| {r['policy']} | {r['budget'] or '–'} | {r['protect']} | {acc:.3f} | {d:+.3f} | "
                         f"{interval(lo, hi)} | {n10} / {n01} | {p:.3g} |")
    n = len(outcomes(base))
    return "\n".join(lines + [f"n = {n} problems: no difference below {min_detectable(n):.3f} can reach p < 0.05"])


def paired(rows: list[dict], base: str = "snapkv") -> str:
    """Every policy's per-trace KL against `base`'s on the same traces: mean difference ± standard error and in how
    many traces the policy is lower. Markdown; empty when base is not among the rows."""
    ref = {r["budget"]: r["kl_by_trace"] for r in rows if r["policy"] == base and "kl_by_trace" in r}
    lines = []
    for r in rows:
        b = ref.get(r["budget"])
        if r["policy"] in ("full", base) or b is None or len(b) != len(r.get("kl_by_trace", [])):
            continue
        d = [x - y for x, y in zip(r["kl_by_trace"], b)]
        lines.append(f"| {r['policy']} | {r['budget']} | {mean_se(d)} | {sum(x < 0 for x in d)}/{len(d)} |")
    head = [f"KL difference against {base} per trace (mean ± standard error; lower in x/N traces):",
            "| policy | budget | Δ KL | lower |", "|---|---|---|---|"]
    return "\n".join(head + lines) if lines else ""


# -----------------------------------------------------------------------------


def markdown(rows: list[dict], keys=()) -> str:
    """A Markdown table; key columns that are the same in every row move to one caption line above it, lists
    stay in the JSON only."""
    cols = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], list) and k != "row_sha"))
    same = [c for c in cols if len(rows) > 1 and c in keys and c not in ("policy", "budget")
            and len({json.dumps(r.get(c)) for r in rows}) == 1]
    fmt = lambda v: "–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    cols = [c for c in cols if c not in same]
    lines = [" ".join(f"{c}={fmt(rows[0][c])}" for c in same)] if same else []
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])


# -----------------------------------------------------------------------------
# rank correlation (which sentences a policy keeps)


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0 .. n-1 of x, ties given their mean rank: [3., 1., 3., 2.] -> [2.5, 0., 2.5, 1.]."""
    r = torch.empty(len(x), dtype=torch.double)
    r[x.argsort()] = torch.arange(len(x), dtype=torch.double)
    uniq, inv = torch.unique(x, return_inverse=True)
    return torch.zeros(len(uniq), dtype=torch.double).index_add_(0, inv, r)[inv] / torch.bincount(inv)[inv]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of a and b (Pearson's on their tie-averaged ranks); NaN if either has no spread."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.square().sum() * rb.square().sum()).sqrt()
    return (ra * rb).sum().item() / den.item() if den > 0 else math.nan
