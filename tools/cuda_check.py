"""
The GPU check: the papers' setting, where a user first tries nanokv, run once on a CUDA GPU in a few minutes.

    python tools/cuda_check.py             # one CUDA GPU: Qwen3-4B's shape, random bf16 weights, 32k positions
    python tools/cuda_check.py --dry-run   # the same code path on the CPU at tiny shapes, fp32 (the tests run it)

It prints one Markdown table, a row per check, and exits non-zero if any check fails:
1. triton: each Triton kernel (RMSNorm, RoPE, the window-attention scorer) against its torch reference, fp32 and bf16
   (the CPU tests only run them in the Triton interpreter, in fp32);
2. sdpa: the backend SDPA picks for model.py's own calls (a decode step without a mask, with a per-head mask, a
   prefill chunk with its bottom-right causal mask), read from the op it dispatches to, and its output against the
   written-out attention (model.eager_attention);
3. evict: every registered policy's eviction rounds at K = 2048, r = 64, batch 8, with positions jumped to the end
   of a 32k context (bench.py's trick): two rounds per row, then the invariants (K slots, positions in order and
   unique, protected prompt or sinks and the recent buffer held) and the time per round;
4. decode: tokens/s and peak memory of the full cache against K = 2048 (random, prompt protected) at 32,768
   positions, batch 1 and 8 (bench.measure_here, its prefill chunked).
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project's modules
sys.path.insert(0, str(ROOT))

QWEN3_4B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6}
TINY = {**QWEN3_4B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024}
# (config, dtype, context, K, r, batches, prompt tokens, timed decode steps): the real check and its dry run
SETTINGS = {"gpu": (QWEN3_4B, "bfloat16", 32768, 2048, 64, (1, 8), 64, 64),
            "dry": (TINY, "float32", 640, 48, 16, (1, 8), 8, 20)}


def row(check: str, ok: bool, detail: str) -> tuple[str, bool, str]:
    return check, ok, detail


# -----------------------------------------------------------------------------
# 1. the Triton kernels


def check_kernels(device: str, dtypes, long_s: int) -> list[tuple]:
    """Each Triton kernel against its reference on irregular and strided shapes: one row per (kernel, dtype)."""
    import torch
    import kernels

    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in dtypes:
        # made on the device in the dtype before any slicing, so the strided views below stay strided there
        rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        x, w = rand(3, 37, 576), rand(576)
        cases = {"rms_norm": (kernels.rms_norm_triton, kernels.rms_norm_ref, (x, w, 1e-6))}
        q = rand(2, 37, 3 * 5 * 128)[..., : 5 * 128].view(2, 37, 5, 128).transpose(1, 2)  # strided, as from qkv
        ang = (torch.arange(37) + 1000 * torch.arange(2)[:, None])[..., None] / 1e6 ** (torch.arange(64) / 64)
        cos, sin = (torch.cat(t, -1).float().to(device) for t in ([ang.cos()] * 2, [-ang.sin(), ang.sin()]))
        cases["rope"] = (kernels.rope_triton, kernels.rope_ref, (q, cos, sin))  # tables as model.rope_cos_sin
        for W, S in ((64, long_s), (200, 37)):  # a scorer's window over a full cache; a long window over a few keys
            qs, ks = rand(2, 32, W, 128) * 0.2, rand(2, 8, S, 128)
            k_pos = torch.stack([torch.randperm(2 * S, generator=g)[:S] for _ in range(16)]).view(2, 8, S).to(device)
            q_pos = torch.randint(0, 2 * S, (2, W), generator=g).to(device)
            q_pos[:, 0] = -1  # an empty ring slot
            cases[f"window_attn_mass W={W} S={S}"] = (kernels.window_attn_mass_triton, kernels.window_attn_mass_ref,
                                                      (qs, ks, q_pos, k_pos, 128**-0.5))
        for name, (fast, ref, args) in cases.items():
            got, want = fast(*args).float(), ref(*args).float()
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)
            rows.append(row(f"triton {name} {str(dtype)[6:]}", err <= tol, f"max rel. error {err:.1e} (tol {tol:g})"))
    return rows


# -----------------------------------------------------------------------------
# 2. SDPA: which backend model.py's calls get, and whether it computes what the written-out attention does

SDPA_OPS = {"cudnn": "cuDNN", "flash_attention_for_cpu": "flash (CPU)", "flash": "FlashAttention",
            "efficient": "memory-efficient", "math": "math (unfused)"}


def sdpa_backend(call) -> str:
    """The backend SDPA dispatched `call` to, read from the aten op the profiler records (e.g.
    aten::_scaled_dot_product_flash_attention -> FlashAttention)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    names = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_")
             or e.name.startswith("aten::_flash") or e.name.startswith("aten::_efficient")]
    for key, label in SDPA_OPS.items():
        if any(key in n for n in names):
            return label
    return "unknown (" + ", ".join(sorted(set(names))[:3]) + ")"


