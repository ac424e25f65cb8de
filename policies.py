"""
The eviction scorers. Each maps a ScoreCtx (one layer's cached keys/values, positions, the last w queries,
side state) to scores [B, H_kv or 1, S], higher = keep; cache.evict does the selection, never a scorer.

Left out: prefill-only methods, quantisation, anything that needs an n x n attention matrix (attention comes
from the last w queries, w x S, or from one extra q.K^T per decode step for H2O).
Papers: EPIKV (https://arxiv.org/abs/2606.26472), VASE (https://arxiv.org/abs/2606.03928), CriticalKV
(https://arxiv.org/abs/2502.03805), Random Attention (prompt protection + per-head random keep), and the
baselines SnapKV (https://arxiv.org/abs/2404.14469), H2O (https://arxiv.org/abs/2306.14048), StreamingLLM
(https://arxiv.org/abs/2309.17453), R-KV (https://arxiv.org/abs/2505.24133), AdaKV (https://arxiv.org/abs/2407.11550),
and the seeds' own baselines CurDKV (https://arxiv.org/abs/2509.15038), LagKV (https://arxiv.org/abs/2504.04704),
Scissorhands (https://arxiv.org/abs/2305.17118), RaaS (https://arxiv.org/abs/2502.11147); TriAttention, which reads
RoPE's frequencies, has a file of its own (triattention.py).

Laid out top to bottom: ScoreCtx; shared helpers; the scorers that read attention (streaming's positions aside:
snapkv, h2o and the per-step observers Scissorhands and RaaS share, rkv, random); values (vase, the CurDKV leverage,
criticalkv; adakv and criticalkv-ada, whose heads get their own budgets from budgets.py); the residual stream and K/V
spread (epikv, epikv-lag, lagkv); the registry.
"""

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import budgets
from cache import FREE
from kernels import dense, linear, window_attn_mass
from triattention import prepare as triattention_stats
from triattention import triattention

BIG = 1e30  # "always keep among the candidates", below cache.evict's +inf for protected slots
N_SINK = 4  # StreamingLLM's attention sinks, kept when the prompt is not protected (generate.make_run)


@dataclass
class ScoreCtx:
    """What a scorer sees of one layer of the B batch rows it scores together (rows due in the same step). Each row
    must score as it would alone: per-row draws (see draw), no op that mixes rows."""

    layer: int
    keys: Tensor  # [B, H_kv, S, D] post-RoPE; S = K + r (a per-head policy past its first round: span + r)
    values: Tensor  # [B, H_kv, S, D]
    pos: Tensor  # [B, H_kv, S] original token position of each slot
    protected: Tensor  # [B, H_kv, S] bool: slots cache.evict will keep whatever we say (prompt/sinks, recent)
    queries: Tensor  # [B, H_q, w, D] the ring of the last w post-RoPE queries
    q_pos: Tensor  # [B, w] their positions, -1 = empty
    wo: object  # [hidden, H_q * D] this layer's o_proj weight, of any kind (kernels.dense)
    side: dict  # per-slot side state, name -> [B, H_kv, S]
    all_kv: tuple  # (k, v) of every layer, [L, B, H_kv, S, D]; for scorers that pool over layers
    cfg: object  # ModelConfig
    budget: int  # K: slots held right after an eviction, recent buffer included
    buffer: int  # r: the newest slots, never evicted; the candidates are the other S - r
    generators: list  # one torch.Generator per row, seeded by (seed, row, layer, eviction round)
    fresh: int  # slots [fresh, S) arrived since the last eviction (their side state is still unset), every row
    memo: dict = field(default_factory=dict)  # shared by the layers of one eviction round
    keep: Tensor | None = None  # set by a scorer that gives heads their own budgets: [B, H_kv] slots each keeps, buffer
    # included (budgets.py); None = every head keeps K
    stats: object = None  # what Policy.prepare made of the model, once a request (TriAttention's query statistics)


# -----------------------------------------------------------------------------
# shared helpers (one place for each idea)


def newest_queries(ctx: ScoreCtx, w: int) -> tuple[Tensor, Tensor]:
    """The w newest queries of the ring [B, H_q, w, D] and their positions [B, w]."""
    q, q_pos = ctx.queries, ctx.q_pos
    if w >= q_pos.shape[1]:
        return q, q_pos
    newest = q_pos.topk(w, dim=-1).indices  # [B, w]: the ring is unordered, position % w
    return q.gather(2, newest[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3])), q_pos.gather(1, newest)


