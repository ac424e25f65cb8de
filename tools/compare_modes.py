"""
The fast modes beside the exact one, in one process: --dtype bfloat16, --quant int8, --quant int4 (int4-bf16: with
its bf16 copies for steps of 16 rows or more, as eval.py's batched steps run it) and --quant int4x8 against fp32.

    python tools/compare_modes.py speed --model qwen2.5-coder-1.5b --batch-sizes 1,16,32
    python tools/compare_modes.py fidelity --model qwen2.5-coder-1.5b \
        --traces results/study/fidelity_q15.json.traces.json

speed: each mode's model is loaded once, and their decoders take turns of 16 greedy steps (who goes first rotates),
so every mode sees the same machine; a mode's tokens/s is its steps over its own time, with the split of a step into
matrix products, attention, eviction and the rest (as `eval.py bench`), for each batch size. The CPU is named in
the output: speeds on another CPU differ, and a mode's rank may too.
fidelity: the cost of a mode in what it computes: the model's own full-cache conversations (eval.py fidelity's
traces, or --n new ones) teacher-forced through the full cache in each mode, KL(fp32 || mode) and top-1 agreement
with fp32 (or --reference) per generated position; and --problems greedy answers decoded in each mode against the
reference's (the first token where they part, and whether the graded answer is the same). One mode is in memory at a
time.
error: what each format (int8 per row, bf16, int4 from the kept blocks) does to a GGUF's own numbers, per block type:
the measured ground for quant.plan's choice.
accuracy: a fast mode's full-cache accuracy against fp32's, paired on the same problems (two eval.py accuracy files,
--exact and --fast): the difference with its bootstrap interval and sign test, and whether the mode passes the check
the replication study ran on (p > 0.2 and the interval within +-0.06).
"""

import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import torch  # noqa: E402

import bench  # noqa: E402
from cli import (Parser, UsageError, check_output, cpu_info, cpu_threads, int_list, load,  # noqa: E402
                 resolve_device, write_output)
from eval import answer_of, ask  # noqa: E402
from generate import generate, make_run  # noqa: E402
from kernels import DENSE_ROWS, dense  # noqa: E402
from model import Checkpoint, ModelConfig, ModelError, Transformer, opened, weight_files  # noqa: E402
from policies import POLICIES  # noqa: E402
from quant import int4_codes, int4_groups, int8_rows  # noqa: E402
from results import differs, model_key, one_setting, read_json, tool_rows  # noqa: E402
from stats import bootstrap_diff, outcomes, sign_test  # noqa: E402
from tasks import DATA, load_data  # noqa: E402
from traces import conversation_plans, pack_conversations, replay, targets  # noqa: E402
from weights import DEFAULT_MODEL, INT4_TYPES, SetupError, model_dir  # noqa: E402

# mode -> (--dtype, --quant, the most rows a step multiplies: from kernels.DENSE_ROWS, int4's steps of many rows run
# through bf16 copies where the CPU has bf16 units, cli.bf16_matmul). int4x8: int4's numbers, int8 dot products
MODES = {"fp32": ("float32", None, 1), "bf16": ("bfloat16", None, 1), "int8": (None, "int8", 1),
         "int4": (None, "int4", 1), "int4-bf16": (None, "int4", DENSE_ROWS), "int4x8": (None, "int4x8", 1)}


def load_modes(name: str, modes: list[str]) -> dict:
    """mode -> (model, tokenizer, its dtype, its quant), each loaded once."""
    out = {}
    for m in modes:
        dtype, quant, rows = MODES[m]
        model, tok = load(name, "cpu", dtype, quant, rows=rows)
        out[m] = (model, tok, resolve_device("cpu", dtype, quant)[1], quant)
        mb = sum(bench.matrix_bytes(getattr(owner, attr)) for owner, attr, _ in model.matrices()) / 2**20
        print(f"[load] {m}: {out[m][2]} activations, {mb:.0f} MiB of matrices", file=sys.stderr)
    return out


