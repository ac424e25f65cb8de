"""
Generate text with a KV-cache eviction policy: prefill, decode loop, eviction cadence, sampling, the CLI.

    python generate.py --policy criticalkv --show-kept

Eviction (DESIGN.md §5): the newest `buffer` tokens are never scored; when the cache reaches budget + buffer
slots, every layer keeps `budget` (protected prompt or sinks, the buffer, and the best-scored rest).
Left out: batching of different-length prompts, speculative decoding, paged memory.
"""

import argparse
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from cache import KVCache
from model import ModelError, Tokenizer, load_model
from policies import POLICIES, Policy, ScoreCtx

DEFAULT_PROMPT = (
    "Lisa reads 12 pages on Monday, twice as many on Tuesday, and 5 fewer than Tuesday on Wednesday. "
    "How many pages did she read in total? Show your reasoning step by step."
)
DEFAULT_BUDGET = 192  # for evicting policies: fits the default protected prompt, and the default answer evicts
N_SINK = 4  # StreamingLLM's attention sinks, kept when the prompt is not protected


class UsageError(Exception):
    """A bad combination of settings: the message names the numbers and the fix."""


def autodetect_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def peak_memory_mb(device) -> float:
    """Peak memory so far: CUDA allocator peak, else the process's peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


# -----------------------------------------------------------------------------
# one generation's eviction settings


@dataclass
class Run:
    policy: Policy
    budget: int | None  # K, slots right after an eviction; None = full cache
    buffer: int  # r, newest slots never scored
    protect_below: int  # positions below this always survive: the prompt length, or N_SINK
    seed: int = 0
    state: dict = field(default_factory=dict)  # per-run policy state (EPIKV's rolling history)
    rounds: int = 0  # eviction events so far
    evict_s: float = 0.0  # seconds spent in them
    max_slots: int = 0  # most slots ever held
    watch: Callable | None = None  # watch(cache, "before" | "after") around each eviction, untimed (eval.py)


def policy_names(arg: str, full: bool = True) -> list[str]:
    """--policies of eval.py and bench.py: 'all' (every registered policy) or a comma list -> names;
    full=False drops 'full'."""
    names = [p for p in arg.split(",") if p]
    if not names:
        raise UsageError("--policies is empty: give a comma list of policies, or all")
    names = list(POLICIES) if names == ["all"] else names
    for p in names:
        if p not in POLICIES:
            raise UsageError(f"unknown policy {p!r} in --policies: choose from all, {', '.join(sorted(POLICIES))}")
    return [p for p in names if full or p != "full"]


def make_run(policy: str, budget: int | None, buffer: int, protect: bool | None, prompt_len: int, seed: int = 0) -> Run:
    """Check the settings against each other and the prompt; protect=None takes the policy's paper default."""
    if policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r}: choose one of {', '.join(sorted(POLICIES))}")
    p = POLICIES[policy]
    if p.score is None:
        if budget is not None:
            raise UsageError("--budget has no effect with --policy full (it keeps every token): "
                             "drop it or pick an evicting policy")
        return Run(p, None, buffer, 0, seed)
    budget = DEFAULT_BUDGET if budget is None else budget
    if buffer < 1:
        raise UsageError(f"--buffer must be at least 1 (got {buffer})")
    if budget <= buffer:
        raise UsageError(f"--budget {budget} must exceed --buffer {buffer}: the buffer is part of the budget")
    protect = p.protect_prompt if protect is None else protect
    keep = prompt_len if protect else N_SINK
    if keep > budget - buffer:
        what = f"the protected prompt ({prompt_len} tokens)" if protect else f"the {N_SINK} sink tokens"
        fix = " or --no-protect-prompt" if protect else ""
        raise UsageError(f"{what} do not fit in --budget {budget} minus --buffer {buffer} = {budget - buffer} "
                         f"slots: use --budget >= {keep + buffer}{fix}")
    return Run(p, budget, buffer, keep, seed)


def make_cache(model, run: Run, n_tokens: int, batch: int = 1) -> KVCache:
    """A cache for n_tokens in all: budget + buffer slots when evicting, else every token."""
    cfg = model.cfg
    cap = n_tokens if run.budget is None else min(n_tokens, run.budget + run.buffer)
    w = model.model.embed_tokens.weight
    return KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, cap,
                   n_q_heads=cfg.num_attention_heads, window=run.policy.window, side=run.policy.side,
                   device=w.device, dtype=w.dtype)


# -----------------------------------------------------------------------------
# prefill, decode, eviction


