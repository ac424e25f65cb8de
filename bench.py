"""
Decode speed, eviction overhead and peak memory of each policy against context length (`python eval.py bench`).

For each (policy, context) we replay random token ids through `feed` up to the context, on the same eviction
cadence as generation (the full cache prefills in one call), then time `--steps` greedy decode steps that end
at position `context`. `--eager` adds full-cache rows whose attention materialises the [B, H_q, T, S] fp32
matrix, the way attention-weight methods run with eager kernels, so the quadratic memory wall shows in the
same table. Each row runs in a fresh subprocess, because the process's peak memory (ru_maxrss) never goes
down. `--model` also takes a bare config.json: random weights of that shape, for speed runs.
Left out: batching, CUDA graphs / torch.compile. Roofline as in gpt-fast's "memory-bandwidth bound" argument.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from generate import (UsageError, feed, load, make_cache, make_run, peak_memory_mb, policy_names,
                      resolve_device)
from model import ModelConfig, ModelError, Transformer

WARMUP = 4  # untimed decode steps before the window: first calls pay for allocations


def add_arguments(ap):
    """Bench-only flags; eval.py defines the shared ones (--model, --device, --dtype, --policies, --buffer, --out)."""
    ap.add_argument("--budget", type=int, default=512, help="K: cache slots right after an eviction (buffer included)")
    ap.add_argument("--contexts", default="1024,4096,8192",
                    help="comma list of positions (tokens) each timed decode window ends at")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed per row (>= 2 x buffer so that "
                    "at least one eviction lands in the window)")
    ap.add_argument("--prompt-len", type=int, default=64, help="leading tokens treated as the prompt "
                    "(protected for random and epikv*, as in their papers)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = its default, one per "
                    "core); 1 is steadier when other jobs share the machine")
    ap.add_argument("--eager", action="store_true", help="add full-cache rows with the materialised n x n "
                    "fp32 attention (the eager reference) for each context")


def jobs(args) -> list[dict]:
    """One dict of key fields per row: every policy x context, then the eager rows."""
    try:
        contexts = [int(c) for c in str(args.contexts).split(",")]
    except ValueError:
        raise UsageError(f"--contexts takes comma-separated integers (got {args.contexts!r})") from None
    if min(contexts) <= args.steps + WARMUP + args.prompt_len:
        raise UsageError(f"every context must exceed --steps {args.steps} + {WARMUP} warm-up + --prompt-len "
                         f"{args.prompt_len}: raise --contexts or lower --steps")
    names = policy_names(args.policies)
    for n in names:  # fail here, once, on a bad --budget / --buffer / prompt combination
        make_run(n, None if n == "full" else args.budget, args.buffer, getattr(args, "protect_prompt", None),
                 args.prompt_len)
    rows = [{"policy": n, "context": c, "eager": False} for n in names for c in contexts]
    return rows + ([{"policy": "full", "context": c, "eager": True} for c in contexts] if args.eager else [])


def measure(args, job: dict) -> dict:
    """Measure one row in a fresh Python process (honest per-row peak memory) and return it."""
    opts = {k: getattr(args, k, None) for k in ("model", "device", "dtype", "budget", "buffer", "steps", "seed",
                                                 "prompt_len", "threads", "protect_prompt")}
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps({**opts, **job})],
                       capture_output=True, text=True)
    if p.returncode < 0:  # killed by a signal: on Linux almost always the OOM killer (the eager memory wall)
        return {**job, "error": f"killed by signal {-p.returncode} (out of memory?)"}
    last = (p.stderr.strip().splitlines() or [""])[-1]
    if p.returncode != 0 and last.startswith("error: "):  # the row's own one-line message: pass it on
        raise UsageError(last[len("error: ") :])
    if p.returncode != 0:
        raise RuntimeError(f"bench row {job} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# -----------------------------------------------------------------------------
# one row, inside the subprocess


def build_model(path, device, dtype):
    """The model of a directory (or the default), or random weights for a bare config.json."""
    if path and Path(path).is_file():
        device, dtype = resolve_device(device, dtype)
        model = Transformer(ModelConfig.from_hf(path), device, dtype)
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():  # small random weights; norms 1 and biases 0 keep it tame
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
        return model.eval()
    return load(path, device, dtype)[0]


def reset_peak(device):
    """Forget the peak memory so far (loading the weights maps the file too, which would hide the run's own peak)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak RSS that ru_maxrss reports


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, mb: int = 256) -> float:
    """Bytes/s of a large tensor copy (read + write), best of 5: the memory roofline of a decode step."""
    a = torch.ones(mb * 2**18, device=device)  # mb MiB of fp32, far past the last-level cache
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


