"""
Generate text with a KV-cache eviction policy: prefill, decode loop, eviction cadence, sampling, the CLI.

    python generate.py --policy criticalkv --show-kept
    python generate.py --policy criticalkv --html kept.html    # then open kept.html in a browser

Eviction (DESIGN.md §5): the newest `buffer` tokens are never scored; when the cache reaches budget + buffer
slots, every layer keeps `budget` (protected prompt or sinks, the buffer, and the best-scored rest); a per-head
policy (adakv, criticalkv-ada) splits the layer's heads x budget unevenly between its heads (budgets.py).
Several prompts of different lengths decode as one batch, each row on its own eviction cadence; a batch of one
row is the plain batch-1 decoder. `generate_refill` keeps a sweep's batch full (continuous batching): a finished
row's place goes to the next prompt, prefilled apart and copied in. Left out: speculative decoding, paged memory.

Laid out top to bottom: a request's settings (`Run`, `make_run`, `make_cache`); the loop, the part to read first
(`evict_round`, `evict_due`, `feed`, `sample`, `generate`), then the refilling batch (`generate_refill`, `join`);
the CLI (`build_parser`, `main`, `run_cli`, `compare_run`, `divergence`). What every command line shares (devices,
loading, one-line errors) is in cli.py; what the cache kept, drawn (--show-kept's map, --kept-json, the --html page
that records every round through Run.watch), is in viewer.py.
"""

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from tqdm import tqdm

import budgets
import viewer  # what the cache kept, drawn (--show-kept, --kept-json, --html): the CLI's alone, never the loop's
from cache import FREE, KVCache
from cli import (Parser, UsageError, add_device_args, check_output, distinct_outputs, load, local_model, note,
                 output_failed, peak_memory_mb, write_output)
from model import ModelError
from policies import POLICIES, Policy
from scoring import N_SINK, ScoreCtx

DEFAULT_PROMPT = ("Describe the water cycle step by step, from evaporation to precipitation. "
                  "What is the main source of heat that drives it?")
DEFAULT_ANSWER = "sun"  # the full cache's greedy answer ends with it (test_all checks), after ~460 tokens
DEFAULT_BUDGET = 192  # for evicting policies: fits the default protected prompt, and the default answer evicts


# -----------------------------------------------------------------------------
# one request's eviction settings and bookkeeping


@dataclass
class Run:
    policy: Policy
    budget: int | None  # K, slots right after an eviction; None = full cache
    buffer: int  # r, newest slots never scored
    prompt_len: list[int]  # per row of the request
    protect_below: list[int]  # per row: positions below this always survive (its prompt length, or N_SINK)
    seed: int = 0
    ids: list[int] = field(default_factory=list)  # per row: its identity for random draws (default: its index)
    state: list[dict] = field(default_factory=list)  # per row: the policy's state (EPIKV's rolling history)
    rounds: list[int] = field(default_factory=list)  # per row: eviction rounds so far
    evict_s: float = 0.0  # seconds spent evicting, all rows
    max_slots: int = 0  # most slots any row ever held
    span: int = 0  # slots a row spans after a round (make_cache): K, or with per-head budgets the most a head may hold
    stats_file: str | None = None  # the policy's statistics from a file (--triattention-stats), else its own
    stats: object = None  # what policy.prepare made of the model (make_cache), handed to every ScoreCtx
    # watch(cache, b, when, scores) around each eviction of batch row b, untimed (eval.py, viewer.py). when: "before",
    # "scored" (no slot has moved yet; scores: row b's per layer, [H_kv or 1, S] each, as cache.evict will rank them)
    # or "after"; scores is None but at "scored"
    watch: Callable | None = None

    def __post_init__(self):
        self.ids = self.ids or list(range(len(self.prompt_len)))
        self.state = self.state or [{} for _ in self.prompt_len]
        self.rounds = self.rounds or [0] * len(self.prompt_len)

    @property
    def evictions(self) -> int:
        return sum(self.rounds)

    def due(self, row: int) -> int:
        """The slot count at which row `row` evicts: K + r; with per-head budgets, after its first round, span + r."""
        return (self.span if self.rounds[row] else self.budget) + self.buffer

    @property
    def ring(self) -> int:
        """How many recent queries per row the cache keeps for the scorer."""
        return self.buffer if self.policy.window == "buffer" else self.policy.window


