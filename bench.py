"""
Decode speed, eviction overhead and peak memory of each policy against context length and batch size
(`python eval.py bench`).

For each (policy, context, batch) we fill the cache with random token ids through `feed` (the full cache: a prefill
up to the window; a compressed one: K + r tokens and one eviction, then its positions jump to the window, which
holds the same number of slots a full replay leaves), then time `--steps` greedy decode steps of every row that end
at position `context`, evicting on the generation cadence. `--eager` adds full-cache rows whose attention
materialises the [B, H_q, T, S] fp32 matrix, the way attention-weight methods run with eager kernels, so the
quadratic memory wall shows in the same table. Each row runs in a fresh subprocess, because the process's peak
memory (ru_maxrss) never goes down. On CPU each row also says where a step's time went: in the matrix products, in
attention, in eviction, and the rest. `--model` also takes a bare config.json: random weights of that shape.
The roofline is gpt-fast's memory-bandwidth argument, with the bandwidth a matrix-vector product reaches here.
Left out: CUDA graphs, torch.compile.
"""

import ctypes
import json
import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

import model as model_py
from cli import UsageError, cpu_info, cpu_threads, int_list, load, peak_memory_mb, policy_names, resolve_device
from generate import feed, make_cache, make_run
from kernels import linear
from model import ModelConfig, ModelError, Transformer, weight
from results import model_key

WARMUP = 4  # untimed decode steps before the window: first calls pay for allocations
SIDE_BLOCKS, SIDE_STEPS = 6, 16  # --side-by-side: turns per decoder, and decode steps per turn
PREFILL_CHUNK = 4096  # tokens per row fed at once when filling the full cache


def add_arguments(ap):
    """Bench-only flags; eval.py defines the common ones (--model, --device, --dtype, --policies, --buffer,
    --protect-prompt, --seed, --out)."""
    ap.add_argument("--budget", type=int, default=512, help="K: cache slots right after an eviction (buffer included)")
    ap.add_argument("--contexts", default="1024,4096,8192",
                    help="comma list of positions (tokens) each timed decode window ends at")
    ap.add_argument("--batch-sizes", default="1", help="comma list of rows decoded together, e.g. 1,4,16,32")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed per row (>= 2 x buffer so that "
                    "at least one eviction lands in the window)")
    ap.add_argument("--prompt-len", type=int, default=64, help="leading tokens treated as the prompt "
                    "(protected for random and epikv*, as in their papers)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = nanokv's choice: one, with "
                    "the matmuls in OpenBLAS's threads; more makes kernels.linear use torch's own matmul)")
    ap.add_argument("--side-by-side", action="store_true", help="rows of batch > 1 also time a batch-1 decoder in "
                    "the same process, alternating, and report the speed-up over batch 1 measured so")
    ap.add_argument("--eager", action="store_true", help="add full-cache rows with the materialised n x n "
                    "fp32 attention (the eager reference) for each context and batch size")


def jobs(args) -> list[dict]:
    """One dict of key fields per row: every policy x context x batch, then the eager rows. A key holds every
    setting that changes the row's figures."""
    contexts, batches = int_list("--contexts", args.contexts), int_list("--batch-sizes", args.batch_sizes)
    if args.steps < 1 or args.threads < 0 or args.prompt_len < 1:
        raise UsageError("--steps and --prompt-len must be at least 1, --threads at least 0 (0 = torch's default)")
    if min(contexts) <= args.steps + WARMUP + args.prompt_len:
        raise UsageError(f"every context must exceed --steps {args.steps} + {WARMUP} warm-up + --prompt-len "
                         f"{args.prompt_len}: raise --contexts or lower --steps")
    if args.side_by_side and max(batches) > 1 and min(contexts) <= SIDE_BLOCKS * SIDE_STEPS + WARMUP + args.prompt_len:
        raise UsageError(f"--side-by-side decodes {SIDE_BLOCKS * SIDE_STEPS} steps per decoder: every context must "
                         f"exceed that + {WARMUP} warm-up + --prompt-len {args.prompt_len}")
    names = policy_names(args.policies)
    protect = args.protect_prompt
    for n in names:  # fail here, once, on a bad --budget / --buffer / prompt combination
        make_run(n, None if n == "full" else args.budget, args.buffer, protect, args.prompt_len)
    device, dtype = resolve_device(args.device, args.dtype, args.quant)
    if args.quant and args.model and Path(args.model).is_file():
        raise UsageError("--quant needs a model directory or name: a bare config.json has only random weights")
    common = {"buffer": args.buffer, "steps": args.steps, "prompt_len": args.prompt_len, "threads": args.threads,
              "protect": protect, "seed": args.seed, "model": model_key(args.model), "device": str(device),
              "dtype": str(dtype), **({"quant": args.quant} if args.quant else {})}  # old rows keep their keys
    rows = [{"policy": n, "context": c, "batch": b, "eager": False, "budget": None if n == "full" else args.budget,
             **({"side_by_side": True} if args.side_by_side and b > 1 else {})}  # in the key only where it adds one
            for n in names for c in contexts for b in batches]
    rows += [{"policy": "full", "context": c, "batch": b, "eager": True, "budget": None}
             for c in contexts for b in batches] if args.eager else []
    return [{"task": "bench", **r, **common} for r in rows]


