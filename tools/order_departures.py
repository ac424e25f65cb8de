"""
Two departures of the seeds' baselines that nothing in a kept set shows by itself, measured:

    python tools/order_departures.py            # random runs (seconds), then SmolLM2-135M's default answer (minutes)

- slot order (curdkv, lagkv): nanokv keeps a row's slots in position order; kvpress stores the kept slots in top-k
  order (best first), so from the second round on its 16-slot windows (curdkv) and 128-slot chunks (lagkv) group other
  tokens. On random keys and values, both arms fed the same tokens round after round: Jaccard of the kept positions per
  KV head, after the first round (where the arms are alike) and after the last.
- tie rules (curdkv, raas): over one whole answer with the rule, at every round, layer and KV head, the candidates that
  the rule keeps against those torch.topk keeps on the scores without it (curdkv's exact leverage, raas's raw
  timestamps), on the same cache; and how many cuts fall inside a block of equal raw scores.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import torch  # noqa: E402

import generate as G  # noqa: E402
from cli import load  # noqa: E402
from policies_values import curdkv, lagkv  # noqa: E402
from scoring import N_SINK, ScoreCtx  # noqa: E402


def ctx_of(keys, values, pos, K, r):
    """The ScoreCtx a slot scorer of keys and values needs, one row [1, H_kv, S(, D)]."""
    S = keys.shape[2]
    protected = (pos < N_SINK) | (torch.arange(S) >= S - r)
    return ScoreCtx(layer=0, keys=keys, values=values, pos=pos, protected=protected, queries=None, q_pos=None, wo=None,
                    side={}, all_kv=None, cfg=None, budget=K, buffer=r, generators=[], fresh=0)


def run_order(score, K, r, rounds, seed, kvpress_order, H=2, D=64):
    """Kept positions per head [H] after each round of a random run; slots in position order (nanokv) or in the
    order top-k returns them (kvpress: best first, the protected ones ranked first)."""
    g = torch.Generator().manual_seed(seed)
    n = K + r * (rounds + 1)
    k_all, v_all = torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g) * 2  # token t's k, v per head
    pos = torch.arange(K + r).repeat(H, 1)  # [H, S] the slots' positions
    seen = []
    for rd in range(rounds):
        at = pos[..., None].expand(-1, -1, D)
        keys, values = k_all.gather(1, at), v_all.gather(1, at)
        ctx = ctx_of(keys[None], values[None], pos[None], K, r)
        s = score(ctx)[0].expand(H, -1).masked_fill(ctx.protected[0], float("inf"))
        idx = s.topk(K, dim=-1).indices  # best first
        idx = idx if kvpress_order else idx.sort(-1).values
        pos = pos.gather(1, idx)
        seen.append([set(p.tolist()) for p in pos])
        nxt = K + r + rd * r
        pos = torch.cat([pos, torch.arange(nxt, nxt + r).repeat(H, 1)], 1)  # the next r tokens arrive
    return seen


def jaccard(a, b):
    return len(a & b) / len(a | b)


def order_table():
    print("slot order, random runs (2 KV heads, D = 64, 5 seeds, 8 rounds): Jaccard of the kept positions, "
          "nanokv's position order against kvpress's top-k order")
    print("| policy | K | r | round 1 | round 2 | round 8 (min-max over seeds) |")
    print("|---|---|---|---|---|---|")
    for name, score, K, r in (("curdkv", curdkv, 128, 32), ("curdkv", curdkv, 256, 64), ("lagkv", lagkv, 512, 64)):
        js = []
        for seed in range(5):
            a, b = run_order(score, K, r, 8, seed, False), run_order(score, K, r, 8, seed, True)
            js.append([sum(jaccard(x, y) for x, y in zip(ra, rb)) / len(ra) for ra, rb in zip(a, b)])
        mean = lambda i: sum(j[i] for j in js) / len(js)
        last = [j[-1] for j in js]
        print(f"| {name} | {K} | {r} | {mean(0):.3f} | {mean(1):.3f} | {mean(7):.3f} "
              f"({min(last):.3f}-{max(last):.3f}) |")


def ties_table(model, tok, K=128, r=64, n=512):
    """One answer per policy (with its rule); at every round the rule's kept candidates against topk's on the raw
    scores of the same cache."""
    prompt = tok.encode(tok.chat([{"role": "user", "content": G.DEFAULT_PROMPT}]))
    print(f"\ntie rules, SmolLM2-135M, default prompt, {n} new tokens, K = {K}, r = {r}: the rule's kept candidates "
          "against torch.topk's on the raw scores, every (round, layer, KV head)")
    print("| policy | cuts | cuts inside a block of equal raw scores | kept sets that differ | mean Jaccard |")
    print("|---|---|---|---|---|")
    for name in ("curdkv", "raas"):
        run = G.make_run(name, K, r, None, len(prompt))
        count = dict(cuts=0, tied=0, differ=0, j=0.0)

        def watch(cache, b, when, scores):
            if when != "scored":
                return
            S = cache.length[b]
            for l in range(cache.k.shape[0]):
                pos = cache.pos[l, b : b + 1, :, :S]
                ctx = ctx_of(cache.k[l, b : b + 1, :, :S], cache.v[l, b : b + 1, :, :S], pos, K, r)
                prot = ctx.protected | (pos < run.protect_below[b])
                raw = curdkv(ctx, bits=0) if name == "curdkv" else cache.side["raas"][l, b : b + 1, :, :S]
                for h in range(pos.shape[1]):
                    inf = float("inf")
                    x, rule = raw[0, h].masked_fill(prot[0, h], inf), scores[l][h].masked_fill(prot[0, h], inf)
                    a, c = set(x.topk(K).indices.tolist()), set(rule.topk(K).indices.tolist())
                    v = x.sort(descending=True).values
                    count["cuts"] += 1
                    count["tied"] += int(v[K - 1] == v[K])
                    count["differ"] += int(a != c)
                    count["j"] += jaccard(a, c)

        run.watch = watch
        with torch.inference_mode():
            G.generate(model, [prompt], run, n)
        c = count
        print(f"| {name} | {c['cuts']} | {c['tied']} | {c['differ']} | {c['j'] / max(c['cuts'], 1):.3f} |")


def main():
    torch.manual_seed(0)
    order_table()
    model, tok = load(None, "cpu", "float32")
    ties_table(model, tok)


if __name__ == "__main__":
    main()