def evict_round(model, cache: KVCache, run: Run):
    """Score every layer, then evict every layer back to the budget."""
    if run.watch:
        run.watch(cache, "before")
    t0 = time.perf_counter()
    S = cache.length[0]
    all_kv = (cache.k[:, :, :, :S], cache.v[:, :, :, :S])
    memo = {}  # shared by this round's layers (e.g. epikv-lag scores all layers at once)
    scores, masks = [], []
    # subtle: all layers are scored before any is evicted, so a scorer that pools over layers sees one state
    for layer, blk in enumerate(model.model.layers):
        keys, values = cache.get(layer)
        pos, protected = cache.pos[layer, :, :, :S], cache.protected(layer, run.protect_below, run.buffer)
        masks.append(protected)
        g = torch.Generator(keys.device).manual_seed(run.seed * 1_000_003 + run.rounds * 1_009 + layer)
        ctx = ScoreCtx(layer, keys, values, pos, protected, cache.q_ring[layer], cache.q_pos,
                       blk.self_attn.o_proj.weight, {n: s[layer, :, :, :S] for n, s in cache.side.items()},
                       all_kv, model.cfg, run.budget, run.buffer, g, run.budget if run.rounds else 0, memo)
        scores.append(run.policy.score(ctx))
    for layer, (s, protected) in enumerate(zip(scores, masks)):
        cache.evict(layer, s, run.budget, protected)
    if cache.k.is_cuda:
        torch.cuda.synchronize()
    run.rounds += 1
    run.evict_s += time.perf_counter() - t0
    if run.watch:
        run.watch(cache, "after")


def feed(model, cache: KVCache, tokens: Tensor, run: Run, all_logits: bool = False) -> Tensor:
    """Run tokens [B, T] through the model in chunks that fit the cache, evicting whenever it is full.
    Returns the logits of the last position [B, 1, V], or of every position [B, T, V]."""
    logits = []
    i, T = 0, tokens.shape[1]
    while i < T:
        n = min(T - i, cache.capacity - cache.length[0])
        if n == 0:
            raise RuntimeError(f"KV cache full ({cache.capacity} slots) with no eviction due: size it for the sequence")
        out = model(tokens[:, i : i + n], cache, all_logits=all_logits, collect=run.policy.observe is not None)
        if run.policy.observe:
            run.policy.observe(cache, out, run.state)
        run.max_slots = max(run.max_slots, cache.length[0])
        if run.budget is not None and cache.length[0] == run.budget + run.buffer:
            evict_round(model, cache, run)
        logits.append(out.logits)
        i += n
    return torch.cat(logits, 1) if all_logits else logits[-1]


