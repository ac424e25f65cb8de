"""
What nanokv's per-head policies (adakv, criticalkv-ada) change against their reference code, measured on a real model
at the first eviction round, where both see the same cache (the references run once, at prefill):

    python tools/perhead_departures.py                       # SmolLM2-135M, the default answer, K = 128, 192, 256

- sinks: nanokv keeps the 4 first positions of an unprotected prompt; the references keep none. Jaccard of the kept
  positions per (layer, KV head), and how far the head budgets move, with and without them.
- the protected prompt (--protect-prompt): the same against the unprotected run.
- criticalkv-ada's window: kvpress pads the window to the top vote + 1 and keeps it only as far as the safeguard and
  stage 1 reach; nanokv always keeps the newest r. Counted with the tests' transcription of kvpress
  (test_all.ref_critical_ada) on the model's own keys, values, window queries and W_O: window slots kvpress drops,
  and the Jaccard of the rest.
- adakv's cap: from the second round a head holds only its own slots, and budgets.adakv caps b_h at them. Counted over
  a whole answer at K = 128 and 192: how many (layer, head, round) budgets the cap bound, and the slots it cost.
- adakv's vote: kvpress's SnapKV (avg-pool 5, the window of r queries; criticalkv-ada's too) against FFY0's released
  GQA settings (max-pool 7 over the newest 32 queries, mean over the group): Jaccard of the kept positions per
  (layer, KV head) and how many head budgets agree, first round.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import math  # noqa: E402
from dataclasses import replace  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import budgets  # noqa: E402
import generate as G  # noqa: E402
from cache import FREE  # noqa: E402
from cli import load  # noqa: E402
from kernels import dense, window_attn_mass  # noqa: E402
from policies import POLICIES  # noqa: E402
from policies_attention import adakv  # noqa: E402
from scoring import group_mean, newest_queries  # noqa: E402


def ffy0_vote(ctx, window=32, kernel=7):
    """FFY0/AdaKV's calcul_attn_sore with its released GQA settings (c*_w32_k7_maxpool, gqa_func mean): the newest 32
    queries' softmax over the keys each sees, mean over them, the candidates' columns max-pooled over 7, mean over the
    GQA group. [B, H_kv, S], the buffer at 0 (kept anyway)."""
    n = ctx.keys.shape[2] - ctx.buffer
    q, q_pos = newest_queries(ctx, window)
    a = window_attn_mass(q, ctx.keys, q_pos, ctx.pos, 1.0 / math.sqrt(ctx.keys.shape[-1]))[..., :n] / window
    a = F.max_pool1d(a, kernel_size=kernel, stride=1, padding=kernel // 2)
    return F.pad(group_mean(a, ctx.cfg.n_rep), (0, ctx.buffer))


def first_round(model, ids, name, K, r, protect, sinks=True):
    """Feed ids[:K + r] (the first round falls on the last token); returns (kept positions [L][H_kv] as sets,
    budgets [L, H_kv] with the buffer, the cache and ring state just before the round)."""
    run = G.make_run(name, K, r, protect, len(PROMPT))
    if not sinks:
        run.protect_below = [0]
    seen = {}

    def watch(cache, b, when, scores):
        if when == "before":  # the state both sides see: keys, values, the ring of window queries
            seen["state"] = [(cache.k[l, 0, :, : K + r].clone(), cache.v[l, 0, :, : K + r].clone(),
                              cache.q_ring[l, 0].clone(), cache.q_pos[0].clone()) for l in range(cache.k.shape[0])]
        if when == "after" and "kept" not in seen:
            pos = cache.head_pos(0)  # [L, H_kv, S]: each head's positions, whatever the layout
            seen["kept"] = [[set(p[p != FREE].tolist()) for p in layer] for layer in pos]
            seen["keep"] = (pos != FREE).sum(-1)

    run.watch = watch
    cache = G.make_cache(model, run, K + r)
    with torch.inference_mode():
        G.feed(model, cache, torch.tensor([ids[: K + r]]), run)
    return seen["kept"], seen["keep"], seen["state"]


def jaccard(a, b):
    return len(a & b) / len(a | b)


def mean_j(x, y):
    return sum(jaccard(a, b) for la, lb in zip(x, y) for a, b in zip(la, lb)) / sum(len(l) for l in x)


def main():
    global PROMPT
    import test_all  # the transcription of kvpress's CriticalAdaKVPress lives in the tests

    model, tok = load(None, "cpu", "float32")
    PROMPT = tok.encode(tok.chat([{"role": "user", "content": G.DEFAULT_PROMPT}]))
    with torch.inference_mode():
        (answer,), _, _ = G.generate(model, [PROMPT], G.make_run("full", None, 64, None, len(PROMPT)), 512)
    ids = PROMPT + answer
    r = 64
    print(f"SmolLM2-135M, default prompt ({len(PROMPT)} tokens) + its full-cache answer ({len(answer)} tokens), "
          f"r = {r}")
    print("| policy | K | Jaccard sinks vs none | mean abs budget shift | Jaccard protected vs sinks |")
    print("|---|---|---|---|---|")
    for name in ("adakv", "criticalkv-ada"):
        for K in (128, 192, 256):
            kept, keep, _ = first_round(model, ids, name, K, r, False)
            kept0, keep0, _ = first_round(model, ids, name, K, r, False, sinks=False)
            keptp, _, _ = first_round(model, ids, name, K, r, True)
            shift = (keep - keep0).abs().float().mean().item()
            print(f"| {name} | {K} | {mean_j(kept, kept0):.3f} | {shift:.2f} | {mean_j(kept, keptp):.3f} |")
    print("\ncriticalkv-ada without sinks against the transcription of kvpress, first round:")
    print("| K | int(0.2 K) | window slots kvpress drops (of L x H_kv x r) | Jaccard of the rest | budgets equal |")
    print("|---|---|---|---|---|")
    for K in (128, 192, 256, 384):
        kept, keep, state = first_round(model, ids, "criticalkv-ada", K, r, False, sinks=False)
        dropped = total = 0
        same = True
        j = []
        for l, (k, v, q, qp) in enumerate(state):
            q = q[:, qp.argsort()]  # the ring in position order: the transcription's window is the last r queries
            wo = dense(model.model.layers[l].self_attn.o_proj.weight).float()
            b, want = test_all.ref_critical_ada(k.float(), v.float(), q.float(), wo, r, K)
            same &= b == keep[l].tolist()
            window = set(range(K, K + r))
            for h, w in enumerate(want):
                dropped += len(window - w)
                total += r
                j.append(jaccard(kept[l][h] - window, w - window))
        print(f"| {K} | {int(0.2 * K)} | {dropped} of {total} | {sum(j) / len(j):.3f} | {same} |")
    print("\nadakv's vote, first round (sinks): kvpress's SnapKV (nanokv) against FFY0's max-pool 7 over 32 queries")
    print("| K | Jaccard of kept positions | head budgets equal |")
    print("|---|---|---|")
    POLICIES["adakv-ffy0"] = replace(POLICIES["adakv"], score=partial(adakv, vote=ffy0_vote))
    for K in (128, 192, 256):
        kept, keep, _ = first_round(model, ids, "adakv", K, r, False)
        kept_f, keep_f, _ = first_round(model, ids, "adakv-ffy0", K, r, False)
        print(f"| {K} | {mean_j(kept, kept_f):.3f} | {int((keep == keep_f).sum())} of {keep.numel()} |")
    print("\nadakv over the whole answer (default protection, r = 64): budgets the cap bound")
    count = {}
    blend = budgets.adakv

    def spy(s, n, alpha=budgets.SAFEGUARD):  # the blend before the cap, beside the capped budgets
        b, free = blend(s, n, alpha), (budgets.pooled_counts(s, n) * (1 - alpha) + int(alpha * n)).round().long()
        count["heads"] += b.numel()
        count["capped"] += int((b < free).sum())
        count["lost"] += int((free - b).sum())
        return b

    budgets.adakv = spy
    try:
        for K in (128, 192):
            count.update(heads=0, capped=0, lost=0)
            run = G.make_run("adakv", K, r, None, len(PROMPT))
            with torch.inference_mode():
                G.generate(model, [PROMPT], run, len(answer))
            print(f"K = {K}: {run.evictions} rounds, {count['heads']} (layer, head) budgets, {count['capped']} capped, "
                  f"{count['lost']} slots lost")
    finally:
        budgets.adakv = blend


if __name__ == "__main__":
    main()