def make_run(policy: str, budget: int | None, buffer: int, protect: bool | None, prompt_len: int | list[int],
             seed: int = 0, ids: list[int] | None = None, stats_file: str | None = None) -> Run:
    """Check the settings against each other and the prompt (or each row's prompt, for a batch);
    protect=None takes the policy's paper default. ids: each row's identity for its random draws, e.g. its problem's
    index in a sweep, so that a row's draws do not depend on which batch it ran in. stats_file: a calibration file
    for a policy that reads one (TriAttention, in its authors' format)."""
    lens = [prompt_len] if isinstance(prompt_len, int) else list(prompt_len)
    if policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r}: choose one of {', '.join(sorted(POLICIES))}")
    p = POLICIES[policy]
    if stats_file is not None:  # '' included: an empty flag is a mistake, not "none"
        check_stats_file(stats_file, policy, p)
    if p.score is None:
        if budget is not None:
            raise UsageError("--budget has no effect with --policy full (it keeps every token): "
                             "drop it or pick an evicting policy")
        return Run(p, None, buffer, lens, [0] * len(lens), seed, ids or [])
    budget = DEFAULT_BUDGET if budget is None else budget
    if buffer < 1:
        raise UsageError(f"--buffer must be at least 1 (got {buffer})")
    if budget <= buffer:
        raise UsageError(f"--budget {budget} must exceed --buffer {buffer}: the buffer is part of the budget")
    protect = p.protect_prompt if protect is None else protect
    keep = max(lens) if protect else N_SINK
    if keep > budget - buffer:
        what = f"the protected prompt ({keep} tokens) does" if protect else f"the {N_SINK} sink tokens do"
        fix = " or --no-protect-prompt" if protect else ""
        raise UsageError(f"{what} not fit in --budget {budget} minus --buffer {buffer} = {budget - buffer} "
                         f"slots: use --budget >= {keep + buffer}{fix}")
    if p.per_head and p.observe:  # an observer reads each head's slots at slot = index; a pooled head starts elsewhere
        raise UsageError(f"{policy}: per-head budgets with an observe= hook are not supported (the heads share a pool)")
    return Run(p, budget, buffer, lens, lens if protect else [N_SINK] * len(lens), seed, ids or [],
               stats_file=stats_file)


def check_stats_file(path: str, policy: str, p: Policy):
    """--triattention-stats, before the model loads: read by a policy that reads one, and a file with bytes in it
    (its content is checked when it loads: triattention.from_authors_format)."""
    if not p.prepare:
        raise UsageError(f"--triattention-stats is read by triattention and triattention-layer only, not {policy}")
    f = Path(path)
    what = "is empty: name the file" if not path.strip() else "is a directory, not a file" if f.is_dir() else \
        "does not exist" if not f.exists() else "is not a regular file" if not f.is_file() else \
        "is an empty file (0 bytes)" if f.stat().st_size == 0 else None
    if what:
        raise UsageError(f"--triattention-stats {path!r} {what}: pass a statistics file in the authors' format (their "
                         "scripts/calibrate.py), or drop the flag: nanokv then calibrates itself")


def make_cache(model, run: Run, n_tokens: int, batch: int | None = None) -> KVCache:
    """A cache for each row of the request (or `batch` rows that its rows take turns in, generate_refill) and
    n_tokens per row: K + r slots per head when evicting (K + r + 1 for a per-head policy), else all."""
    run.span = run.budget
    if run.policy.per_head and run.budget is not None:  # after a round, the row spans what its fullest head may keep
        run.span = budgets.row_span(model.cfg.num_key_value_heads, run.budget, run.buffer)
    evicts = run.budget is not None and n_tokens >= run.budget + run.buffer  # a round falls on the K + r-th token
    # per-head budgets: the heads of a (row, layer) share one pool of H_kv * cap slots (cache.py); AdaKV's rounding
    # may give the heads of a layer up to H_kv // 2 slots past H_kv * K between them: one slot per head covers it
    cap = run.budget + run.buffer + run.policy.per_head if evicts else n_tokens
    run.state, run.rounds = [{} for _ in run.prompt_len], [0] * len(run.prompt_len)  # a new cache starts afresh
    if run.policy.prepare and run.stats is None:  # e.g. TriAttention's calibration: once a request, cached on disk
        run.stats = run.policy.prepare(model, run.stats_file)
    return empty_cache(model, run, len(run.prompt_len) if batch is None else batch, cap)


def empty_cache(model, run: Run, batch: int, capacity: int) -> KVCache:
    """`batch` empty rows of `capacity` slots, laid out for the model and run's policy; run's state is left alone."""
    cfg, w = model.cfg, model.model.embed_tokens.weight
    return KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, capacity,
                   n_q_heads=cfg.num_attention_heads, window=run.ring, side=run.policy.side,
                   device=w.device, dtype=w.dtype)


