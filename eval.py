"""
Measure eviction policies against the full cache: fidelity, accuracy, recall probes, output perturbation, speed.

    python eval.py fidelity --policies all --budgets 128,256,512 --n 20 --out fidelity.json

Each subcommand is a list of jobs, one per (policy, budget, ...), run by one driver that prints a Markdown table
and keeps the rows in --out, rewritten atomically after every job, so an interrupted sweep resumes where it
stopped. Fidelity (teacher-forced KL against the full cache) works even for a model too small to solve problems.
Left out: sampling / pass@k, batching problems together, model-judged answer equivalence.
"""

import argparse
import json
import math
import os
import random
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from generate import Parser, UsageError, add_device_args, feed, generate, load, make_cache, make_run, policy_names
from model import ModelError
from policies import POLICIES

DATA = Path(__file__).resolve().parent.parent / "shared" / "data"
SYSTEM = "Solve each problem step by step and put the final answer in \\boxed{}."  # short: fits a small K - r
ASK = "\nPlease reason step by step, and put your final answer within \\boxed{}."
PERTURB_WINDOW = 64  # queries whose attention output CriticalKV's perturbation compares


# -----------------------------------------------------------------------------
# data and answer checking (conventions in ../shared/data/README.md)


def load_data(path: str) -> list[dict]:
    """Rows of a jsonl file with a question ('problem' or 'question') and an 'answer'; one-line errors."""
    if not Path(path).is_file():
        raise UsageError(f"data file {path} does not exist (see ../shared/data/README.md)")
    rows = []
    for i, line in enumerate(open(path, encoding="utf-8"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {i}: not valid JSON ({e.msg})") from None
        q = row.get("problem", row.get("question")) if isinstance(row, dict) else None
        if not isinstance(q, str) or "answer" not in row:
            missing = "'answer'" if isinstance(q, str) else "'problem' (or 'question')"
            raise UsageError(f"{path} line {i}: missing field {missing}")
        rows.append({"question": q, "answer": str(row["answer"]), "solution": row.get("solution", str(row["answer"]))})
    if not rows:
        raise UsageError(f"data file {path} has no rows")
    return rows


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced: 'so \\boxed{\\frac{1}{2}}.' -> '\\frac{1}{2}'."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed")
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 1 : j]
    return None  # unclosed: the generation was cut off


def normalise(s: str) -> str:
    """Light MATH normalisation: '\\left( 3, \\dfrac{\\pi}{2} \\right)' -> '(3,\\pi/2)', '90^\\circ' -> '90'."""
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)\b", "", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s).replace("\\%", "").replace("$", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)  # \frac12
    s = re.sub(r"\\[,;:! ]", "", s)  # LaTeX spacing
    return s.replace(" ", "").rstrip(".")


def as_number(s: str | None) -> float | None:
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def extract_answer(text: str, gsm8k: bool) -> str | None:
    """GSM8K: last \\boxed{} or else the last number; MATH/AIME: the last \\boxed{}."""
    boxed = last_boxed(text)
    if boxed is not None or not gsm8k:
        return boxed
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].rstrip(",") if nums else None


def is_correct(pred: str | None, answer: str) -> bool:
    """answer is the dataset's field: GSM8K's full solution ending in '#### 18', or MATH's LaTeX."""
    if pred is None:
        return False
    if "####" in answer:
        gold, got = as_number(answer.split("####")[-1]), as_number(normalise(pred))
        return gold is not None and got is not None and abs(gold - got) < 1e-6
    a, b = normalise(pred), normalise(answer)
    x, y = as_number(a), as_number(b)
    return a == b or (x is not None and y is not None and abs(x - y) < 1e-6)


# -----------------------------------------------------------------------------
# shared state of a sweep: the model, its traces and the full cache's log-probs, built once on first use


def model_of(args, lab: dict):
    if "model" not in lab:
        lab["model"], lab["tok"] = load(args.model, args.device, args.dtype)
    return lab["model"], lab["tok"]


