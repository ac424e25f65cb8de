"""
Budgets that differ per head: policies score, budgets allocate. Every other policy gives each (layer, KV head) the
same K; AdaKV lets the KV heads of one layer share the layer's budget unevenly, by pooling their scores.

Two rules, each as its reference code computes it (DESIGN.md §6b):
- `adakv`: the authors' FFY0/AdaKV `AdaptiveSnapKVCluster.update_kv_gqa`: b_h = round(n_h (1 - α) + ⌊α n⌋),
  n_h the head's share of the layer's pooled top H_kv * n; a blend towards the uniform n.
- `safeguarded`: kvpress `CriticalAdaKVPress` (the CriticalKV authors' code): every head's top ⌊α n⌋ first, then
  b_h = the head's share of the pooled top H_kv * n; a floor, above which a head keeps what it wins.
A scorer that gives heads their own budgets sets ScoreCtx.keep (policies_attention.adakv,
policies_values.criticalkv_ada); cache.evict then keeps keep[b, h] slots in head h, and the cache is sized by
head_cap. AdaKV: https://arxiv.org/abs/2407.11550.
"""

import torch
from torch import Tensor

SAFEGUARD = 0.2  # α: the share of the uniform budget every head keeps whatever the pool says (both references')


def head_cap(n_kv_heads: int, n: int, alpha: float = SAFEGUARD) -> int:
    """The most one head may keep of a layer's n * H_kv slots under either rule: all of them but the other heads'
    floors ⌊α n⌋. e.g. 2 heads, n = 448: 896 - 89 = 807 (a uniform head keeps 448)."""
    return n_kv_heads * n - (n_kv_heads - 1) * int(alpha * n)


def row_span(n_kv_heads: int, K: int, r: int, alpha: float = SAFEGUARD) -> int:
    """The slots a row spans after a per-head round: the most one head may hold under either rule, FFY0's (n = K - r
    candidates per head, the buffer r on top) or kvpress's (n = K slots per head, the window inside). e.g. 2 heads,
    K = 192, r = 16: max(317 + 16, 384 - 38) = 346; K = 512, r = 64: max(807 + 64, 1024 - 102) = 922."""
    return max(head_cap(n_kv_heads, K - r, alpha) + r, head_cap(n_kv_heads, K, alpha))


def pooled_counts(s: Tensor, n: int) -> Tensor:
    """[B, H_kv, S] scores -> [B, H_kv]: how many of each head's slots are among the H_kv * n best of its row, the
    heads' scores pooled. e.g. s = [[[5, 1], [4, 3]]] (two heads of two slots), n = 1: the best two of {5, 1, 4, 3}
    are 5 (head 0) and 4 (head 1) -> [[1, 1]]; n = 2 takes all four -> [[2, 2]]."""
    B, H, S = s.shape
    head = s.reshape(B, H * S).topk(H * n, dim=-1).indices // S  # [B, H * n]: the head of each winner
    return torch.zeros(B, H, dtype=torch.long, device=s.device).scatter_add_(1, head, torch.ones_like(head))


def adakv(s: Tensor, n: int, alpha: float = SAFEGUARD) -> Tensor:
    """AdaKV's head budgets [B, H_kv] from candidate scores s [B, H_kv, S] (+inf where a slot must stay, -inf where
    a head holds nothing) for n candidates per head on average: b_h = round(n_h (1 - α) + ⌊α n⌋), as FFY0/AdaKV
    rounds it, so the heads' sum is H_kv * n within a slot or two. e.g. two heads, n = 10, n_h = (13, 7):
    (10.4 + 2, 5.6 + 2) -> (12, 8). A head never gets less than its +inf slots, nor more than it holds (possible
    from the second round on).
    subtle: the blend can fall short of what must stay. A head whose n candidates are all protected wins n_h = n of
    the pool, and round(0.8 n + ⌊0.2 n⌋) is n - 1 whenever 0.2 n has a fractional part of one half or more (n = 8:
    round(7.4) = 7). FFY0 never meets this (it protects nothing but the window, kept on top); we raise the budget to
    the protected count, which adds at most one slot to the head."""
    b = (pooled_counts(s, n) * (1 - alpha) + int(alpha * n)).round().long()
    b = torch.maximum(b, (s == torch.inf).sum(-1))  # a protected slot is never evicted, whatever the blend says
    return torch.minimum(b, (s > -torch.inf).sum(-1))


def top_per_head(x: Tensor, n: Tensor) -> Tensor:
    """Bool mask [B, H_kv, S] of the n[b, h] highest x in each head (n [B, H_kv]).
    e.g. x = [[[3, 1, 2], [0, 5, 4]]], n = [[2, 1]] -> [[[T, F, T], [F, T, F]]]."""
    idx = x.topk(int(n.max()), dim=-1).indices  # [B, H_kv, m], best first
    first = torch.arange(idx.shape[-1], device=x.device) < n[..., None]  # the head's own n of them
    return torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(-1, idx, first)


def safeguarded(s: Tensor, n: int, alpha: float = SAFEGUARD) -> tuple[Tensor, Tensor]:
    """kvpress's CriticalAdaKVPress budgets for scores s [B, H_kv, S] (every slot, the recent window at the top),
    n slots per head on average, window included: each head's top ⌊α n⌋ are safe, then b_h = how many of the head's
    slots are among the pooled top H_kv * n once the safe ones rank first. Returns (safe [B, H_kv, S] bool, b
    [B, H_kv]); b sums to H_kv * n exactly."""
    B, H, _ = s.shape
    safe = top_per_head(s, torch.full((B, H), int(alpha * n), device=s.device))
    return safe, pooled_counts(s.masked_fill(safe, torch.inf), n)
