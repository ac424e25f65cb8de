"""
Measure eviction policies against the full cache: fidelity, accuracy, recall probes, output perturbation, speed.

    python eval.py fidelity --policies all --budgets 128,256 --n 12 --out results/fidelity.json
    python eval.py plot results/fidelity.json --out docs          # figures (needs requirements-plot.txt)

Each subcommand is a list of jobs, one per (policy, budget, ...), run by one driver that prints a Markdown table
and saves each finished row (results.py): into --out, so an interrupted sweep resumes where it stopped, or with
--shard I/N into a file of the shard's own, for `eval.py merge`. A row's key holds every setting that changes its
result (the data and the model by content hash). Fidelity (teacher-forced KL against the full cache) works even for
a model too small to solve problems. Free generation keeps --batch-size rows live, a finished problem's row refilled
with the next problem, and keeps each problem's outcome. Left out: sampling / pass@k, model-judged answers.

Laid out top to bottom: the sweep's shared state (the model, the cached traces); the measurements, one function
per subcommand, each mapping a job to its row's fields; the driver (jobs, their keys and costs, checks before the
first job); the CLI. Beside it: traces.py (the packed conversations, other models' reasoning traces and their
sentences, replay, compare), probes.py (recall probes and
per-head measures), stats.py (paired statistics, tables), bench.py (speed), plot.py (figures), results.py (result
files).
"""

import argparse
import fcntl
import os
import sys
import tempfile
from pathlib import Path

import torch

from cli import (Parser, UsageError, add_device_args, bf16_matmul, int4_source, int_list, kernel_path, load,
                 local_model, made_on, minmax_int4, note, output_failed, plain_text, policy_names, resolve_device)
from cache import FREE
from generate import generate, generate_refill, make_run
from kernels import DENSE_ROWS
from model import ModelError
from policies import POLICIES
from quant import INT4_MODES
from probes import FACT_NAME, build_probe, head_perturbation, head_probe, perturbation_row, plant_fact
from results import (Progress, check_writable, digest, merge, model_key, pack_text, read_json, read_rows, result_file,
                     run_jobs, shard_arg, temp_beside, todo, write_json)
from stats import markdown, paired, paired_accuracy
from tasks import DATA, extract_answer, file_hash, grading, is_correct, is_short_loop, load_data
from traces import (check_first_turns, compare, conversation_plans, first_turn, first_turns, long_answers,
                    pack_conversations, read_traces, reasoning_traces, replay, sentence_share, sentence_summary,
                    targets, trace_cap)
from weights import MODEL_HOME

ASK = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def ask(tok, question: str) -> list[int]:
    """The prompt of a free-generation problem: the question and ASK, one user turn of the chat template."""
    return tok.encode(tok.chat([{"role": "user", "content": question + ASK}]))


def answer_of(tok, ids: list[int], answer: str, prompt: list[int] = ()) -> tuple[str, str, str | None]:
    """(the generated text, how it stopped: "eos" or "max", the answer the grader extracts) of generated ids. A thinking
    model is graded on what follows its </think> (prompt: its ids, whose template may have opened <think>)."""
    text, stop = tok.decode(ids), "eos" if ids[-1] in tok.eos_ids else "max"
    th = tok.thought(list(prompt), ids)
    return text, stop, extract_answer(th.answer, "####" in answer, stop, th.closed)


# -----------------------------------------------------------------------------
# shared state of a sweep: the model, its traces and the full cache's logits, built once on first use


def step_rows(args) -> int:
    """The most rows a step of this sweep multiplies, which picks its matmul kernel (cli.bf16_matmul): the batch for
    free generation; a replay feeds chunks of --buffer tokens (and its first chunk holds the budget). --int-kernels
    counts as one row: the int kernels at every size, and the rows' keys of before the bf16 copies."""
    if getattr(args, "int_kernels", False):
        return 1
    rows = args.batch_size or 1  # None until main resolves the device's default
    return rows if args.cmd == "accuracy" else max(rows, args.buffer)


def model_of(args, lab: dict):
    if "model" not in lab:
        lab["model"], lab["tok"] = load(args.model, args.device, args.dtype, args.quant, args.thinking, step_rows(args))
    return lab["model"], lab["tok"]


def run_for(job: dict, args, prompt_len):
    return make_run(job["policy"], job["budget"], args.buffer, job["protect"], prompt_len, args.seed)