def run_for(job: dict, args, prompt_len: int):
    return make_run(job["policy"], job["budget"], args.buffer, job["protect"], prompt_len, args.seed)


def turn_ids(tok, messages: list[dict], text: str) -> tuple[list[int], str]:
    """Tokens that the chat template adds after `text` (what the conversation already holds) for messages."""
    full = tok.chat(messages)
    if not full.startswith(text):
        raise ModelError("the chat template rewrites earlier turns, so conversations cannot be packed")
    return tok.encode(full[len(text) :]), full


@torch.inference_mode()
def pack_conversation(model, tok, problems: list[str], args, out: list) -> dict:
    """Greedy full-cache answers to problems, one user turn each, until the conversation holds --min-tokens.
    Appends to out and returns ids, the prompt length (first turn) and the [start, end) spans of the answers."""
    full = make_run("full", None, args.buffer, None, 0)
    cache = make_cache(model, full, args.min_tokens + 2 * args.max_new_tokens + 1024)
    messages, text, ids, spans = [{"role": "system", "content": SYSTEM}], "", [], []
    for p in problems:
        messages.append({"role": "user", "content": p})
        new, text = turn_ids(tok, messages, text)
        if len(ids) + len(new) + args.max_new_tokens > cache.capacity:
            if not spans:
                raise UsageError(f"a problem of {len(new)} tokens does not fit the trace cache: raise --min-tokens")
            break
        ids += new
        if not spans:
            prompt_len = len(ids)  # the system message and the first problem: what --protect-prompt keeps
        logits, answer = feed(model, cache, torch.tensor([new], device=model.device), full), []
        while len(answer) < args.max_new_tokens:
            answer.append(logits[0, -1].argmax().item())
            if answer[-1] in tok.eos_ids:
                answer.pop()  # the template writes the end-of-turn token itself, with the next turn
                break
            logits = feed(model, cache, torch.tensor([answer[-1:]], device=model.device), full)
        spans.append((len(ids), len(ids) + len(answer)))
        ids += answer
        messages.append({"role": "assistant", "content": tok.decode(answer)})
        text += messages[-1]["content"]
        if len(ids) >= args.min_tokens:
            break
    out.append({"ids": ids, "prompt_len": prompt_len, "spans": spans})
    return out[-1]


def traces(args, lab: dict) -> list[dict]:
    """The packed fidelity traces, cached beside --out so that a rerun does not regenerate them."""
    if "traces" in lab:
        return lab["traces"]
    key = {k: getattr(args, k) for k in ("model", "data", "n", "min_tokens", "max_new_tokens")}
    path = Path(args.out + ".traces.json") if args.out else None
    saved = json.loads(path.read_text()) if path and path.exists() else {}
    if saved.get("key") != key:
        model, tok = model_of(args, lab)
        qs = [r["question"] for r in load_data(args.data)]
        pool, out = qs[: args.n], []
        spare = sorted(qs[args.n :], key=lambda q: len(tok.encode(q)))  # problems past --n, shortest first
        bar = tqdm(total=len(pool), desc="traces (full cache, greedy)")
        while pool:
            # subtle: each conversation opens with the shortest spare problem, so that its protected first turn
            # fits K - r even at K = 128; the last one may borrow more spare problems to reach --min-tokens
            opener = spare[:1]  # empty once the spare problems run out: then a --n problem opens
            used = len(pack_conversation(model, tok, opener + pool + spare[1:], args, out)["spans"])
            from_pool = min(max(used - len(opener), 0), len(pool))
            borrowed = max(used - len(opener) - len(pool), 0)  # spares answered after the pool ran dry
            spare, pool = spare[len(opener) + borrowed :], pool[from_pool:]
            bar.update(from_pool)
        saved = {"key": key, "traces": out}
        if path:
            write_json(path, saved)
    lab["traces"] = saved["traces"]
    return lab["traces"]


