"""
Where one decode step's time goes: torch.profiler over greedy steps of the full cache, split into the matrix products
(by the weight's kind: torch's int4 and int8 kernels, int4x8's int8 dot products, dense), attention, RMSNorm, RoPE
and the rest (the cache, small ops, Python), with the top operators by their own time.

    OMP_NUM_THREADS=1 python tools/profile_step.py --model qwen2.5-coder-1.5b --quant int4 --batch 1

Shares, not speeds: at one thread the shares hold on a loaded machine; time the modes with tools/compare_modes.py.
"""

import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import bench  # noqa: E402
import model as model_py  # noqa: E402
from cli import Parser, UsageError, add_device_args, cpu_info, load  # noqa: E402
from kernels import QuantWeight  # noqa: E402


def kind_of(w) -> str:
    """A weight's kind for the split: its QuantWeight kind(s), else dense."""
    if isinstance(w, tuple):
        return "+".join(sorted({kind_of(p) for p in w}))
    return w.kind if isinstance(w, QuantWeight) else "dense"


PROFILING = {"on": False}  # record_function only while the profiler runs: it costs tens of us a call (3x a norm's)


def labelled(fn, label, spent: Counter):
    """fn, its calls timed into spent[label] and, while PROFILING, recorded for the profiler under label (a function
    of the call's arguments, or a string). The labels never nest: model.py calls none of these inside another."""
    def call(*args, **kw):
        key = label(*args) if callable(label) else label
        t0 = time.perf_counter()
        try:
            if not PROFILING["on"]:
                return fn(*args, **kw)
            with record_function(key):
                return fn(*args, **kw)
        finally:
            spent[key] += time.perf_counter() - t0
    return call


def main(argv=None):
    ap = Parser(description="The split of one decode step's time: matrix products by kind, attention, norms, rest.")
    ap.add_argument("--model", default=None, help="a name weights.py knows, or a model directory")
    add_device_args(ap)
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together")
    ap.add_argument("--context", type=int, default=512, help="the position the profiled steps end at")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed, then as many profiled (after 4 warm)")
    args = ap.parse_args(argv)
    try:
        if min(args.batch, args.steps) < 1 or args.context <= 2 * args.steps + bench.WARMUP + 4:
            raise UsageError("--batch and --steps must be at least 1, and --context above 2 * --steps + 8")
        model, _ = load(args.model, "cpu", args.dtype, args.quant)
    except UsageError as e:
        sys.exit(f"error: {e}")
    o = {"policy": "full", "budget": None, "buffer": 64, "protect": None, "prompt_len": 64, "seed": 0,
         "context": args.context}
    run, cache, logits = bench.decoder(model, o, args.batch, 2 * args.steps + 4)
    logits = bench.greedy(model, cache, run, logits, 4)  # warm: first calls allocate
    saved = {n: getattr(model_py, n) for n in ("linear", "rms_norm", "rope")}
    sdpa, parts = model_py.F.scaled_dot_product_attention, Counter()
    model_py.linear = labelled(saved["linear"], lambda x, w: f"matmul {kind_of(w)}", parts)
    model_py.rms_norm = labelled(saved["rms_norm"], "norm", parts)
    model_py.rope = labelled(saved["rope"], "rope", parts)
    model_py.F.scaled_dot_product_attention = labelled(sdpa, "attention", parts)
    try:  # the split from the timers alone (the profiler's own cost falls on the small ops), then the profile
        t0 = time.perf_counter()
        logits = bench.greedy(model, cache, run, logits, args.steps)
        wall, split = time.perf_counter() - t0, Counter(parts)  # before the profiled steps add to parts
        PROFILING["on"] = True
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            bench.greedy(model, cache, run, logits, args.steps)
    finally:
        PROFILING["on"] = False
        for n, fn in saved.items():
            setattr(model_py, n, fn)
        model_py.F.scaled_dot_product_attention = sdpa
    info = cpu_info()
    print(f"CPU: {info['cpu']}, {' '.join(info['flags'])}; {torch.get_num_threads()} thread(s); {args.quant or 'dense'}"
          f", batch {args.batch}, position {args.context}; {wall / args.steps * 1e3:.1f} ms a step")
    print("| part | ms a step | share |\n|---|---|---|")
    for k, v in sorted(split.items(), key=lambda kv: -kv[1]) + [("rest (cache, small ops, Python)",
                                                                 wall - sum(split.values()))]:
        print(f"| {k} | {v / args.steps * 1e3:.2f} | {v / wall:.1%} |")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
