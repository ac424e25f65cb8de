"""
Scorers that read attention: which held keys the queries look at. SnapKV (https://arxiv.org/abs/2404.14469) asks the
recent window's queries; H2O (https://arxiv.org/abs/2306.14048), Scissorhands (https://arxiv.org/abs/2305.17118) and
RaaS (https://arxiv.org/abs/2502.11147) keep a per-slot tally of one q.K^T per decode step (summed, counted over a
threshold, timestamped) through observers; R-KV (https://arxiv.org/abs/2505.24133) subtracts key redundancy; AdaKV
(https://arxiv.org/abs/2407.11550) pools SnapKV's vote over a layer's heads to give each head its own budget.
Left out: anything that needs the n x n attention matrix.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

import budgets
from cache import FREE
from kernels import linear, window_attn_mass
from scoring import ScoreCtx, newest_queries, ranked, snapkv_attention


def snapkv(ctx: ScoreCtx) -> Tensor:
    """SnapKV (https://arxiv.org/abs/2404.14469): keys the recent window's queries attend to."""
    return snapkv_attention(ctx)


def h2o(ctx: ScoreCtx) -> Tensor:
    """H2O (https://arxiv.org/abs/2306.14048): heavy hitters, attention mass summed over every decode step."""
    return ctx.side["h2o"]


def step_attention(cache, out) -> Tensor:
    """The attention each held slot got in this forward, [L, B, H_kv, S]: summed over the chunk's queries and each GQA
    group (one q.K^T, never n x n). All layers and rows go through one batched call: free slots sit at position FREE,
    after every query, and a padding column's query is marked empty (-1), so neither gets or gives any attention."""
    L, B, H_kv = cache.k.shape[:3]
    S, chunk = max(cache.length), out.chunk
    q = torch.stack(out.queries).flatten(0, 1)  # [L * B, H_q, T, D]
    T, D = q.shape[-2:]
    real = torch.arange(T, device=q.device) < torch.tensor(chunk.n, device=q.device)[:, None]  # [B, T]
    q_pos = chunk.pos.masked_fill(~real, -1).repeat(L, 1)  # [L * B, T]
    keys, pos = cache.k[:, :, :, :S].flatten(0, 1), cache.pos[:, :, :, :S].flatten(0, 1)  # [L * B, H_kv, S(, D)]
    mass = window_attn_mass(q, keys, q_pos, pos, 1.0 / math.sqrt(D))  # [L * B, H_q, S]
    return mass.view(L, B, H_kv, -1, S).sum(3)


def h2o_observe(cache, out, run):
    """After each forward: add the new queries' attention to every held key."""
    mass = step_attention(cache, out)
    cache.side["h2o"][:, :, :, : mass.shape[-1]] += mass


def step_share(cache, out) -> tuple[Tensor, Tensor, Tensor]:
    """This forward's attention per slot as the mean one query of the GQA group paid it, [L, B, H_kv, S]; which slots
    the rows hold ([L, B, H_kv, S] bool, rows that took no token hold none); and each row's held count [B].
    note: a chunk of T > 1 tokens (a prefill, a teacher-forced block) is one observation: its queries' mean, each
    slot divided by the queries that see it (cold-compress's prefill rule); a decode step is exact."""
    mass = step_attention(cache, out)
    S, chunk, dev = mass.shape[-1], out.chunk, mass.device
    n = torch.tensor(chunk.n, device=dev)  # [B] real tokens per row
    pos = cache.pos[:, :, :, :S]
    last = chunk.pos.gather(1, chunk.last[:, None])[:, 0]  # [B] each row's newest position
    seen_by = (last[None, :, None, None] - pos + 1).clamp(min=1).minimum(n[None, :, None, None].clamp(min=1))
    held = (pos <= last[None, :, None, None]) & (n > 0)[None, :, None, None]
    n_rep = out.queries[0].shape[1] // mass.shape[2]
    return mass / (seen_by * n_rep), held, torch.tensor(cache.length, device=dev)


def scissorhands_observe(cache, out, run):
    """Scissorhands (https://arxiv.org/abs/2305.17118), as cold-compress's attn_thresholding: count, per slot, the steps
    in which its attention reached the uniform share 1 / (slots held), and the steps it was there for."""
    share, held, n_held = step_share(cache, out)
    S = share.shape[-1]
    cache.side["sh_hits"][..., :S] += (share >= 1.0 / n_held[None, :, None, None]) & held
    cache.side["sh_seen"][..., :S] += held


def scissorhands(ctx: ScoreCtx) -> Tensor:
    """Scissorhands: the share of the steps a slot was held in which it drew at least the uniform attention (the
    "persistence of importance"). note: over its whole stay, cold-compress's default (history_window_size=1), not the
    paper's last m = 400 steps, which needs a 400-deep history per slot."""
    return ctx.side["sh_hits"] / ctx.side["sh_seen"].clamp(min=1)


def raas_observe(cache, out, run):
    """RaaS (https://arxiv.org/abs/2502.11147): a slot's timestamp becomes now whenever it is in the top half (by count)
    of its row's held slots by this step's attention; a new slot starts at its own position."""
    share, held, n_held = step_share(cache, out)
    S = share.shape[-1]
    ts, pos = cache.side["raas"][..., :S], cache.pos[:, :, :, :S]
    rank = share.masked_fill(~held, -1.0).argsort(-1, descending=True).argsort(-1)  # 0 = most attended
    top = (rank < (n_held + 1)[None, :, None, None] // 2) & held
    now = out.chunk.pos.gather(1, out.chunk.last[:, None])[:, 0].float()[None, :, None, None]  # [1, B, 1, 1]
    ts.copy_(torch.where(top, now.expand_as(ts), torch.where(held, ts.maximum(pos.float()), ts)))


def raas(ctx: ScoreCtx) -> Tensor:
    """RaaS: the most recently useful slots win, the oldest timestamps go (least recently used); the prompt is kept.
    Equal timestamps (every slot of one step's top half shares it) go to the newer slot: without a rule most cuts fell
    inside such a block, and torch.topk's internal order chose."""
    return ranked(ctx.side["raas"], ctx.pos)


def rkv(ctx: ScoreCtx, lam: float = 0.1, threshold: float = 0.5, window: int = 8) -> Tensor:
    """R-KV (https://arxiv.org/abs/2505.24133): important and not redundant, lam * attention - (1 - lam) * redundancy,
    as R-KV's code computes them. attention: the last 8 queries' logits over the held keys but the window's own,
    the GQA group's logits combined by a max *before* the softmax, mean over the 8, max-pooled over 7 keys.
    redundancy: each key's mean cosine similarity to the others, softmax over keys. λ = 0.1 as in R-KV's README
    (their code defaults to 0.07). note: the similarity is S x S over the *cached* keys, bounded by K + r."""
    B, H_kv, S, D = ctx.keys.shape
    window = min(window, ctx.buffer)  # with a buffer under 8 the window's keys would include candidates
    n = S - window
    q, q_pos = newest_queries(ctx, window)  # [B, H_q, w, D], [B, w]
    # each KV head's group of queries as the rows of one matrix: [B, H_kv, rep * w, D] @ [B, H_kv, D, n]
    logits = (q.float().reshape(B, H_kv, -1, D) @ ctx.keys[:, :, :n].float().transpose(-1, -2) / math.sqrt(D))
    logits = logits.view(B, H_kv, -1, window, n)  # [B, H_kv, rep, w, n]
    future = ctx.pos[:, :, None, None, :n] > q_pos[:, None, None, :, None]  # causal by position
    attn = logits.masked_fill_(future, -math.inf).amax(2).softmax(-1).nan_to_num().mean(-2)  # [B, H_kv, n]
    attn = F.pad(F.max_pool1d(attn, kernel_size=7, stride=1, padding=3), (0, window))
    k = F.normalize(ctx.keys.float(), dim=-1)
    sim = linear(k, k)  # [B, H_kv, S, S] cosine similarity of every pair of cached keys, k @ k.T
    sim.diagonal(dim1=-2, dim2=-1).fill_(0.0)  # a key is not its own look-alike
    # subtle: in each key's row, the entry of its newest look-alike (similarity > threshold) is zeroed, so the
    # latest copy of a repeated passage is penalised least. As in R-KV's code, a key with no look-alike zeroes its
    # entry for key 0 instead. newest = 1 + index of that look-alike, 0 = none. The S x S passes are R-KV's whole
    # cost, so the similarity goes through OpenBLAS's threads (kernels.linear) and the search runs in place
    newest = sim.gt_(threshold).mul_(torch.arange(1, S + 1, device=sim.device, dtype=sim.dtype)).amax(-1)
    j = (newest.long() - 1).clamp(min=0)  # [B, H_kv, S]
    # spared = sim[i, j(i)], taken back out of column j(i) below; sim now holds 0/1 x index, so we recompute the
    # dot products k_i . k_j(i) (S x D work). Key 0 with no look-alike points at itself: its diagonal entry, 0
    k_j = k.view(-1, D).index_select(0, (j + torch.arange(B * H_kv, device=j.device).view(B, H_kv, 1) * S).view(-1))
    spared = (k * k_j.view(B, H_kv, S, D)).sum(-1).masked_fill(j == torch.arange(S, device=j.device), 0.0)
    # the column sums of sim are k_j . sum_i k_i minus its zeroed diagonal k_j . k_j: S x D work, not an S x S pass
    col_sums = (k @ k.sum(-2, keepdim=True).transpose(-1, -2))[..., 0] - k.square().sum(-1)  # [B, H_kv, S]
    redundancy = (col_sums.scatter_add(-1, j, -spared) / S).softmax(-1)  # mean over rows, [B, H_kv, S]
    return lam * attn - (1 - lam) * redundancy


# --- budgets that differ per head (budgets.py allocates, the scorer votes) -----------------------------------------


def adakv(ctx: ScoreCtx, alpha: float = budgets.SAFEGUARD, vote=snapkv_attention) -> Tensor:
    """AdaKV (https://arxiv.org/abs/2407.11550) on SnapKV, as FFY0/AdaKV's update_kv_gqa: the layer's K - r
    candidates per head become H_kv * (K - r) over the layer, shared by pooling the heads' votes (budgets.adakv);
    each head keeps its own top b_h, the recent buffer on top. Holes (slots a head no longer holds) never count.
    note: the vote is kvpress's SnapKV (avg-pool 5 over the window of r queries), the one criticalkv-ada reads, so the
    CriticalKV comparison's two arms differ only in CriticalKV's stages; FFY0's released GQA scripts vote with a
    max-pool of 7 over 32 queries (tools/perhead_departures.py measures that vote as `vote`)."""
    s = vote(ctx)  # [B, H_kv, S]
    n = ctx.keys.shape[2] - ctx.buffer  # candidates; the buffer is kept on top of every head's budget
    cand = s[..., :n].masked_fill(ctx.protected[..., :n], math.inf).masked_fill(ctx.pos[..., :n] == FREE, -math.inf)
    ctx.keep = budgets.adakv(cand, ctx.budget - ctx.buffer, alpha) + ctx.buffer
    return s
