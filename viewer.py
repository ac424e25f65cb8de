"""
What the cache kept, drawn: what one layer holds at the end (--show-kept's map, --kept-json's data for `eval.py plot`),
and the --html page, one self-contained file (viewer.html filled with a run's data) that replays every eviction round
over the answer's own text, per layer and KV head. A Recording takes the rounds from the run itself, through Run.watch
(the hook eval.kept_share uses): the scores cache.evict ranks, then what each layer and head kept; without one, nothing
is recorded or paid. Marks come from those scores, so no policy logic is repeated: a score >= scoring.BIG means "keep
before ranking the rest" (VASE's widest-value reserve, CriticalKV's stage 1), and each round's cut-off, the lowest
score the ranking kept, tells what a score meant there. A model's text is untrusted: it travels as escaped JSON and
the page sets it as text, never as markup. Left out: other batch rows, the policies' side state.
"""

import base64
import codecs
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from cache import FREE
from scoring import BIG

TEMPLATE = Path(__file__).with_name("viewer.html")
# what a score >= BIG means, in the words of the policies that use it (policies_values.vase, policies_values.criticalkv)
MARKS = {"vase": "VASE's reserve: the widest value ranges", "vase-topk": "VASE's reserve: the widest value ranges",
         "criticalkv": "CriticalKV's stage 1: SnapKV's top half of the budget",
         "criticalkv-ada": "CriticalAdaKV's safeguard and stage 1: SnapKV's top half of each head's budget"}


# -----------------------------------------------------------------------------
# what one layer holds at the end: a terminal map (--show-kept), or the positions as data (--kept-json, for
# `eval.py plot`)


