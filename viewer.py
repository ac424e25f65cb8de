"""
What the cache kept, drawn: what one layer holds at the end (--show-kept's map, --kept-json's data for `eval.py plot`),
and a Recording of every eviction round, taken from the run itself through Run.watch (the hook eval.kept_share uses):
the scores cache.evict ranks, then what each layer and head kept; without one, nothing is recorded or paid.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor


# -----------------------------------------------------------------------------
# what one layer holds at the end: a terminal map (--show-kept), or the positions as data (--kept-json, for
# `eval.py plot`)


def show_kept(cache, layer: int, prompt_len: int, buffer: int, width: int = 96) -> str:
    """One row per KV head: each character covers `per` positions, shaded by the fraction of them kept."""
    n = cache.next_pos[0]
    per = -(-n // width)  # positions per character, rounded up
    cols = -(-n // per)
    pos = cache.pos[layer, 0, :, : cache.length[0]]  # [H_kv, S]
    kept = torch.zeros(pos.shape[0], cols * per, device=pos.device).scatter_(1, pos, 1.0)
    span = torch.arange(cols * per).view(cols, per) < n  # the last character may cover fewer positions
    frac = (kept.view(-1, cols, per).cpu() * span).sum(-1) / span.sum(-1)  # [H_kv, cols]
    shade = lambda f: " " if f == 0 else "█" if f == 1 else "░▒▓"[min(2, int(f * 3))]
    region = "".join("P" if c * per < prompt_len else "R" if (c + 1) * per > n - buffer else "T" for c in range(cols))
    lines = [f"kept positions, layer {layer}: 1 char = {per} positions (P prompt, T trace, R recent buffer)",
             f"         {region}"]
    lines += [f"head {h:<3} " + "".join(shade(f) for f in row) for h, row in enumerate(frac.tolist())]
    return "\n".join(lines)


def kept_map(cache, layer: int, run, policy: str) -> dict:
    """What show_kept draws, as data: the positions each KV head of `layer` holds (row 0), and where the prompt and
    the recent buffer lie among the positions fed so far. `eval.py plot` draws it as an image."""
    return {"kind": "kept", "policy": policy, "budget": run.budget, "buffer": run.buffer, "layer": layer,
            "prompt_len": run.prompt_len[0], "positions": cache.next_pos[0],
            "heads": cache.pos[layer, 0, :, : cache.length[0]].tolist()}  # [H_kv][S], in temporal order


# -----------------------------------------------------------------------------
# recording every round of one row, through run.watch


@dataclass
class Round:
    at: int  # positions fed when the round ran: [0, at) existed
    scores: Tensor  # [L, H_kv, at] fp32, what cache.evict ranked, by position; NaN where no slot held the position
    kept: Tensor  # [L, H_kv, at] bool: the positions each layer and KV head holds after the round


class Recording:
    """Attached to a Run (it takes run.watch), records every eviction round of one row of the request."""

    def __init__(self, run, row: int = 0):
        self.row, self.rounds, self.scores = row, [], None
        run.watch = self.watch

    def watch(self, cache, b: int, when: str, scores: list[Tensor] | None):
        if cache.rows[b] != self.row:
            return
        L, _, H, _ = cache.pos.shape
        at, S = cache.next_pos[b], cache.length[b]
        pos = cache.pos[:, b, :, :S].cpu()  # [L, H_kv, S], each slot's position (all < at)
        if when == "scored":  # slot i of a head scores scores[layer][h, i]; a one-set scorer's [1, S] serves all heads
            # NaN ranks as -inf in cache.evict: we record it so, and keep NaN for "no slot held this position"
            s = torch.stack([x.float().nan_to_num(nan=-math.inf).expand(H, S).cpu() for x in scores])  # [L, H_kv, S]
            self.scores = torch.full((L, H, at), math.nan).scatter_(2, pos, s)
        elif when == "after":
            self.rounds.append(Round(at, self.scores, torch.zeros(L, H, at, dtype=torch.bool).scatter_(2, pos, True)))