def window_attention(ctx: ScoreCtx, n_keys: int | None = None) -> Tensor:
    """Mean softmax attention that each of the first n_keys held keys (default all) gets from the ring's queries,
    each query normalised over those keys it may see (causal by position). Returns [B, H_q, n_keys]."""
    q, q_pos = ctx.queries, ctx.q_pos
    keys, pos = ctx.keys[:, :, :n_keys], ctx.pos[:, :, :n_keys]
    mass = window_attn_mass(q, keys, q_pos, pos, 1.0 / math.sqrt(keys.shape[-1]))
    return mass / (q_pos >= 0).sum(-1).clamp(min=1)[:, None, None]


def group_mean(x: Tensor, n_rep: int) -> Tensor:
    """[B, H_q, S] -> [B, H_kv, S]: average the query heads that share a KV head (GQA)."""
    B, H_q, S = x.shape
    return x.view(B, H_q // n_rep, n_rep, S).mean(2)


def snapkv_attention(ctx: ScoreCtx, buffer_in_softmax: bool = True) -> Tensor:
    """SnapKV's vote [B, H_kv, S]: the window's attention (the window is the recent buffer), its own columns
    dropped, then avg-pooled over 5 neighbouring candidates, zero-padded at the edge (count_include_pad, as in
    SnapKV's and kvpress's code), mean over the GQA group. Each query's softmax runs over every held key, or, with
    buffer_in_softmax=False, over the candidates only (VASE's weights). The buffer scores 0: it is kept anyway."""
    n = ctx.keys.shape[2] - ctx.buffer  # candidates
    a = window_attention(ctx, None if buffer_in_softmax else n)[..., :n]
    a = F.avg_pool1d(a, kernel_size=5, stride=1, padding=2)
    return F.pad(group_mean(a, ctx.cfg.n_rep), (0, ctx.buffer))


def top_candidates(x: Tensor, protected: Tensor, n: int | list[int]) -> Tensor:
    """Bool mask [B, H_kv, S] of the n highest x among unprotected slots; n an int, or a list of one count per row."""
    if not isinstance(n, int):  # row by row: topk breaks ties differently for another k, so a row takes its own
        return torch.cat([top_candidates(x[b : b + 1], protected[b : b + 1], k) for b, k in enumerate(n)])
    x = x.masked_fill(protected, -math.inf)
    n = max(0, min(n, x.shape[-1]))
    return torch.zeros_like(protected).scatter_(-1, x.topk(n, dim=-1).indices, True) & ~protected


def draw(ctx: ScoreCtx, fn: Callable, *shape: int) -> Tensor:
    """[B, *shape] random numbers from fn (torch.rand or torch.randn), row b from its own generator: a row's draws
    are the same whether it is scored alone or beside others."""
    return torch.stack([fn(*shape, generator=g, device=ctx.keys.device) for g in ctx.generators])


def gumbel_log_weights(weights: Tensor, ctx: ScoreCtx) -> Tensor:
    """Sampling without replacement with probability proportional to weights, as a score:
    top-k of log(w) + Gumbel noise draws k items exactly as successive weighted draws would."""
    u = draw(ctx, torch.rand, *weights.shape[1:]).clamp_(1e-20, 1.0)
    return weights.clamp(min=1e-20).log() - (-u.log()).log()


# -----------------------------------------------------------------------------
# scorers


def streaming(ctx: ScoreCtx) -> Tensor:
    """StreamingLLM (https://arxiv.org/abs/2309.17453): the newest tokens win; the sinks come from protection."""
    return ctx.pos.float()


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
    """RaaS: the most recently useful slots win, the oldest timestamps go (least recently used); the prompt is kept."""
    return ctx.side["raas"]


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


def random_(ctx: ScoreCtx) -> Tensor:
    """Random Attention: protect the prompt, then keep uniformly random tokens, independently per KV head."""
    return draw(ctx, torch.rand, *ctx.pos.shape[1:])


def candidate_attention(ctx: ScoreCtx) -> Tensor:
    """VASE's sampling weights: SnapKV's vote with each query normalised over the candidates only."""
    return snapkv_attention(ctx, buffer_in_softmax=False)


def vase(ctx: ScoreCtx, sample: bool = True, reserve: int = 1, weights=candidate_attention) -> Tensor:
    """VASE-AttnV (https://arxiv.org/abs/2606.03928): reserve the N_v = K/4 slots whose values have the widest range
    max(v) - min(v), the 4 sinks counted inside the reserve (the authors give them an infinite range); fill
    the rest by drawing without replacement, probability proportional to the window's attention normalised over the
    candidates only (temperature 1). The ablations are this function with one knob turned: sample=False fills by
    top-k (vase-topk), reserve=0 has no reserve (vase-noreserve), reserve=-1 with SnapKV's vote evicts the
    widest-range values first (vase-adversary)."""
    n = ctx.keys.shape[2] - ctx.buffer
    s = weights(ctx)  # [B, H_kv, S]
    s = gumbel_log_weights(s, ctx) if sample else s
    if not reserve:
        return s
    v = ctx.values.float()
    # one N_v per row. The authors count the 4 sinks inside the reserve; a protected prompt (Random Attention's
    # setting, not VASE's) is kept by protection, so only N_SINK of its tokens count: counting all of them would
    # empty the reserve whenever the prompt is longer than K/4. A reserve to keep is at most the slots left
    kept = ctx.protected[:, 0, :n].sum(-1).tolist()  # prompt or sinks, per row
    n_v = [ctx.budget // 4 - min(p, N_SINK) for p in kept]
    n_v = [min(x, ctx.budget - ctx.buffer - p) for x, p in zip(n_v, kept)] if reserve > 0 else n_v
    widest = top_candidates(v.amax(-1) - v.amin(-1), ctx.protected, n_v)
    return s.masked_fill(widest, BIG * reserve)


def cur_leverage(x: Tensor, G: Tensor | None = None, window: int = 0) -> Tensor:
    """CurDKV's approximate leverage of each slot, x [B, H_kv, S, D] -> [B, H_kv, S]: ||x G||^2 with row b's sketch
    G[b] [D, r], or ||x||^2 without one; with window > 0, normalised to sum 1 within each `window` slots from slot 0
    (a last partial window over its own slots)."""
    s = x.float().square().sum(-1) if G is None else torch.stack([(x[b].float() @ G[b]).square().sum(-1)
                                                                   for b in range(len(G))])
    if window:
        n = s.shape[-1]
        w = F.pad(s, (0, -n % window)).unflatten(-1, (-1, window))  # [B, H_kv, S / window, window]
        s = (w / w.sum(-1, keepdim=True)).flatten(-2)[..., :n]
    return s


def vase_dkv(ctx: ScoreCtx, rank: int = 20) -> Tensor:
    """VASE-DKV (https://arxiv.org/abs/2606.03928): CurDKV-style leverage ||k G||^2 * ||v G||^2, with a Gaussian
    sketch G ~ N(0, 1/rank) [D, rank] drawn afresh at every eviction (each row's generator is seeded per row, layer
    and round)."""
    G = draw(ctx, torch.randn, ctx.keys.shape[-1], rank) / math.sqrt(rank)  # [B, D, rank], one sketch per row
    return cur_leverage(ctx.keys, G) * cur_leverage(ctx.values, G)


def curdkv(ctx: ScoreCtx, window: int = 16) -> Tensor:
    """CurDKV (https://arxiv.org/abs/2509.15038) as kvpress's CURPress defaults: deterministic, the exact ||k||^2 *
    ||v||^2 (the sketch off), each normalised within 16-slot windows; the 4 sinks come from protection."""
    return cur_leverage(ctx.keys, window=window) * cur_leverage(ctx.values, window=window)


def value_norms(values: Tensor, wo: Tensor) -> Tensor:
    """||V_h W_O,h||_1: how far each value moves the layer output, through each query head's slice of
    o_proj, L1 over the hidden size, mean over the query heads of its group. values [B, H_kv, S, D] -> [B, H_kv, S]."""
    H_kv, D = values.shape[1], values.shape[3]
    wo = dense(wo)  # a quantized o_proj as the forward multiplies by it
    # query head h reads KV head h // n_rep through its own D rows of wo.T [H_q * D, hidden], so a group's heads
    # are a stack [n_rep, D, hidden] (a view, in either weight layout)
    w = wo.T.reshape(H_kv, -1, D, wo.shape[0])  # [H_kv, n_rep, D, hidden]
    # one KV head at a time: a first round scores every slot, and [B, n_rep, S, hidden] is the largest intermediate
    return torch.stack([(values[:, g, None] @ w[g]).float().abs().sum(-1).mean(1) for g in range(H_kv)], 1)


def criticalkv(ctx: ScoreCtx, base=snapkv_attention, alpha: float = 0.5, eps: float = 1e-4) -> Tensor:
    """CriticalKV (https://arxiv.org/abs/2502.03805): stage 1 keeps int(alpha * K) slots by the base score, the
    recent window among them (kvpress's CriticalKVPress pads the window to the top score), so it adds
    int(alpha * K) - r candidates; stage 2 ranks the rest by (s + eps) * ||V_h W_O,h||_1, the size of the change
    each value makes to the layer output. A value's norm never changes, so we compute it once per slot and carry it."""
    s = base(ctx)  # [B, H_kv, S]
    stage1 = top_candidates(s, ctx.protected, int(alpha * ctx.budget) - ctx.buffer)
    return ((s + eps) * carried_norms(ctx)).masked_fill(stage1, BIG)


def carried_norms(ctx: ScoreCtx) -> Tensor:
    """value_norms of every held slot [B, H_kv, S], carried in the cache's side state: only new slots are computed."""
    norms = ctx.side["vnorm"]  # a view into the cache's side state: filled here, gathered on eviction
    # note: row by row, as a matmul over several rows' slots may round differently from one over a row's own
    norms[..., ctx.fresh :] = torch.cat([value_norms(v[None], ctx.wo) for v in ctx.values[:, :, ctx.fresh :]])
    return norms


# --- budgets that differ per head (budgets.py allocates, these score) -------------------------------------------


def adakv(ctx: ScoreCtx, alpha: float = budgets.SAFEGUARD) -> Tensor:
    """AdaKV (https://arxiv.org/abs/2407.11550) on SnapKV, as FFY0/AdaKV's update_kv_gqa: the layer's K - r
    candidates per head become H_kv * (K - r) over the layer, shared by pooling the heads' votes (budgets.adakv);
    each head keeps its own top b_h, the recent buffer on top. Holes (slots a head no longer holds) never count."""
    s = snapkv_attention(ctx)  # [B, H_kv, S]
    n = ctx.keys.shape[2] - ctx.buffer  # candidates; the buffer is kept on top of every head's budget
    cand = s[..., :n].masked_fill(ctx.protected[..., :n], math.inf).masked_fill(ctx.pos[..., :n] == FREE, -math.inf)
    ctx.keep = budgets.adakv(cand, ctx.budget - ctx.buffer, alpha) + ctx.buffer
    return s


def criticalkv_ada(ctx: ScoreCtx, alpha: float = budgets.SAFEGUARD, ratio: float = 0.5, eps: float = 1e-4) -> Tensor:
    """CriticalAdaKV (https://arxiv.org/abs/2502.03805, the paper's headline), as kvpress's CriticalAdaKVPress: SnapKV
    votes with the recent buffer (and sinks or prompt) on top, as kvpress pads the window; every head's top
    int(alpha * K) safe; head budgets b_h from the pooled votes (budgets.safeguarded, K per head with the buffer);
    then CriticalKV's two stages inside each head: int(ratio * b_h) by the vote, the rest of b_h by
    (s + eps) * ||V_h W_O,h||_1."""
    s = snapkv_attention(ctx).masked_fill(ctx.protected, BIG).masked_fill(ctx.pos == FREE, -math.inf)
    safe, keep = budgets.safeguarded(s, ctx.budget, alpha)  # [B, H_kv, S], [B, H_kv]
    stage1 = budgets.top_per_head(s.masked_fill(safe, math.inf), (keep * ratio).long())  # safe ones rank first
    ctx.keep = keep
    return ((s + eps) * carried_norms(ctx)).masked_fill(stage1 | safe, BIG)


# --- EPIKV ---------------------------------------------------------------------


def rolling_z(hist: Tensor, g: Tensor, window: int = 64, eps: float = 1e-6) -> Tensor:
    """Causal rolling z-score of each new value against the last `window` values, itself included.
    hist [..., H] earlier values, g [..., T] new ones -> z [..., T] (0 with fewer than 2 values).
    e.g. hist=[1, 3], g=[5]: window [1, 3, 5], mean 3, population std 1.633 -> z = 1.2247."""
    x = torch.cat([hist, g], -1).double()
    c1 = F.pad(x.cumsum(-1), (1, 0))
    c2 = F.pad(x.square().cumsum(-1), (1, 0))
    end = torch.arange(hist.shape[-1] + 1, x.shape[-1] + 1, device=x.device)  # window ends of the new values
    start = (end - window).clamp(min=0)
    n = (end - start).double()
    mean = (c1[..., end] - c1[..., start]) / n
    std = ((c2[..., end] - c2[..., start]) / n - mean.square()).clamp(min=0).sqrt()
    z = (x[..., end - 1] - mean) / (std + eps)
    return torch.where(n >= 2, z, torch.zeros_like(z)).float()


def epikv_bands(L: int, bands: bool) -> tuple[list[int], list[int]]:
    """The paper's layers (of 32) scaled to depth L: single layers 10 / 21, or bands 7-13 / 18-25."""
    r = lambda f: min(L - 1, round(f * L))
    if bands:
        return list(range(r(7 / 32), r(13 / 32) + 1)), list(range(r(18 / 32), r(25 / 32) + 1))
    return [r(0.31)], [r(0.66)]


def epikv_observe(cache, out, run, bands: bool = False, weights=(1.0, 1.0), window: int = 64):
    """EPIKV (https://arxiv.org/abs/2606.26472): g(t) = ||h(t) - h(t-1)||_2 on the residual stream (block outputs)
    when token t is produced, averaged over each band's layers; score w_A z_A(t) - w_B z_B(t) with a causal rolling
    z-score per band, frozen into the token's slot (same for every layer and head). As the authors' code, the
    history starts at the first token after the prompt; prompt tokens score 0. Each row keeps its own history."""
    A, Bd = epikv_bands(len(out.hidden), bands)
    h = torch.stack([out.hidden[l].float() for l in A + Bd], 1)  # [B, nl, T, hidden]
    for b, row in enumerate(cache.rows):
        n = out.chunk.n[b]
        if n == 0:
            continue
        state, hb = run.state[row], h[b, :, :n]  # [nl, n, hidden]
        prev = state.get("prev", hb[:, :1])  # position 0 has no predecessor: no movement
        g = (hb - torch.cat([prev, hb[:, :-1]], 1)).norm(dim=-1)  # [nl, n] movement into each token
        g = torch.stack([g[: len(A)].mean(0), g[len(A) :].mean(0)])  # [2, n] band means
        # the chunk's tokens still in the prompt (position 0 counts as prompt: it has no movement)
        skip = min(max(max(run.prompt_len[row], 1) - (cache.next_pos[b] - n), 0), n)
        hist = state.get("hist", g.new_zeros(2, 0))
        z = F.pad(rolling_z(hist, g[:, skip:], window), (skip, 0))  # [2, n]; prompt tokens 0
        state["prev"], state["hist"] = hb[:, -1:], torch.cat([hist, g[:, skip:]], -1)[:, -(window - 1) :]
        S = cache.length[b]
        cache.side["epikv"][:, b, :, S - n : S] = weights[0] * z[0] - weights[1] * z[1]


def epikv(ctx: ScoreCtx) -> Tensor:
    """EPIKV: residual-stream movement, no attention matrix (FlashAttention stays on); one token set."""
    return ctx.side["epikv"][:, :1]


def epikv_lag(ctx: ScoreCtx, chunk: int = 128) -> Tensor:
    """EPIKV lag-normalised KV, as the authors' code: K and V averaged over layers first; in chunks of 128 slots,
    each normalised per KV head and channel by the *previous* chunk's min/max; the first chunk left raw; std over
    D (torch's unbiased default), mean over heads; score = K part + V part.
    note: the raw first chunk sits on another scale than the normalised ones: the oldest 128 slots tend to survive."""
    if "lag" not in ctx.memo:  # every layer of the round gets the same score: compute it once
        total = 0
        for x in ctx.all_kv:  # [L, B, H_kv, S, D]
            x = x.float().mean(0)  # [B, H_kv, S, D]
            out = x.clone()
            for c in range(chunk, x.shape[2], chunk):
                ref = x[:, :, c - chunk : c]  # the previous chunk
                lo, hi = ref.amin(2, keepdim=True), ref.amax(2, keepdim=True)
                out[:, :, c : c + chunk] = (x[:, :, c : c + chunk] - lo) / (hi - lo + 1e-9)
            total = total + out.std(-1).mean(1)  # [B, S]
        ctx.memo["lag"] = total[:, None]
    return ctx.memo["lag"]


def lag_score(x: Tensor, lag: int) -> Tensor:
    """LagKV's score of whole chunks x [H, n, lag, D]: each of the first n - 1 chunks min-max normalised per channel by
    the *next* chunk, std over channels (unbiased), softmax over the chunk. -> [H, n - 1, lag]"""
    ref, x = x[:, 1:], x[:, :-1]
    lo, hi = ref.amin(-2, keepdim=True), ref.amax(-2, keepdim=True)
    return ((x - lo) / (hi - lo)).std(-1).softmax(-1)


def lagkv(ctx: ScoreCtx, lag: int = 128) -> Tensor:
    """LagKV (https://arxiv.org/abs/2504.04704) as kvpress's LagKVPress (lag 128, sinks 4): per layer and KV head,
    chunks of `lag` slots after the protected ones, each scored by the next chunk's min/max (K and V scores summed),
    ranked within its chunk (rank / lag, so every chunk keeps about the same share); the last whole chunk and the rest,
    which have no next chunk, are kept first, newest first. Against epikv-lag, in a line each: the next chunk, not the
    previous; per layer and head, not averaged over layers and heads; a softmax and a rank within each chunk, not raw
    std; the unreferenced tail kept, not the first chunk left raw."""
    B, H, S, D = ctx.keys.shape
    out = (1 + torch.arange(S, device=ctx.keys.device) / S).repeat(B, H, 1)  # [B, H, S] the tail's scores, > any rank
    for b in range(B):  # rows hold different prompts, so their chunks start at different slots
        P = int(ctx.protected[b, 0, : S - ctx.buffer].sum())  # the prompt or the sinks: the leading slots
        n = (S - P) // lag
        if n < 2:
            continue
        chunks = lambda x: x[b, :, P : P + n * lag].float().view(H, n, lag, D)
        s = lag_score(chunks(ctx.keys), lag) + lag_score(chunks(ctx.values), lag)  # [H, n - 1, lag]
        out[b, :, P : P + (n - 1) * lag] = (s.argsort(-1).argsort(-1) / lag).flatten(1)
    return out


# -----------------------------------------------------------------------------
# the registry


@dataclass
class Policy:
    score: Callable[[ScoreCtx], Tensor] | None  # None = never evict
    protect_prompt: bool = False  # the paper's default; --protect-prompt overrides it for all
    window: int | str = 0  # how many recent queries the scorer reads from the ring; "buffer" = r of them
    observe: Callable | None = None  # observe(cache, out, run) after every forward, for state built while decoding
    side: tuple = ()  # per-slot side state the cache must carry
    per_head: bool = False  # heads get their own budgets (the scorer sets ScoreCtx.keep); the cache: budgets.head_cap
    prepare: Callable | None = None  # prepare(model, stats_file) -> ScoreCtx.stats, once a request (calibration)


POLICIES = {
    "full": Policy(None),
    "streaming": Policy(streaming),
    "snapkv": Policy(snapkv, window="buffer"),
    "h2o": Policy(h2o, observe=h2o_observe, side=("h2o",)),
    "rkv": Policy(rkv, window=8),
    "random": Policy(random_, protect_prompt=True),
    "vase": Policy(vase, window="buffer"),
    "vase-dkv": Policy(vase_dkv),
    "criticalkv": Policy(criticalkv, window="buffer", side=("vnorm",)),
    "epikv": Policy(epikv, protect_prompt=True, observe=epikv_observe, side=("epikv",)),
    "epikv-band": Policy(epikv, protect_prompt=True, side=("epikv",),
                         observe=partial(epikv_observe, bands=True, weights=(1.29, 1.0))),
    "epikv-lag": Policy(epikv_lag, protect_prompt=True),
    # VASE's ablations, one knob of the same scorer each: they test the two halves of its claim
    "vase-topk": Policy(partial(vase, sample=False), window="buffer"),
    "vase-noreserve": Policy(partial(vase, reserve=0), window="buffer"),
    "vase-adversary": Policy(partial(vase, sample=False, reserve=-1, weights=snapkv_attention), window="buffer"),
    # budgets that differ per head, evicting for real at every round (kvpress only masks at decode time)
    "adakv": Policy(adakv, window="buffer", per_head=True),
    "criticalkv-ada": Policy(criticalkv_ada, window="buffer", side=("vnorm",), per_head=True),
    # the seeds' own baselines (DESIGN.md §6b)
    "triattention": Policy(triattention, protect_prompt=True, prepare=triattention_stats),
    "triattention-layer": Policy(partial(triattention, shared=False), protect_prompt=True, prepare=triattention_stats),
    "curdkv": Policy(curdkv),
    "lagkv": Policy(lagkv),
    "scissorhands": Policy(scissorhands, observe=scissorhands_observe, side=("sh_hits", "sh_seen")),
    "raas": Policy(raas, protect_prompt=True, observe=raas_observe, side=("raas",)),
}