def sample(logits: Tensor, temperature: float, top_p: float, g: torch.Generator | None = None) -> Tensor:
    """logits [B, V] -> token ids [B, 1]. Temperature 0 is argmax (deterministic, what the tests use)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = (logits / temperature).softmax(-1)
    if top_p < 1:  # nucleus: keep the smallest set of top tokens whose mass reaches top_p
        p, idx = probs.sort(-1, descending=True)
        p[(p.cumsum(-1) - p) > top_p] = 0
        probs = torch.zeros_like(probs).scatter_(-1, idx, p)
    return torch.multinomial(probs, 1, generator=g)


@torch.inference_mode()
def generate(model, prompt: list[int], run: Run, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_ids=(), on_token=None) -> tuple[list[int], KVCache, dict]:
    """Prefill the prompt, then decode until EOS or max_new_tokens. Returns (new ids, cache, timings)."""
    cache = make_cache(model, run, len(prompt) + max_new_tokens)
    g = torch.Generator(model.device).manual_seed(run.seed)
    t0 = time.perf_counter()
    logits = feed(model, cache, torch.tensor([prompt], device=model.device), run)
    t1 = time.perf_counter()
    out = []
    while True:
        tok = sample(logits[:, -1], temperature, top_p, g)  # [1, 1]
        out.append(tok.item())
        if on_token:
            on_token(out)
        if out[-1] in eos_ids or len(out) == max_new_tokens:
            break
        logits = feed(model, cache, tok, run)
    t2 = time.perf_counter()
    return out, cache, {"prefill_s": t1 - t0, "decode_s": t2 - t1}


# -----------------------------------------------------------------------------
# terminal map of what one layer kept


def show_kept(cache: KVCache, layer: int, prompt_len: int, buffer: int, width: int = 96) -> str:
    """One row per KV head: each character covers `per` positions, shaded by the fraction of them kept."""
    n = cache.next_pos
    per = -(-n // width)  # positions per character, rounded up
    cols = -(-n // per)
    pos = cache.pos[layer, 0, :, : cache.length[layer]]  # [H_kv, S]
    kept = torch.zeros(pos.shape[0], cols * per, device=pos.device).scatter_(1, pos, 1.0)
    span = torch.arange(cols * per).view(cols, per) < n  # the last character may cover fewer positions
    frac = (kept.view(-1, cols, per).cpu() * span).sum(-1) / span.sum(-1)  # [H_kv, cols]
    shade = lambda f: " " if f == 0 else "█" if f == 1 else "░▒▓"[min(2, int(f * 3))]
    region = "".join("P" if c * per < prompt_len else "R" if (c + 1) * per > n - buffer else "T" for c in range(cols))
    lines = [f"kept positions, layer {layer}: 1 char = {per} positions (P prompt, T trace, R recent buffer)",
             f"         {region}"]
    lines += [f"head {h:<3} " + "".join(shade(f) for f in row) for h, row in enumerate(frac.tolist())]
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# CLI


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + traceback-looking noise
        self.exit(2, f"error: {message} (see --help)\n")


def add_device_args(ap: argparse.ArgumentParser):
    """--device and --dtype, shared with eval.py."""
    ap.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the first available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="weights and cache dtype (default: bfloat16 on CUDA, float32 elsewhere)")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(description="Generate with a KV-cache eviction policy and report what it cost.")
    ap.add_argument("--model", default=None, help="Hugging Face model directory (Llama/Mistral/Qwen2/Qwen3); "
                    "default: the embedded SmolLM2-135M-Instruct, fetched on first use (python weights.py)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message, wrapped in the model's chat template")
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
    ap.add_argument("--show-kept", type=int, nargs="?", const=-1, default=None, metavar="LAYER",
                    help="after generating, map which positions each KV head of LAYER kept (default: middle layer)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        run_cli(args)
    except (ModelError, UsageError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")


def resolve_device(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """--device / --dtype -> a usable device and dtype: bf16 on CUDA, fp32 elsewhere unless asked."""
    device = device or autodetect_device()
    try:
        d = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device: use cpu, cuda, cuda:N or mps") from None
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this torch sees {torch.cuda.device_count()} CUDA device(s); "
                         "use --device cpu or an existing cuda:N")
    if d.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError("--device mps: MPS is not available here; use --device cpu")
    return device, getattr(torch, dtype) if dtype else torch.bfloat16 if d.type == "cuda" else torch.float32


def load(model_dir, device, dtype):
    """Model and tokenizer from a directory, or the embedded default model (fetched on first use)."""
    from weights import SetupError, default_model_dir

    try:
        model_dir = model_dir or default_model_dir(fetch=True)
    except SetupError as e:
        raise ModelError(str(e)) from None
    device, dtype = resolve_device(device, dtype)
    return load_model(model_dir, device, dtype), Tokenizer(model_dir)


def run_cli(args):
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    if not 0 < args.top_p <= 1 or args.temperature < 0:
        raise UsageError("--top-p must be in (0, 1] and --temperature >= 0")
    model, tok = load(args.model, args.device, args.dtype)
    prompt = tok.encode(tok.chat([{"role": "user", "content": args.prompt}]))
    limit = model.cfg.max_position_embeddings
    if len(prompt) + args.max_new_tokens > limit:
        raise UsageError(f"prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} exceeds the "
                         f"model's {limit} positions: shorten the prompt or lower --max-new-tokens")
    run = make_run(args.policy, args.budget, args.buffer, args.protect_prompt, len(prompt), args.seed)
    L = model.cfg.num_hidden_layers
    if args.show_kept is not None and not -1 <= args.show_kept < L:
        raise UsageError(f"--show-kept {args.show_kept}: the model has layers 0 to {L - 1}")

    printed = [0]

    def stream(ids):  # print the new text, holding back a partial UTF-8 character
        text = tok.decode(ids)
        if not text.endswith("\ufffd"):
            print(text[printed[0] :], end="", flush=True)
            printed[0] = len(text)

    ids, cache, t = generate(model, prompt, run, args.max_new_tokens, args.temperature, args.top_p,
                             tok.eos_ids, stream)
    print()
    if args.show_kept is not None:
        layer = args.show_kept if args.show_kept >= 0 else L // 2
        print(show_kept(cache, layer, len(prompt), run.buffer))
    tps = (len(ids) - 1) / t["decode_s"] if len(ids) > 1 else float("nan")
    ev = f"{run.rounds} evictions, {run.evict_s * 1e3:.1f} ms ({run.evict_s * 1e3 / max(run.rounds, 1):.2f} ms each)"
    K = "full cache" if run.budget is None else f"K={run.budget} r={run.buffer}"
    print(f"[{args.policy} {K}] prompt {len(prompt)} tok | generated {len(ids)} tok | {tps:.1f} tok/s | "
          f"slots {cache.length[0]} held, {run.max_slots} max | {ev} | peak {peak_memory_mb(model.device):.0f} MB")


if __name__ == "__main__":
    main()