def speed(args, models: dict) -> list[dict]:
    """Per batch size, every mode's decoder takes `turns` turns of `steps` greedy steps, the order rotating."""
    rows = []
    for B in int_list("--batch-sizes", args.batch_sizes):
        o = {"policy": args.policy, "budget": None if args.policy == "full" else args.budget, "buffer": args.buffer,
             "protect": None, "prompt_len": 64, "seed": 0, "context": args.context}
        dec, spent, took = {}, {}, Counter()
        for m, (model, _, dtype, quant) in models.items():
            cpu_threads("cpu", dtype, quant)
            dec[m] = list(bench.decoder(model, o, B, args.turns * args.steps))  # [run, cache, logits]
            spent[m] = Counter(evict=-dec[m][0].evict_s)
        names = list(models)
        for turn in range(args.turns):
            for m in names[turn % len(names):] + names[: turn % len(names)]:
                model, _, dtype, quant = models[m]
                run, cache, logits = dec[m]
                cpu_threads("cpu", dtype, quant)
                with bench.clocked(spent[m]):
                    t0 = time.perf_counter()
                    dec[m][2] = bench.greedy(model, cache, run, logits, args.steps)
                    took[m] += time.perf_counter() - t0
        for m in names:
            s, n = spent[m], args.turns * args.steps
            s["evict"] += dec[m][0].evict_s
            rest = took[m] - s["evict"] - s["matmul"] - s["attention"]
            ms = lambda v: round(v / n * 1e3, 2)
            rows.append({"mode": m, "batch": B, "tok_s": round(B * n / took[m], 2),
                         "vs_fp32": round(took["fp32"] / took[m], 2) if "fp32" in took else None,
                         "ms_per_step": ms(took[m]), "matmul_ms": ms(s["matmul"]), "attention_ms": ms(s["attention"]),
                         "evict_ms": ms(s["evict"]), "rest_ms": ms(rest)})
        del dec
    return rows


def saved_traces(args) -> list[dict]:
    """--traces: an eval.py fidelity traces file, which must be of this model (its key names the model)."""
    saved = read_json(Path(args.traces), dict, "pass a traces file of eval.py fidelity (FILE.traces.json)")
    if not (isinstance(saved.get("key"), dict) and isinstance(saved.get("traces"), list)):
        raise UsageError(f"--traces {args.traces} has no 'key' and 'traces': pass a traces file of eval.py fidelity "
                         "(FILE.traces.json)")
    if saved["key"].get("model") != model_key(args.model):
        raise UsageError(f"--traces {args.traces} holds another model's conversations ({saved['key']['model']}): "
                         "pass that model's, or drop --traces to pack new ones")
    return saved["traces"][: args.n]


def fidelity(args, modes: list[str]) -> list[dict]:
    """KL(ref || mode) and top-1 agreement on the conversations; greedy answers against the reference's (modes[0]:
    fp32, or --reference). One model in memory at a time (the 1.5B's four modes together take 14 GB): the reference
    first, whose log-probs wait on disk, memory-mapped."""
    rows_data = load_data(args.data)[: args.problems]
    out, refs, exact = [], tempfile.TemporaryDirectory(prefix="nanokv-modes-"), None  # exact: fp32's answers
    for m in modes:
        model, tok, _, _ = load_modes(args.model, [m])[m]
        if m == modes[0]:
            traces = saved_traces(args) if args.traces else pack_conversations(
                model, tok, conversation_plans(tok, [r["question"] for r in load_data(args.data)], args.n), args)
        prompts = [ask(tok, r["question"]) for r in rows_data]
        run = make_run("full", None, 64, None, [len(p) for p in prompts])
        answers = generate(model, prompts, run, args.max_new_tokens, eos_ids=tok.eos_ids)[0]
        kl = top1 = n = 0.0
        for i, tr in enumerate(traces):
            at, path = targets(tr), Path(refs.name) / f"{i}.pt"
            q = replay(model, tr["ids"], make_run("full", None, 64, None, 1))[at].log_softmax(-1)  # [N, V]
            if m == modes[0]:
                torch.save(q, path)
            p = torch.load(path, mmap=True)
            kl += (p.exp() * (p - q)).sum().item()
            top1 += (p.argmax(-1) == q.argmax(-1)).sum().item()
            n += len(at)
        exact = exact or answers
        parts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(answers, exact)]
        same = [answer_of(tok, x, r["answer"])[2] == answer_of(tok, y, r["answer"])[2]
                for x, y, r in zip(answers, exact, rows_data)]
        out.append({"mode": m, "kl": kl / n, "top1": top1 / n, "tokens": int(n), "traces": len(traces),
                    "identical": sum(p is None for p in parts), "problems": len(parts),
                    "first_divergence": sorted(p for p in parts if p is not None), "same_answer": sum(same)})
        print(table(out[-1:]), file=sys.stderr)
        del model
    return out