def seed_of(*parts: int) -> int:
    """A 63-bit generator seed from any integers, e.g. (--seed, row, layer, round); any --seed works, even 2**70."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


# -----------------------------------------------------------------------------
# prefill, decode, eviction


def evict_round(model, cache: KVCache, run: Run, b: int, n: int = 1):
    """Score every layer of batch rows b .. b + n - 1 together, then evict every layer of them back to the budget.
    The rows are all due (each holds run.due(row) slots: budget + buffer, or span + buffer once per-head), and all in
    their first round or all past it."""
    rows = cache.rows[b : b + n]  # their indices in the request: draws and state follow them, not their batch slots
    if run.watch:
        for i in range(b, b + n):
            run.watch(cache, i, "before", None)
    t0 = time.perf_counter()
    S, r, dev = cache.length[b], slice(b, b + n), cache.k.device  # views into the cache, no copies
    per_head, fresh = run.policy.per_head, run.span if run.rounds[rows[0]] else 0
    # a per-head cache's heads are segments of one pool: the scorers get copies laid out per head (cache.head_view)
    all_kv = None if per_head else (cache.k[:, r, :, :S], cache.v[:, r, :, :S])
    below = torch.tensor([run.protect_below[row] for row in rows], device=dev)  # [n]
    next_pos = torch.tensor(cache.next_pos[b : b + n], device=dev)[:, None, None]  # [n, 1, 1]
    memo = {}  # shared by this round's layers (e.g. epikv-lag scores all layers at once)
    scores, masks, keeps, views = [], [], [], []
    # subtle: all layers are scored before any is evicted, so a scorer that pools over layers sees one state
    for layer, blk in enumerate(model.model.layers):
        if per_head:  # keys, values, positions [n, H_kv, S(, D)] as if each head had a padded row of its own
            keys, values, pos, side, src = cache.head_view(layer, r, fresh, S)
            views.append((pos, side, src))
        else:
            keys, values, pos = cache.k[layer, r, :, :S], cache.v[layer, r, :, :S], cache.pos[layer, r, :, :S]
            side = {k: s[layer, r, :, :S] for k, s in cache.side.items()}
        protected = cache.protected(layer, r, below, run.buffer, pos)
        gens = [torch.Generator(dev).manual_seed(seed_of(run.seed, run.ids[row], layer,
                                                         run.rounds[row] if run.policy.redraw else 0))
                for row in rows]  # one per row: its draws do not depend on the rows scored beside it
        ctx = ScoreCtx(layer=layer, keys=keys, values=values, pos=pos, protected=protected,
                       queries=cache.q_ring[layer, r], q_pos=cache.q_pos[r], wo=blk.self_attn.o_proj.weight, side=side,
                       all_kv=all_kv, cfg=model.cfg, budget=run.budget, buffer=run.buffer, generators=gens,
                       fresh=fresh, memo=memo, stats=run.stats)
        s = run.policy.score(ctx)
        if blk.self_attn.window and s.shape[1] > 1:  # a sliding layer never again sees keys that left its window:
            # they go first (not for one-set scorers such as EPIKV, whose layers must keep the same positions)
            s = s.masked_fill(pos <= next_pos - blk.self_attn.window, -float("inf"))
        scores.append(s)
        masks.append(protected)
        keeps.append(ctx.keep)  # a per-head policy's own budgets, [n, H_kv] (budgets.py); else None
    if run.watch:  # untimed: the watcher sees what evict will rank while the scores still line up with cache.pos
        run.evict_s += time.perf_counter() - t0
        for i in range(b, b + n):  # a pooled cache's scores as head_pos lays out its slots
            run.watch(cache, i, "scored", [cache.to_front(l, i, v[2][i - b], s[i - b]) for l, (s, v) in
                                           enumerate(zip(scores, views))] if per_head else [s[i - b] for s in scores])
        t0 = time.perf_counter()
    if per_head:
        cache.evict(r, scores, masks, keeps, run.span, views, run.buffer)
    else:
        cache.evict(r, scores, masks, run.budget)
    if cache.k.is_cuda:
        torch.cuda.synchronize()
    for row in rows:
        run.rounds[row] += 1
    run.evict_s += time.perf_counter() - t0
    if run.watch:
        for i in range(b, b + n):
            run.watch(cache, i, "after", None)


def evict_due(model, cache: KVCache, run: Run):
    """Evict every row that holds run.due(row) slots. Neighbouring rows due in the same step are scored together,
    one scorer call per layer for all of them: a decode step of 16 rows of the same length would otherwise pay
    the per-call overhead 16 times. A run of neighbours splits where first rounds meet later ones (`fresh`)."""
    due = [run.budget is not None and length == run.due(row) for length, row in zip(cache.length, cache.rows)]
    first = [run.rounds[row] == 0 for row in cache.rows]
    b = 0
    for (is_due, _), run_of_rows in groupby(zip(due, first)):  # neighbours alike in both
        n = len(list(run_of_rows))
        if is_due:
            evict_round(model, cache, run, b, n)
        b += n


def feed(model, cache: KVCache, tokens: Tensor, run: Run, n: list[int] | None = None,
         all_logits: bool = False, most: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Run tokens [B, T] through the model, row b taking its first n[b] (default all T), in chunks that fit the
    cache, end where a row's eviction is due and hold at most `most` tokens (a long replay's memory); each row evicts
    when it holds run.due(row) slots. Returns every position's logits [B, T, V] (all_logits), else each row's last
    real position's [B, 1, V], in `dtype` (default the model's output's, fp32)."""
    B, T = tokens.shape
    n, done = ([T] * B if n is None else list(n)), [0] * B
    out_logits = None
    while any(d < m for d, m in zip(done, n)):
        # as far as the cache holds, and no further than where a row's eviction is due
        # (a pooled row's length is its fullest head's: the pool itself checks that each head's appends fit)
        take = [min(m - d, m if cache.pooled else cache.capacity - l, m if run.budget is None else run.due(row) - l,
                    most or m)
                for m, d, l, row in zip(n, done, cache.length, cache.rows)]
        if any(t <= 0 < m - d for t, m, d in zip(take, n, done)):
            raise RuntimeError(f"KV cache full ({cache.capacity} slots) with no eviction due: size it for the sequence")
        Tc = max(take)
        if len(set(done)) == 1:  # the common case: every row is at the same column
            x = tokens[:, done[0] : done[0] + Tc]
        else:  # ragged: each row continues from its own column (the tail past a row's take is padding)
            cols = (torch.tensor(done, device=tokens.device)[:, None] + torch.arange(Tc, device=tokens.device))
            x = tokens.gather(1, cols.clamp(max=T - 1))
        out = model(x, cache, take, all_logits=all_logits, collect=run.policy.observe is not None)
        if not out.logits.sum().isfinite():  # one NaN or inf anywhere makes the sum NaN or inf: a cheap check
            raise ModelError("the model produced NaN/inf logits: its weights are likely corrupt (for the default "
                             "model run 'python weights.py --force'; else re-download --model)")
        if run.policy.observe:
            run.policy.observe(cache, out, run)
        run.max_slots = max(run.max_slots, *cache.length)
        evict_due(model, cache, run)
        if out_logits is None:
            out_logits = out.logits.new_zeros(B, T if all_logits else 1, out.logits.shape[-1], dtype=dtype)
        for b, (d, t) in enumerate(zip(done, take)):  # each row's real logits go to its own columns
            if t and all_logits:
                out_logits[b, d : d + t] = out.logits[b, :t]
            elif t:
                out_logits[b] = out.logits[b]
        done = [d + t for d, t in zip(done, take)]
    return out_logits


