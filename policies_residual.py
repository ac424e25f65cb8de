"""
EPIKV (https://arxiv.org/abs/2606.26472): scores read the residual stream, how far each block's output moves when a
token is produced, and no attention at all, so attention keeps its fused kernel. An observer turns the movement of two
layer bands into a causal rolling z-score and freezes it into the token's slot, one score shared by every layer and
head (one kept set). EPIKV's K/V lag variant (epikv-lag) sits beside LagKV in policies_values.py.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from scoring import ScoreCtx


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