def cost(job: dict) -> float:
    """A row's expected cost for --shard's balance, in rough seconds of this CPU: a fresh process, the fill (the whole
    context for the full cache; K + r for a compressed one, which then jumps) and the decode steps over the slots
    held; the eager reference's attention grows with the square of the context."""
    held = job["context"] if job["budget"] is None else job["budget"] + job["buffer"]
    step = 0.05 + held * 15e-6 * (1 + job["eager"] * held / 1024)
    steps = job["steps"] + WARMUP + (2 * SIDE_BLOCKS * SIDE_STEPS if job.get("side_by_side") else 0)
    return 3 + job["batch"] * (held * 0.005 + steps * step)


def measure(job: dict, model: str | None = None) -> dict:
    """Measure one row in a fresh Python process (honest per-row peak memory) and return its result fields; model is
    the --model path (the job names it by its content). A row with an "error" is shown, never saved."""
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(job), model or ""],
                       capture_output=True, text=True)
    if p.returncode < 0:  # killed by a signal: on Linux almost always the OOM killer (the eager memory wall)
        return {"error": f"killed by signal {-p.returncode} (out of memory?)"}
    last = (p.stderr.strip().splitlines() or [""])[-1]
    if p.returncode != 0 and last.startswith("error: "):  # the row's own one-line message: pass it on
        raise UsageError(last[len("error: ") :])
    if p.returncode != 0:
        raise RuntimeError(f"bench row {job} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# -----------------------------------------------------------------------------
# one row, inside the subprocess


def build_model(path, device: str | None, dtype: str | None, quant: str | None = None):
    """The model of a directory (or the default), or random weights for a bare config.json."""
    if path and Path(path).is_file():
        device, dtype = resolve_device(device, dtype)
        cpu_threads(device, dtype, None)
        model = Transformer(ModelConfig.from_hf(path), device, dtype)
        g = torch.Generator(device).manual_seed(0)  # drawn on the device: billions of weights on a GPU
        for name, p in model.named_parameters():  # small random weights; norms 1 and biases 0 keep it tame
            if p.dim() > 1:
                p.normal_(0, 0.02, generator=g)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
        return model.eval()
    return load(path, device, dtype, quant)[0]


def reset_peak(device):
    """Forget the peak memory so far (loading the weights maps the file too, which would hide the run's own peak).
    On CPU the heap's free pages go back to the OS first: glibc keeps much of what the load freed resident, a different
    amount each run (the 1.5B in int4: 2,266 to 2,450 MiB resident after loading, 1,904 MiB after the trim, every time),
    so the rows' peaks would differ by that much, and a row's own allocations could hide in those pages."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif Path("/proc/self/clear_refs").exists():
        trim_heap()
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak RSS that ru_maxrss reports


def trim_heap():
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim, every arena); nothing where there is none."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # another C library (musl): its free pages stay, the peak counts them
        pass


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def matvec_bandwidth(device, dtype, mb: int = 256) -> float:
    """Bytes/s that a matrix-vector product reads, best of 5, on a weight far past the last-level cache, in the model's
    own layout and through its own kernels.linear: the bandwidth a batch-1 decoder can reach, its memory roofline."""
    cols = 4096
    w = weight(mb * 2**20 // (cols * torch.finfo(dtype).bits // 8), cols, device=device, dtype=dtype).fill_(0.5)
    x = torch.randn(1, cols, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):  # the first call warms up
        sync(device)
        t0 = time.perf_counter()
        linear(x, w)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return w.nbytes / best


@contextmanager
def clocked(spent: Counter):
    """Add the wall time spent inside the model's matrix products (model.py's calls of kernels.linear: every layer and
    the LM head) to spent["matmul"], and inside its attention (SDPA, or the eager reference) to spent["attention"], by
    wrapping the names model.py calls; restored on exit. On CPU these calls are synchronous, so the sums are exact
    wall time; on CUDA they only queue work, so the bench does not use this there."""
    targets = [(model_py, "linear", "matmul"), (model_py.F, "scaled_dot_product_attention", "attention"),
               (model_py, "eager_attention", "attention")]
    saved = [(module, name, getattr(module, name)) for module, name, _ in targets]

    def timed(fn, key):
        def call(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
        return call

    for module, name, key in targets:
        setattr(module, name, timed(getattr(module, name), key))
    try:
        yield spent
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def decoder(model, o: dict, B: int, steps: int):
    """B rows of the row's policy, filled so that the warm-up and then `steps` greedy decode steps end at position
    o["context"]: returns (run, cache, last logits [B, 1, V])."""
    C, device = o["context"], model.device
    run = make_run(o["policy"], o["budget"], o["buffer"], o["protect"], [o["prompt_len"]] * B, o["seed"])
    cache = make_cache(model, run, C)
    g = torch.Generator().manual_seed(o["seed"])
    fill = C - steps - WARMUP  # positions before the warm-up and the timed window
    ctx = torch.randint(model.cfg.vocab_size, (B, fill), generator=g).to(device)  # [B, T]
    if run.budget is None:  # the full cache: a prefill up to the window, in chunks, so that a 32k prefill of 8 rows
        # never holds [8, 32k, intermediate] activations on a GPU
        for s in range(0, fill, PREFILL_CHUNK):
            logits = feed(model, cache, ctx[:, s : s + PREFILL_CHUNK], run)
    else:  # fill the K + r slots (one eviction round), then jump to the window: it holds the same slots as after a
        # replay of every position, only their positions differ (a 32k replay would take minutes on a GPU)
        logits = feed(model, cache, ctx[:, : run.budget + run.buffer], run)
        cache.next_pos = [fill] * B
    return run, cache, greedy(model, cache, run, logits, WARMUP)


def greedy(model, cache, run, logits, steps: int):
    """`steps` greedy decode steps of every row from the last logits [B, 1, V], evicting on the run's cadence."""
    for _ in range(steps):
        logits = feed(model, cache, logits[:, -1].argmax(-1, keepdim=True), run)
    return logits


