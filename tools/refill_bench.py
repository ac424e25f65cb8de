"""
Refill against batches that drain, side by side in one process: one accuracy job (eval.py's own code) run in each
mode on the same model, its wall and CPU time, its decode steps and how many rows each step decoded.

    OMP_NUM_THREADS=2 python tools/refill_bench.py --modes no-refill:16,refill:16,refill:32 --model \
        qwen2.5-coder-1.5b --quant int4 --policies snapkv --budgets 192 --buffer 16 --protect-prompt --n 32 \
        --max-new-tokens 512 --data data/gsm8k_test.jsonl --out results/refill_q15.jsonl

    python tools/refill_bench.py steps results/study/curve_q15.json snapkv 192 --batch-sizes 16,24,32

    OMP_NUM_THREADS=2 python tools/refill_bench.py rows --model qwen2.5-coder-1.5b --quant int4 --rows 4,8,16,24 \
        --sweep results/study/curve_q15.json snapkv 192

rows: what a decode step costs against its live rows, measured side by side (decoders of each size take turns of 8
greedy steps, snapkv at K = 192, r = 16, the prompt protected, as the sweeps run), fitted as a + b x rows; with
--sweep, the time each loop of `steps` would take on that sweep's answers (refill charged one fixed part a more for
each newcomer's own prefill), and their ratio: refill saves steps, i.e. their fixed part a, so it pays where a step's
cost grows slowly with its rows.
steps: what refill would have saved on a finished sweep, from its answers' lengths alone: the decode steps and live
rows per step of --no-refill at the row's batch size against refill at each of --batch-sizes (both loops replayed
step by step as generate and generate_refill run them), on the first 32 problems and on all.

Every other flag is eval.py accuracy's (one policy and one budget: the full-cache reference row is not run). Live
rows per step (row-steps / decode steps) measures the batch's fullness, which does not depend on the machine's load;
the times do, so the modes run one after the other in one process, the model loaded once, and the CPU and the load
average are printed beside them. Each mode's graded outcomes and answer texts are compared with the first mode's.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import eval as ev  # noqa: E402
from cli import UsageError, cpu_info  # noqa: E402
from model import ModelError  # noqa: E402


def parse_modes(text: str) -> list[tuple[bool, int]]:
    """'no-refill:16,refill:32' -> [(False, 16), (True, 32)]."""
    modes = []
    for part in text.split(","):
        kind, _, size = part.partition(":")
        if kind not in ("refill", "no-refill") or not size.isdigit() or int(size) < 1:
            raise UsageError(f"--modes takes refill:N or no-refill:N, comma-separated (got {part!r})")
        modes.append((kind == "refill", int(size)))
    return modes


def refill_steps(lengths: list[int], size: int) -> tuple[int, int]:
    """(decode steps, rows they decoded) of generate_refill on answers of these lengths (tokens each, first one from
    the prefill), at most `size` rows live, e.g. [3, 1, 2] at 2 rows: step 1 decodes the first row alone (the
    1-token answer ended at its prefill, and the third takes its place), step 2 the first and the third: (2, 3)."""
    queue, live, steps, rows = list(lengths), [], 0, 0
    while True:
        while queue and len(live) < size:
            live.append(queue.pop(0))  # remaining tokens to sample, the first from its prefill
        live = [n - 1 for n in live if n > 1]  # every live row samples a token; the ended ones leave
        if not live and not queue:
            return steps, rows
        if live:  # the rows that go on take one decode step together
            steps, rows = steps + 1, rows + len(live)


def batch_steps(lengths: list[int], size: int) -> tuple[int, int]:
    """(decode steps, rows they decoded) of generate on batches of `size` in order, each until its longest ends."""
    batches = [lengths[i : i + size] for i in range(0, len(lengths), size)]
    return sum(max(b) - 1 for b in batches), sum(n - 1 for b in batches for n in b)


def steps_main(argv: list[str]):
    if len(argv) < 3:
        raise UsageError("steps takes FILE POLICY K (K: none for the full cache) [--batch-sizes 16,24,32]")
    path, policy, K = argv[0], argv[1], None if argv[2].lower() == "none" else int(argv[2])
    sizes = [int(x) for x in argv[argv.index("--batch-sizes") + 1].split(",")] if "--batch-sizes" in argv else [16]
    rows = [r for r in json.load(open(path)) if r.get("policy") == policy and r.get("budget") == K]
    if not rows:
        raise UsageError(f"{path} has no {policy} row at K = {K}")
    lengths, size = [p["tokens"] for p in rows[0]["per_problem"]], rows[0]["batch_size"]
    print(f"{path}: {policy}, K = {K}, mean answer {sum(lengths) / len(lengths):.0f} tokens")
    print("| problems | --no-refill at its batch size: steps, live rows / step | refill at | steps, live rows / step "
          "| fewer steps |")
    print("|---|---|---|---|---|")
    for n in sorted({min(32, len(lengths)), len(lengths)}):
        s0, r0 = batch_steps(lengths[:n], size)
        for b in sizes:
            s1, r1 = refill_steps(lengths[:n], b)
            print(f"| {n} | {size}: {s0}, {r0 / s0:.2f} | {b} | {s1}, {r1 / s1:.2f} | {s0 / s1:.2f}x |")


def rows_main(argv: list[str]):
    import torch

    import bench
    from cli import load

    opt = lambda flag, default: argv[argv.index(flag) + 1] if flag in argv else default
    sizes = [int(x) for x in opt("--rows", "4,8,16,24").split(",")]
    turns, k = 4, 8
    model, _ = load(opt("--model", None), "cpu", None, opt("--quant", None))
    o = {"context": 448, "policy": "snapkv", "budget": 192, "buffer": 16, "protect": True, "prompt_len": 128,
         "seed": 0}
    took = dict.fromkeys(sizes, 0.0)
    with torch.inference_mode():
        dec = {b: list(bench.decoder(model, o, b, turns * k)) for b in sizes}  # b -> [run, cache, logits]
        for turn in range(turns):  # who goes first alternates, so every size sees the same machine
            for b in sizes if turn % 2 == 0 else sizes[::-1]:
                run, cache, logits = dec[b]
                t0 = time.perf_counter()
                dec[b][2] = bench.greedy(model, cache, run, logits, k)
                took[b] += time.perf_counter() - t0
    ms = {b: took[b] / (turns * k) * 1e3 for b in sizes}
    mx, my = sum(sizes) / len(sizes), sum(ms.values()) / len(sizes)
    slope = sum((b - mx) * (ms[b] - my) for b in sizes) / sum((b - mx) ** 2 for b in sizes)
    a = my - slope * mx
    info = cpu_info()
    print(f"CPU: {info['cpu']}, {info['capability']}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; torch "
          f"threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}")
    print("| live rows | ms per decode step | ms per row |\n|---|---|---|")
    for b in sizes:
        print(f"| {b} | {ms[b]:.0f} | {ms[b] / b:.1f} |")
    print(f"fit: {a:.0f} ms + {slope:.1f} ms x rows")
    if "--sweep" in argv:
        at = argv.index("--sweep")
        path, policy, K = argv[at + 1], argv[at + 2], None if argv[at + 3].lower() == "none" else int(argv[at + 3])
        r = next(r for r in json.load(open(path)) if r.get("policy") == policy and r.get("budget") == K)
        lengths = [p["tokens"] for p in r["per_problem"]]
        for n_p in sorted({min(32, len(lengths)), len(lengths)}):
            s0, r0 = batch_steps(lengths[:n_p], r["batch_size"])
            t0 = (a * s0 + slope * r0) / 1e3
            for b in sizes:
                s1, r1 = refill_steps(lengths[:n_p], b)
                # + the prefills: a forward per newcomer (at worst one each) where the batches had one per batch
                t1 = (a * s1 + slope * r1 + a * (n_p - -(-n_p // r["batch_size"]))) / 1e3
                print(f"{n_p} problems: --no-refill at {r['batch_size']} {t0 / 60:.1f} min of decode steps, refill at "
                      f"{b} {t1 / 60:.1f} min: {t0 / t1:.2f}x")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["steps"]:
            return steps_main(argv[1:])
        if argv[:1] == ["rows"]:
            return rows_main(argv[1:])
        if "--modes" not in argv:
            raise UsageError("give --modes, e.g. --modes no-refill:16,refill:16")
        at = argv.index("--modes")
        modes = parse_modes(argv[at + 1])
        out = argv[argv.index("--out") + 1] if "--out" in argv else None
        argv = [a for i, a in enumerate(argv) if i not in (at, at + 1)]
        if out:
            argv = [a for a in argv if a not in ("--out", out)]
        args = ev.build_parser().parse_args(["accuracy", *argv])
        args.batch_size = modes[0][1]
        jobs = ev.make_jobs(args)[1:]  # not the full cache's reference row
        if len(jobs) != 1:
            raise UsageError(f"name one policy and one budget (got {len(jobs)} jobs)")
        lab, first, info = {}, None, cpu_info()
        ev.check_jobs(args, jobs, lab)
        print(f"CPU: {info['cpu']}, {info['capability']}, {' '.join(info['flags'])}; "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print("| mode | batch | wall s | CPU s | decode steps | live rows / step | accuracy | outcomes as first | "
              "texts as first | load before, after |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for refill, size in modes:
            args.refill, args.batch_size = refill, size
            job = ev.make_jobs(args)[1]
            spent = {"steps": 0, "row_steps": 0}
            real = {name: getattr(ev, name) for name in ("generate", "generate_refill")}

            def counted(fn):  # adds each call's decode steps and rows to spent
                def call(*a, **kw):
                    res = fn(*a, **kw)
                    t = res[-1]
                    spent["steps"] += t["steps"]
                    spent["row_steps"] += t["row_steps"]
                    return res
                return call

            for name, fn in real.items():
                setattr(ev, name, counted(fn))
            load0 = os.getloadavg()[0]
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                row = ev.accuracy(args, job, lab)
            finally:
                for name, fn in real.items():
                    setattr(ev, name, fn)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            per = row["per_problem"]
            first = first or per
            same = sum(a["correct"] == b["correct"] for a, b in zip(per, first))
            texts = sum(a["text_z"] == b["text_z"] for a, b in zip(per, first))
            live = spent["row_steps"] / max(spent["steps"], 1)
            print(f"| {'refill' if refill else 'no-refill'} | {size} | {wall:.0f} | {cpu:.0f} | {spent['steps']} | "
                  f"{live:.2f} | {row['accuracy']:.3f} | {same}/{len(per)} | {texts}/{len(per)} | "
                  f"{load0:.1f}, {os.getloadavg()[0]:.1f} |", flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps({**job, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), **spent,
                                        "live_rows": round(live, 3), "cpu": info["cpu"], "load": load0,
                                        **{k: v for k, v in row.items() if k != "per_problem"},
                                        "correct": [p["correct"] for p in per]}) + "\n")
    except (ModelError, UsageError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