def targets(trace: dict) -> torch.Tensor:
    """Positions whose logits predict a generated token: each span [a, b) is predicted from a - 1 ... b - 2."""
    return torch.tensor([t - 1 for a, b in trace["spans"] for t in range(a, b)])


@torch.inference_mode()
def replay(model, ids: list[int], run, start: int = 0):
    """Teacher-force ids through run's cache on the generation cadence; logits [T - start, V] from `start`."""
    cache = make_cache(model, run, len(ids))
    x = torch.tensor([ids], device=model.device)
    if start:
        feed(model, cache, x[:, :start], run)
    return feed(model, cache, x[:, start:], run, all_logits=True)[0]


# -----------------------------------------------------------------------------
# the measurements: each maps one job to its row's result fields


def fidelity(args, job: dict, lab: dict) -> dict:
    model, _ = model_of(args, lab)
    refs = lab.setdefault("refs", {})
    kl = top1 = gap = n = 0.0
    by_trace = []  # mean KL per trace: the same traces for every policy, so differences can be paired
    for i, tr in enumerate(traces(args, lab)):
        at = targets(tr)
        nxt = torch.tensor(tr["ids"])[at + 1, None]  # [N, 1] the trace tokens
        if i not in refs:  # the full cache's log-probs, once per trace: [N, V]
            refs[i] = replay(model, tr["ids"], make_run("full", None, args.buffer, None, 0))[at].log_softmax(-1)
        p, q = refs[i], replay(model, tr["ids"], run_for(job, args, tr["prompt_len"]))[at].log_softmax(-1)
        by_trace.append((p.exp() * (p - q)).sum().item())
        kl += by_trace[-1]
        by_trace[-1] /= len(at)
        top1 += (p.argmax(-1) == q.argmax(-1)).sum().item()
        gap += (p.gather(1, nxt) - q.gather(1, nxt)).sum().item()
        n += len(at)
    return {"kl": kl / n, "top1": top1 / n, "nll_gap": gap / n, "tokens": int(n), "kl_by_trace": by_trace}


def accuracy(args, job: dict, lab: dict) -> dict:
    model, tok = model_of(args, lab)
    right = answered = tokens = 0
    rows = load_data(args.data)[: args.n]
    for row in rows:
        prompt = tok.encode(tok.chat([{"role": "user", "content": row["question"] + ASK}]))
        ids, _, _ = generate(model, prompt, run_for(job, args, len(prompt)), args.max_new_tokens, eos_ids=tok.eos_ids)
        pred = extract_answer(tok.decode(ids), "####" in row["answer"])
        right += is_correct(pred, row["answer"])
        answered, tokens = answered + (pred is not None), tokens + len(ids)
    return {"accuracy": right / len(rows), "answered": answered / len(rows), "mean_tokens": tokens / len(rows)}


