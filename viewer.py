"""
What the cache kept, drawn: what one layer holds at the end, as a terminal map (generate.py --show-kept) or as data
for `eval.py plot` (--kept-json). The loop never calls it: generate.py's CLI does.
"""

import torch


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
