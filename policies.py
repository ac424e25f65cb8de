"""
The eviction scorers. Each maps a ScoreCtx (one layer's cached keys/values, positions, the last w queries,
side state) to scores [B, H_kv or 1, S], higher = keep; cache.evict does the selection, never a scorer.

Left out: prefill-only methods, quantisation, anything that needs an n x n attention matrix (attention comes
from the last w queries, w x S, or from one extra q.K^T per decode step for H2O).
Papers: EPIKV (https://arxiv.org/abs/2606.26472), VASE (https://arxiv.org/abs/2606.03928), CriticalKV
(https://arxiv.org/abs/2502.03805), Random Attention (prompt protection + per-head random keep), and the
baselines SnapKV (https://arxiv.org/abs/2404.14469), H2O (https://arxiv.org/abs/2306.14048), StreamingLLM
(https://arxiv.org/abs/2309.17453), R-KV (https://arxiv.org/abs/2505.24133).
"""

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import window_attn_mass

BIG = 1e30  # "always keep among the candidates", below cache.evict's +inf for protected slots


@dataclass
class ScoreCtx:
    layer: int
    keys: Tensor  # [B, H_kv, S, D] post-RoPE
    values: Tensor  # [B, H_kv, S, D]
    pos: Tensor  # [B, H_kv, S] original token position of each slot
    protected: Tensor  # [B, H_kv, S] bool: slots cache.evict will keep whatever we say (prompt/sinks, recent)
    queries: Tensor  # [B, H_q, w, D] the ring of the last w post-RoPE queries
    q_pos: Tensor  # [w] their positions, -1 = empty
    wo: Tensor  # [hidden, H_q * D] this layer's o_proj weight
    side: dict  # per-slot side state, name -> [B, H_kv, S]
    all_kv: tuple  # (k, v) of every layer, [L, B, H_kv, S, D]; for scorers that pool over layers
    cfg: object  # ModelConfig
    budget: int  # K: slots held right after an eviction, recent buffer included
    buffer: int  # r
    generator: torch.Generator  # seeded by (seed, layer, eviction round)
    fresh: int  # slots [fresh, S) arrived since the last eviction (their side state is still unset)
    memo: dict = field(default_factory=dict)  # shared by the layers of one eviction round


# -----------------------------------------------------------------------------
# shared helpers (one place for each idea)


def window_attention(ctx: ScoreCtx, w: int | None = None) -> Tensor:
    """Mean softmax attention each key gets from the last w queries of the ring (all of it by default).
    Returns [B, H_q, S]. Each query is normalised over every key it attends to (causal by position)."""
    q, q_pos = ctx.queries, ctx.q_pos
    if w is not None and w < q_pos.shape[0]:  # the ring is unordered: take the w newest positions
        newest = q_pos.topk(w).indices
        q, q_pos = q[:, :, newest], q_pos[newest]
    mass = window_attn_mass(q, ctx.keys, q_pos, ctx.pos, 1.0 / math.sqrt(ctx.keys.shape[-1]))
    return mass / (q_pos >= 0).sum().clamp(min=1)


