"""
What a scorer sees, and the few helpers scorers share (one place for each idea): ScoreCtx, one layer of the rows due
for eviction; the recent window's attention and SnapKV's vote, which several families build on; a top-n mask; per-row
random draws. A scorer maps a ScoreCtx to scores [B, H_kv or 1, S], higher = keep; cache.evict selects, never a scorer.
The scorers live by the signal they read (policies.py has the map and the registry). Ties get a rule (ranked) where
a scorer's scores tie in fact: RaaS's timestamps, CurDKV's leverage of a repeated token.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import window_attn_mass

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
    all_kv: tuple | None  # (k, v) of every layer, [L, B, H_kv, S, D]; for scorers that pool over layers (None for a
    # per-head policy: its layers are pools of segments, cache.head_view copies out one layer at a time)
    cfg: object  # ModelConfig
    budget: int  # K: slots held right after an eviction, recent buffer included
    buffer: int  # r: the newest slots, never evicted; the candidates are the other S - r
    generators: list  # one torch.Generator per row, seeded by (seed, row, layer, round: 0 if not Policy.redraw)
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


def ranked(score: Tensor, pos: Tensor, bits: int = 0) -> Tensor:
    """Scores [B, H_kv, S] -> their ranks 0 .. S - 1 as floats (higher = keep), equal scores ordered by position, the
    newer higher: a tie gets a rule instead of torch.topk's internal order. With bits > 0 each score is first rounded
    to that many significant bits, so that two scores a last-bit rounding apart (a row scored in a batch and alone, a
    repeated token's key norm before and after RoPE) tie too and fall to the rule; only a score within that rounding
    of a step of the grid (2^-bits relative) can still go either way. A NaN ranks lowest (cache.evict's rule).
    e.g. [3, 1, 3] at positions [0, 1, 2] -> [1, 0, 2]; with bits = 2, [1.0, 1.1] -> 1.0 and 1.0: the newer wins."""
    x = score.float().nan_to_num(nan=-math.inf)
    if bits:
        m, e = torch.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
        x = torch.where(x.isfinite(), torch.ldexp(torch.round(m * 2**bits) / 2**bits, e), x)
    by_pos = pos.argsort(-1)  # [B, H_kv, S] oldest first
    order = by_pos.gather(-1, x.gather(-1, by_pos).argsort(dim=-1, stable=True))  # ascending score, ties oldest first
    ranks = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype).expand_as(x)
    return torch.empty_like(x).scatter_(-1, order, ranks)


def draw(ctx: ScoreCtx, fn: Callable, *shape: int) -> Tensor:
    """[B, *shape] random numbers from fn (torch.rand or torch.randn), row b from its own generator: a row's draws
    are the same whether it is scored alone or beside others."""
    return torch.stack([fn(*shape, generator=g, device=ctx.keys.device) for g in ctx.generators])


def gumbel_log_weights(weights: Tensor, ctx: ScoreCtx) -> Tensor:
    """Sampling without replacement with probability proportional to weights, as a score:
    top-k of log(w) + Gumbel noise draws k items exactly as successive weighted draws would."""
    u = draw(ctx, torch.rand, *weights.shape[1:]).clamp_(1e-20, 1.0)
    return weights.clamp(min=1e-20).log() - (-u.log()).log()