def side_by_side(model, o: dict, blocks: int = SIDE_BLOCKS, k: int = SIDE_STEPS) -> float:
    """Batch B's aggregate speed-up over batch 1, measured in one process: a batch-1 and a batch-B decoder take turns
    of k steps, `blocks` times each (who goes first alternates), and their total times are compared, evictions
    included. Rows in separate processes minutes apart also measure the machine's drift (on this shared VM, tens
    of percent); turns in one process see the same machine."""
    dec = {b: list(decoder(model, o, b, blocks * k)) for b in (1, o["batch"])}  # b -> [run, cache, logits]
    took = {b: 0.0 for b in dec}
    for turn in range(blocks):
        for b in (1, o["batch"]) if turn % 2 == 0 else (o["batch"], 1):
            run, cache, logits = dec[b]
            sync(model.device)
            t0 = time.perf_counter()
            dec[b][2] = greedy(model, cache, run, logits, k)
            sync(model.device)
            took[b] += time.perf_counter() - t0
    return round(o["batch"] * took[1] / took[o["batch"]], 2)


@torch.inference_mode()
def measure_here(o: dict, path: str | None = None) -> dict:
    device, dtype = resolve_device(o["device"], o["dtype"].replace("torch.", ""), o.get("quant"))
    model = build_model(path, device, str(dtype).replace("torch.", ""), o.get("quant"))
    if o.get("threads"):  # after loading, which picks nanokv's default (generate.cpu_threads)
        torch.set_num_threads(o["threads"])
    cfg, C, steps, B = model.cfg, o["context"], o["steps"], o["batch"]
    if C > cfg.max_position_embeddings:
        raise UsageError(f"context {C} exceeds the model's {cfg.max_position_embeddings} positions")
    model.eager = o["eager"]
    reset_peak(device)  # note: the peak then counts the resident weights and torch, not the loading transient
    run, cache, logits = decoder(model, o, B, steps)
    run.watch = heads = head_watch(run)  # each round's slots per (layer, KV head): the per-head budgets, untimed
    rounds0, evict0, slots, spent = run.evictions, run.evict_s, 0, Counter()
    on_cpu = torch.device(device).type == "cpu"
    sync(device)
    with clocked(spent) if on_cpu else nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):  # greedy decode of every row: the timed window, evictions included
            # slots read by this step's attention (before its own token); a pooled row's heads read the whole pool
            slots += sum(cache.capacity if cache.pooled else n for n in cache.length)
            logits = feed(model, cache, logits[:, -1].argmax(-1, keepdim=True), run)
        sync(device)
        dt = time.perf_counter() - t0
    n_ev, ev_s = run.evictions - rounds0, run.evict_s - evict0  # row-rounds: each row evicts on its own
    # where a step's time goes (CPU): matmuls, attention, eviction, and the rest (norms, RoPE, cache writes, Python)
    spent["rest"] = dt - ev_s - spent["matmul"] - spent["attention"]
    split = {f"{k}_ms": round(spent[k] / steps * 1e3, 3) for k in ("matmul", "attention", "rest")} if on_cpu else {}
    peak = peak_memory_mb(device)  # read before the bandwidth probe and the side-by-side decoders allocate
    info = cpu_info()
    # roofline: each step reads every matrix once (not the embedding table: one row a token) and every held K/V
    w_bytes = sum(matrix_bytes(getattr(owner, attr)) for owner, attr, _ in model.matrices())
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * cache.k.element_size()
    roof_tok_s = B * matvec_bandwidth(device, dtype) / (w_bytes + kv_bytes * slots / steps)
    side = {}
    mem = kv_memory(cache, run, heads.held)  # before the cache is freed
    if o.get("side_by_side") and B > 1:
        del cache  # the row's own decoder is done: free its slots before two more decoders fill theirs
        side["speedup_side_by_side"] = side_by_side(model, o)
    return {
        "ms_per_step": round(dt / steps * 1e3, 3), "tok_s": round(B * steps / dt, 2),  # tokens of all rows
        "roofline": round(B * steps / dt / roof_tok_s, 3),  # fraction of the bandwidth-bound tokens/s
        "evict_ms": round(ev_s / n_ev * 1e3, 3) if n_ev else None,  # mean per row per eviction round
        "evict_share": round(ev_s / dt, 4), "evictions": n_ev,
        **split, **side, **mem, "peak_mb": round(peak, 1), "slots": run.max_slots,
        # the 1-minute load average: other jobs on the machine spoil the timings, so each row says how busy it was
        "used_threads": torch.get_num_threads(), "load": round(os.getloadavg()[0], 2),
        **({"cpu": " ".join([info["cpu"], info["capability"], *info["flags"]])} if on_cpu else {}),
    }


