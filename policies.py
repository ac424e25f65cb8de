"""
The eviction policies: a registry of names, each a scorer and how it runs (its protection, query window, observer,
side state, per-head budgets). Scorers map a ScoreCtx (scoring.py) to scores, higher = keep, and live by the signal
they read: attention (policies_attention.py: snapkv, h2o, scissorhands, raas, rkv, adakv); values (policies_values.py:
vase and its ablations, vase-dkv, curdkv, curdkv-fixed, criticalkv, criticalkv-ada, lagkv, epikv-lag); the residual
stream (policies_residual.py: epikv, epikv-band); RoPE's frequencies (triattention.py); and here positions
(streaming) and nothing at all (random).
Left out: prefill-only methods, quantisation. Papers: linked at each scorer; StreamingLLM
(https://arxiv.org/abs/2309.17453), Random Attention (prompt protection + per-head random keep) below.
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from policies_attention import (adakv, h2o, h2o_observe, raas, raas_observe, rkv, scissorhands, scissorhands_observe,
                                snapkv)
from policies_residual import epikv, epikv_observe
from policies_values import criticalkv, criticalkv_ada, curdkv, epikv_lag, lagkv, vase, vase_dkv
from scoring import ScoreCtx, draw, snapkv_attention
from triattention import prepare as triattention_stats
from triattention import triattention


# -----------------------------------------------------------------------------
# the two scorers that read neither attention nor values


def streaming(ctx: ScoreCtx) -> Tensor:
    """StreamingLLM (https://arxiv.org/abs/2309.17453): the newest tokens win; the sinks come from protection."""
    return ctx.pos.float()


def random_(ctx: ScoreCtx) -> Tensor:
    """Random Attention: protect the prompt, then keep uniformly random tokens, independently per KV head."""
    return draw(ctx, torch.rand, *ctx.pos.shape[1:])


# -----------------------------------------------------------------------------
# the registry


@dataclass
class Policy:
    score: Callable[[ScoreCtx], Tensor] | None  # None = never evict
    protect_prompt: bool = False  # the paper's default; --protect-prompt overrides it for all
    window: int | str = 0  # how many recent queries the scorer reads from the ring; "buffer" = r of them
    observe: Callable | None = None  # observe(cache, out, run) after every forward, for state built while decoding
    side: tuple = ()  # per-slot side state the cache must carry
    per_head: bool = False  # heads get their own budgets (the scorer sets ScoreCtx.keep); the cache: budgets.row_span
    prepare: Callable | None = None  # prepare(model, stats_file) -> ScoreCtx.stats, once a request (calibration)
    redraw: bool = True  # ScoreCtx.generators start afresh each round; False: the same draws every round of a request


POLICIES = {
    "full": Policy(None),
    "streaming": Policy(streaming),
    "snapkv": Policy(snapkv, window="buffer"),
    "h2o": Policy(h2o, observe=h2o_observe, side=("h2o",)),
    "rkv": Policy(rkv, window=8),
    "random": Policy(random_, protect_prompt=True),
    "vase": Policy(vase, window="buffer"),
    "vase-dkv": Policy(vase_dkv),
    "criticalkv": Policy(criticalkv, window="buffer", side=("vnorm",)),
    "epikv": Policy(epikv, protect_prompt=True, observe=epikv_observe, side=("epikv",)),
    "epikv-band": Policy(epikv, protect_prompt=True, side=("epikv",),
                         observe=partial(epikv_observe, bands=True, weights=(1.29, 1.0))),
    "epikv-lag": Policy(epikv_lag, protect_prompt=True),
    # VASE's ablations, one knob of the same scorer each: they test the two halves of its claim
    "vase-topk": Policy(partial(vase, sample=False), window="buffer"),
    "vase-noreserve": Policy(partial(vase, reserve=0), window="buffer"),
    "vase-adversary": Policy(partial(vase, sample=False, reserve=-1, weights=snapkv_attention), window="buffer"),
    # budgets that differ per head, evicting for real at every round (kvpress only masks at decode time)
    "adakv": Policy(adakv, window="buffer", per_head=True),
    "criticalkv-ada": Policy(criticalkv_ada, window="buffer", side=("vnorm",), per_head=True),
    # the seeds' own baselines (DESIGN.md §6b)
    "triattention": Policy(triattention, protect_prompt=True, prepare=triattention_stats),
    "triattention-layer": Policy(partial(triattention, shared=False), protect_prompt=True, prepare=triattention_stats),
    "curdkv": Policy(curdkv),
    # VASE's own deterministic control (cur_fixed_gauss, the "CurDKV" of its plots): vase-dkv's sketch, drawn once
    "curdkv-fixed": Policy(vase_dkv, redraw=False),
    "lagkv": Policy(lagkv),
    "scissorhands": Policy(scissorhands, observe=scissorhands_observe, side=("sh_hits", "sh_seen")),
    "raas": Policy(raas, protect_prompt=True, observe=raas_observe, side=("raas",)),
}
