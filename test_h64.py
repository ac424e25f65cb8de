"""Per-head budgets in one pool per (row, layer): the segments' bookkeeping, a head that wins almost every vote, rows
joining mid-round with refill, and the pool's masked attention against a dense reference."""

import dataclasses
import math

import pytest
import torch

import budgets
import generate as G
import model as M
import policies as P
from cache import FREE, KVCache
from test_all import PROMPTS, REFILL, REFILL_EOS, tiny, tiny_lab  # noqa: F401  (the fixtures)


def test_segments_hand_worked():
    """Two heads of five slots (keys = positions): head 0 keeps positions 0, 2, 4, head 1 keeps 1, 2; with r = 2 the
    segments start at 0 and 3 + 2 = 5, in position order, free slots FREE; one append lands behind each segment
    (slots 3 and 7); heads() lays the pool out as the scorers saw the padded rows: [0, 1, 2, 3] and [5, 6, -1, 7]."""
    c = KVCache(1, 1, 2, 1, 6)  # L = 1, B = 1, H_kv = 2, D = 1, cap = 6: a pool of 12
    c.pos[0, 0, :, :5] = torch.arange(5)
    c.k[0, 0, :, :5, 0] = torch.arange(5.0)
    c.v.copy_(c.k)
    c.length, c.next_pos = [5], [5]
    s = torch.tensor([[[5.0, 1, 4, 0, 3], [0, 9, 8, 1, 2]]])  # [1, H_kv, S]
    none = torch.zeros(1, 2, 5, dtype=torch.bool)
    c.evict(slice(0, 1), [s], [none], [torch.tensor([[3, 2]])], span=3, buffer=2)
    assert c.off.tolist() == [[[0, 5]]] and c.seg.tolist() == [[[3, 2]]] and c.length == [3]
    F_ = FREE
    assert c.pos[0, 0].flatten().tolist() == [0, 2, 4, F_, F_, 1, 2, F_, F_, F_, F_, F_]
    assert c.k[0, 0].flatten()[[0, 1, 2, 5, 6]].tolist() == [0, 2, 4, 1, 2]  # the keys moved with their slots
    assert c.head_pos(0).tolist() == [[[0, 2, 4], [1, 2, F_]]]
    ch = c.chunk(1)
    assert ch.at.tolist() == [[[3, 7]]]  # behind each segment
    k = torch.full((1, 2, 1, 1), 5.0)
    c.append(0, k, k, None, ch)
    c.advance(ch)
    assert c.seg.tolist() == [[[4, 3]]] and c.pos[0, 0].flatten()[[3, 7]].tolist() == [5, 5]
    assert c.heads(0, slice(0, 1), 3, 4).tolist() == [[[0, 1, 2, 3], [5, 6, -1, 7]]]
    assert c.owners(0).tolist() == [[[True] * 5 + [False] * 7, [False] * 5 + [True] * 7]]


class _Favoured:
    """adakv with head 0's votes lifted far above the others': it wins almost every slot of the pooled vote."""

    def __call__(self, ctx):
        s = P.POLICIES["snapkv"].score(ctx).clone()
        s[:, 0] += 10.0  # every candidate of head 0 outranks every other head's
        n = ctx.keys.shape[2] - ctx.buffer
        cand = s[..., :n].masked_fill(ctx.protected[..., :n], math.inf).masked_fill(ctx.pos[..., :n] == FREE, -math.inf)
        ctx.keep = budgets.adakv(cand, ctx.budget - ctx.buffer) + ctx.buffer
        return s


def test_a_head_winning_almost_every_vote_fits_the_pool(tiny, monkeypatch):
    """When head 0 wins nearly every vote (tiny model, K = 24, r = 8, 2 KV heads), it holds more than K + r slots
    after a round, the other head far fewer than K; the pool of 2 (K + r + 1) still holds both and their appends,
    segments never overlap, and every head keeps its sinks and newest r."""
    monkeypatch.setitem(P.POLICIES, "adakv", dataclasses.replace(P.POLICIES["adakv"], score=_Favoured()))
    seen = []

    def watch(cache, b, when, scores):
        if when == "after":
            off, seg = cache.off[:, b], cache.seg[:, b]  # [L, H_kv]
            assert (off[:, 1] >= off[:, 0] + seg[:, 0] + 8).all() and (off[:, 1] + seg[:, 1] + 8 <= 2 * 33).all()
            pos = cache.head_pos(b)
            for l in range(pos.shape[0]):
                for h in range(2):
                    p = pos[l, h][pos[l, h] != FREE].tolist()
                    assert p[:4] == [0, 1, 2, 3] and p[-8:] == list(range(cache.next_pos[b] - 8, cache.next_pos[b]))
            seen.append(seg.clone())

    run = G.make_run("adakv", 24, 8, False, 10, seed=3)
    run.watch = watch
    G.generate(tiny, [list(range(3, 13))], run, 80)
    seg = torch.stack(seen[1:])  # from the second round on a head can hold what it wins
    assert len(seen) >= 5 and seg[..., 0].min() > 24 + 8 and seg[..., 1].max() < 24 - 8  # far from K = 24 each
    assert (seg.sum(-1) <= 2 * 24 + 1).all()  # and the layer's heads keep 2 K between them (AdaKV's rounding: + 1)