def error(args) -> list[dict]:
    """What each format does to a GGUF's own numbers, per block type: every matrix's exact values (the fp32
    safetensors, bit for bit the GGUF's dequantized blocks) against int8 per output row, bf16, and for the 4-bit types
    the int4 kernel's matrix from the kept codes (bf16 scales and zeros): the relative RMS error ||w' - w|| / ||w||
    and the largest error over the largest |w|, averaged over the type's matrices (worst in brackets)."""
    path = Path(args.model) if args.model and Path(args.model).is_dir() else model_dir(args.model or DEFAULT_MODEL)
    cfg = ModelConfig.from_hf(path)
    files = weight_files(path)
    shapes = {}
    for file in files:
        with opened(file) as f:
            shapes |= {n: (file.name, f.get_slice(n).get_shape()) for n in f.keys()}
    ckpt = Checkpoint(path, shapes)
    names = [n for _, _, ns in Transformer(cfg, "meta").matrices() for n in ns]
    per = {}  # (type, format) -> [(rms, max)]
    for name in names:
        w, kind = ckpt.read(name).float(), ckpt.types.get(name, "none")
        made = {"int8": dense(int8_rows(w, torch.float32)), "bf16": w.bfloat16().float()}
        if kind in INT4_TYPES:
            made["int4"] = dense(int4_groups(*int4_codes(ckpt, name), torch.bfloat16)).float()
        for fmt, got in made.items():
            per.setdefault((kind, fmt), []).append((((got - w).norm() / w.norm()).item(),
                                                   ((got - w).abs().max() / w.abs().max()).item()))
    return [{"type": t, "format": fmt, "matrices": len(v), "rms": sum(r for r, _ in v) / len(v),
             "rms_worst": max(r for r, _ in v), "max": sum(m for _, m in v) / len(v), "max_worst": max(m for _, m in v)}
            for (t, fmt), v in sorted(per.items())]


def accuracy(args) -> list[dict]:
    """The full-cache rows of --exact and --fast of one setting (problems, cap, grading), paired over the problems."""
    same = ("model", "template", "data_sha", "n", "max_new_tokens", "grading")  # all but the mode
    needs = {"accuracy": ("policy", "accuracy", "data", "dtype", "per_problem")}
    full = lambda path: [r for r in tool_rows([path], needs) if r["task"] == "accuracy" and r["policy"] == "full"]
    fast, exact = full(args.fast), full(args.exact)
    pairs = [(a, b) for a in fast for b in exact if not differs(a, b, same)]
    if len(fast) == len(exact) == 1:  # one row each: name what they do not share
        one_setting(fast + exact, f"the full-cache rows of --fast {args.fast} and --exact {args.exact}", same,
                    {id(fast[0]): "--fast's", id(exact[0]): "--exact's"})
    if len(pairs) != 1:
        raise UsageError(f"--fast {args.fast} and --exact {args.exact} hold {len(pairs)} pairs of full-cache rows of one "
                         f"setting ({', '.join(same)}), not 1: run both on the same --data, --n and --max-new-tokens")
    (a, b), = pairs
    oa, ob = outcomes(a), outcomes(b)
    items = sorted(set(oa) & set(ob))
    d, lo, hi = bootstrap_diff([oa[i] for i in items], [ob[i] for i in items])
    n10, n01, p = sign_test([oa[i] for i in items], [ob[i] for i in items])
    mode = lambda r: f"{r.get('quant') or 'none'} ({r['dtype'].replace('torch.', '')})"  # e.g. int4 (bfloat16)
    return [{"fast_mode": mode(a), "exact_mode": mode(b), "data": a["data"], "n": len(items), "fast": a["accuracy"],
             "exact": b["accuracy"], "diff": d, "lo": lo, "hi": hi, "fast_only": n10, "exact_only": n01, "p": p,
             "passes": lo is not None and p > 0.2 and lo >= -0.06 and hi <= 0.06}]


