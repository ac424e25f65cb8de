"""
The flat, preallocated KV cache and the one place where eviction happens.

Keys are stored after RoPE together with each slot's original token position, so a head may keep any
subset of positions without re-rotating anything (StreamingLLM-style re-rotation is deliberately left out).
Everything that rides with a slot (position, H2O's accumulated attention, EPIKV's frozen score) is
gathered with it. The rows of a batch are independent: each holds its own number of slots, counts its own
positions and is evicted on its own cadence. A slot past a row's length is free: its position reads FREE, later
than any query, so every causal-by-position test hides it. With budgets that differ per head (evict_per_head), a head
holding fewer slots than the row spans has free slots inside the row too, hidden the same way. References: kvpress
`ScorerPress.compress`, gpt-fast / nanochat KV caches.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

FREE = torch.iinfo(torch.long).max  # the position of a free slot: after every query, so never attended to


@dataclass
class Chunk:
    """Where the tokens of one forward pass go; built once by KVCache.chunk, read by every layer.
    Row b appends its first n[b] tokens; the rest of its T columns is right padding: computed, never stored."""

    n: list[int]  # real tokens per row
    pos: Tensor  # [B, T] token positions; a padding column repeats its row's last position
    last: Tensor  # [B] each row's last real column
    end: int  # 1 + the latest position any query has
    start: int | None  # the slot every row appends at, when all rows are alike (else None: see `real`)
    S: int  # slots the longest row holds after this chunk
    real: tuple[Tensor, Tensor, Tensor]  # (row, column, slot) of each real token, [N] each
    ring: tuple[Tensor, Tensor, Tensor] | None  # (row, column, ring slot) of the queries the ring keeps, or None


class KVCache:
    def __init__(self, n_layers, batch, n_kv_heads, head_dim, capacity, *, n_q_heads=0, window=0,
                 side=(), device="cpu", dtype=torch.float32):
        L, B, H, D = n_layers, batch, n_kv_heads, head_dim
        self.k = torch.zeros(L, B, H, capacity, D, device=device, dtype=dtype)  # [L, B, H_kv, cap, D]
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(L, B, H, capacity, device=device, dtype=torch.long)  # original token position
        # per-slot side state for the scorers, e.g. "h2o" accumulated attention; [L, B, H_kv, cap] fp32
        self.side = {name: torch.zeros(L, B, H, capacity, device=device) for name in side}
        # a ring of each row's last `window` post-RoPE queries per layer, for attention-based scorers
        self.q_ring = torch.zeros(L, B, n_q_heads, window, D, device=device, dtype=dtype)  # [L, B, H_q, w, D]
        self.q_pos = torch.zeros(B, window, device=device, dtype=torch.long)  # their positions, -1 = empty
        self.capacity = capacity
        self.views()
        self.reset()

    def views(self):
        # note: per-layer views, made once: indexing the [L, ...] tensors in every layer of every step costs time
        self.k_l, self.v_l, self.q_ring_l = list(self.k), list(self.v), list(self.q_ring)

    def reset(self):
        """Forget every token (the tensors stay allocated)."""
        B = self.k.shape[1]
        self.length = [0] * B  # slots each row holds (the same in every layer between forward passes)
        self.next_pos = [0] * B  # position of each row's next token
        self.rows = list(range(B))  # each row's index in the request: stays put when finished rows leave
        self.pos.fill_(FREE)
        self.q_pos.fill_(-1)
        self.holes = False  # True once heads hold different numbers of slots: attention must then mask free slots

    @property
    def batch(self) -> int:
        return len(self.rows)

    def chunk(self, T: int, n: list[int] | None = None) -> Chunk:
        """Plan a forward of T columns per row in which row b appends its first n[b] tokens (default all T)."""
        n = [T] * self.batch if n is None else n
        dev = self.pos.device
        n_t = torch.tensor(n, device=dev)
        last = (n_t - 1).clamp(min=0)  # [B]
        # padding columns repeat the last real position, so they see what the row's last token sees
        cols = torch.minimum(torch.arange(T, device=dev), last[:, None])  # [B, T]
        pos = torch.tensor(self.next_pos, device=dev)[:, None] + cols
        end = max(p + max(c, 1) for p, c in zip(self.next_pos, n))
        alike = len(set(self.length)) == 1 and set(n) == {T}  # the common case: one slice write serves all rows
        row = torch.arange(self.batch, device=dev).repeat_interleave(n_t)
        col = torch.cat([torch.arange(c, device=dev) for c in n])
        slot = torch.tensor(self.length, device=dev)[row] + col
        S = max(l + c for l, c in zip(self.length, n))
        if S > self.capacity:
            raise RuntimeError(f"KV cache overflow: {S} slots > capacity {self.capacity}")
        # positions and side state of the new slots are the same in every layer: written here, once, for all
        if alike:
            s = slice(self.length[0], self.length[0] + T)
            self.pos[:, :, :, s] = pos[:, None]
            for side in self.side.values():
                side[:, :, :, s] = 0  # a reused slot must not inherit its previous owner's state
        else:
            self.pos[:, row, :, slot] = pos[row, col][:, None, None]  # indexed: [N, L, H_kv]
            for side in self.side.values():
                side[:, row, :, slot] = 0
        start = self.length[0] if alike else None
        # the query ring takes each row's last w real tokens, at ring slot position % w. Only those: the older ones
        # would land on the same ring slots, and an indexed write with repeated indices has no defined winner
        w, ring = self.q_pos.shape[1], None
        if w:
            keep = col >= n_t[row] - w  # [N]
            r, c = row[keep], col[keep]
            ring = (r, c, pos[r, c] % w)  # (row, column, ring slot), [N_ring] each
        return Chunk(n, pos, last, end, start, S, (row, col, slot), ring)

    def append(self, layer: int, k: Tensor, v: Tensor, q: Tensor | None, chunk: Chunk) -> tuple[Tensor, Tensor]:
        """Write the chunk's real k, v [B, H_kv, T, D] (and queries q [B, H_q, T, D] into the ring); return
        views of the slots the longest row holds, [B, H_kv, S, D]."""
        K, V = self.k_l[layer], self.v_l[layer]  # [B, H_kv, cap, D]
        if chunk.start is not None:  # every row appends T tokens at the same slot: plain slices
            K[:, :, chunk.start : chunk.S], V[:, :, chunk.start : chunk.S] = k, v
        else:  # ragged rows: scatter each real token to its row's next slot
            row, col, slot = chunk.real
            K[row, :, slot], V[row, :, slot] = k[row, :, col], v[row, :, col]
        if chunk.ring is not None and q is not None:
            row, col, at = chunk.ring  # indices made once per forward, in chunk(): every layer writes the same slots
            self.q_ring_l[layer][row, :, at] = q[row, :, col]
        return K[:, :, : chunk.S], V[:, :, : chunk.S]

    def advance(self, chunk: Chunk):
        """Close a forward pass: every layer has appended the chunk."""
        if chunk.ring is not None:
            row, col, at = chunk.ring
            self.q_pos[row, at] = chunk.pos[row, col]
        for b, c in enumerate(chunk.n):
            self.length[b] += c
            self.next_pos[b] += c

    def keep_rows(self, keep: list[int]):
        """Drop every row not in `keep` (e.g. rows that finished generating): the batch shrinks, memory stays."""
        idx = torch.tensor(keep, device=self.k.device, dtype=torch.long)
        self.k, self.v, self.pos = self.k[:, idx], self.v[:, idx], self.pos[:, idx]
        self.side = {name: s[:, idx] for name, s in self.side.items()}
        self.q_ring, self.q_pos = self.q_ring[:, idx], self.q_pos[idx]
        self.length, self.next_pos, self.rows = ([x[b] for b in keep] for x in (self.length, self.next_pos, self.rows))
        self.views()

    def put_row(self, b: int, src: "KVCache", j: int):
        """Make batch row b a copy of src's row j, every slot and its state (caches of one capacity): a request
        prefilled on its own takes the place a finished row left (generate.generate_refill)."""
        self.k[:, b], self.v[:, b], self.pos[:, b] = src.k[:, j], src.v[:, j], src.pos[:, j]
        for name, side in self.side.items():
            side[:, b] = src.side[name][:, j]
        self.q_ring[:, b], self.q_pos[b] = src.q_ring[:, j], src.q_pos[j]
        self.length[b], self.next_pos[b], self.rows[b] = src.length[j], src.next_pos[j], src.rows[j]
        self.holes |= src.holes  # a row whose heads hold different numbers of slots needs the mask

    def protected(self, layer: int, rows: slice, protect_below: Tensor, n_recent: int) -> Tensor:
        """[n, H_kv, S] bool: the slots of batch rows `rows` (n rows, each holding S slots) that always survive:
        positions below each row's protect_below [n] and the newest n_recent."""
        S = self.length[rows.start]
        recent = torch.arange(S, device=self.pos.device) >= S - n_recent
        return (self.pos[layer, rows, :, :S] < protect_below[:, None, None]) | recent

    def evict(self, rows: slice, scores: list[Tensor], protected: list[Tensor], keep: int | list[Tensor],
              span: int = 0):
        """Keep the `keep` best slots of each KV head of batch rows `rows` (n rows, each holding S slots), in every
        layer: the `protected` ones ([n, H_kv, S] bool, see protected()) always survive, the rest go by highest
        score. scores[layer] is [n, H_kv or 1, S]; a single row of scores means one token set for all heads.
        keep may instead give each head its own count, per layer [n, H_kv] (see evict_per_head)."""
        if not isinstance(keep, int):
            return self.evict_per_head(rows, scores, protected, keep, span)
        S = self.length[rows.start]
        for layer, (s, p) in enumerate(zip(scores, protected)):
            pos = self.pos[layer, rows]  # [n, H_kv, cap]
            n, H = pos.shape[:2]
            s = s.float().nan_to_num(nan=-float("inf")).expand(n, H, S)  # a NaN must never outrank +inf
            s = s.masked_fill(p, float("inf"))
            # keep the top `keep`, then restore temporal order so slots stay sorted by position
            idx = s.topk(keep, dim=-1, sorted=False).indices.sort(dim=-1).values  # [n, H_kv, keep]
            self.move(layer, rows, idx, S)
            pos[:, :, keep:S] = FREE
        for b in range(rows.start, rows.stop):
            self.length[b] = keep

    def move(self, layer: int, rows: slice, idx: Tensor, S: int):
        """Bring slots idx [n, H_kv, m] (of the first S) of every (row, KV head) to the front, in that order: keys,
        values, positions and side state."""
        k, v, pos = self.k[layer, rows], self.v[layer, rows], self.pos[layer, rows]  # [n, H_kv, cap(, D)]
        n, H, cap, D = k.shape
        m = idx.shape[-1]
        # the kept slots of every (row, head) as rows of a [n * H_kv * cap, D] view: one index_select moves whole
        # D-vectors (a gather with an expanded index moves them a float at a time, ~8x slower on CPU)
        flat = (idx + torch.arange(n * H, device=idx.device).view(n, H, 1) * cap).view(-1)  # [n * H_kv * m]
        # note: index_select reads everything before the write-back, so overlapping ranges are safe
        k[:, :, :m] = k.reshape(n * H * cap, D).index_select(0, flat).view(n, H, m, D)
        v[:, :, :m] = v.reshape(n * H * cap, D).index_select(0, flat).view(n, H, m, D)
        pos[:, :, :m] = pos[:, :, :S].gather(2, idx)
        for side in self.side.values():
            side[layer, rows, :, :m] = side[layer, rows, :, :S].gather(2, idx)

    def evict_per_head(self, rows: slice, scores: list[Tensor], protected: list[Tensor], keep: list[Tensor], span: int):
        """evict with budgets that differ per head: head h of a layer keeps its own keep[layer][b, h] best slots, in
        order, at the front of the row; the slots behind them are free (position FREE, masked like any free slot) up to
        `span`, the row's new length: the most one head may hold, so that every row appends at one slot as before.
        Memory: the cache allocates span + r slots per head, a head uses its own keep + what arrived since."""
        S = self.length[rows.start]
        self.holes = True
        for layer, (s, p, kh) in enumerate(zip(scores, protected, keep)):
            pos = self.pos[layer, rows]  # [n, H_kv, cap]
            n, H = pos.shape[:2]
            s = s.float().nan_to_num(nan=-float("inf")).expand(n, H, S).masked_fill(p, float("inf"))
            s = s.masked_fill(pos[:, :, :S] == FREE, -float("inf"))  # a free slot is never kept
            m = int(kh.max())
            must = p.sum(-1)  # [n, H_kv] slots each head must keep: protected positions and the recent buffer
            if (kh < must).any():  # a budget rule that gives a head less would drop a +inf slot: a bug, never a choice
                short = kh < must
                raise RuntimeError(f"layer {layer}: a head's budget {int(kh[short][0])} is below its "
                                   f"{int(must[short][0])} protected slots: raise it in the budget rule (budgets.py)")
            if m > span:
                raise RuntimeError(f"a head keeps {m} slots, past the {span} the cache spans: size it by budgets.row_span")
            # each head's best first; those past its own count sort to the end (as slot S), then temporal order
            top = s.topk(m, dim=-1).indices  # [n, H_kv, m]
            late = torch.arange(m, device=top.device) >= kh[..., None]
            idx = top.masked_fill(late, S).sort(dim=-1).values  # [n, H_kv, m]
            held = idx < S
            self.move(layer, rows, idx.clamp(max=S - 1), S)
            pos[:, :, :m].masked_fill_(~held, FREE)
            pos[:, :, m : max(S, span)] = FREE
        for b in range(rows.start, rows.stop):
            self.length[b] = span