def build_probe(tok, rows: list[dict], i: int, seed: int, kind: str, where: str, gap: int) -> dict:
    """Probe i, a pure function of (rows, i, seed): prompt, a long teacher-forced trace of reference solutions
    with the secret stated once, the question, and the answer tokens. Returns ids, prompt_len, answer span."""
    rng = random.Random(f"{seed}:{i}:{kind}")
    secret = "".join(rng.choice("0123456789") for _ in range(5 if kind == "passcode" else 4))
    lead = 128 if kind == "fact" else 0  # the fact is planted after a first stretch of trace
    filler = tok.encode("\n\n".join(rows[(i + j) % len(rows)]["solution"] for j in range(40)))
    filler = (filler * (1 + (lead + gap) // len(filler)))[: lead + gap]  # exactly `gap` tokens after the secret
    if kind == "passcode":
        said = f"The passcode is {secret}. Remember it."
        user = said + " Now work through these solutions." if where == "prompt" else "Work through these solutions."
        plant = "" if where == "prompt" else said + "\n\n"
        question, prefix = "What is the passcode?", "The passcode is"
    else:
        user, question, prefix = "Work through these solutions.", "What is the value of x?", "The value of x is"
        plant = f"\n\nLet x = {secret}.\n\n"
    msgs = [{"role": "user", "content": user}]
    head = tok.encode(tok.chat(msgs))
    body = filler[:lead] + tok.encode(plant) + filler[lead:]
    # the end of the assistant turn and the question, as the template writes them ("X" stands for the trace)
    turns = msgs + [{"role": "assistant", "content": "X"}, {"role": "user", "content": question}]
    tail = turn_ids(tok, turns, tok.chat(msgs) + "X")[0] + tok.encode(prefix)
    answer = tok.encode(prefix + " " + secret)[len(tok.encode(prefix)) :]
    ids = head + body + tail + answer
    return {"ids": ids, "prompt_len": len(head), "answer": (len(ids) - len(answer), len(ids))}


def probe(args, job: dict, lab: dict) -> dict:
    model, tok = model_of(args, lab)
    rows = load_data(args.data)
    recall = logprob = 0.0
    for i in range(args.n):
        pr = build_probe(tok, rows, i, args.seed, job["probe"], job["where"], args.gap)
        a, b = pr["answer"]
        lp = replay(model, pr["ids"], run_for(job, args, pr["prompt_len"]), start=a - 1)[: b - a].log_softmax(-1)
        want = torch.tensor(pr["ids"][a:b])[:, None]
        logprob += lp.gather(1, want).sum().item()
        recall += bool((lp.argmax(-1) == want[:, 0]).all())  # greedy would write exactly the answer
    return {"recall": recall / args.n, "logprob": logprob / args.n}


def window_output(cache, layer: int) -> torch.Tensor:
    """Attention output of the ring's queries over the held slots, causal by position: [B, H_q, w, D] fp32."""
    keys, values = cache.get(layer)  # [B, H_kv, S, D]
    q, qp = cache.q_ring[layer].float(), cache.q_pos  # [B, H_q, w, D], [w]
    n_rep = q.shape[1] // keys.shape[1]
    k, v = keys.float().repeat_interleave(n_rep, 1), values.float().repeat_interleave(n_rep, 1)
    pos = cache.pos[layer, :, :, : keys.shape[2]].repeat_interleave(n_rep, 1)  # [B, H_q, S]
    att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H_q, w, S]
    att = att.masked_fill(pos[:, :, None, :] > qp[:, None], -math.inf)
    return (att.softmax(-1) @ v)[:, :, qp >= 0]


def head_perturbation(args, policy: str, budget: int, protect, lab: dict) -> torch.Tensor:
    """CriticalKV's measure on the fidelity traces: ||o - o_hat||_1 of each window query's per-head attention
    output projected through that head's slice of o_proj (as in the paper, o = A V W_O), before vs after an
    eviction round, L1 over the hidden size, mean over queries, the GQA group and rounds -> [L, H_kv]."""
    memo = lab.setdefault("perturb", {})
    if (policy, budget, protect) in memo:
        return memo[policy, budget, protect]
    model, _ = model_of(args, lab)
    L, H_kv, H_q = model.cfg.num_hidden_layers, model.cfg.num_key_value_heads, model.cfg.num_attention_heads
    wo = [blk.self_attn.o_proj.weight.float().view(-1, H_q, model.cfg.head_dim) for blk in model.model.layers]
    total, rounds, before = torch.zeros(L, H_kv), 0, {}

    def watch(cache, when):  # called around each eviction round (untimed)
        nonlocal total, rounds
        outs = [torch.einsum("hwd,ohd->hwo", window_output(cache, l)[0], wo[l]) for l in range(L)]  # [H_q, w, hidden]
        if when == "before":
            before["o"] = outs
            return
        l1 = torch.stack([(o - b).abs().sum(-1).mean(-1) for o, b in zip(outs, before["o"])])  # [L, H_q]
        total += l1.view(L, H_kv, -1).mean(-1).cpu()
        rounds += 1

    for tr in traces(args, lab):
        run = run_for({"policy": policy, "budget": budget, "protect": protect}, args, tr["prompt_len"])
        # every policy needs the window's queries here, even one whose scorer reads none: widen the ring
        run.policy = replace(run.policy, window=max(run.policy.window, PERTURB_WINDOW))
        run.watch = watch
        replay(model, tr["ids"], run, start=len(tr["ids"]) - 1)  # only the last position's logits
    memo[policy, budget, protect] = total / max(rounds, 1)
    return memo[policy, budget, protect]


def perturbation(args, job: dict, lab: dict) -> dict:
    mine = head_perturbation(args, job["policy"], job["budget"], job["protect"], lab)
    snap = head_perturbation(args, "snapkv", job["budget"], job["protect"], lab)
    return {"mean_l1": mine.mean().item(), "heads_better_than_snapkv": (mine < snap).float().mean().item()}


# -----------------------------------------------------------------------------
# the driver: jobs -> rows, resumable, atomically written, printed as Markdown


def make_jobs(args) -> list[dict]:
    """Key fields of each row: the full cache first (the reference), then every policy x budget."""
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        raise UsageError(f"--budgets takes comma-separated integers (got {args.budgets!r})") from None
    names = policy_names(args.policies, full=False)
    protect = lambda p: POLICIES[p].protect_prompt if args.protect_prompt is None else args.protect_prompt
    jobs = [] if args.cmd == "perturbation" else [{"policy": "full", "budget": None, "protect": None}]
    jobs += [{"policy": p, "budget": b, "protect": protect(p)} for p in names for b in budgets]
    extra = {}
    if args.cmd == "probe":  # the planted fact always sits in the trace: --where is for the passcode
        extra = {"probe": args.probe, "where": args.where if args.probe == "passcode" else None}
    common = {"data": Path(args.data).name, "n": args.n, "buffer": args.buffer, "seed": args.seed,
              "model": args.model, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens}
    if args.cmd in ("fidelity", "perturbation"):
        common["min_tokens"] = args.min_tokens
    if args.cmd == "probe":
        common["gap"] = args.gap
    return [{"task": args.cmd, **j, **extra, **common} for j in jobs]


def write_json(path: Path, obj):
    """Write to a temporary file, then rename over path: an interrupted write never leaves a broken file."""
    path.parent.mkdir(parents=True, exist_ok=True)  # e.g. results/ in a fresh checkout
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def read_rows(path: str | None) -> list[dict]:
    try:
        rows = json.loads(Path(path).read_text()) if path and Path(path).exists() else []
    except json.JSONDecodeError:
        rows = None
    if not isinstance(rows, list):
        raise UsageError(f"--out {path} is not a JSON list of rows: move it away or pick another file")
    return rows


def markdown(rows: list[dict], keys=()) -> str:
    """A Markdown table; key columns that are the same in every row move to one caption line above it, lists
    stay in the JSON only."""
    cols = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], list)))
    same = [c for c in cols if len(rows) > 1 and c in keys and c not in ("policy", "budget")
            and len({json.dumps(r.get(c)) for r in rows}) == 1]
    fmt = lambda v: "–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    cols = [c for c in cols if c not in same]
    lines = [" ".join(f"{c}={fmt(rows[0][c])}" for c in same)] if same else []
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])