def table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k != "first_divergence"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    return "\n".join(lines + ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows])


def main(argv=None):
    ap = Parser(description="fp32, bf16, int8 and int4 side by side: decode speed, or what each costs in fidelity.")
    ap.add_argument("what", choices=["speed", "fidelity", "error", "accuracy"])
    ap.add_argument("--model", default=None, help="a name weights.py knows, or a model directory (default: the "
                    "default model)")
    ap.add_argument("--modes", default="fp32,bf16,int8,int4", help="comma list of fp32, bf16, int8, int4, "
                    "int4-bf16, int4x8 (fp32 is the reference: always included)")
    ap.add_argument("--batch-sizes", default="1,16,32", help="speed: rows decoded together")
    ap.add_argument("--policy", default="snapkv", choices=sorted(POLICIES), help="speed: the policy each decoder "
                    "evicts with")
    ap.add_argument("--budget", type=int, default=192, help="speed: K")
    ap.add_argument("--buffer", type=int, default=16, help="speed: r")
    ap.add_argument("--context", type=int, default=1024, help="speed: the position the timed steps end at")
    ap.add_argument("--turns", type=int, default=6, help="speed: turns per mode")
    ap.add_argument("--steps", type=int, default=16, help="speed: greedy steps per turn")
    ap.add_argument("--reference", default="fp32", help="fidelity: the mode the others are compared with (default: "
                    "fp32, the exact path; e.g. int4, to see what int4x8's activations alone change, in less memory)")
    ap.add_argument("--traces", default=None, help="fidelity: an eval.py fidelity traces file of this model (FILE"
                    ".traces.json); else --n conversations are packed from --data")
    ap.add_argument("--n", type=int, default=12, help="fidelity: conversations")
    ap.add_argument("--min-tokens", type=int, default=512, help="fidelity: tokens per packed conversation")
    ap.add_argument("--data", default=str(DATA / "gsm8k_test.jsonl"), help="fidelity: problems")
    ap.add_argument("--problems", type=int, default=20, help="fidelity: greedy answers compared")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="fidelity: cap on each answer")
    ap.add_argument("--exact", default=None, help="accuracy: an eval.py accuracy file of the mode checked against "
                    "(fp32, the exact path, or another: its mode is named in the table)")
    ap.add_argument("--fast", default=None, help="accuracy: one of a fast mode, on the same problems")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        for flag in ("budget", "buffer", "context", "turns", "steps", "n", "min_tokens", "problems", "max_new_tokens"):
            if getattr(args, flag) < 1:  # each divides or counts: 0 would end in a division by zero, or nothing
                raise UsageError(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
        check_output("--out", args.out)  # before the work, not after it
        ref = args.reference
        modes = [ref] + [m for m in args.modes.split(",") if m != ref]
        if ref not in MODES:
            raise UsageError(f"--reference {ref}: choose from {', '.join(MODES)}")
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise UsageError(f"--modes {','.join(bad)}: choose from {', '.join(MODES)}")
        info = cpu_info()
        print(f"CPU: {info['cpu']}, torch capability {info['capability']}, flags {' '.join(info['flags'])}")
        if args.what == "accuracy" and not (args.exact and args.fast):
            raise UsageError("accuracy needs --exact FILE and --fast FILE (eval.py accuracy files)")
        run = {"speed": lambda: speed(args, load_modes(args.model, modes)), "fidelity": lambda: fidelity(args, modes),
               "error": lambda: error(args), "accuracy": lambda: accuracy(args)}
        rows = run[args.what]()
        print(table(rows))
        if args.out:
            write_output("--out", args.out, json.dumps({"cpu": info, "args": vars(args), "rows": rows}, indent=1))
    except (UsageError, ModelError, SetupError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
