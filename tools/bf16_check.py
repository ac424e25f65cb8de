"""
What the bf16 copies of int4 weights change: on the 1.5B with --quant int4, side by side in one process,
the int kernels everywhere against the rule of kernels.linear (steps of DENSE_ROWS rows or more through the bf16
copies). Prints, for each: the full-cache logits of a few GSM8K prompts (max error, KL), one long fidelity trace's
replay (its first --trace-tokens) through the full cache and through snapkv at K = 512, r = 64 (seconds, profile, KL),
and greedy answers of --n GSM8K problems decoded --batch-size at a time (the same tokens? the same grade?).

    OMP_NUM_THREADS=2 python tools/bf16_check.py --n 20 --batch-size 20 --trace-tokens 2048
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cli  # noqa: E402
from eval import answer_of, ask  # noqa: E402
from generate import feed, generate, make_cache, make_run  # noqa: E402
from kernels import DENSE_ROWS, QuantWeight  # noqa: E402
from quant import bf16_copies  # noqa: E402
from tasks import is_correct, load_data  # noqa: E402
from traces import compare, replay  # noqa: E402


def use_copies(model, on: bool):
    """Switch every quantized matrix between its int kernel (off) and kernels.linear's rule (on)."""
    for owner, attr, _ in model.matrices():
        w = getattr(owner, attr)
        for part in w if isinstance(w, tuple) else (w,):
            if isinstance(part, QuantWeight):
                part.dense_rows = DENSE_ROWS if on else 0


def full_logits(model, ids: list[int]) -> torch.Tensor:
    run = make_run("full", None, 64, None, len(ids))
    cache = make_cache(model, run, len(ids))
    return feed(model, cache, torch.tensor([ids]), run, all_logits=True)[0].float()  # [T, V]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--n", type=int, default=20, help="GSM8K problems decoded greedily in both modes (0: none)")
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--trace-tokens", type=int, default=2048, help="tokens of the first long trace replayed (0: none)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok = cli.load(args.model, "cpu", None, "int4")
    print(f"# {cli.cpu_info()}, {torch.get_num_threads()} threads; loaded in {time.perf_counter() - t0:.0f} s, "
          f"peak {cli.peak_memory_mb('cpu'):.0f} MiB", flush=True)
    gb = bf16_copies(model) / 2**30
    print(f"bf16 copies: {gb:.2f} GiB, peak now {cli.peak_memory_mb('cpu'):.0f} MiB", flush=True)
    rows = load_data("data/gsm8k_test.jsonl")
    with torch.inference_mode():
        # 1. logits of whole prompts (every step >= DENSE_ROWS rows): int kernels against copies
        for r in rows[:4]:
            ids = ask(tok, r["question"])
            use_copies(model, False)
            a = full_logits(model, ids)
            use_copies(model, True)
            b = full_logits(model, ids)
            p, q = a.log_softmax(-1), b.log_softmax(-1)
            kl = (p.exp() * (p - q)).sum(-1)  # [T]
            print(f"logits, {len(ids)} tokens: max |int4 - bf16| {(a - b).abs().max():.4f} (max |logit| "
                  f"{a.abs().max():.1f}), KL mean {kl.mean():.2e} max {kl.max():.2e}, top-1 agree "
                  f"{(a.argmax(-1) == b.argmax(-1)).float().mean():.3f}", flush=True)
        # 2. one long trace: the full cache's replay and snapkv's, in both modes
        if args.trace_tokens:
            tr = json.load(open("results/study/longfid_q15.json.traces.json"))["traces"][0]
            ids, start = tr["ids"][: args.trace_tokens], tr["prompt_len"]
            nxt = torch.tensor(ids)[start:, None]
            res = {}
            for on in (False, True):
                use_copies(model, on)
                t0 = time.perf_counter()
                ref = replay(model, ids, make_run("full", None, 64, None, start))[start - 1 : -1]
                t1 = time.perf_counter()
                prof = cProfile.Profile()
                prof.enable()
                got = replay(model, ids, make_run("snapkv", 512, 64, True, start))[start - 1 : -1]
                t2 = time.perf_counter()
                c = compare(ref, got, nxt)
                t3 = time.perf_counter()
                prof.disable()
                res[on] = (ref, got)
                print(f"trace of {len(ids)} tokens, {'bf16 rule' if on else 'int kernels'}: full replay "
                      f"{t1 - t0:.1f} s, snapkv K=512 r=64 replay {t2 - t1:.1f} s, compare {t3 - t2:.1f} s; KL/token "
                      f"{c['kl'] / len(nxt):.4f}, top-1 {c['top1'] / len(nxt):.3f}", flush=True)
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
                print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-1800:], flush=True)
            for which, k in (("full", 0), ("snapkv", 1)):
                c = compare(res[False][k], res[True][k], nxt)
                print(f"{which} replay, int kernels against the bf16 rule: KL/token {c['kl'] / len(nxt):.2e}, "
                      f"top-1 {c['top1'] / len(nxt):.4f}", flush=True)
        # 3. greedy answers, batch by batch, in both modes
        if args.n:
            outs, secs = {}, {}
            for on in (False, True):
                use_copies(model, on)
                t0, outs[on] = time.perf_counter(), []
                for i in range(0, args.n, args.batch_size):
                    batch = rows[i : min(i + args.batch_size, args.n)]
                    prompts = [ask(tok, r["question"]) for r in batch]
                    run = make_run("full", None, 64, None, [len(p) for p in prompts])
                    outs[on] += generate(model, prompts, run, args.max_new_tokens, eos_ids=tok.eos_ids)[0]
                secs[on] = time.perf_counter() - t0
            same = sum(a == b for a, b in zip(outs[False], outs[True]))
            grade = {on: [is_correct(answer_of(tok, ids, r["answer"])[2], r["answer"]) for ids, r in
                          zip(outs[on], rows)] for on in outs}
            first = [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in zip(outs[False], outs[True]) if a != b]
            print(f"greedy, {args.n} GSM8K problems at batch {args.batch_size}: {same}/{args.n} identical token "
                  f"sequences (the others part at tokens {first}); correct int4 {sum(grade[False])} bf16 "
                  f"{sum(grade[True])}, graded alike {sum(x == y for x, y in zip(grade[False], grade[True]))}; "
                  f"decode s int4 {secs[False]:.0f} bf16 {secs[True]:.0f} ({secs[False] / secs[True]:.2f}x)",
                  flush=True)
            print("tokens", json.dumps({"int4": [len(o) for o in outs[False]], "bf16": [len(o) for o in outs[True]]}))
    print(f"peak {cli.peak_memory_mb('cpu'):.0f} MiB")


if __name__ == "__main__":
    main()