def traces(args, lab: dict) -> list[dict]:
    """The packed fidelity traces, cached beside --out so that a rerun does not regenerate them."""
    if "traces" in lab:
        return lab["traces"]
    long = getattr(args, "long", None)
    # note: not bf16_rows: a trace is the text the policies are teacher-forced through, and one the int kernels wrote
    # serves as well (the study's 12 long traces took hours); its replays and their rows do carry it
    settings = {k: v for k, v in model_settings(args).items() if k not in ("bf16_rows", "kernel_path")}
    key = {"data": file_hash(args.data), "n": args.n, "min_tokens": args.min_tokens,
           "max_new_tokens": args.max_new_tokens, **settings, **({"long": long} if long else {})}
    path = Path(args.out + ".traces.json") if args.out else None
    saved = read_json(path, dict) if path and path.exists() else {}
    if getattr(args, "traces", None):  # another model's reasoning, read by this one: nothing to generate or save
        lab["traces"] = reasoning_traces(model_of(args, lab)[1], args.traces, args.n, long, args.loops, args.skip)
        return lab["traces"]
    if saved.get("key") != key:
        model, tok = model_of(args, lab)
        questions = [r["question"] for r in load_data(args.data)]
        out = long_answers(model, tok, questions, args) if long else []
        plans = [] if long else conversation_plans(tok, questions, args.n)
        for i in range(0, len(plans), args.batch_size):
            out += pack_conversations(model, tok, plans[i : i + args.batch_size], args)
        saved = {"key": key, "traces": out}
        if path:
            write_json(path, saved)
    lab["traces"] = saved["traces"]
    return lab["traces"]


# -----------------------------------------------------------------------------
# the measurements: each maps one job to its row's result fields


# another model's traces run to thousands of tokens: replayed at most 1,024 a pass (the same logits up to rounding,
# in a fraction of the memory); the study's own traces keep the passes their rows were made with
REPLAY_MOST = 1024


def reference(args, lab: dict, tr: dict, at: torch.Tensor) -> torch.Tensor:
    """The full cache's logits on a trace at positions `at`, [N, V], computed once per trace and kept on disk in the
    dtype the model computed them in (bf16: half of fp32, and exact), memory-mapped back. A sweep that saves to --out
    keeps them under $NANOKV_HOME/refs, named by the trace and the model's settings, so that a killed sweep's rerun
    does not replay the full cache again (12 long traces: 14 GB, 12 replays); they go when its command has finished
    every job (main), unless --keep-refs keeps them for the next sweep. Without --out, in a temporary folder that goes
    with the sweep."""
    path = reference_path(args, lab, tr)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:  # two sweeps on the same traces (two lanes): one replays, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            model, _ = model_of(args, lab)
            most = REPLAY_MOST if getattr(args, "traces", None) else None
            logits = rows_at(replay(model, tr["ids"], make_run("full", None, args.buffer, None, 1), most=most), at)
            small = logits.to(model.model.norm.weight.dtype)
            exact = all(torch.equal(small[i : i + 256].float(), logits[i : i + 256])  # a piece at a time: no
                        for i in range(0, len(small), 256))  # second fp32 copy of a long trace's logits
            fd, tmp = temp_beside(path)  # a killed save's file is removed by the next one (results.clear_stale)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(small if exact else logits.clone(), f)
                os.replace(tmp, path)  # a reader never loads half a file
            finally:
                Path(tmp).unlink(missing_ok=True)  # a failed save's; after the rename there is none
    return torch.load(path, mmap=True)


