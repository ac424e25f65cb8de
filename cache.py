"""
The flat, preallocated KV cache and the one place where eviction happens.

Keys are stored after RoPE together with each slot's original token position, so a head may keep any
subset of positions without re-rotating anything (StreamingLLM-style re-rotation is deliberately left out).
Everything that rides with a slot (position, H2O's accumulated attention, EPIKV's frozen score) is
gathered with it. The rows of a batch are independent: each holds its own number of slots, counts its own
positions and is evicted on its own cadence. A slot past a row's length is free: its position reads FREE, later
than any query, so every causal-by-position test hides it. With budgets that differ per head (evict_per_head), the
H_kv * cap slots of a (row, layer) become one pool: each head's kept slots a contiguous segment, in position order,
with r free slots behind it for the appends until the next round (FFY0/AdaKV's flattened cache, without its varlen
kernel). References: kvpress `ScorerPress.compress`, gpt-fast / nanochat KV caches.
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
    at: Tensor | None = None  # pooled: [L, N, H_kv] the pool slot of each real token, per layer and head (else None)


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
        self.pooled = False  # True once heads hold different numbers of slots: one pool per (row, layer), see pool()
        self.off = self.seg = None  # pooled: [L, B, H_kv] each head's segment: its first pool slot, the slots it holds

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
        if S > self.capacity and not self.pooled:  # a pooled row's length counts its fullest head (see pool())
            raise RuntimeError(f"KV cache overflow: {S} slots > capacity {self.capacity}")
        at = None
        # positions and side state of the new slots are the same in every layer: written here, once, for all
        if self.pooled:  # each head appends behind its own segment, at a slot of its own in each layer
            at, alike = self.append_slots(row, col), False
            # [L, N * H_kv] into [L, B * P]
            flat = (at + (row * at.shape[-1] * self.capacity)[None, :, None]).flatten(1)
            self.pos.view(flat.shape[0], -1).scatter_(1, flat, pos[row, col][None, :, None].expand_as(at).flatten(1))
            for side in self.side.values():
                side.view(flat.shape[0], -1).scatter_(1, flat, 0.0)
        elif alike:
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
        return Chunk(n, pos, last, end, start, S, (row, col, slot), ring, at)

    def append(self, layer: int, k: Tensor, v: Tensor, q: Tensor | None, chunk: Chunk) -> tuple[Tensor, Tensor]:
        """Write the chunk's real k, v [B, H_kv, T, D] (and queries q [B, H_q, T, D] into the ring); return
        views of the slots the longest row holds, [B, H_kv, S, D]."""
        K, V = self.k_l[layer], self.v_l[layer]  # [B, H_kv, cap, D]
        if chunk.at is not None:  # pooled: each head's tokens go behind its segment; attention reads the whole pool
            row, col, _ = chunk.real
            B, H, cap, D = K.shape
            K, V = K.view(B, 1, H * cap, D), V.view(B, 1, H * cap, D)  # [B, 1, P, D], P = H_kv * cap
            at = chunk.at[layer]  # [N, H_kv]
            K[row[:, None], 0, at], V[row[:, None], 0, at] = k[row, :, col], v[row, :, col]  # [N, H_kv, D] each
        elif chunk.start is not None:  # every row appends T tokens at the same slot: plain slices
            K[:, :, chunk.start : chunk.S], V[:, :, chunk.start : chunk.S] = k, v
        else:  # ragged rows: scatter each real token to its row's next slot
            row, col, slot = chunk.real
            K[row, :, slot], V[row, :, slot] = k[row, :, col], v[row, :, col]
        if chunk.ring is not None and q is not None:
            row, col, at = chunk.ring  # indices made once per forward, in chunk(): every layer writes the same slots
            self.q_ring_l[layer][row, :, at] = q[row, :, col]
        if chunk.at is not None:
            return K, V
        return K[:, :, : chunk.S], V[:, :, : chunk.S]

    def advance(self, chunk: Chunk):
        """Close a forward pass: every layer has appended the chunk."""
        if chunk.ring is not None:
            row, col, at = chunk.ring
            self.q_pos[row, at] = chunk.pos[row, col]
        for b, c in enumerate(chunk.n):
            self.length[b] += c
            self.next_pos[b] += c
        if self.pooled:
            self.seg += torch.tensor(chunk.n, device=self.seg.device)[None, :, None]

    def keep_rows(self, keep: list[int]):
        """Drop every row not in `keep` (e.g. rows that finished generating): the batch shrinks, memory stays."""
        idx = torch.tensor(keep, device=self.k.device, dtype=torch.long)
        self.k, self.v, self.pos = self.k[:, idx], self.v[:, idx], self.pos[:, idx]
        self.side = {name: s[:, idx] for name, s in self.side.items()}
        self.q_ring, self.q_pos = self.q_ring[:, idx], self.q_pos[idx]
        self.length, self.next_pos, self.rows = ([x[b] for b in keep] for x in (self.length, self.next_pos, self.rows))
        if self.pooled:
            self.off, self.seg = self.off[:, idx], self.seg[:, idx]
        self.views()

    def put_row(self, b: int, src: "KVCache", j: int):
        """Make batch row b a copy of src's row j, every slot and its state (caches of one capacity): a request
        prefilled on its own takes the place a finished row left (generate.generate_refill)."""
        self.k[:, b], self.v[:, b], self.pos[:, b] = src.k[:, j], src.v[:, j], src.pos[:, j]
        for name, side in self.side.items():
            side[:, b] = src.side[name][:, j]
        self.q_ring[:, b], self.q_pos[b] = src.q_ring[:, j], src.q_pos[j]
        self.length[b], self.next_pos[b], self.rows[b] = src.length[j], src.next_pos[j], src.rows[j]
        if src.pooled or self.pooled:  # the row's segments come with it (a row laid out as one is its own segments)
            self.pool()
            src.pool()
            self.off[:, b], self.seg[:, b] = src.off[:, j], src.seg[:, j]

    def protected(self, layer: int, rows: slice, protect_below: Tensor, n_recent: int, pos: Tensor | None = None
                  ) -> Tensor:
        """[n, H_kv, S] bool: the slots of batch rows `rows` (n rows, each holding S slots) that always survive:
        positions below each row's protect_below [n] and the newest n_recent. pos: the rows' positions per head
        [n, H_kv, S] (head_view's, for a pooled cache), else the cache's own."""
        S = self.length[rows.start]
        pos = self.pos[layer, rows, :, :S] if pos is None else pos
        recent = torch.arange(S, device=self.pos.device) >= S - n_recent
        return (pos < protect_below[:, None, None]) | recent

    def evict(self, rows: slice, scores: list[Tensor], protected: list[Tensor], keep: int | list[Tensor],
              span: int = 0, views: list[tuple] | None = None, buffer: int = 0):
        """Keep the `keep` best slots of each KV head of batch rows `rows` (n rows, each holding S slots), in every
        layer: the `protected` ones ([n, H_kv, S] bool, see protected()) always survive, the rest go by highest
        score. scores[layer] is [n, H_kv or 1, S]; a single row of scores means one token set for all heads.
        keep may instead give each head its own count, per layer [n, H_kv] (see evict_per_head)."""
        if not isinstance(keep, int):
            return self.evict_per_head(rows, scores, protected, keep, span, views, buffer)
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

    # -------------------------------------------------------------------------------------------------------------
    # budgets that differ per head: one pool per (row, layer)
    #
    # The H_kv * cap slots of a (row, layer) are one pool, P = H_kv * cap. Head h holds seg[h] slots from off[h], in
    # position order; the slots up to the next head's offset are free (position FREE): its appends go there. A layer's
    # heads keep H_kv * K slots together after a round and each gains r before the next, so a pool of H_kv * (K + r)
    # holds them all (plus a slot per head for AdaKV's rounding, generate.make_cache). Before its first per-head
    # round a row is the uniform layout read as a pool: head h at h * cap, holding the row's length.

    def pool(self):
        """Read the cache as pools from now on (the first per-head round): segments as laid out so far."""
        if self.pooled:
            return
        L, B, H, cap = self.pos.shape
        dev = self.pos.device
        self.off = (torch.arange(H, device=dev) * cap).expand(L, B, H).clone()  # [L, B, H_kv]
        self.seg = torch.tensor(self.length, device=dev)[None, :, None].expand(L, B, H).clone()  # [L, B, H_kv]
        self.pooled = True

    def ends(self, layer=slice(None), rows=slice(None)) -> Tensor:
        """[..., H_kv] the slot past each head's region: the next head's offset, the pool's size for the last."""
        off = self.off[layer, rows]
        return torch.cat([off[..., 1:], torch.full_like(off[..., :1], off.shape[-1] * self.capacity)], -1)

    def append_slots(self, row: Tensor, col: Tensor) -> Tensor:
        """[L, N, H_kv]: the pool slot where real token (row[i], col[i]) goes in each layer and head, behind the
        head's segment; a segment that would run into the next head's stops with an error."""
        at = self.off[:, row] + self.seg[:, row] + col[None, :, None]
        if (at >= self.ends()[:, row]).any():
            raise RuntimeError("KV cache overflow: a head's appends run past its segment's free slots")
        return at

    def owners(self, layer: int) -> Tensor:
        """[B, H_kv, P] bool: which pool slots are head h's region (its segment and the free slots behind it)."""
        P = self.off.shape[-1] * self.capacity
        slot = torch.arange(P, device=self.off.device)
        return (slot >= self.off[layer][..., None]) & (slot < self.ends(layer)[..., None])

    def heads(self, layer, rows: slice, base: int, S: int) -> Tensor:
        """[..., n, H_kv, S] the pool slot behind each slot of a padded per-head layout of width S, -1 where free:
        head h's first `kept` slots at the front, free slots up to `base`, then what it appended since (length - base
        slots). base = the width a round left (evict_per_head's span; 0 before the first round) gives the layout
        the scorers see, the one the padded cache had; base = length gives each head's slots at the front.
        e.g. base 4, S 6, head at off 10 with seg 4 (2 kept, 2 appended): [10, 11, -1, -1, 12, 13]."""
        off, seg = self.off[layer, rows], self.seg[layer, rows]  # [..., n, H_kv]
        since = torch.tensor(self.length[rows], device=off.device)[:, None] - base  # [n, 1] appended since
        kept = seg - since
        j = torch.arange(S, device=off.device)
        src = torch.where(j < base, off[..., None] + j, (off + kept)[..., None] + j - base)
        return src.masked_fill((j < base) & (j >= kept[..., None]), -1)

    def head_view(self, layer: int, rows: slice, base: int, S: int) -> tuple:
        """Copies of rows' keys, values [n, H_kv, S, D], positions [n, H_kv, S] (FREE where free) and side state laid
        out per head (heads()), for the scorers; and the pool slot behind each, [n, H_kv, S]."""
        self.pool()
        src = self.heads(layer, rows, base, S)
        n, H = src.shape[:2]
        P, D = H * self.capacity, self.k.shape[-1]
        safe = src.clamp(min=0)
        flat = (safe + torch.arange(n, device=src.device)[:, None, None] * P).view(-1)
        k = self.k[layer, rows].view(n * P, D).index_select(0, flat).view(n, H, S, D)
        v = self.v[layer, rows].view(n * P, D).index_select(0, flat).view(n, H, S, D)
        per_slot = lambda x: x[layer, rows].reshape(n, P).gather(1, safe.view(n, -1)).view(n, H, S)
        pos = per_slot(self.pos).masked_fill(src < 0, FREE)
        return k, v, pos, {name: per_slot(x) for name, x in self.side.items()}, src

    def head_pos(self, b: int) -> Tensor:
        """[L, H_kv, S] the positions each head of batch row b holds, at the front, FREE behind (S: the row's
        length): the same reading in either layout."""
        S = self.length[b]
        if not self.pooled:
            return self.pos[:, b, :, :S]
        src = self.heads(slice(None), slice(b, b + 1), S, S)[:, 0]  # [L, H_kv, S]
        L, H = src.shape[:2]
        return self.pos[:, b].reshape(L, -1).gather(1, src.clamp(min=0).view(L, -1)).view(L, H, S).masked_fill(
            src < 0, FREE)

    def to_front(self, layer: int, b: int, src: Tensor, x: Tensor) -> Tensor:
        """Batch row b's per-slot values x [H_kv or 1, S] laid out as src [H_kv, S] (head_view's) -> laid out as
        head_pos lays them out, -inf where a head holds nothing (e.g. a round's scores, for a watcher)."""
        H, S = src.shape
        rel = (src - self.off[layer, b][:, None]).masked_fill(src < 0, S)  # each slot's place in its segment
        out = torch.full((H, S + 1), -float("inf"), device=x.device)
        return out.scatter_(1, rel, x.float().expand(H, S))[:, :S]

    def evict_per_head(self, rows: slice, scores: list[Tensor], protected: list[Tensor], keep: list[Tensor], span: int,
                       views: list[tuple] | None = None, buffer: int = 0):
        """evict with budgets that differ per head: head h of a layer keeps its own keep[layer][b, h] best slots,
        ranked on the padded layout views[layer] = (pos, side, src) of head_view; then compact() lays them out as
        segments. The row's length becomes `span`, the most one head may hold, as if every head were padded to it:
        the scorers' layout and the eviction cadence (span + r) stay what they were with one padded row per head."""
        S = self.length[rows.start]
        if views is None:  # the rows as they lie, before any per-head round
            views = [self.head_view(layer, rows, 0, S)[2:] for layer in range(len(scores))]
        for layer, (s, p, kh, (pos, side, src)) in enumerate(zip(scores, protected, keep, views)):
            n, H = pos.shape[:2]
            s = s.float().nan_to_num(nan=-float("inf")).expand(n, H, S).masked_fill(p, float("inf"))
            s = s.masked_fill(pos == FREE, -float("inf"))  # a free slot is never kept
            m = int(kh.max())
            must = p.sum(-1)  # [n, H_kv] slots each head must keep: protected positions and the recent buffer
            if (kh < must).any():  # a budget rule that gives a head less would drop a +inf slot: a bug, never a choice
                short = kh < must
                raise RuntimeError(f"layer {layer}: a head's budget {int(kh[short][0])} is below its "
                                   f"{int(must[short][0])} protected slots: raise it in the budget rule (budgets.py)")
            if m > span:
                raise RuntimeError(f"a head keeps {m} slots, past the {span} the cache spans: size it by "
                                   "budgets.row_span")
            # each head's best first; those past its own count sort to the end (as slot S), then temporal order
            top = s.topk(m, dim=-1).indices  # [n, H_kv, m]
            late = torch.arange(m, device=top.device) >= kh[..., None]
            idx = top.masked_fill(late, S).sort(dim=-1).values  # [n, H_kv, m]: head h's kh[h] kept first, in order
            self.compact(layer, rows, idx.clamp(max=S - 1), ~late, kh, (pos, side, src), buffer)
        for b in range(rows.start, rows.stop):
            self.length[b] = span

    def compact(self, layer: int, rows: slice, idx: Tensor, held: Tensor, kh: Tensor, view: tuple, buffer: int):
        """Lay out each head's kept slots idx [n, H_kv, m] (of the padded view, held [n, H_kv, m] marks the real
        ones, kh [n, H_kv] of them) as its new segment: head h from sum over g < h of (kh[g] + buffer), in order,
        `buffer` free slots behind. Keys and values move inside the pool; positions and side state come from the
        view, where a scorer may have filled new slots' state (criticalkv's value norms)."""
        pos, side, src = view
        n, H, m = idx.shape
        P, D = H * self.capacity, self.k.shape[-1]
        off = torch.cumsum(kh + buffer, -1) - (kh + buffer)  # [n, H_kv]
        if (off[:, -1] + kh[:, -1] + buffer > P).any():
            raise RuntimeError(f"the heads keep {kh.sum(-1).max()} slots, past the pool's {P} less the buffers")
        base = torch.arange(n, device=idx.device)[:, None, None] * P
        frm = (src.gather(2, idx) + base)[held]  # [N_kept] flat pool slots, every row and head
        to = (off[..., None] + torch.arange(m, device=idx.device) + base)[held]
        for x in (self.k[layer, rows], self.v[layer, rows]):  # [n, H_kv, cap, D] views
            flat = x.view(n * P, D)
            flat[to] = flat.index_select(0, frm)  # note: index_select copies before the write: overlaps are safe
        for x, y in ((self.pos, pos), *((self.side[k], side[k]) for k in self.side)):
            flat = x[layer, rows].view(n * P)
            flat.fill_(FREE if x is self.pos else 0)
            flat[to] = y.gather(2, idx)[held]
        self.off[layer, rows], self.seg[layer, rows] = off, kh
