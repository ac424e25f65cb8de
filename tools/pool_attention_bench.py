"""
How a pooled per-head layer (cache.py) may be read by one decode step's attention, timed on random tensors of a
model's attention shape, each way checked against the others: the pool's one SDPA with a segment mask (model.py's
choice, model.pool_attention's math), one SDPA per (row, KV head) on a narrowed view of its segment, a gather of each
head's segment into padded heads then one masked SDPA, and for scale a uniform cache (snapkv's K + r a head, no mask)
and the padded layout before the pool (every head row_span + r slots, masked). Timings mean something on an idle
machine only.

    python tools/pool_attention_bench.py                       # the 1.5B's shape: H_q 12, H_kv 2, D 128, K 512, r 64
    python tools/pool_attention_bench.py --batch 16 --threads 1
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import budgets  # noqa: E402


def layout(B, H_kv, K, r, g):
    """Random head lengths around K (a layer's heads keep H_kv K between them), each + r appended: offsets, lengths."""
    share = torch.rand(B, H_kv, generator=g) + 0.5
    keep = (share / share.sum(-1, keepdim=True) * H_kv * K).long().clamp(min=r)
    n = keep + r  # [B, H_kv] slots each head holds just before a round: the fullest point
    off = torch.cumsum(n, -1) - n
    return off, n


def ways(q, pk, pv, off, n, K, r, dtype):
    """The three readings of the pool and the two references, each a function of nothing -> [B, H_q, 1, D]."""
    B, H_q, _, D = q.shape
    H_kv, P = off.shape[1], pk.shape[2]
    rep = H_q // H_kv
    slot = torch.arange(P)
    own = (slot >= off[..., None]) & (slot < (off + n)[..., None])  # [B, H_kv, P]
    W = int(n.max())
    idx = (off[..., None] + torch.arange(W)).clamp(max=P - 1)  # [B, H_kv, W]
    valid = torch.arange(W) < n[..., None]

    def mask():  # the pool: every query head on one query axis, the pool read once
        m = own.repeat_interleave(rep, 1).view(B, 1, H_q, P)
        return F.scaled_dot_product_attention(q.reshape(B, 1, H_q, D), pk, pv, attn_mask=m).view(B, H_q, 1, D)

    def narrow():  # one SDPA per (row, KV head): no mask, no copy, B * H_kv calls
        out = torch.empty_like(q)
        for b in range(B):
            for h in range(H_kv):
                o, m = int(off[b, h]), int(n[b, h])
                k, v = pk[b : b + 1, :, o : o + m], pv[b : b + 1, :, o : o + m]
                qh = q[b : b + 1, h * rep : (h + 1) * rep].reshape(1, 1, rep, D)
                out[b, h * rep : (h + 1) * rep] = F.scaled_dot_product_attention(qh, k, v).view(rep, 1, D)
        return out

    def gather():  # each head's segment copied into padded heads [B, H_kv, W, D], then masked like the old layout
        flat = (idx + torch.arange(B)[:, None, None] * P).view(-1)
        k = pk.reshape(B * P, D).index_select(0, flat).view(B, H_kv, W, D)
        v = pv.reshape(B * P, D).index_select(0, flat).view(B, H_kv, W, D)
        m = valid[:, :, None].expand(B, H_kv, rep, W)
        return F.scaled_dot_product_attention(q.view(B, H_kv, rep, D), k, v, attn_mask=m).view(B, H_q, 1, D)

    uk, uv = torch.randn(B, H_kv, K + r, D, dtype=dtype), torch.randn(B, H_kv, K + r, D, dtype=dtype)

    def uniform():  # snapkv's cache: K + r a head, every slot read, no mask
        return F.scaled_dot_product_attention(q.view(B, H_kv, rep, D), uk, uv).view(B, H_q, 1, D)

    span = budgets.row_span(H_kv, K, r) + r
    ok = torch.randn(B, H_kv, span, D, dtype=dtype)
    om = (torch.arange(span) < span // 2)[None, None, None].expand(B, H_kv, rep, span)

    def padded():  # the layout before the pool: every head row_span + r slots, the free ones masked
        return F.scaled_dot_product_attention(q.view(B, H_kv, rep, D), ok, ok, attn_mask=om).view(B, H_q, 1, D)

    return {"pool, one masked SDPA": mask, "pool, SDPA per head (narrow)": narrow, "pool, gather to padded heads": gather,
            "uniform K + r (snapkv)": uniform, f"padded row_span + r = {span} (before)": padded}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, a.dtype)
    B, H_q, H_kv, D, K, r = a.batch, a.heads, a.kv_heads, a.head_dim, a.budget, a.buffer
    cap = K + r + 1
    off, n = layout(B, H_kv, K, r, g)
    q = torch.randn(B, H_q, 1, D, dtype=dtype)
    pk, pv = torch.randn(B, 1, H_kv * cap, D, dtype=dtype), torch.randn(B, 1, H_kv * cap, D, dtype=dtype)
    fns = ways(q, pk, pv, off, n, K, r, dtype)
    ref = fns["pool, one masked SDPA"]().float()
    for name in ("pool, SDPA per head (narrow)", "pool, gather to padded heads"):  # the same attention, three ways
        torch.testing.assert_close(fns[name]().float(), ref, atol=2e-2, rtol=2e-2)
    print(f"B {B}, H_q {H_q}, H_kv {H_kv}, D {D}, K {K}, r {r}, {a.dtype}, {torch.get_num_threads()} threads: "
          f"ms per layer call, median of {a.reps}")
    for name, fn in fns.items():
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        print(f"  {name:40s} {sorted(ts)[len(ts) // 2] * 1e3:8.3f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