def sample(logits: Tensor, temperature: float, top_p: float, gens: list) -> Tensor:
    """logits [B, V] -> token ids [B, 1]. Temperature 0 is argmax (deterministic, what the tests use). Each row draws
    from its own generator, so its tokens do not depend on the other rows of the batch."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    # subtracting the max first keeps a tiny temperature finite: it tends to argmax instead of overflowing
    probs = ((logits - logits.amax(-1, keepdim=True)) / temperature).softmax(-1)
    if top_p < 1:  # nucleus: keep the smallest set of top tokens whose mass reaches top_p
        p, idx = probs.sort(-1, descending=True)
        p[(p.cumsum(-1) - p) > top_p] = 0
        probs = torch.zeros_like(probs).scatter_(-1, idx, p)
    return torch.cat([torch.multinomial(p[None], 1, generator=g) for p, g in zip(probs, gens)])


@torch.inference_mode()
def generate(model, prompts: list[list[int]], run: Run, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_ids=(), on_token=None) -> tuple[list[list[int]], KVCache, dict]:
    """Prefill every prompt (rows of one batch, each its own length), then decode one token per unfinished row per
    step until its EOS or max_new_tokens; a finished row leaves the batch. Returns (new ids per prompt, cache,
    timings). on_token(row, ids) sees each row's ids so far after every token."""
    if not prompts or not all(prompts):
        raise UsageError("generate needs at least one prompt, and no prompt may be empty")
    cache = make_cache(model, run, max(map(len, prompts)) + max_new_tokens)
    gens = [torch.Generator(model.device).manual_seed(seed_of(run.seed, i)) for i in run.ids]
    t0 = time.perf_counter()
    T = max(map(len, prompts))
    x = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=model.device)  # right-padded [B, T]
    logits = feed(model, cache, x, run, n=[len(p) for p in prompts])[:, -1]  # [B, V]
    t1 = time.perf_counter()
    outs, steps, row_steps = [[] for _ in prompts], 0, 0
    while True:
        tok = sample(logits, temperature, top_p, [gens[row] for row in cache.rows])  # [B, 1]
        finished = []
        for b, (row, t) in enumerate(zip(cache.rows, tok[:, 0].tolist())):
            outs[row].append(t)
            if on_token:
                on_token(row, outs[row])
            if t in eos_ids or len(outs[row]) == max_new_tokens:
                finished.append(b)
        if len(finished) == cache.batch:
            break
        if finished:  # the rest decode on without them; the last rows to finish stay, for the caller to inspect
            keep = [b for b in range(cache.batch) if b not in finished]
            cache.keep_rows(keep)
            tok = tok[keep]
        logits = feed(model, cache, tok, run)[:, -1]
        steps, row_steps = steps + 1, row_steps + cache.batch
    t2 = time.perf_counter()
    return outs, cache, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": steps, "row_steps": row_steps}