def group_mean(x: Tensor, n_rep: int) -> Tensor:
    """[B, H_q, S] -> [B, H_kv, S]: average the query heads that share a KV head (GQA)."""
    B, H_q, S = x.shape
    return x.view(B, H_q // n_rep, n_rep, S).mean(2)


def snapkv_attention(ctx: ScoreCtx) -> Tensor:
    """SnapKV's vote: window attention, avg-pooled over 5 neighbouring keys, GQA mean -> [B, H_kv, S]."""
    a = F.avg_pool1d(window_attention(ctx), kernel_size=5, stride=1, padding=2)
    return group_mean(a, ctx.cfg.n_rep)


def top_candidates(x: Tensor, protected: Tensor, n: int) -> Tensor:
    """Bool mask [B, H_kv, S] of the n highest x among unprotected slots."""
    x = x.masked_fill(protected, -math.inf)
    n = min(n, x.shape[-1])
    return torch.zeros_like(protected).scatter_(-1, x.topk(n, dim=-1).indices, True) & ~protected


def gumbel_log_weights(weights: Tensor, g: torch.Generator) -> Tensor:
    """Sampling without replacement with probability proportional to weights, as a score:
    top-k of log(w) + Gumbel noise draws k items exactly as successive weighted draws would."""
    u = torch.rand(weights.shape, generator=g, device=weights.device).clamp_(1e-20, 1.0)
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


def h2o_observe(cache, out, state):
    """After each forward: add the new queries' attention to every held key (one q.K^T, never n x n).
    Every layer holds the same number of slots, so all layers go through one batched call."""
    L, B, H_kv = cache.k.shape[:3]
    S = cache.length[0]
    q = torch.stack(out.queries).flatten(0, 1)  # [L * B, H_q, T, D]
    T, D = q.shape[-2:]
    q_pos = torch.arange(cache.next_pos - T, cache.next_pos, device=q.device)
    keys, pos = cache.k[:, :, :, :S].flatten(0, 1), cache.pos[:, :, :, :S].flatten(0, 1)  # [L * B, H_kv, S(, D)]
    mass = window_attn_mass(q, keys, q_pos, pos, 1.0 / math.sqrt(D))  # [L * B, H_q, S]
    cache.side["h2o"][:, :, :, :S] += mass.view(L, B, H_kv, -1, S).sum(3)  # summed over each GQA group


def rkv(ctx: ScoreCtx, lam: float = 0.1, threshold: float = 0.5) -> Tensor:
    """R-KV (https://arxiv.org/abs/2505.24133): important and not redundant. lam * attention (last 8 queries,
    max-pooled over 7 keys) - (1 - lam) * redundancy (a key's mean cosine similarity to the others, softmax
    over S). note: the similarity is S x S over the *cached* keys, bounded by K + r, never the sequence."""
    attn = group_mean(F.max_pool1d(window_attention(ctx, w=8), kernel_size=7, stride=1, padding=3), ctx.cfg.n_rep)
    k = F.normalize(ctx.keys.float(), dim=-1)
    sim = k @ k.transpose(-1, -2)  # [B, H_kv, S, S] cosine similarity of every pair of cached keys
    sim.diagonal(dim1=-2, dim2=-1).fill_(0.0)  # a key is not its own look-alike
    # subtle: a key's newest look-alike (similarity > threshold) is not counted as redundant, so the latest copy
    # of a repeated passage survives while older copies are penalised. newest = 1 + index of that key, 0 = none.
    S = sim.shape[-1]
    newest = ((sim > threshold) * torch.arange(1, S + 1, device=sim.device, dtype=torch.int32)).amax(-1)
    j = (newest.long() - 1).clamp(min=0)  # [B, H_kv, S]
    spared = sim.gather(-1, j[..., None])[..., 0] * (newest > 0)  # sim[i, newest(i)], taken back out below
    redundancy = (sim.sum(-2).scatter_add(-1, j, -spared) / S).softmax(-1)  # mean over rows, [B, H_kv, S]
    return lam * attn - (1 - lam) * redundancy


def random_(ctx: ScoreCtx) -> Tensor:
    """Random Attention: protect the prompt, then keep uniformly random tokens, independently per KV head."""
    return torch.rand(ctx.pos.shape, generator=ctx.generator, device=ctx.pos.device)


def vase(ctx: ScoreCtx) -> Tensor:
    """VASE-AttnV (https://arxiv.org/abs/2606.03928): reserve the N_v = K/4 tokens whose values have the largest
    range max(v) - min(v); draw the rest without replacement with probability proportional to SnapKV attention
    (temperature 1)."""
    v = ctx.values.float()
    reserved = top_candidates(v.amax(-1) - v.amin(-1), ctx.protected, ctx.budget // 4)
    sampled = gumbel_log_weights(snapkv_attention(ctx), ctx.generator)
    return sampled.masked_fill(reserved, BIG)


def vase_dkv(ctx: ScoreCtx, rank: int = 20) -> Tensor:
    """VASE-DKV (https://arxiv.org/abs/2606.03928): CurDKV-style leverage ||k G||^2 * ||v G||^2, with a Gaussian
    sketch G ~ N(0, 1/rank) [D, rank] drawn afresh at every eviction (the generator is seeded per layer and round)."""
    D = ctx.keys.shape[-1]
    G = torch.randn(D, rank, generator=ctx.generator, device=ctx.keys.device) / math.sqrt(rank)
    return (ctx.keys.float() @ G).square().sum(-1) * (ctx.values.float() @ G).square().sum(-1)


def value_norms(values: Tensor, wo: Tensor) -> Tensor:
    """||V_h W_O,h||_1: how far each value moves the layer output, through each query head's slice of
    o_proj, L1 over the hidden size, mean over the query heads of its group. values [B, H_kv, S, D] -> [B, H_kv, S]."""
    B, H_kv, S, D = values.shape
    n_rep = wo.shape[1] // (H_kv * D)
    # query head h reads KV head h // n_rep through its own column block of o_proj (a strided view, no copy)
    norms = [F.linear(values[:, h // n_rep], wo[:, h * D : (h + 1) * D]).float().abs().sum(-1)  # [B, S]
             for h in range(H_kv * n_rep)]
    return torch.stack(norms, 1).view(B, H_kv, n_rep, S).mean(2)


def criticalkv(ctx: ScoreCtx, base=snapkv_attention, alpha: float = 0.5, eps: float = 1e-4) -> Tensor:
    """CriticalKV (https://arxiv.org/abs/2502.03805): stage 1 keeps the top alpha * (K - r) by the base
    score; stage 2 ranks the rest by (s + eps) * ||V_h W_O,h||_1, the size of the change each value makes
    to the layer output. A value's norm never changes, so we compute it once per slot and carry it."""
    s = base(ctx)  # [B, H_kv, S]
    norms = ctx.side["vnorm"]  # a view into the cache's side state: filled here, gathered on eviction
    norms[..., ctx.fresh :] = value_norms(ctx.values[:, :, ctx.fresh :], ctx.wo)
    stage1 = top_candidates(s, ctx.protected, int(alpha * (ctx.budget - ctx.buffer)))
    return ((s + eps) * norms).masked_fill(stage1, BIG)


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


def epikv_observe(cache, out, state, bands: bool = False, window: int = 64):
    """EPIKV (https://arxiv.org/abs/2606.26472): g_l(t) = ||h_l(t) - h_l(t-1)||_2 on the residual stream when token
    t is produced; score z_A(t) - z_B(t) with a causal rolling z-score, frozen into the token's slot (same for every
    layer and head)."""
    A, Bd = epikv_bands(len(out.hidden), bands)
    layers = A + Bd
    h = torch.stack([out.hidden[l].float() for l in layers], 1)  # [B, nl, T, hidden]
    first = "prev" not in state
    if first:
        state["prev"], state["hist"] = h[:, :, :1], h.new_zeros(h.shape[0], len(layers), 0)
    g = (h - torch.cat([state["prev"], h[:, :, :-1]], 2)).norm(dim=-1)  # [B, nl, T]
    if first:  # position 0 has no predecessor: its movement is undefined, so it gets no value and z = 0
        g = g[..., 1:]
    z = rolling_z(state["hist"], g, window)  # [B, nl, T] (T - 1 on the first call)
    z = F.pad(z, (1, 0)) if first else z
    state["prev"], state["hist"] = h[:, :, -1:], torch.cat([state["hist"], g], -1)[..., -(window - 1) :]
    score = z[:, : len(A)].mean(1) - z[:, len(A) :].mean(1)  # [B, T]
    T = score.shape[-1]
    for layer in range(len(out.hidden)):
        S = cache.length[layer]
        cache.side["epikv"][layer, :, :, S - T : S] = score[:, None]


def epikv(ctx: ScoreCtx) -> Tensor:
    """EPIKV: residual-stream movement, no attention matrix (FlashAttention stays on); one token set."""
    return ctx.side["epikv"][:, :1]


def epikv_lag(ctx: ScoreCtx, chunk: int = 128) -> Tensor:
    """EPIKV lag-normalised KV: in chunks of 128 slots, normalise K and V per channel by the *previous*
    chunk's min/max; score = std over D of K plus of V, mean over heads and layers.
    note: DESIGN.md leaves the first chunk raw, but raw values sit on another scale than [0, 1] and would
    always win (the oldest 128 slots could never be evicted), so we normalise it by its own min/max."""
    if "lag" not in ctx.memo:  # every layer of the round gets the same score: compute it once
        total = 0
        for x in ctx.all_kv:  # [L, B, H_kv, S, D]
            x = x.float()
            out = torch.empty_like(x)
            for c in range(0, x.shape[3], chunk):
                ref = x[:, :, :, max(c - chunk, 0) : max(c, chunk)]  # previous chunk (the first: itself)
                lo, hi = ref.amin(3, keepdim=True), ref.amax(3, keepdim=True)
                out[:, :, :, c : c + chunk] = (x[:, :, :, c : c + chunk] - lo) / (hi - lo + 1e-9)
            # population std over D, written out: ~3x faster than Tensor.std on these strided chunks
            total = total + (out - out.mean(-1, keepdim=True)).square().mean(-1).sqrt().mean((0, 2))  # [B, S]
        ctx.memo["lag"] = total[:, None]
    return ctx.memo["lag"]


# -----------------------------------------------------------------------------
# the registry


@dataclass
class Policy:
    score: Callable[[ScoreCtx], Tensor] | None  # None = never evict
    protect_prompt: bool = False  # the paper's default; --protect-prompt overrides it for all
    window: int = 0  # how many recent queries the scorer reads from the ring
    observe: Callable | None = None  # called after every forward, for state built during decoding
    side: tuple = ()  # per-slot side state the cache must carry


POLICIES = {
    "full": Policy(None),
    "streaming": Policy(streaming),
    "snapkv": Policy(snapkv, window=64),
    "h2o": Policy(h2o, observe=h2o_observe, side=("h2o",)),
    "rkv": Policy(rkv, window=8),
    "random": Policy(random_, protect_prompt=True),
    "vase": Policy(vase, window=64),
    "vase-dkv": Policy(vase_dkv),
    "criticalkv": Policy(criticalkv, window=64, side=("vnorm",)),
    "epikv": Policy(epikv, protect_prompt=True, observe=epikv_observe, side=("epikv",)),
    "epikv-band": Policy(epikv, protect_prompt=True, observe=partial(epikv_observe, bands=True), side=("epikv",)),
    "epikv-lag": Policy(epikv_lag, protect_prompt=True),
}