def show_kept(cache, layer: int, prompt_len: int, buffer: int, width: int = 96) -> str:
    """One row per KV head: each character covers `per` positions, shaded by the fraction of them kept."""
    n = cache.next_pos[0]
    per = -(-n // width)  # positions per character, rounded up
    cols = -(-n // per)
    pos = cache.head_pos(0)[layer].clamp(max=cols * per)  # [H_kv, S]; a free slot (per-head
    # budgets) lands in one extra column, dropped
    kept = torch.zeros(pos.shape[0], cols * per + 1, device=pos.device).scatter_(1, pos, 1.0)[:, :-1]
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
            "heads": [[p for p in head if p != FREE] for head in cache.head_pos(0)[layer].tolist()]}
    # [H_kv][held], in temporal order; with per-head budgets each head holds its own number


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
        # [L, H_kv, S], each slot's position (< at), or FREE where a head with a smaller budget holds nothing: those
        # land in one extra column, dropped
        pos = cache.head_pos(b).cpu().clamp(max=at)
        if when == "scored":  # slot i of a head scores scores[layer][h, i]; a one-set scorer's [1, S] serves all heads
            # NaN ranks as -inf in cache.evict: we record it so, and keep NaN for "no slot held this position"
            s = torch.stack([x.float().nan_to_num(nan=-math.inf).expand(H, S).cpu() for x in scores])  # [L, H_kv, S]
            self.scores = torch.full((L, H, at + 1), math.nan).scatter_(2, pos, s)[..., :at]
        elif when == "after":
            kept = torch.zeros(L, H, at + 1, dtype=torch.bool).scatter_(2, pos, True)[..., :at]
            self.rounds.append(Round(at, self.scores, kept))


# -----------------------------------------------------------------------------
# the page's data: text, settings and rounds, packed


def token_texts(pieces: list[bytes]) -> tuple[list[str], dict[int, str]]:
    """Each token's text as it reads in the answer: a UTF-8 character split across tokens shows with the token that
    completes it, bytes that are no UTF-8 as U+FFFD. Also, as hex, the bytes of each token that is no text alone.
    Example: [b"caf", b"\\xc3", b"\\xa9", b"\\xff"] -> ["caf", "", "é", "\\ufffd"], {1: "c3", 2: "a9", 3: "ff"}"""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = [dec.decode(p) for p in pieces]
    if texts:
        texts[-1] += dec.decode(b"", final=True)  # a character cut short at the end
    odd = {}
    for i, p in enumerate(pieces):
        try:
            p.decode("utf-8")
        except UnicodeDecodeError:
            odd[i] = p.hex(" ")
    return texts, odd


def bits(x: Tensor) -> str:
    """A bool tensor as base64 of its bits, flattened: bit i is bit i % 8 (least significant first) of byte i // 8."""
    return base64.b64encode(np.packbits(x.flatten().numpy(), bitorder="little").tobytes()).decode()


def halves(x: Tensor) -> str:
    """A tensor as base64 of little-endian float16s: three significant digits, BIG and beyond become +inf."""
    with np.errstate(over="ignore"):  # past float16's 65504 is +inf, as intended
        return base64.b64encode(x.flatten().numpy().astype("<f2").tobytes()).decode()


def cut_off(r: Round, protect_below: int, buffer: int) -> Tensor:
    """[L, H_kv]: the score a slot needed to stay at round r, the lowest that the ranking kept (the K'-th highest of the
    ranked slots, K' = what the budget leaves after the protected, the recent buffer and the must-keeps). NaN where the
    round ranked nothing; a slot evicted there scored at most this."""
    ranked = ~r.scores.isnan() & (r.scores < BIG)  # [L, H_kv, at]: held and scored, no must-keep
    ranked[..., :protect_below] = False  # the protected prompt or the sinks
    ranked[..., max(0, r.at - buffer) :] = False  # the recent buffer at the round: never ranked
    low = r.scores.masked_fill(~(ranked & r.kept), math.inf).amin(-1)
    return low.masked_fill(low == math.inf, math.nan)


def view(name: str, run, rec: Recording, prompt: list[int], ids: list[int], pieces: list[bytes],
         thinking: int = 0) -> dict:
    """One run as the page reads it. ids: the answer (its last token was sampled, never fed); pieces: the bytes of
    each token of prompt + ids (Tokenizer.token_bytes); thinking: how many of the answer's tokens are a thinking
    model's thinking, </think> included (Tokenizer.thought; 0: none), marked on the page where it ends."""
    texts, odd = token_texts(pieces)
    rounds = []
    for r in rec.rounds:
        marked = r.scores >= BIG  # NaN compares False: only held positions are marked
        rounds.append({"at": r.at, "kept": bits(r.kept), "scores": halves(r.scores),
                       "marked": bits(marked) if marked.any() else None,
                       "cut": halves(cut_off(r, run.protect_below[rec.row], run.buffer))})
    evicting = run.budget is not None
    return {"name": name, "label": f"{name} K={run.budget} r={run.buffer}" if evicting else "full cache",
            "budget": run.budget, "buffer": run.buffer if evicting else 0,
            "protect_below": run.protect_below[rec.row] if evicting else 0,
            "fed": len(prompt) + len(ids) - 1, "ids": prompt + ids, "tokens": texts, "odd": odd,
            "think_end": len(prompt) + thinking if thinking else None,  # the first position after the thinking
            "mark": MARKS.get(name, "the scorer's must-keep (score >= BIG)"), "rounds": rounds}


def embed(data) -> str:
    """JSON that can sit inside <script>: ASCII only (so U+2028 and U+2029 arrive escaped too), and <, > and & written
    as \\u escapes, so that no text can close the element (</script>) or open a comment. The page reads it with
    JSON.parse and shows it with textContent: text, never markup."""
    s = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page(views: list[dict], cfg, prompt_len: int) -> str:
    """The HTML page for one or two runs of the same prompt (a policy, and what --compare answered with)."""
    data = {"layers": cfg.num_hidden_layers, "heads": cfg.num_key_value_heads, "prompt_len": prompt_len,
            "runs": views}
    return TEMPLATE.read_text(encoding="utf-8").replace("__DATA__", embed(data), 1)