def check_sdpa(cfg: dict, device: str, dtype, S: int) -> list[tuple]:
    """model.py's three SDPA calls at context S against model.eager_attention (fp32 softmax)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    import model as M

    g = torch.Generator().manual_seed(0)
    H_q, H_kv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_rep, B, T = H_q // H_kv, 2, 256 if S > 4096 else 16
    rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    k, v = rand(B, H_kv, S, D), rand(B, H_kv, S, D)
    q1 = rand(B, H_q, 1, D)
    mask = torch.rand(B, H_kv, 1, S, generator=g).to(device) < 0.9  # a decode step over heads that hold other slots
    mask[..., -1] = True
    qc = rand(B, H_q, T, D)  # a prefill chunk: its T queries after S - T held slots, causal among themselves
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T).to(device)
    cases = {  # (SDPA as model.py calls it, the same through the eager reference)
        "sdpa no mask": (lambda: F.scaled_dot_product_attention(q1.reshape(B, H_kv, n_rep, D), k, v),
                         lambda: M.eager_attention(q1, k, v, None)),
        "sdpa mask": (lambda: F.scaled_dot_product_attention(q1.reshape(B, H_kv, n_rep, D), k, v,
                                                             attn_mask=mask.repeat(1, 1, n_rep, 1)),
                      lambda: M.eager_attention(q1, k, v, mask)),
        "sdpa causal chunk": (lambda: F.scaled_dot_product_attention(qc, k, v, attn_mask=causal_lower_right(T, S),
                                                                     enable_gqa=True),
                              lambda: M.eager_attention(qc, k, v, causal.expand(B, H_kv, T, S))),
    }
    rows, tol = [], 1e-5 if dtype == torch.float32 else 2e-2
    for name, (fast, ref) in cases.items():
        backend = sdpa_backend(fast)
        got, want = fast().reshape(B, H_q, -1, D).float(), ref().float()
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)
        rows.append(row(name, err <= tol, f"{backend}, S = {S:,}, max rel. error {err:.1e}"))
    return rows


# -----------------------------------------------------------------------------
# 3. every policy's eviction rounds, at the end of a long context


def check_evictions(model, K: int, r: int, B: int, P: int, context: int) -> list[tuple]:
    """For each registered policy (at its paper's prompt setting): fill K + r slots of B rows (the first round), jump
    the positions to the end of the context, decode r steps (the second round), then check every row and layer."""
    import torch

    import generate as G
    from policies import POLICIES

    g = torch.Generator().manual_seed(0)
    rows = []
    for name in POLICIES:
        if POLICIES[name].score is None:  # full: nothing to evict
            continue
        run = G.make_run(name, K, r, None, [P] * B, ids=list(range(B)))
        cache = G.make_cache(model, run, context)
        x = torch.randint(model.cfg.vocab_size, (B, K + r), generator=g).to(model.device)
        try:
            logits = G.feed(model, cache, x, run)  # the first round, as the prefill reaches K + r
            cache.next_pos = [context - r - 1] * B  # far on: the same slots, later positions
            for _ in range(r):  # the second round, on the generation cadence
                logits = G.feed(model, cache, logits[:, -1].argmax(-1, keepdim=True), run)
        except Exception as e:  # a policy that breaks at this shape: its row says how, the others still run
            rows.append(row(f"evict {name}", False, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
            continue
        rows.append(row(f"evict {name}", *invariants(cache, run, K, r)))
        del cache, logits
    return rows


def invariants(cache, run, K: int, r: int) -> tuple[bool, str]:
    """Whether every row went through two rounds and holds K slots per layer and KV head (a per-head policy: its heads
    hold H_kv x K together, each its own number, the rest of the row free), in position order, no position twice, its
    protected positions (prompt or sinks) and its newest r tokens (the buffer) among them."""
    import torch
    from cache import FREE

    bad, B = [], len(run.rounds)
    S = run.span if run.policy.per_head else K  # a row's length after a round
    if run.rounds != [2] * B or cache.length != [S] * B:
        bad.append(f"rounds {sorted(set(run.rounds))}, slots {sorted(set(cache.length))}")
    # [L, B, H_kv, S]: each head's positions at the front (a per-head policy's heads share one pool per layer)
    pos = torch.stack([cache.head_pos(b)[..., :S] for b in range(B)], 1)
    held = pos != FREE  # each head's slots first, then the free ones
    counts = held.sum(-1)  # [L, B, H_kv]
    if not bool((counts == K).all() if not run.policy.per_head else (counts.sum(-1) <= K * counts.shape[-1]).all()):
        bad.append(f"slots per head {counts.min().item()}-{counts.max().item()}, not K = {K}")
    if not bool(((pos[..., 1:] > pos[..., :-1]) | ~held[..., 1:]).all() and (held[..., :-1] | ~held[..., 1:]).all()):
        bad.append("positions out of order or repeated")
    below = torch.tensor(run.protect_below, device=pos.device)[None, :, None, None]
    if not bool((((pos < below) & held).sum(-1) == below[..., 0]).all()):
        bad.append("a protected position evicted")
    newest = torch.tensor(cache.next_pos, device=pos.device)[None, :, None, None] - r
    if not bool((((pos >= newest) & held).sum(-1) == r).all()):  # the r tokens fed since the first round
        bad.append("the recent buffer not held")
    ms = run.evict_s / max(run.evictions / B, 1) * 1e3  # the rows are due together: one round evicts all B
    return not bad, "; ".join(bad) or f"2 rounds of {B} rows at once, {ms:.1f} ms per round"


# -----------------------------------------------------------------------------
# 4. decode speed and peak memory


def check_decode(path: str, device: str, dtype: str, context: int, K: int, r: int, B: int, P: int, steps: int):
    """The full cache and K (random, prompt protected) at `context` positions: bench.measure_here's figures."""
    import torch

    import bench

    rows = []
    for policy, budget in (("full", None), ("random", K)):
        o = {"policy": policy, "budget": budget, "buffer": r, "protect": True if budget else None, "context": context,
             "batch": B, "steps": steps, "prompt_len": P, "eager": False, "seed": 0, "threads": 0, "device": device,
             "dtype": dtype}
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        try:
            m = bench.measure_here(o, path)
        except torch.OutOfMemoryError as e:
            rows.append(row(f"decode {policy} batch {B}", False, f"out of memory: {str(e)[:80]}"))
            continue
        what = "full cache" if budget is None else f"K = {K}"
        rows.append(row(f"decode {policy} batch {B}", True, f"{what}, {context:,} positions: {m['tok_s']:,.1f} tok/s, "
                        f"{m['ms_per_step']:.1f} ms/step, peak {m['peak_mb'] / 1024:.2f} GiB"))
    return rows


# -----------------------------------------------------------------------------


def main():
    # no prefixes of flags, as cli.Parser; not imported: torch must wait until TRITON_INTERPRET is set
    ap = argparse.ArgumentParser(description="Check nanokv's CUDA path at the papers' setting (Qwen3-4B's shape, "
                                 "32k positions, K = 2048) and print one table; exits 1 on any failed check.",
                                 allow_abbrev=False)
    ap.add_argument("--dry-run", action="store_true", help="the same checks on the CPU at tiny shapes, fp32 (Triton "
                    "in its interpreter): what the tests run, with no GPU")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on the CPU
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: no CUDA device visible to this torch: run tools/cuda_check.py on a machine with a CUDA GPU, "
                 "or --dry-run here")
    cfg, dtype, context, K, r, batches, P, steps = SETTINGS["dry" if args.dry_run else "gpu"]
    device = "cpu" if args.dry_run else "cuda"
    where = "CPU, dry run" if args.dry_run else torch.cuda.get_device_name()
    print(f"nanokv GPU check on {where}: {'tiny' if args.dry_run else 'Qwen3-4B'}-shaped random weights, {dtype}, "
          f"{context:,} positions, K = {K}, r = {r}\n\n| check | result | detail |\n|---|---|---|", flush=True)
    failed = 0

    def show(rows):
        nonlocal failed
        for check, ok, detail in rows:
            print(f"| {check} | {'ok' if ok else 'FAIL'} | {detail} |", flush=True)
            failed += not ok

    t0 = time.perf_counter()
    show(check_kernels(device, [torch.float32] if args.dry_run else [torch.float32, torch.bfloat16],
                       long_s=300 if args.dry_run else 2112))
    show(check_sdpa(cfg, device, getattr(torch, dtype), context))
    with tempfile.TemporaryDirectory() as d, torch.inference_mode():
        path = os.path.join(d, "config.json")  # the shape as a config.json: bench builds random weights from it
        with open(path, "w") as f:
            json.dump(cfg, f)
        import bench

        model = bench.build_model(path, device, dtype)
        show(check_evictions(model, K, r, max(batches), P, context))
        del model
        for B in batches:
            show(check_decode(path, device, dtype, context, K, r, B, P, steps))
    print(f"\n{failed} of the checks failed" if failed else "\nevery check passed",
          f"({time.perf_counter() - t0:.0f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