def run_jobs(args, jobs: list[dict], measure) -> list[dict]:
    """Measure every job that --out does not already hold; keep the file current after each one."""
    rows = read_rows(args.out)
    done = lambda job: any(all(r.get(k) == v for k, v in job.items()) for r in rows)
    for job in tqdm([j for j in jobs if not done(j)], desc=args.cmd):
        rows.append({**job, **measure(job)})
        if args.out:
            write_json(Path(args.out), rows)
    return [r for r in rows if r.get("task") == args.cmd]


# -----------------------------------------------------------------------------
# CLI

TASKS = {"fidelity": fidelity, "accuracy": accuracy, "probe": probe, "perturbation": perturbation}


def build_parser() -> argparse.ArgumentParser:
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    add_device_args(shared)
    shared.add_argument("--policies", default="all", help="comma list of policies, or all (every registered one; "
                        "fidelity, accuracy and probe add the full cache as the reference row)")
    shared.add_argument("--budgets", default="128,256,512", help="comma list of K: cache slots right after an "
                        "eviction, buffer included")
    shared.add_argument("--buffer", type=int, default=64, help="r: newest tokens never scored; eviction every r steps")
    shared.add_argument("--protect-prompt", action=argparse.BooleanOptionalAction, default=None,
                        help="keep every prompt token, for all policies (default: each policy's paper setting)")
    shared.add_argument("--data", default=str(DATA / "math500.jsonl"), help="jsonl with 'problem' (or 'question') "
                        "and 'answer' per line, e.g. ../shared/data/gsm8k_test.jsonl")
    shared.add_argument("--n", type=int, default=20, help="problems (fidelity, accuracy) or probes to run")
    shared.add_argument("--max-new-tokens", type=int, default=512, help="cap on each generated answer")
    shared.add_argument("--seed", type=int, default=0, help="seeds probes and the stochastic policies")
    shared.add_argument("--out", default=None, help="JSON file of rows; rerunning with the same file resumes")
    ap = Parser(description="Evaluate KV-cache eviction policies against the full cache.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join([*TASKS, "bench"]) + "}")
    p = sub.add_parser("fidelity", parents=[shared], help="teacher-forced KL / top-1 / NLL gap vs the full cache")
    p.add_argument("--min-tokens", type=int, default=1024, help="pack problems into one conversation until it "
                   "holds this many tokens (a small model stops early)")
    sub.add_parser("accuracy", parents=[shared], help="free generation, extracted answers, pass@1")
    p = sub.add_parser("probe", parents=[shared], help="passcode / planted-fact recall after a long trace")
    p.add_argument("--probe", choices=["passcode", "fact"], default="passcode", help="passcode: a code said once, "
                   "asked at the end; fact: 'x = 7291' planted in the trace, asked --gap tokens later")
    p.add_argument("--where", choices=["prompt", "trace"], default="prompt", help="where the passcode is said")
    p.add_argument("--gap", type=int, default=1536, help="trace tokens between the secret and the question")
    p = sub.add_parser("perturbation", parents=[shared], help="CriticalKV's ||o - o_hat||_1 at each eviction")
    p.add_argument("--min-tokens", type=int, default=1024, help="as for fidelity (the same traces)")
    try:
        import bench  # the speed benchmark lives in its own file; without it there is no bench subcommand
    except ModuleNotFoundError as e:
        if e.name != "bench":
            raise
        return ap
    bench.add_arguments(sub.add_parser("bench", parents=[shared], help="decode speed, eviction cost, peak memory"))
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "bench":
            import bench

            jobs = [{"task": "bench", **j} for j in bench.jobs(args)]
            measure = lambda job: bench.measure(args, {k: v for k, v in job.items() if k != "task"})
        else:
            if args.n < 1 or args.max_new_tokens < 1:
                raise UsageError("--n and --max-new-tokens must be at least 1")
            load_data(args.data)  # fail on a bad file before loading the model
            jobs, lab = make_jobs(args), {}
            measure = lambda job: TASKS[args.cmd](args, job, lab)
        print(markdown(run_jobs(args, jobs, measure), keys=set().union(*jobs)))
    except (ModelError, UsageError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted: finished rows are in --out; rerun the same command to resume")


if __name__ == "__main__":
    main()