def rows_at(logits: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """logits [T, V] at positions `at`: a view where they run contiguously (a single trace's span), else a copy."""
    if len(at) and at[-1] - at[0] + 1 == len(at):
        return logits[at[0] : at[-1] + 1]
    return logits[at]


def reference_path(args, lab: dict, tr: dict) -> Path:
    if not args.out and "refs_tmp" not in lab:
        lab["refs_tmp"] = tempfile.TemporaryDirectory(prefix="nanokv-refs-")  # removed when the sweep ends
    # not --buffer: the full cache never evicts, so its replay is one chunk whatever r is (as its row, make_jobs)
    name = digest({"ids": tr["ids"], **model_settings(args)}) + ".pt"
    return MODEL_HOME / "refs" / name if args.out else Path(lab["refs_tmp"].name) / name


def fidelity(args, job: dict, lab: dict) -> dict:
    """Teacher-forced KL against the full cache, trace by trace. Each trace's sums are saved as it finishes
    (results.Progress), so a killed sweep's rerun replays only the traces not yet done."""
    model, _ = model_of(args, lab)
    progress = Progress(result_file(args.out, args.shard), job)
    done = progress.part.get("per_trace", [])  # the first traces' sums, in trace order
    for tr in traces(args, lab)[len(done) :]:
        at = targets(tr)
        nxt = torch.tensor(tr["ids"])[at + 1, None]  # [N, 1] the trace tokens
        ref = reference(args, lab, tr, at)
        run = run_for(job, args, tr["prompt_len"])
        kept = kept_share(run)
        rounds = sentence_share(run, tr) if tr.get("sentences") else None  # which sentences each round keeps
        most = REPLAY_MOST if getattr(args, "traces", None) else None
        logits = ref if job["policy"] == "full" else rows_at(replay(model, tr["ids"], run, most=most), at)  # full: 0
        c = compare(ref, logits, nxt, at=rounds is not None)
        kl_at = c.pop("kl_at", None)
        done.append({**c, "tokens": len(at), "evictions": run.rounds[0],
                     "kept": kept(0, len(tr["ids"]) - tr["prompt_len"] + 1),  # every token after the prompt was fed
                     **({"sentences": sentence_summary(tr, rounds, at, kl_at)} if rounds is not None else {})})
        progress.save(per_trace=done)
    total = lambda field: sum(t[field] for t in done)
    n = total("tokens")
    return {"kl": total("kl") / n, "top1": total("top1") / n, "nll_gap": total("gap") / n, "tokens": n,
            "kl_by_trace": [t["kl"] / t["tokens"] for t in done],  # paired by trace: the same traces for every policy
            "mean_evictions": total("evictions") / len(done), "mean_kept": total("kept") / len(done),
            **({"trace_ids": [tr["id"] for tr in traces(args, lab)]} if getattr(args, "traces", None) else {}),
            # per trace (None: no sentence labels), paired by trace as kl_by_trace (traces.sentence_summary)
            **({"sentences_by_trace": [t.get("sentences") for t in done]} if any("sentences" in t for t in done)
               else {})}


def accuracy(args, job: dict, lab: dict) -> dict:
    """Free generation of --batch-size live rows: with --refill (the default) a finished problem's row goes to the
    next problem (generate_refill), else the problems go --batch-size at a time (generate). Each finished problem's
    outcome is saved (results.Progress), so a rerun of a killed sweep decodes only the problems not yet done; the draws
    of a stochastic policy are seeded by each problem's index, so the row is the one an uninterrupted run gives."""
    model, tok = model_of(args, lab)
    rows = load_data(args.data)[: args.n]
    progress = Progress(result_file(args.out, args.shard), job)
    done = progress.part.get("per_problem", [])  # the finished problems' outcomes, in problem order
    saved = [p["i"] for p in done]
    if sorted(set(saved)) != saved or not set(saved) <= set(range(len(rows))):
        raise UsageError(f"{progress.path} holds problems twice or out of range: delete it and rerun")
    left = sorted(set(range(len(rows))) - set(saved))  # in problem order
    where = made_on(model.model.embed_tokens.weight.device)
    steps = row_steps = 0

    def finish(i: int, prompt: list[int], ids: list[int], rounds: int, kept: float):
        text, stop, pred = answer_of(tok, ids, rows[i]["answer"], prompt)
        think = {}
        if tok.thinks:  # a thinking model's rows say how long it thought, and if it stopped
            th = tok.thought(prompt, ids)
            think = {"think_tokens": th.tokens, "answer_tokens": len(ids) - th.tokens, "think_closed": th.closed}
        done.append({"i": i, "correct": is_correct(pred, rows[i]["answer"]), "answered": pred is not None,
                     "loop": is_short_loop(ids, args.max_new_tokens, tok.eos_ids), "tokens": len(ids), "stop": stop,
                     "evictions": rounds, "kept": kept, "pred": pred, **think,
                     "text_z": pack_text(text), "made_on": where})  # what was graded, and where
        done.sort(key=lambda p: p["i"])
        progress.save(per_problem=done)

    # with --refill, one request of every problem left; else one per --batch-size of them
    size = max(len(left), 1) if args.refill else args.batch_size
    for at in range(0, len(left), size):
        batch = left[at : at + size]
        prompts = [ask(tok, rows[i]["question"]) for i in batch]
        # each problem's index in the sweep seeds its draws, so the rows do not depend on --batch-size
        run = make_run(job["policy"], job["budget"], args.buffer, job["protect"], [len(p) for p in prompts],
                       args.seed, ids=batch)
        kept = kept_share(run)
        on_done = lambda k, ids: finish(batch[k], prompts[k], ids, run.rounds[k], kept(k, len(ids)))
        if args.refill:
            _, t = generate_refill(model, prompts, run, args.max_new_tokens, args.batch_size, eos_ids=tok.eos_ids,
                                   on_done=on_done)
        else:
            outs, _, t = generate(model, prompts, run, args.max_new_tokens, eos_ids=tok.eos_ids)
            for k, ids in enumerate(outs):
                on_done(k, ids)
        steps, row_steps = steps + t["steps"], row_steps + t["row_steps"]
    if steps:  # how full the batch stayed: refill's gain, whatever the machine's load
        note(f"[accuracy] {job['policy']}: {len(left)} problems in {steps} decode steps, {row_steps / steps:.2f} "
             f"live rows per step of --batch-size {args.batch_size}")
    mean = lambda field: sum(p[field] for p in done) / len(done)
    think = {"mean_think_tokens": mean("think_tokens"), "mean_answer_tokens": mean("answer_tokens"),
             "unclosed": sum(p["think_closed"] is False for p in done) / len(done)} if "think_tokens" in done[0] else {}
    return {"accuracy": mean("correct"), "answered": mean("answered"), "loops": mean("loop"),
            "mean_tokens": mean("tokens"), "mean_evictions": mean("evictions"), "mean_kept": mean("kept"),
            "max_tokens": max(p["tokens"] for p in done), **think, "per_problem": done}


def kept_share(run):
    """Watch run's evictions; returns kept(row, n): the share of row's n-token answer still held in its cache when the
    answer ended, averaged over layers and KV heads. Exact and cheap: after each eviction of the row we count the
    held slots past its prompt, once; every token fed after its last eviction is held too. The answer's last token
    is sampled but never fed, so n - 1 of its tokens reach the cache. 1.0 for a row that never evicted."""
    last = {}  # row -> (answer slots held after its last eviction, mean over layers and KV heads; its next position)

    def watch(cache, b, when, scores):
        if when == "after":
            row = cache.rows[b]
            pos = cache.head_pos(b)  # [L, H_kv, S]; a free slot (per-head budgets) sits at FREE: held by none
            held = ((pos >= run.prompt_len[row]) & (pos != FREE)).sum(-1).double().mean().item()  # [L, H_kv] -> mean
            last[row] = (held, cache.next_pos[b])

    def kept(row: int, n: int) -> float:
        if row not in last or n < 2:
            return 1.0
        held, at = last[row]
        P = run.prompt_len[row]
        return (held + P + n - 1 - max(at, P)) / (n - 1)

    run.watch = watch
    return kept


def probe(args, job: dict, lab: dict) -> dict:
    model, _ = model_of(args, lab)
    if args.probe == "heads":
        return head_probe(model, job["heads"], lab["probes"], args.seed)
    recall = logprob = 0.0
    for pr in lab["probes"]:  # built by check_jobs
        a, b = pr["answer"]
        lp = replay(model, pr["ids"], run_for(job, args, pr["prompt_len"]), start=a - 1)[: b - a].log_softmax(-1)
        want = torch.tensor(pr["ids"][a:b])[:, None]
        logprob += lp.gather(1, want).sum().item()
        recall += bool((lp.argmax(-1) == want[:, 0]).all())  # greedy would write exactly the answer
    return {"recall": recall / args.n, "logprob": logprob / args.n}


def perturbation(args, job: dict, lab: dict) -> dict:
    """CriticalKV's ||o - o_hat||_1 on the fidelity traces, per attention head, and the share of heads below
    snapkv's at the same budget (probes.head_perturbation; each (policy, budget, protect) measured once a sweep)."""
    memo = lab.setdefault("perturb", {})

    def heads(policy: str) -> dict:
        key = (policy, job["budget"], job["protect"])
        if key not in memo:
            memo[key] = head_perturbation(model_of(args, lab)[0], traces(args, lab),
                                          lambda prompt_len: run_for({**job, "policy": policy}, args, prompt_len))
        return memo[key]

    return perturbation_row(heads(job["policy"]), heads("snapkv"))


# -----------------------------------------------------------------------------
# the driver: jobs -> rows, validated up front, saved by results.run_jobs (resume, shards), printed as Markdown


def model_settings(args) -> dict:
    """What the model computes on, in every row's key and the traces' key. note: the batch size too: batched matmuls
    may round differently in bf16 on a GPU. A model without a chat template gets "template": "none": its prompts are
    plain text, so its rows must never pair with (or stand in for) rows made with a template. subtle: only then, so
    that the rows made with a template, which is every row saved before this field existed, keep their keys and a
    finished sweep stays finished; --quant likewise only where given (every row before it is exact)."""
    device, dtype = resolve_device(args.device, args.dtype, args.quant)
    plain = {"template": "none"} if plain_text(args.model) else {}
    quant = {"quant": args.quant} if args.quant else {}
    # not a GGUF's own blocks
    quant |= {"int4": "minmax"} if args.quant in INT4_MODES and minmax_int4(args.model) else {}
    thinking = {"thinking": args.thinking} if args.thinking is not None else {}  # only where given, as --quant
    # a directory's 4-bit blocks are checked against its weights on load (model.Checkpoint.check_side); the rows are
    # keyed by those weights' fingerprint too. A named model's rows keep their keys: its manifest pins both files
    source = int4_source(args.model) if args.quant in INT4_MODES else None
    quant |= {"int4_source": source} if source else {}
    # steps of many rows through bf16 copies of the int values: other numbers than the int kernels' (RESULTS.md)
    quant |= {"bf16_rows": DENSE_ROWS} if bf16_matmul(device, dtype, args.quant, step_rows(args)) else {}
    # the kernels that compute the numbers: rows of two paths never pair (results.PAIRED), nor resume each other
    path = {"kernel_path": kernel_path(device, dtype, args.quant, step_rows(args))}
    return {"model": model_key(args.model), "device": torch.device(device).type, "dtype": str(dtype),
            "batch_size": args.batch_size, **plain, **quant, **thinking, **path}


# What a replay (fidelity, probe, perturbation) costs beyond the full cache's, per policy: scoring at each eviction
# round, and per forward for h2o and epikv's state. Measured once on this CPU (1,024-token replays of the default model
# at K = 128 and 512, rounded; the machine was shared, so about +-0.2); only --shard's balance uses it.
EXTRA = {"streaming": 0.0, "random": 0.1, "snapkv": 0.1, "vase-noreserve": 0.2, "vase-dkv": 0.3, "curdkv-fixed": 0.3,
         "rkv": 0.4, "vase-adversary": 0.4, "vase": 0.5, "epikv": 0.5, "epikv-band": 0.5, "epikv-lag": 0.5,
         "vase-topk": 0.6, "criticalkv": 0.6, "h2o": 0.9,
         # the per-head and the seeds' baseline policies, by their rounds and per-step observers beside these
         # (RESULTS.md's bench rows)
         "triattention": 0.2, "triattention-layer": 0.2, "lagkv": 0.2, "adakv": 0.2, "curdkv": 0.3,
         "criticalkv-ada": 0.7, "scissorhands": 0.9, "raas": 0.9}


def cost(job: dict) -> float:
    """A job's expected cost relative to the full cache's, for --shard's balance. Free generation spends its time
    decoding (eviction is a few percent of it), so accuracy jobs cost alike; a replay's cost depends on its policy."""
    return 1.0 if job["task"] == "accuracy" or job["policy"] == "full" else 1 + EXTRA.get(job["policy"], 0.5)


def make_jobs(args) -> list[dict]:
    """Key fields of each row: the full cache first (the reference), then every policy x budget. The key holds
    every setting that changes a row's result, so a rerun with another setting computes a new row."""
    budgets = int_list("--budgets", args.budgets)
    names = policy_names(args.policies, full=False)
    protect = lambda p: POLICIES[p].protect_prompt if args.protect_prompt is None else args.protect_prompt
    jobs = [] if args.cmd == "perturbation" else [{"policy": "full", "budget": None, "protect": None}]
    jobs += [{"policy": p, "budget": b, "protect": protect(p)} for p in names for b in budgets]
    extra = {}
    if args.cmd == "probe":  # the planted fact always sits in the trace: --where is for the passcode
        extra = {"probe": args.probe, "where": args.where if args.probe == "passcode" else None, "gap": args.gap}
    if args.cmd == "probe" and args.probe == "heads":  # the full cache, the fact kept in k of the KV heads
        jobs = [{"policy": "full", "budget": None, "protect": None, "heads": k} for k in args.heads]
        extra |= {"min_tokens": args.min_tokens, "fact": FACT_NAME, "scored": "digits"}  # not the space before them
    if args.cmd in ("fidelity", "perturbation"):
        extra = {"min_tokens": args.min_tokens, **({"long": args.long} if args.long else {})}  # old rows keep keys
    if getattr(args, "traces", None):  # another model's traces, named by content as data is; no --min-tokens
        extra = {"replay": "traces", **({"long": args.long} if args.long else {}), **({"loops": True} if args.loops
                                                                                       else {}),
                 **({"skip": args.skip} if args.skip else {})}  # a later block of traces; the first keeps its keys
    if args.cmd == "accuracy":  # rows graded by an earlier rule are recomputed (or regraded: tools/regrade.py)
        extra = {"grading": grading(load_data(args.data))}
        # a refilled batch mixes other rows beside each problem than --no-refill's, which bf16 or int4 matmuls may
        # round differently; the rows made before refill (no such field) keep their keys
        extra |= {"refill": True} if args.refill else {}
    common = {"data": Path(args.data).name, "data_sha": file_hash(args.data), "n": args.n, "buffer": args.buffer,
              "seed": args.seed, **model_settings(args), "max_new_tokens": args.max_new_tokens}
    # the full cache never evicts, so its row is the same for every --buffer: one reference row serves them all
    return [{"task": args.cmd, **j, **extra, **common, **({"buffer": None} if j["policy"] == "full" else {})}
            for j in jobs]


def check_jobs(args, jobs: list[dict], lab: dict):
    """Refuse, in one line and before the first job runs, any setting that would fail mid-sweep."""
    for flag in ("n", "max_new_tokens", "batch_size", "min_tokens", "gap", "long"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    model, tok = model_of(args, lab)
    limit = model.cfg.max_position_embeddings
    long = getattr(args, "long", None)
    if getattr(args, "traces", None):  # read, not generated: each must fit the model's positions
        for j in jobs:
            run_for(j, args, [1])  # a bad --budget / --buffer stops here, before the traces are tokenized
        trs = traces(args, lab)
        longest = max(len(tr["ids"]) for tr in trs)
        if longest > limit:
            raise UsageError(f"a trace of {args.traces} needs {longest} positions, past the model's {limit}: pass "
                             "shorter traces (or a --long range that leaves it out)")
        for j in jobs:
            run_for(j, args, [tr["prompt_len"] for tr in trs])
        return
    rows = load_data(args.data)
    check_n(args, rows)
    if long:  # single long answers: any problem of the file may be one, and its answer must fit; the prompts that
        # --protect-prompt keeps are those of the answers found (generated here, once: they are saved with --out)
        if long > args.max_new_tokens:
            raise UsageError(f"--long {long} asks for answers longer than --max-new-tokens {args.max_new_tokens} "
                             "allows: raise --max-new-tokens or lower --long")
        for j in jobs:
            run_for(j, args, [1])  # a bad --budget / --buffer stops here, before any answer is decoded
        longest = max(len(first_turn(tok, r["question"])) for r in rows) + args.max_new_tokens
        if longest > limit:
            raise UsageError(f"a problem of {args.data} and its answer need up to {longest} positions, past the "
                             f"model's {limit}: lower --max-new-tokens")
        lens = [tr["prompt_len"] for tr in traces(args, lab)]
    elif args.cmd in ("fidelity", "perturbation") or args.cmd == "probe" and args.probe == "heads":
        # the conversations open with the n shortest problems: what --protect-prompt keeps, and what must fit
        lens = first_turns(tok, conversation_plans(tok, [r["question"] for r in rows], args.n))
        check_first_turns(lens, args, limit)
    if args.cmd == "accuracy":
        lens = [len(ask(tok, r["question"])) for r in rows[: args.n]]
        longest = max(lens) + args.max_new_tokens
    elif args.cmd == "probe" and args.probe == "heads":  # the model's own conversations, a fact planted in each
        pr = lab["probes"] = [plant_fact(tok, tr, i, args.seed, args.gap) for i, tr in enumerate(traces(args, lab))]
        lens, longest = [len(p["ids"]) for p in pr], max(len(p["ids"]) for p in pr)
    elif args.cmd == "probe":
        pr = lab["probes"] = [build_probe(tok, rows, i, args.seed, args.probe, args.where, args.gap)
                              for i in range(args.n)]  # every job replays these same probes
        lens, longest = [p["prompt_len"] for p in pr], max(len(p["ids"]) for p in pr)
    elif not long:  # fidelity / perturbation: the traces' cache
        longest = trace_cap(args)
    if longest > limit and args.cmd == "accuracy":  # the question is the data's, not a setting's
        i = max(range(len(lens)), key=lens.__getitem__)
        fix = f"lower --max-new-tokens to at most {limit - lens[i]}, or " if lens[i] < limit else ""
        raise UsageError(f"problem {i + 1} of {args.data} is {lens[i]} tokens as a prompt, and with --max-new-tokens "
                         f"{args.max_new_tokens} needs {longest} positions, past the model's {limit}: {fix}leave it "
                         "out of the file" + (f" (or lower --n to {i})" if i else ""))
    if longest > limit:  # each subcommand's own flags: what sizes a probe, what sizes the traces
        flags = "--gap or --max-new-tokens" if args.cmd == "probe" else "--min-tokens or --max-new-tokens"
        raise UsageError(f"these settings need sequences of up to {longest} tokens, past the model's {limit} "
                         f"positions: lower {flags}")
    for j in jobs:
        run_for(j, args, lens)  # one-line refusal of a prompt that does not fit K - r, or a bad --budget/--buffer


def check_n(args, rows: list[dict]):
    """--n counts problems (accuracy) or conversations that each open with a problem of their own (fidelity,
    perturbation, the heads probe): a shorter file would give rows that say n = 100 and hold 8 problems. The passcode
    and fact probes are exempt: probe i draws its filler round-robin from the rows, so any --n makes n probes."""
    if args.cmd == "probe" and args.probe != "heads" or args.n <= len(rows):
        return
    what = "asks for more" if args.cmd == "accuracy" else "conversations each open with a problem of their own"
    raise UsageError(f"{args.data} has {len(rows)} problems; --n {args.n} {what}: pass --n {len(rows)} or fewer, "
                     "or a larger --data")


# -----------------------------------------------------------------------------
# CLI

TASKS = {"fidelity": fidelity, "accuracy": accuracy, "probe": probe, "perturbation": perturbation}


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)  # every subcommand, bench included
    common.add_argument("--model", default=None, help="Hugging Face model directory, Hub id (ORG/NAME[@REVISION], "
                        "downloaded once into the Hugging Face cache), or a name weights.py fetches (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    add_device_args(common)
    common.add_argument("--policies", default="all", help="comma list of policies, or all (every registered one; "
                        "fidelity, accuracy and probe add the full cache as the reference row)")
    common.add_argument("--buffer", type=int, default=64, help="r: newest tokens never scored; eviction every r steps")
    common.add_argument("--protect-prompt", action=argparse.BooleanOptionalAction, default=None,
                        help="keep every prompt token, for all policies (default: each policy's paper setting)")
    common.add_argument("--int-kernels", action="store_true", help="with --quant, torch's int kernels at every batch "
                        "size, never the bf16 copies of a CPU with bf16 units: the numbers (and row keys) of the "
                        "sweeps made before them, for runs that must pair with those rows (refused without --quant)")
    common.add_argument("--seed", type=int, default=0, help="seeds probes and the stochastic policies")
    common.add_argument("--out", default=None, help="JSON file of rows; rerunning with the same file resumes, and "
                        "several sweeps on one machine may write one file at once")
    common.add_argument("--shard", type=shard_arg, default=None, metavar="I/N", help="run only the I-th of N slices "
                        "of the jobs (1 <= I <= N, balanced by expected cost), into a file of its own beside --out; "
                        "then `eval.py merge --out FILE`")
    shared = Parser(add_help=False, parents=[common])  # the measurements on data
    shared.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None, help="a thinking model's "
                        "chat template switch (Qwen3's enable_thinking), in the rows' key when given; answers are "
                        "graded after </think> (default: the template's own; --no-thinking is refused where the "
                        "template has no switch, as R1 distills', either flag where it writes no <think>)")
    shared.add_argument("--budgets", default="128,256,512", help="comma list of K: cache slots right after an "
                        "eviction, buffer included")
    shared.add_argument("--data", default=str(DATA / "math500.jsonl"), help="jsonl with 'problem' (or 'question') "
                        "and 'answer' per line, e.g. data/gsm8k_test.jsonl")
    shared.add_argument("--n", type=int, default=12, help="problems (accuracy), probes (probe), or packed "
                        "conversations (fidelity, perturbation)")
    shared.add_argument("--max-new-tokens", type=int, default=512, help="cap on each generated answer")
    shared.add_argument("--batch-size", type=int, default=None, help="problems (accuracy: rows live at once, see "
                        "--refill) or conversations decoded together (default: 16 on CPU, 64 on CUDA); in fp32 the "
                        "tokens do not depend on it, but bf16 "
                        "matmuls may round differently, so it is part of a row's key")
    ap = Parser(description="Evaluate KV-cache eviction policies against the full cache.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join([*TASKS, "bench", "merge", "plot"]) + "}")
    p = sub.add_parser("fidelity", parents=[shared], help="teacher-forced KL / top-1 / NLL gap vs the full cache")
    p.add_argument("--min-tokens", type=int, default=1024, help="pack problems into each conversation until it "
                   "holds this many tokens")
    p.add_argument("--long", type=int, default=None, metavar="T", help="instead of packed conversations: one problem "
                   "each, the first --n of --data whose greedy full-cache answer (up to --max-new-tokens) runs to T "
                   "tokens or more (long-trace fidelity)")
    p.add_argument("--traces", default=None, metavar="FILE", help="instead of the model's own answers: replay the "
                   "reasoning traces of FILE (jsonl: id, problem, trace, optional labelled sentences; "
                   "data/reasoning_traces.jsonl), the first --n of --long tokens or more; sentences' importance rows")
    p.add_argument("--loops", action="store_true", help="with --traces: keep traces that loop (tasks.is_loop), "
                   "which are left out and named by default")
    p.add_argument("--skip", type=int, default=0, metavar="S", help="with --traces: leave out the first S traces "
                   "that qualify and take the next --n (a study's next block: tools/seeds.py and tools/sentences.py "
                   "pool the blocks' rows of one setting)")
    p.add_argument("--keep-refs", action="store_true", help="keep the full cache's logits under $NANOKV_HOME/refs "
                   "when the sweep is done, for a next sweep on the same traces (another --buffer, more policies); "
                   "the last one without this flag removes them")
    p = sub.add_parser("accuracy", parents=[shared], help="free generation, extracted answers, pass@1, loop rate")
    p.add_argument("--refill", action=argparse.BooleanOptionalAction, default=True, help="when a problem's answer "
                   "ends, the next problem takes its row, so --batch-size rows stay live (continuous batching); "
                   "--no-refill decodes --batch-size problems at a time until the longest ends, as rows made before "
                   "refill were")
    p = sub.add_parser("probe", parents=[shared], help="passcode / planted-fact recall after a long trace")
    p.add_argument("--probe", choices=["passcode", "fact", "heads"], default="passcode", help="passcode: a code said "
                   "once, asked at the end; fact: 'x = 7291' planted in the trace, asked --gap tokens later; heads: "
                   "Random Attention's head-redundancy probe, the fact planted in the model's own full-cache answers "
                   "and kept in only k KV heads of every layer before the question (the full cache, k = 0 ... H_kv)")
    p.add_argument("--where", choices=["prompt", "trace"], default="prompt", help="where the passcode is said")
    p.add_argument("--gap", type=int, default=1536, help="trace tokens between the secret and the question (>= 1)")
    p.add_argument("--min-tokens", type=int, default=None, help=argparse.SUPPRESS)  # heads: the traces' length
    p = sub.add_parser("perturbation", parents=[shared], help="CriticalKV's ||o - o_hat||_1 against the "
                       "uncompressed cache at each eviction")
    p.add_argument("--min-tokens", type=int, default=1024, help="as for fidelity (the same traces)")
    p.add_argument("--long", type=int, default=None, metavar="T", help="as for fidelity (the same traces)")
    import bench  # the speed benchmark lives in its own file

    bench.add_arguments(sub.add_parser("bench", parents=[common], help="decode speed, eviction cost, peak memory"))
    p = sub.add_parser("merge", help="fold the --shard files beside --out into it, checking that none is missing")
    p.add_argument("--out", required=True, help="the --out the shards ran with")
    p = sub.add_parser("plot", help="draw result files as PNGs (needs matplotlib: pip install -r "
                       "requirements-plot.txt)")
    p.add_argument("files", nargs="+", metavar="FILE", help="result files of eval.py (their --out) and maps of "
                   "generate.py --kept-json")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs (created if missing)")
    p.add_argument("--budgets", help="comma list of K: draw only the rows at these budgets (and the full cache's), "
                   "e.g. one budget of a sweep as a row per policy")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.out is not None and not args.out.strip():  # '' would save nothing, silently
            raise UsageError("--out is empty: name the file (plot: the folder) to write, e.g. --out results/rows.json")
        if getattr(args, "int_kernels", False) and not args.quant:  # it picks among --quant's kernels
            raise UsageError("--int-kernels picks the kernels of a --quant run and does nothing without one: add "
                             "--quant int4 or int8, or drop it")
        if getattr(args, "keep_refs", False) and not args.out:  # without --out they sit in a folder that goes
            raise UsageError("--keep-refs keeps the references of a sweep that saves to --out (under "
                             "$NANOKV_HOME/refs); without --out there is nothing to keep: add --out or drop it")
        if args.cmd != "plot" and args.out and args.out.endswith(("/", os.sep)):  # Path() would drop the slash
            raise UsageError(f"--out {args.out} names a folder: name the rows' file in it, e.g. "
                             f"--out {Path(args.out) / 'rows.json'}")
        if args.cmd == "merge":
            return report(*merge(args.out), f"merged into {args.out}")
        if args.cmd == "plot":
            import plot  # matplotlib: imported by this subcommand only

            budgets = int_list("--budgets", args.budgets) if args.budgets is not None else None  # '' is refused
            return print("\n".join(map(str, plot.draw(args.files, args.out, budgets))))
        where, lab = result_file(args.out, args.shard), {}
        if where:
            check_writable(where)  # before the model loads and the first job runs
        if args.cmd == "bench":
            import bench

            args.model = local_model(args.model)  # a Hub id is read from its snapshot: rows are keyed by its files
            jobs, job_cost = bench.jobs(args), bench.cost
            measure = lambda job: bench.measure(job, args.model)
        else:
            if getattr(args, "skip", 0) < 0:
                raise UsageError(f"--skip must be 0 or more (got {args.skip}): the traces to leave out before --n")
            if getattr(args, "traces", None):  # the traces' file names the rows' data
                read_traces(args.traces)
                args.data = args.traces
            elif getattr(args, "loops", False) or getattr(args, "skip", 0):
                flag = "--loops keeps looping traces" if args.loops else "--skip leaves out the first traces"
                raise UsageError(f"{flag} of --traces FILE: pass --traces, or drop it")
            else:
                load_data(args.data)  # fail on a bad file before loading the model
            args.model = local_model(args.model)  # as for bench
            if args.batch_size is None:
                args.batch_size = 64 if torch.device(resolve_device(args.device, args.dtype, args.quant)[0]).type == \
                    "cuda" else 16
            job_cost = cost
            if args.cmd == "probe" and args.probe == "heads":
                # the full cache (every head keeps the fact) first: whether the model recalls at all comes first
                args.heads = list(range(model_of(args, lab)[0].cfg.num_key_value_heads, -1, -1))
                args.min_tokens = args.gap + 256  # the conversations run on past the question's place
            jobs = make_jobs(args)
            held = read_rows(Path(args.out)) if args.out and not args.shard else []
            if todo(jobs, held):  # a finished sweep only reports its rows: no model load
                check_jobs(args, jobs, lab)
            measure = lambda job: TASKS[args.cmd](args, job, lab)
        rows = run_jobs(jobs, measure, args.out, args.shard, job_cost, desc=args.cmd)
        if args.cmd == "fidelity" and not args.keep_refs and not any("error" in r for r in rows):  # all done: they go
            for tr in lab.get("traces", []):
                ref = reference_path(args, lab, tr)
                for p in (ref, Path(f"{ref}.lock")):
                    p.unlink(missing_ok=True)
        done = f"shard {args.shard[0]}/{args.shard[1]} in {where}" if args.shard else ""
        report(jobs, rows, done and f"{done}; when every shard is done: python eval.py merge --out {args.out}")
    except (ModelError, UsageError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted: finished rows (and accuracy's finished problems, fidelity's finished traces) are "
                 "saved; rerun the same command to resume")
    except BrokenPipeError:  # e.g. `python eval.py ... | head`: the reader left, nothing to report
        sys.stderr.close()
    except OSError as e:  # e.g. `> /dev/full`: one line, not a traceback
        output_failed(e)


def report(jobs: list[dict], rows: list[dict], note: str):
    """The rows as a Markdown table (fidelity: with the paired differences against snapkv) on stdout, where they went
    on stderr; failed jobs make the exit status non-zero, so that a scheduler sees them (Slurm's afterok)."""
    print(markdown(rows, keys=set().union(*jobs)))
    if paired(rows):
        print("\n" + paired(rows))
    base = next((r for r in rows if r.get("task") == "accuracy" and r["policy"] == "full"), None)
    if base and len(rows) > 1:
        print("\nPaired against the full cache on the same problems:\n" + paired_accuracy(rows, base))
    if note:
        print(note, file=sys.stderr)
    failed = sum("error" in r for r in rows)
    if failed:
        raise UsageError(f"{failed} job(s) failed and were not saved: rerun the same command to retry them")


if __name__ == "__main__":
    main()
