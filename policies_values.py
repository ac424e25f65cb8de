"""
Scorers that read the values, and the keys' sizes beside them. VASE (https://arxiv.org/abs/2606.03928) always keeps
the widest values and samples the rest by attention; CurDKV (https://arxiv.org/abs/2509.15038) and VASE-DKV rank key x
value leverage; CriticalKV (https://arxiv.org/abs/2502.03805) weighs attention by what each value does to the layer
output, ||V W_O||_1, also inside AdaKV's per-head budgets (CriticalAdaKV, its headline); LagKV
(https://arxiv.org/abs/2504.04704) and EPIKV's lag variant (https://arxiv.org/abs/2606.26472) score each chunk's K/V
spread against a neighbouring chunk.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

import budgets
from cache import FREE
from kernels import dense
from scoring import BIG, N_SINK, ScoreCtx, draw, gumbel_log_weights, ranked, snapkv_attention, top_candidates

CURDKV_BITS = 10  # curdkv's scores count as equal within 2^-10 (0.1 %) of each other: ties then go to the newer slot


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
    and round); registered with Policy(redraw=False), curdkv-fixed, the same sketch every round of a request."""
    G = draw(ctx, torch.randn, ctx.keys.shape[-1], rank) / math.sqrt(rank)  # [B, D, rank], one sketch per row
    return cur_leverage(ctx.keys, G) * cur_leverage(ctx.values, G)


def curdkv(ctx: ScoreCtx, window: int = 16, bits: int = CURDKV_BITS) -> Tensor:
    """CurDKV (https://arxiv.org/abs/2509.15038) as kvpress's CURPress defaults: deterministic, the exact ||k||^2 *
    ||v||^2 (the sketch off), each normalised within 16-slot windows; the 4 sinks come from protection. Ranked with
    ties to the newer slot, the score rounded to `bits` significant bits first (scoring.ranked; bits = 0: exact).
    subtle: a token repeated inside a window ties in fact in layer 0 (the same value, and RoPE keeps a key's norm), but
    its two key norms differ in their last bits, and differently in a batch than alone: without the rule, a row's
    kept set depended on its batch and on the thread count."""
    s = cur_leverage(ctx.keys, window=window) * cur_leverage(ctx.values, window=window)
    return ranked(s, ctx.pos, bits) if bits else s


# value_norms' piece: above every round the studies run (K + r <= 1,280 slots), so only a long prompt is cut
NORM_SLOTS = 2048


def value_norms(values: Tensor, wo: Tensor) -> Tensor:
    """||V_h W_O,h||_1: how far each value moves the layer output, through each query head's slice of
    o_proj, L1 over the hidden size, mean over the query heads of its group. values [B, H_kv, S, D] -> [B, H_kv, S]."""
    H_kv, D = values.shape[1], values.shape[3]
    wo = dense(wo)  # a quantized o_proj as the forward multiplies by it
    # query head h reads KV head h // n_rep through its own D rows of wo.T [H_q * D, hidden], so a group's heads
    # are a stack [n_rep, D, hidden] (a view, in either weight layout)
    w = wo.T.reshape(H_kv, -1, D, wo.shape[0])  # [H_kv, n_rep, D, hidden]
    # one KV head and NORM_SLOTS slots at a time: a first round scores every slot, and [B, n_rep, S, hidden] in fp32
    # is the largest intermediate (an 8k prompt on the 1.5B: 0.58 GiB of them at once, measured; a quarter a piece)
    norm = lambda v, g: (v[:, None] @ w[g]).float().abs().sum(-1).mean(1)  # [B, S']
    return torch.stack([torch.cat([norm(values[:, g, a : a + NORM_SLOTS], g)
                                   for a in range(0, values.shape[2], NORM_SLOTS)], -1) for g in range(H_kv)], 1)


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
    wo = dense(ctx.wo)  # once for every row (an int4 o_proj is rebuilt from its codes on each call)
    # note: row by row, as a matmul over several rows' slots may round differently from one over a row's own
    norms[..., ctx.fresh :] = torch.cat([value_norms(v[None], wo) for v in ctx.values[:, :, ctx.fresh :]])
    return norms


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


# --- K and V spread, chunk against chunk ------------------------------------------------------------------------


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