def head_watch(run):
    """A Run.watch that records, after each round, how many slots each (layer, KV head) of the row keeps: [L, H_kv]
    per row-round in .held (a head's budget b_h is that minus the buffer)."""
    from cache import FREE

    def watch(cache, b, when, scores):
        if when == "after":
            watch.held.append((cache.head_pos(b) != FREE).sum(-1).cpu())  # [L, H_kv]

    watch.held = []
    return watch


def kv_memory(cache, run, held: list) -> dict:
    """Allocated and used K+V bytes of all rows (MB), and how unequal the head budgets got: min / median / max of
    b_h = slots a head keeps after a round minus the buffer, over every layer, head, row and round of the window.
    Used: the slots holding a token at the fullest point of a cycle, just before a round (each head's kept slots + r);
    a uniform policy uses all it allocates, a per-head one a pool of H_kv (K + r + 1) slots per row and layer
    (cache.py).
    alloc_per_layer: the slots allocated per row and layer, all KV heads together (generate.py's summary prints it)."""
    per_slot = 2 * cache.k.shape[-1] * cache.k.element_size()  # K and V of one slot
    alloc = cache.k.shape[0] * cache.k.shape[1] * cache.k.shape[2] * cache.capacity * per_slot
    per_layer = {"alloc_per_layer": cache.k.shape[2] * cache.capacity}
    if not held:
        return {"kv_alloc_mb": round(alloc / 1e6, 2), **per_layer}
    h = torch.stack(held)  # [rounds, L, H_kv]
    used = (h.sum((1, 2)).double().mean().item() + h[0].numel() * run.buffer) * cache.k.shape[1] * per_slot
    b = (h - run.buffer).flatten().double()
    return {"kv_alloc_mb": round(alloc / 1e6, 2), **per_layer, "kv_used_mb": round(used / 1e6, 2),
            "head_cap": run.span - run.buffer,
            "bh_min": int(b.min()), "bh_median": b.median().item(), "bh_max": int(b.max())}


def matrix_bytes(w) -> int:
    """Bytes a matmul reads of a weight: a dense tensor, a kernels.QuantWeight, or a tuple of parts."""
    return sum(map(matrix_bytes, w)) if isinstance(w, tuple) else w.nbytes


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":  # the per-row worker that measure() spawns
        try:
            print(json.dumps(measure_here(json.loads(sys.argv[2]), sys.argv[3] or None)))
        except (UsageError, ModelError) as e:
            sys.exit(f"error: {e}")
        except (MemoryError, torch.OutOfMemoryError) as e:  # the eager memory wall: a row that says so
            print(json.dumps({"error": f"out of memory: {str(e)[:200]}"}))
    else:
        sys.exit("error: run the benchmark as `python eval.py bench ...` (bench.py --one is its per-row worker)")