@torch.inference_mode()
def generate_refill(model, prompts: list[list[int]], run: Run, max_new_tokens: int, batch_size: int,
                    temperature: float = 0.0, top_p: float = 1.0, eos_ids=(), on_done=None) -> tuple[list, dict]:
    """Continuous batching: decode every prompt with at most batch_size rows live. When a row finishes, the next
    prompt takes its place: it is prefilled on its own (`join`) and decodes from the next step beside the others,
    so the batch stays full instead of draining to its longest answer. run holds every prompt (its rows are their
    indices in `prompts`); each row's tokens are those of generate on it alone, as its draws follow run.ids.
    on_done(row, ids) sees each prompt's new ids as it finishes. Returns (new ids per prompt, timings, with the
    decode steps and the rows they decoded: row_steps / steps is how full the batch stayed)."""
    if not prompts or not all(prompts):
        raise UsageError("generate needs at least one prompt, and no prompt may be empty")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {batch_size})")
    cache = make_cache(model, run, max(map(len, prompts)) + max_new_tokens, batch=min(batch_size, len(prompts)))
    gens = [torch.Generator(model.device).manual_seed(seed_of(run.seed, i)) for i in run.ids]
    queue, outs = list(range(len(prompts))), [[] for _ in prompts]
    t = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0, "row_steps": 0}
    free, logits = list(range(cache.batch)), None  # batch slots whose row finished (at first: all of them)
    while True:
        t0 = time.perf_counter()
        if queue and free:  # the next prompts take the free slots
            new, slots = queue[: len(free)], free[: len(queue)]
            del queue[: len(new)], free[: len(new)]
            first = join(model, cache, run, [prompts[i] for i in new], new, slots)  # [n, V]
            logits = first.new_zeros(cache.batch, first.shape[-1]) if logits is None else logits
            logits[slots] = first
        if free:  # none left to take them: the batch shrinks, as in generate
            keep = [b for b in range(cache.batch) if b not in free]
            cache.keep_rows(keep)
            logits, free = logits[keep], []
        t1 = time.perf_counter()
        tok = sample(logits, temperature, top_p, [gens[row] for row in cache.rows])  # [B, 1]
        for b, (row, tk) in enumerate(zip(cache.rows, tok[:, 0].tolist())):
            outs[row].append(tk)
            if tk in eos_ids or len(outs[row]) == max_new_tokens:
                free.append(b)
                if on_done:
                    on_done(row, outs[row])
        if len(free) == cache.batch and not queue:
            t["prefill_s"] += t1 - t0
            break
        go = [int(b not in free) for b in range(cache.batch)]  # a finished row takes no token (ragged feed, n = 0)
        if any(go):
            logits = feed(model, cache, tok, run, n=go)[:, -1]
            t["steps"], t["row_steps"] = t["steps"] + 1, t["row_steps"] + sum(go)
        t["prefill_s"], t["decode_s"] = t["prefill_s"] + t1 - t0, t["decode_s"] + time.perf_counter() - t1
    return outs, t


def join(model, cache: KVCache, run: Run, prompts: list[list[int]], rows: list[int], slots: list[int]) -> Tensor:
    """Prefill prompts (rows: their indices in the request) in a cache of their own, then copy each into its batch
    slot of cache; returns their last positions' logits [n, V]. note: apart, not as extra columns of the running
    batch's next step: [B, T] padding would cost every row T columns, for one row's prompt."""
    sub = empty_cache(model, run, len(rows), cache.capacity)
    sub.rows = list(rows)  # draws and policy state follow the request's rows, not the batch slots
    T = max(map(len, prompts))
    x = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=model.device)  # right-padded [n, T]
    logits = feed(model, sub, x, run, n=[len(p) for p in prompts])[:, -1]
    for j, b in enumerate(slots):
        cache.put_row(b, sub, j)
    return logits


