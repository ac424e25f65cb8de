"""
The flat, preallocated KV cache and the one place where eviction happens.

Keys are stored after RoPE together with each slot's original token position, so a head may keep any
subset of positions without re-rotating anything (StreamingLLM-style re-rotation is deliberately left out).
Everything that rides with a slot (position, H2O's accumulated attention, EPIKV's frozen score) is
gathered with it. References: kvpress `ScorerPress.compress`, gpt-fast / nanochat KV caches.
"""

import torch
from torch import Tensor


class KVCache:
    def __init__(self, n_layers, batch, n_kv_heads, head_dim, capacity, *, n_q_heads=0, window=0,
                 side=(), device="cpu", dtype=torch.float32):
        L, B, H, D = n_layers, batch, n_kv_heads, head_dim
        self.k = torch.zeros(L, B, H, capacity, D, device=device, dtype=dtype)  # [L, B, H_kv, cap, D]
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(L, B, H, capacity, device=device, dtype=torch.long)  # original token position
        # per-slot side state for the scorers, e.g. "h2o" accumulated attention; [L, B, H_kv, cap] fp32
        self.side = {name: torch.zeros(L, B, H, capacity, device=device) for name in side}
        # a ring of the last `window` post-RoPE queries per layer, for attention-based scorers
        self.q_ring = torch.zeros(L, B, n_q_heads, window, D, device=device, dtype=dtype)  # [L, B, H_q, w, D]
        self.q_pos = torch.full((window,), -1, device=device, dtype=torch.long)  # -1 = empty ring slot
        self.capacity = capacity
        self.reset()

    def reset(self):
        """Forget every token (the tensors stay allocated)."""
        self.length = [0] * self.k.shape[0]  # slots held, per layer (equal between forwards)
        self.next_pos = 0  # position of the next token to be appended
        self.q_pos.fill_(-1)

    def append(self, layer: int, k: Tensor, v: Tensor, q: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write k, v [B, H_kv, T, D] (and queries q [B, H_q, T, D] into the ring); return views of all slots."""
        T, S0 = k.shape[2], self.length[layer]
        if S0 + T > self.capacity:
            raise RuntimeError(f"KV cache overflow: {S0} + {T} slots > capacity {self.capacity}")
        self.k[layer, :, :, S0 : S0 + T] = k
        self.v[layer, :, :, S0 : S0 + T] = v
        self.pos[layer, :, :, S0 : S0 + T] = torch.arange(self.next_pos, self.next_pos + T, device=k.device)
        for s in self.side.values():
            s[layer, :, :, S0 : S0 + T] = 0  # a reused slot must not inherit its previous owner's state
        w = self.q_ring.shape[3]
        if w and q is not None:  # only the newest w of this chunk fit; ring index = position % w
            n = min(T, w)
            idx = torch.arange(self.next_pos + T - n, self.next_pos + T, device=q.device) % w
            self.q_ring[layer, :, :, idx] = q[:, :, T - n :]
        self.length[layer] = S0 + T
        return self.get(layer)

    def advance(self, T: int):
        """Close a forward pass of T tokens: every layer has appended them."""
        w = self.q_pos.shape[0]
        if w:
            n = min(T, w)
            p = torch.arange(self.next_pos + T - n, self.next_pos + T, device=self.q_pos.device)
            self.q_pos[p % w] = p
        self.next_pos += T

    def get(self, layer: int) -> tuple[Tensor, Tensor]:
        """Views of the held keys and values, [B, H_kv, S, D]."""
        S = self.length[layer]
        return self.k[layer, :, :, :S], self.v[layer, :, :, :S]

    def protected(self, layer: int, protect_below: int, n_recent: int) -> Tensor:
        """Slots that always survive, [B, H_kv, S] bool: positions < protect_below, and the newest n_recent."""
        S = self.length[layer]
        return (self.pos[layer, :, :, :S] < protect_below) | (torch.arange(S, device=self.pos.device) >= S - n_recent)

    def evict(self, layer: int, scores: Tensor, keep: int, protected: Tensor):
        """Keep the `keep` best slots of each (batch, KV head): the `protected` ones ([B, H_kv, S] bool, see
        protected()) always survive; the rest go by highest score.
        scores [B, H_kv or 1, S]; a single row means one token set for all heads of this layer."""
        S = self.length[layer]
        k, v, pos = self.k[layer], self.v[layer], self.pos[layer, :, :, :S]  # pos [B, H_kv, S]
        B, H, _, D = k.shape
        scores = scores.float().nan_to_num(nan=-float("inf")).expand(B, H, S)  # a NaN must never outrank +inf
        scores = scores.masked_fill(protected, float("inf"))
        # keep the top `keep`, then restore temporal order so slots stay sorted by position
        idx = scores.topk(keep, dim=-1, sorted=False).indices.sort(dim=-1).values  # [B, H_kv, keep]
        idx_d = idx[..., None].expand(B, H, keep, D)
        # note: gather reads everything before the write-back, so overlapping ranges are safe
        k[:, :, :keep] = k[:, :, :S].gather(2, idx_d)
        v[:, :, :keep] = v[:, :, :S].gather(2, idx_d)
        self.pos[layer, :, :, :keep] = pos.gather(2, idx)
        for s in self.side.values():
            s[layer, :, :, :keep] = s[layer, :, :, :S].gather(2, idx)
        self.length[layer] = keep