@torch.inference_mode()
def measure_here(o: dict) -> dict:
    device = resolve_device(o["device"], o["dtype"])[0]
    if o.get("threads"):
        torch.set_num_threads(o["threads"])
    model = build_model(o["model"], device, o["dtype"])
    cfg, C, steps = model.cfg, o["context"], o["steps"]
    if C > cfg.max_position_embeddings:
        raise UsageError(f"context {C} exceeds the model's {cfg.max_position_embeddings} positions")
    model.eager = o["eager"]
    reset_peak(device)  # note: the peak then counts the resident weights and torch, not the loading transient
    full = o["policy"] == "full"
    protect = o.get("protect_prompt")  # eval.py's --protect-prompt; None = each policy's paper default
    run = make_run(o["policy"], None if full else o["budget"], o["buffer"], protect, o["prompt_len"], o["seed"])
    cache = make_cache(model, run, C)
    g = torch.Generator().manual_seed(o["seed"])
    ctx = torch.randint(cfg.vocab_size, (1, C - steps - WARMUP), generator=g).to(device)  # [B, T]
    logits = feed(model, cache, ctx, run)  # replay (or one prefill for full) up to the window
    for _ in range(WARMUP):
        logits = feed(model, cache, logits[:, -1].argmax(-1, keepdim=True), run)
    rounds0, evict0, slots = run.rounds, run.evict_s, 0
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):  # greedy decode: the timed window, evictions included
        slots += cache.length[0]  # slots read by this step's attention (before its own token)
        logits = feed(model, cache, logits[:, -1].argmax(-1, keepdim=True), run)
    sync(device)
    dt = time.perf_counter() - t0
    n_ev, ev_s = run.rounds - rounds0, run.evict_s - evict0
    peak = peak_memory_mb(device)  # read before the bandwidth probe allocates its own buffers
    # roofline: each step reads every weight once (tied embeddings: once, as the LM head) and every held K/V
    params = {p.data_ptr(): p.nbytes for p in model.parameters()}
    w_bytes = sum(params.values()) - (0 if model.lm_head is None else model.model.embed_tokens.weight.nbytes)
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * cache.k.element_size()
    roof_tok_s = copy_bandwidth(device) / (w_bytes + kv_bytes * slots / steps)
    return {
        "policy": o["policy"], "context": C, "eager": o["eager"], "budget": None if full else o["budget"],
        "buffer": o["buffer"], "ms_per_token": round(dt / steps * 1e3, 3), "tok_s": round(steps / dt, 2),
        "roofline": round(steps / dt / roof_tok_s, 3),  # fraction of the bandwidth-bound tokens/s
        "evict_ms": round(ev_s / n_ev * 1e3, 3) if n_ev else None,  # mean per eviction event in the window
        "evict_share": round(ev_s / dt, 4), "evictions": n_ev,
        "peak_mb": round(peak, 1), "slots": run.max_slots, "device": str(device), "dtype": str(cache.k.dtype),
        # the 1-minute load average: other jobs on the machine spoil the timings, so each row says how busy it was
        "threads": torch.get_num_threads(), "load": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":  # the per-row worker that measure() spawns
        try:
            print(json.dumps(measure_here(json.loads(sys.argv[2]))))
        except (UsageError, ModelError) as e:
            sys.exit(f"error: {e}")
        except (MemoryError, torch.OutOfMemoryError) as e:  # the eager memory wall: a row that says so
            print(json.dumps({**json.loads(sys.argv[2]), "error": f"out of memory: {str(e)[:200]}"}))
    else:
        sys.exit("error: run the benchmark as `python eval.py bench ...` (bench.py --one is its per-row worker)")