# -----------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(description="Generate with a KV-cache eviction policy and report what it cost.")
    ap.add_argument("--model", default=None, help="Hugging Face model directory (Llama/Mistral/Qwen2/Qwen3), a Hub id "
                    "ORG/NAME[@REVISION] (downloaded once into the Hugging Face cache: HF_HOME, HF_HUB_OFFLINE apply), "
                    "or a name python weights.py fetches: smollm2-135m (the default), qwen2.5-coder-1.5b, "
                    "qwen2.5-coder-0.5b; a named model is fetched on first use")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message, wrapped in the model's chat template")
    ap.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None, help="a thinking model's "
                    "chat template switch (Qwen3's enable_thinking; default: the template's own). --no-thinking is "
                    "refused where the template has no switch (R1 distills always think), either flag where it writes "
                    "no <think> or one only into earlier turns (no thinking mode)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="stop after this many new tokens (>= 1)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (deterministic); e.g. 0.6")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off")
    ap.add_argument("--seed", type=int, default=0, help="seeds sampling and the stochastic policies")
    add_device_args(ap)
    ap.add_argument("--policy", default="full", choices=sorted(POLICIES), help="eviction policy (full = none)")
    ap.add_argument("--budget", type=int, default=None, help=f"K: cache slots right after an eviction, buffer "
                    f"included (default {DEFAULT_BUDGET}; not with --policy full)")
    ap.add_argument("--buffer", type=int, default=64, help="r: newest tokens never scored; eviction runs every r "
                    "steps once the cache holds K + r slots")
    ap.add_argument("--protect-prompt", action=argparse.BooleanOptionalAction, default=None,
                    help="keep every prompt token (default: the policy's paper setting)")
    ap.add_argument("--triattention-stats", default=None, metavar="FILE", help="triattention's query statistics from "
                    "a file in its authors' format (scripts/calibrate.py); default: nanokv calibrates on data/ once "
                    "and caches the result beside the model")
    ap.add_argument("--show-kept", type=int, nargs="?", const=-1, default=None, metavar="LAYER",
                    help="after generating, map which positions each KV head of LAYER kept (default: middle layer)")
    ap.add_argument("--kept-json", default=None, metavar="FILE", help="also write the positions that LAYER of "
                    "--show-kept (default: the middle layer) kept, per KV head, as JSON for `eval.py plot`")
    ap.add_argument("--compare", action="store_true", help="also answer with the full cache (or --vs) on the same "
                    "weights (with --quant, the same quantized ones: no second model is loaded) and show where the "
                    "two texts first differ, and both speeds")
    ap.add_argument("--vs", default=None, choices=sorted(POLICIES), metavar="POLICY", help="the policy --compare "
                    "answers with (default full), at the same --budget, --buffer and --protect-prompt")
    ap.add_argument("--html", default=None, metavar="FILE", help="write one self-contained page (open it in a "
                    "browser) that replays every eviction round over the answer's text, per layer and KV head; with "
                    "--compare, beside the other answer")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        run_cli(args)
    except (ModelError, UsageError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")
    except OSError as e:
        output_failed(e)


def check_sampling(temperature: float, top_p: float):
    if not math.isfinite(temperature) or temperature < 0:
        raise UsageError(f"--temperature must be 0 (greedy) or a positive number (got {temperature})")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (got {top_p})")


def divergence(tok, ref: list[int], got: list[int], policy: str, words: int = 6, vs: str = "full") -> str:
    """What eviction changed: how many tokens agree with the reference's (the full cache's, or policy vs's), and the
    text either side of the first token where the two differ."""
    n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    same = sum(a == b for a, b in zip(ref, got)) / max(len(ref), len(got))
    against = "the full cache" if vs == "full" else vs
    head = f"[compare] against {against}: {same:.0%} of positions agree; "
    if n == len(ref) == len(got):
        return head + "the two answers are identical"
    before = " ".join(tok.decode(ref[:n]).split()[-words:])
    after = lambda ids: " ".join(tok.decode(ids[n:]).split()[:words]) or "(ends)"
    w = max(len(policy), len(vs))
    return (head + f"the first {n} tokens are identical, then\n  ...{before}\n"
            f"  {vs:>{w}} | {after(ref)}\n  {policy:>{w}} | {after(got)}")


def compare_run(args, prompt_len: int) -> Run | None:
    """The run --compare answers with: the full cache, or --vs at the same settings; None without --compare."""
    vs = args.vs or "full"
    if args.vs and not args.compare:
        raise UsageError(f"--vs {args.vs} names the policy --compare answers with: add --compare")
    if args.vs == args.policy:
        raise UsageError(f"--vs {args.vs} is the --policy itself: compare it with another, e.g. --vs "
                         f"{'snapkv' if args.vs == 'full' else 'full'}")
    if not args.compare or vs == args.policy:  # --policy full --compare: nothing to compare
        return None
    return make_run(vs, None if vs == "full" else args.budget, args.buffer, args.protect_prompt, prompt_len, args.seed,
                    stats_file=args.triattention_stats if POLICIES[vs].prepare else None)


def main_run(args, prompt_len: int) -> Run:
    """The run of --policy. The settings of a pair go to the run that reads them: with --policy full and --compare --vs
    POLICY, --budget is the other's (the full cache has none), and --triattention-stats goes to whichever of the two
    reads it; a setting that neither reads is refused by make_run."""
    vs = args.vs if args.compare else None
    other = POLICIES[vs] if vs in POLICIES else None
    budget = None if POLICIES[args.policy].score is None and other and other.score else args.budget
    stats = None if not POLICIES[args.policy].prepare and other and other.prepare else args.triattention_stats
    return make_run(args.policy, budget, args.buffer, args.protect_prompt, prompt_len, args.seed, stats_file=stats)


def thinking_note(name: str, th, n: int) -> str:
    """Where an answer's thinking ended, e.g. '[think] snapkv: thinking 812 tokens, </think> at token 812 of 900'."""
    if th.closed is None:
        return f"[think] {name}: no thinking in this answer (the prompt closed it, or the model skipped it)"
    if not th.closed:
        return f"[think] {name}: the thinking never closed: all {n} tokens are thinking, so there is no answer"
    return f"[think] {name}: thinking {th.tokens} tokens, answer {n - th.tokens}: </think> is token {th.tokens} of {n}"


def closed_thinking(th) -> int:
    """The tokens of a thinking that closed, for the page's mark; 0 where none closed (nothing to mark)."""
    return th.tokens if th.closed else 0


def speed(ids: list[int], t: dict) -> str:
    """Decode tokens/s of one answer: the first token comes with the prefill, so it counts the steps after it."""
    return f"{(len(ids) - 1) / t['decode_s']:.1f}" if len(ids) > 1 else "–"


def run_cli(args):
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    check_sampling(args.temperature, args.top_p)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # e.g. invalid UTF-8 bytes in argv, which Python keeps as lone surrogates
        raise UsageError("--prompt is not valid UTF-8 text: pass the prompt as UTF-8") from None
    if not args.prompt.strip():
        raise UsageError("--prompt is empty: give the model a question")
    main_run(args, 1)  # the settings, before loading
    comparing = compare_run(args, 1) is not None
    check_output("--kept-json", args.kept_json)
    check_output("--html", args.html)
    distinct_outputs(**{"--kept-json": args.kept_json, "--html": args.html})
    args.model = local_model(args.model)  # a Hub id: its snapshot, downloaded once
    if comparing:  # what --compare costs, said before anything loads: a second answer, no second model
        note(f"[compare] after the answer, a second one with {'--vs ' + args.vs if args.vs else 'the full cache'} on "
             f"the same {args.quant or 'dense'} weights: no second model is loaded")
    elif args.compare:
        note("[compare] --policy full is the full cache itself: one answer, nothing to compare it with")
    t0 = time.perf_counter()
    note("[load] reading the model ...")
    model, tok = load(args.model, args.device, args.dtype, args.quant, args.thinking)
    cfg = model.cfg
    note(f"[load] {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads}/"
         f"{cfg.num_key_value_heads} heads, {args.quant or 'dense'} weights, {model.model.embed_tokens.weight.dtype} "
         f"activations on {model.device} in "
         f"{time.perf_counter() - t0:.1f} s")
    prompt = tok.encode(tok.chat([{"role": "user", "content": args.prompt}]))
    limit = model.cfg.max_position_embeddings
    if len(prompt) + args.max_new_tokens > limit:
        raise UsageError(f"prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} exceeds the "
                         f"model's {limit} positions: shorten the prompt or lower --max-new-tokens")
    run = main_run(args, len(prompt))
    other, vs = compare_run(args, len(prompt)), args.vs or "full"
    L = model.cfg.num_hidden_layers
    if args.show_kept is not None and not -1 <= args.show_kept < L:
        raise UsageError(f"--show-kept {args.show_kept}: the model has layers 0 to {L - 1}")

    rec = viewer.Recording(run) if args.html else None  # records every round through run.watch
    printed = [0]

    def stream(ids):  # print the new text (not the end-of-turn token), holding back a partial UTF-8 character
        text = tok.decode([i for i in ids if i not in tok.eos_ids])
        if not text.endswith("\ufffd"):
            print(text[printed[0] :], end="", flush=True)
            printed[0] = len(text)

    sampling = (args.max_new_tokens, args.temperature, args.top_p, tok.eos_ids)
    # the streamed text shows the answer's progress on a terminal; printed to a file, a bar on stderr does instead
    with tqdm(total=args.max_new_tokens, desc=f"[{args.policy}] answer", unit="tok", leave=False, file=sys.stderr,
              disable=sys.stdout.isatty() or not sys.stderr.isatty()) as bar:
        (ids,), cache, t = generate(model, [prompt], run, *sampling,
                                    on_token=lambda row, ids: (stream(ids), bar.update(1)))
    print()
    layer = args.show_kept if args.show_kept is not None and args.show_kept >= 0 else L // 2
    if args.show_kept is not None:
        print(viewer.show_kept(cache, layer, len(prompt), run.buffer))
    if args.kept_json:
        size = write_output("--kept-json", args.kept_json, json.dumps(viewer.kept_map(cache, layer, run, args.policy)))
        note(f"[kept-json] wrote {args.kept_json} ({size / 2**10:.1f} KiB): layer {layer}'s kept positions, for "
             f"`python eval.py plot {args.kept_json} --out DIR`")
    note(f"[{args.policy}] prefill {t['prefill_s']:.1f} s, decode {t['decode_s']:.1f} s")
    views = [(args.policy, run, rec, ids)]
    if other:
        other_rec = viewer.Recording(other) if args.html else None
        # the reference runs on the same weights, quantized or not: --compare asks what eviction changed, and only a
        # reference that differs in the cache alone answers that. An fp32 reference would mix quantization's change
        # into it and load a second model (6.6 GiB more for the 1.5B in int4); quantization's own change is measured
        # by tools/compare_modes.py
        what = "full-cache" if vs == "full" else vs
        with tqdm(total=args.max_new_tokens, desc=f"[compare] {what} answer", unit="tok", leave=False,
                  file=sys.stderr) as bar:
            ref, _, tf = generate(model, [prompt], other, *sampling, on_token=lambda row, ids: bar.update(1))
        note(f"[compare] {what} answer: {len(ref[0])} tokens, prefill {tf['prefill_s']:.1f} s, "
             f"decode {tf['decode_s']:.1f} s, {speed(ref[0], tf)} tok/s")
        print(divergence(tok, ref[0], ids, args.policy, vs=vs))
        views.append((vs, other, other_rec, ref[0]))
    if tok.thinks:  # where each answer's thinking ended, for a thinking model
        for name, _, _, out in views:
            print(thinking_note(name, tok.thought(prompt, out), len(out)))
    if args.html:
        size = write_output("--html", args.html, viewer.page([viewer.view(
            name, r, rr, prompt, out, tok.token_bytes(prompt + out), closed_thinking(tok.thought(prompt, out)))
            for name, r, rr, out in views], cfg, len(prompt)))
        note(f"[html] wrote {args.html} ({size / 2**20:.2f} MiB): open it in a browser, no server needed")
    n_ev, ms = run.evictions, run.evict_s * 1e3
    ev = f"{n_ev} eviction{'s' * (n_ev != 1)}" + (f", {ms:.1f} ms ({ms / n_ev:.2f} ms each)" if n_ev else "")
    K = "full cache" if run.budget is None else f"K={run.budget} r={run.buffer}"
    K += f" {args.quant}" if args.quant else ""
    peak = peak_memory_mb(model.device)  # the whole process's, at the end: --compare's answer and the page included
    held = f"slots {cache.length[0]} held, {run.max_slots} max"
    if cache.pooled:  # per-head budgets: each head holds its own number of slots
        per_head = (cache.head_pos(0) != FREE).sum(-1)  # [L, H_kv]
        held = f"slots per head {per_head.min()}-{per_head.max()} held (mean {per_head.float().mean():.0f})"
    # what the cache allocates for one row in one layer, all KV heads together: the memory a policy costs
    held += f", {cache.pos.shape[2] * cache.capacity} allocated per layer"
    print(f"[{args.policy} {K}] prompt {len(prompt)} tok | generated {len(ids)} tok | {speed(ids, t)} tok/s | "
          f"{held} | {ev} | peak {peak:.0f} MiB")


if __name__ == "__main__":
    main()