def rounds_of(model, name, prompts, refill=0):
    """Every round's (row, next position, per-head positions [L][H_kv]) and the tokens of a greedy run."""
    rounds = []

    def watch(cache, b, when, scores):
        if when == "after":
            held = [[[p for p in h if p != FREE] for h in layer] for layer in cache.head_pos(b).tolist()]
            rounds.append((cache.rows[b], cache.next_pos[b], held))

    run = G.make_run(name, 24, 8, False, [len(p) for p in prompts], seed=3)
    run.watch = watch
    if refill:
        ids, _ = G.generate_refill(model, prompts, run, 40, refill, eos_ids=REFILL_EOS)
    else:
        ids, _, _ = G.generate(model, prompts, run, 40, eos_ids=REFILL_EOS)
    return ids, rounds


@pytest.mark.parametrize("name", ["adakv", "criticalkv-ada"])
def test_refill_rows_keep_what_they_keep_alone(tiny, name):
    """Refill at 2 live rows (tiny model, five prompts ending at different steps, so rows join the pool while the
    others are mid-round): every row's tokens and every round's per-head positions equal its run alone."""
    ids, rounds = rounds_of(tiny, name, REFILL, refill=2)
    for i, prompt in enumerate(REFILL):
        alone_ids, alone_rounds = rounds_of(tiny, name, [prompt])
        assert ids[i] == alone_ids[0]
        assert [r[1:] for r in rounds if r[0] == i] == [r[1:] for r in alone_rounds]
    assert len({len(x) for x in ids}) > 1 and len(rounds) > len(REFILL)


@pytest.mark.parametrize("window", [0, 20])
def test_pool_attention_equals_dense_reference(tiny, window):
    """On a pooled cache (adakv, three rows of different lengths after their rounds, two new tokens each), the pool's
    one masked SDPA, and its eager form, equal a dense float64 attention over each head's own held slots, causal by
    position (and on a sliding window of 20)."""
    run = G.make_run("adakv", 24, 8, False, [len(p) for p in PROMPTS], seed=3)
    cache = G.make_cache(tiny, run, 100)
    with torch.inference_mode():
        x = torch.tensor([p + [0] * (27 - len(p)) for p in PROMPTS])
        G.feed(tiny, cache, x, run, n=[len(p) for p in PROMPTS])
        for _ in range(30):
            G.feed(tiny, cache, torch.ones(3, 1, dtype=torch.long), run)
    assert cache.pooled and len(set(cache.seg[0, :, 0].tolist())) > 1
    B, H_q, H_kv, D, T = 3, 4, 2, 16, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H_q, T, D, generator=g)
    q_pos = torch.tensor(cache.next_pos)[:, None] + torch.arange(T)  # [B, T]
    ch = cache.chunk(T)
    kv = torch.randn(B, H_kv, T, D, generator=g)
    pk, pv = cache.append(1, kv, -kv, None, ch)  # layer 1's pool with the two new tokens, [B, 1, P, D]
    got = M.pool_attention(q, pk, pv, cache, 1, q_pos, window)
    eager = M.pool_attention(q, pk, pv, cache, 1, q_pos, window, eager=True)
    want = torch.zeros(B, H_q, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H_q):
            kh = h // (H_q // H_kv)
            o, n = int(cache.off[1, b, kh]), int(cache.seg[1, b, kh]) + T  # the segment and the chunk behind it
            k, v, p = pk[b, 0, o : o + n].double(), pv[b, 0, o : o + n].double(), cache.pos[1, b].flatten()[o : o + n]
            for t in range(T):
                ok = (p <= q_pos[b, t]) & ((p > q_pos[b, t] - window) if window else True)
                a = (q[b, h, t].double() @ k[ok].T / math.sqrt(D)).softmax(-1)
                want[b, h, t] = a @ v[ok]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager.double(), want, atol=1e-5, rtol=1e-5)


def test_summary_prints_the_allocation_per_layer(tiny_lab, capsys):
    """generate.py's summary gives every policy's allocation per row and layer, all KV heads together, beside the
    slots held: uniform's H_kv (K + r) = 64, a per-head policy's H_kv (K + r + 1) = 66 (its fullest head's
    row_span + r per head was 2 x 48 = 96)."""
    for name, want in (("snapkv", 64), ("adakv", 66)):
        G.main(["--model", tiny_lab.model, "--policy", name, "--budget", "24", "--buffer", "8", "--max-new-tokens",
                "60"])
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert "held" in line and f"{want} allocated per layer" in line
