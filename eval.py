"""
Measure eviction policies against the full cache: fidelity, accuracy, recall probes, output perturbation, speed.

    python eval.py fidelity --policies all --budgets 128,256 --n 12 --out results/fidelity.json

Each subcommand is a list of jobs, one per (policy, budget, ...), run by one driver that prints a Markdown table
and saves each finished row (results.py): into --out, so an interrupted sweep resumes where it stopped, or with
--shard I/N into a file of the shard's own, for `eval.py merge`. A row's key holds every setting that changes its
result (the data and the model by content hash). Fidelity (teacher-forced KL against the full cache) works even for
a model too small to solve problems. Free generation decodes --batch-size problems together and keeps each problem's
outcome. Left out: sampling / pass@k, model-judged answers.
"""

import argparse
import itertools
import json
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from generate import (Parser, UsageError, add_device_args, feed, generate, int_list, load, make_cache, make_run,
                      output_failed, policy_names, resolve_device)
from cache import FREE
from model import ModelError
from policies import POLICIES
from results import (Progress, check_writable, merge, model_key, read_json, result_file, run_jobs, shard_arg,
                     write_json)
from tasks import DATA, GRADING, extract_answer, file_hash, is_correct, is_loop, load_data

SYSTEM = "Solve each problem step by step and put the final answer in \\boxed{}."  # short: fits a small K - r
ASK = "\nPlease reason step by step, and put your final answer within \\boxed{}."


# -----------------------------------------------------------------------------
# shared state of a sweep: the model, its traces and the full cache's log-probs, built once on first use


def model_of(args, lab: dict):
    if "model" not in lab:
        lab["model"], lab["tok"] = load(args.model, args.device, args.dtype)
    return lab["model"], lab["tok"]


def run_for(job: dict, args, prompt_len):
    return make_run(job["policy"], job["budget"], args.buffer, job["protect"], prompt_len, args.seed)


def turn_ids(tok, messages: list[dict], text: str) -> tuple[list[int], str]:
    """Tokens that the chat template adds after `text` (what the conversation already holds) for messages."""
    full = tok.chat(messages)
    if not full.startswith(text):
        raise ModelError("the chat template rewrites earlier turns, so conversations cannot be packed")
    return tok.encode(full[len(text) :]), full


def conversation_plans(tok, questions: list[str], n: int) -> list[list[str]]:
    """n conversations: each opens with one of the n shortest problems, so that its first turn (what
    --protect-prompt keeps) fits a small K - r; then the other problems follow, dealt round-robin in file order,
    as many as each conversation needs. Each conversation is independent of the others and of the batch size."""
    order = sorted(range(len(questions)), key=lambda i: (len(tok.encode(questions[i])), i))
    openers, rest = order[:n], sorted(order[n:])
    return [[questions[openers[c]]] + [questions[i] for i in rest[c::n]] for c in range(n)]


@torch.inference_mode()
def pack_conversations(model, tok, plans: list[list[str]], args) -> list[dict]:
    """Greedy full-cache conversations, one batch row each: problem, answer, next problem, ... until the row holds
    --min-tokens. Rows decode together; a row whose answer ends feeds its next problem's turn in the same step as
    the others' next token. Returns per conversation its ids, prompt length (first turn) and the answer spans."""
    cap = args.min_tokens + 2 * args.max_new_tokens + 1024
    run = make_run("full", None, args.buffer, None, [1] * len(plans))
    cache = make_cache(model, run, cap)
    convs = [{"messages": [{"role": "system", "content": SYSTEM}], "text": "", "ids": [], "spans": [],
              "todo": list(p), "answer": []} for p in plans]

    def next_turn(c) -> list[int] | None:  # the next problem's turn, added to the conversation; None = it is done
        if len(c["ids"]) >= args.min_tokens or not c["todo"]:
            return None
        c["messages"].append({"role": "user", "content": c["todo"].pop(0)})
        new, c["text"] = turn_ids(tok, c["messages"], c["text"])
        if len(c["ids"]) + len(new) + args.max_new_tokens > cap:
            if not c["ids"]:
                raise UsageError(f"a problem of {len(new)} tokens does not fit the trace cache: raise --min-tokens")
            return None
        c["ids"] += new
        c.setdefault("prompt_len", len(c["ids"]))  # the system message and the first problem
        return new

    pending = [next_turn(c) for c in convs]  # what each row feeds next
    bar = tqdm(total=len(plans) * args.min_tokens, desc="traces (full cache, greedy)", unit="tok", leave=False)
    while cache.batch:
        bar.update(sum(map(len, pending)))
        x = torch.tensor([p + [0] * (max(map(len, pending)) - len(p)) for p in pending], device=model.device)
        nxt = feed(model, cache, x, run, n=[len(p) for p in pending])[:, -1].argmax(-1).tolist()
        keep = []
        for b, (row, t) in enumerate(zip(cache.rows, nxt)):
            c = convs[row]
            ended = t in tok.eos_ids  # the template writes the end-of-turn token itself, with the next turn
            if not ended:
                c["answer"].append(t)
                ended = len(c["answer"]) == args.max_new_tokens
            if not ended:
                pending[b] = [t]
                keep.append(b)
                continue
            answer, c["answer"] = c["answer"], []
            c["spans"].append((len(c["ids"]), len(c["ids"]) + len(answer)))
            c["ids"] += answer
            c["messages"].append({"role": "assistant", "content": tok.decode(answer)})
            c["text"] += c["messages"][-1]["content"]
            new = next_turn(c)
            if new is not None:  # a capped answer's last token has not been fed yet: it goes first
                pending[b] = ([] if t in tok.eos_ids else [t]) + new
                keep.append(b)
        if len(keep) < cache.batch:
            cache.keep_rows(keep)
            pending = [pending[b] for b in keep]
    bar.close()
    return [{"ids": c["ids"], "prompt_len": c["prompt_len"], "spans": c["spans"]} for c in convs]


def traces(args, lab: dict) -> list[dict]:
    """The packed fidelity traces, cached beside --out so that a rerun does not regenerate them."""
    if "traces" in lab:
        return lab["traces"]
    key = {"data": file_hash(args.data), "n": args.n, "min_tokens": args.min_tokens,
           "max_new_tokens": args.max_new_tokens, **model_settings(args)}
    path = Path(args.out + ".traces.json") if args.out else None
    saved = read_json(path, dict) if path and path.exists() else {}
    if saved.get("key") != key:
        model, tok = model_of(args, lab)
        plans = conversation_plans(tok, [r["question"] for r in load_data(args.data)], args.n)
        out = []
        for i in range(0, len(plans), args.batch_size):
            out += pack_conversations(model, tok, plans[i : i + args.batch_size], args)
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
            refs[i] = replay(model, tr["ids"], make_run("full", None, args.buffer, None, 1))[at].log_softmax(-1)
        p, q = refs[i], replay(model, tr["ids"], run_for(job, args, tr["prompt_len"]))[at].log_softmax(-1)
        by_trace.append((p.exp() * (p - q)).sum().item())
        kl += by_trace[-1]
        by_trace[-1] /= len(at)
        top1 += (p.argmax(-1) == q.argmax(-1)).sum().item()
        gap += (p.gather(1, nxt) - q.gather(1, nxt)).sum().item()
        n += len(at)
    return {"kl": kl / n, "top1": top1 / n, "nll_gap": gap / n, "tokens": int(n), "kl_by_trace": by_trace}


def accuracy(args, job: dict, lab: dict) -> dict:
    """Free generation, --batch-size problems at a time. After each batch the finished problems' outcomes are saved
    (results.Progress), so a rerun of a killed sweep decodes only the batches not yet done; the draws of a stochastic
    policy are seeded by each problem's index, so the row is the one an uninterrupted run gives."""
    model, tok = model_of(args, lab)
    rows = load_data(args.data)[: args.n]
    progress = Progress(result_file(args.out, args.shard), job)
    done = progress.part.get("per_problem", [])  # the first batches' outcomes, in problem order
    if [p["i"] for p in done] != list(range(len(done))):
        raise UsageError(f"{progress.path} does not hold the first problems in order: delete it and rerun")
    for i in range(len(done), len(rows), args.batch_size):
        batch = rows[i : i + args.batch_size]
        prompts = [tok.encode(tok.chat([{"role": "user", "content": r["question"] + ASK}])) for r in batch]
        # each problem's index in the sweep seeds its draws, so the rows do not depend on --batch-size
        run = make_run(job["policy"], job["budget"], args.buffer, job["protect"], [len(p) for p in prompts],
                       args.seed, ids=list(range(i, i + len(batch))))
        kept = kept_share(run)
        outs, _, _ = generate(model, prompts, run, args.max_new_tokens, eos_ids=tok.eos_ids)
        for k, (r, ids) in enumerate(zip(batch, outs)):
            stop = "eos" if ids[-1] in tok.eos_ids else "max"
            pred = extract_answer(tok.decode(ids), "####" in r["answer"], stop)
            done.append({"i": i + k, "correct": is_correct(pred, r["answer"]), "answered": pred is not None,
                         "loop": is_loop(ids, args.max_new_tokens, tok.eos_ids), "tokens": len(ids), "stop": stop,
                         "evictions": run.rounds[k], "kept": kept(k, len(ids)), "pred": pred})
        progress.save(per_problem=done)
    mean = lambda field: sum(p[field] for p in done) / len(done)
    return {"accuracy": mean("correct"), "answered": mean("answered"), "loops": mean("loop"),
            "mean_tokens": mean("tokens"), "mean_evictions": mean("evictions"), "mean_kept": mean("kept"),
            "max_tokens": max(p["tokens"] for p in done), "per_problem": done}


def kept_share(run):
    """Watch run's evictions; returns kept(row, n): the share of row's n-token answer still held in its cache when the
    answer ended, averaged over layers and KV heads. Exact and cheap: after each eviction of the row we count the
    held slots past its prompt, once; every token fed after its last eviction is held too. The answer's last token
    is sampled but never fed, so n - 1 of its tokens reach the cache. 1.0 for a row that never evicted."""
    last = {}  # row -> (answer slots held after its last eviction, mean over layers and KV heads; its next position)

    def watch(cache, b, when):
        if when == "after":
            row, S = cache.rows[b], cache.length[b]
            held = (cache.pos[:, b, :, :S] >= run.prompt_len[row]).sum(-1).double().mean().item()  # [L, H_kv] -> mean
            last[row] = (held, cache.next_pos[b])

    def kept(row: int, n: int) -> float:
        if row not in last or n < 2:
            return 1.0
        held, at = last[row]
        P = run.prompt_len[row]
        return (held + P + n - 1 - max(at, P)) / (n - 1)

    run.watch = watch
    return kept


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


# --- Random Attention's head-redundancy probe: a planted fact kept in only some KV heads ---------------------------


def plant_fact(tok, trace: dict, i: int, seed: int, gap: int) -> dict:
    """A probe built from one of the model's own full-cache conversations (the fidelity traces): 'Let x = NNNN.'
    is planted in its first answer, the conversation runs on for about `gap` tokens, then a user turn asks for x
    and the assistant's turn opens with 'The value of x is'. Returns ids, the fact's span and the answer's span."""
    rng = random.Random(f"{seed}:{i}:heads")
    secret = "".join(rng.choice("0123456789") for _ in range(4))
    a, b = trace["spans"][0]
    at = a + min(64, (b - a) // 2)  # inside the first answer, after some of its reasoning
    fact = tok.encode(f"\n\nLet x = {secret}.\n\n")
    body = trace["ids"][:at] + fact + trace["ids"][at:]
    end = min(len(body), at + len(fact) + gap)  # cut the conversation about `gap` tokens after the fact
    msgs = [{"role": "user", "content": "Q"}]  # the question turn, as the template writes it after an answer
    turns = msgs + [{"role": "assistant", "content": "X"}, {"role": "user", "content": "What is the value of x?"}]
    prefix = "The value of x is"
    tail = turn_ids(tok, turns, tok.chat(msgs) + "X")[0] + tok.encode(prefix)
    answer = tok.encode(prefix + " " + secret)[len(tok.encode(prefix)) :]
    ids = body[:end] + tail + answer
    return {"ids": ids, "fact": (at, at + len(fact)), "question": end, "answer": (len(ids) - len(answer), len(ids))}


@torch.inference_mode()
def masked_recall(model, pr: dict, keep_sets: list[list[int]]) -> list[tuple[bool, float]]:
    """For each set of KV heads: once the trace has been read, the fact's slots stay in those heads and leave every
    other head, in every layer (their position becomes FREE, so no query reads them); then the question is read and
    the answer scored. Returns (greedy writes exactly the answer, log-probability of the answer) per set. The trace
    is read once; the cache goes back to that point after each set."""
    ids, (f0, f1), split, (a, b) = pr["ids"], pr["fact"], pr["question"], pr["answer"]
    run = make_run("full", None, 64, None, 1)
    cache = make_cache(model, run, len(ids))
    x = torch.tensor([ids], device=model.device)
    feed(model, cache, x[:, :split], run)  # the trace, fact included, read with every head
    saved = cache.pos.clone(), list(cache.length), list(cache.next_pos)
    out, eager = [], model.eager
    # subtle: SDPA's fast paths let a chunk read every held slot; the masked path reads positions, so a FREE slot
    # inside the held length is hidden from every query
    model.eager = True
    for keep in keep_sets:
        for h in range(cache.pos.shape[2]):
            if h not in keep:  # full cache: slot i holds position i
                cache.pos[:, 0, h, f0:f1] = FREE
        lp = feed(model, cache, x[:, split:], run, all_logits=True)[0, a - 1 - split : b - 1 - split].log_softmax(-1)
        want = x[0, a:b, None]
        out.append((bool((lp.argmax(-1) == want[:, 0]).all()), lp.gather(1, want).sum().item()))
        cache.pos.copy_(saved[0])
        cache.length, cache.next_pos = list(saved[1]), list(saved[2])
    model.eager = eager
    return out


def head_probe(model, k: int, probes: list[dict], seed: int) -> dict:
    """Recall and answer log-probability with the fact kept in exactly k of each layer's KV heads: every set of k
    heads (8 drawn at random where there are more), each probe, averaged."""
    sets = [list(c) for c in itertools.combinations(range(model.cfg.num_key_value_heads), k)]
    sets = random.Random(f"{seed}:{k}").sample(sets, 8) if len(sets) > 8 else sets
    got = [masked_recall(model, pr, sets) for pr in probes]  # [probe][set] of (recall, logprob)
    flat = [x for g in got for x in g]
    return {"recall": sum(r for r, _ in flat) / len(flat), "logprob": sum(lp for _, lp in flat) / len(flat),
            "head_sets": len(sets), "recall_by_probe": [sum(r for r, _ in g) / len(g) for g in got],
            "gap_tokens": sum(pr["question"] - pr["fact"][1] for pr in probes) / len(probes)}


# --- output perturbation against the uncompressed cache (CriticalKV's measure) ---------------------------------


def head_outputs(q: Tensor, q_pos: Tensor, keys: Tensor, values: Tensor, k_pos: Tensor, wo: Tensor) -> Tensor:
    """Each query head's attention output projected through its own slice of o_proj, causal by position:
    o_h W_O,h [H_q, w, hidden] for queries q [H_q, w, D] at q_pos [w] over keys/values [H_kv, S, D] at k_pos [H_kv, S];
    wo [hidden, H_q * D]."""
    H_q, _, D = q.shape
    n_rep = H_q // keys.shape[0]
    k, v = keys.float().repeat_interleave(n_rep, 0), values.float().repeat_interleave(n_rep, 0)
    att = q.float() @ k.transpose(-1, -2) / math.sqrt(D)  # [H_q, w, S]
    att = att.masked_fill(k_pos.repeat_interleave(n_rep, 0)[:, None, :] > q_pos[None, :, None], -math.inf)
    o = att.softmax(-1) @ v  # [H_q, w, D]
    return torch.einsum("hwd,ohd->hwo", o, wo.float().view(-1, H_q, D))


def perturbation_l1(q, q_pos, archive, kept, wo) -> Tensor:
    """||o - o_hat||_1 per attention (query) head [H_q]: o over every key/value the run produced (the archive),
    o_hat over the slots it holds (kept), for the same queries, through each head's slice of W_O, L1 over the
    hidden size, mean over the queries. archive and kept are (keys, values, positions) of one layer."""
    diff = (head_outputs(q, q_pos, *archive, wo) - head_outputs(q, q_pos, *kept, wo)).abs().sum(-1)  # [H_q, w]
    return diff.mean(-1)


def head_perturbation(args, policy: str, budget: int, protect, lab: dict) -> dict:
    """CriticalKV's measure on the fidelity traces. Every key and value the compressed run produces also goes to an
    archive that is never evicted. At each eviction round we compare, per (layer, KV head), the attention output over
    the archive with that over the kept slots, for two sets of queries: the window queries the scorers just used
    (the paper's setting, "window"), and the next r queries decoding meets ("next", measured when they are all in,
    at the next round). Returns {"window": [L, H_q], "next": [L, H_q]} per attention head, means over rounds."""
    memo = lab.setdefault("perturb", {})
    if (policy, budget, protect) in memo:
        return memo[policy, budget, protect]
    model, _ = model_of(args, lab)
    cfg = model.cfg
    L, H_kv, H_q, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    wo = [blk.self_attn.o_proj.weight for blk in model.model.layers]
    sums = {"window": torch.zeros(L, H_q), "next": torch.zeros(L, H_q)}
    counts = {"window": 0, "next": 0}

    def measure(cache, which: str, q_from: int):  # the ring's queries at positions >= q_from against the archive
        for l in range(L):
            q, qp = cache.q_ring[l, 0], cache.q_pos[0]
            use = qp >= q_from
            S, n = cache.length[0], cache.next_pos[0]
            kept = (cache.k[l, 0, :, :S], cache.v[l, 0, :, :S], cache.pos[l, 0, :, :S])
            archive = (arch["k"][l, :, :n], arch["v"][l, :, :n], torch.arange(n, device=qp.device).expand(H_kv, n))
            sums[which][l] += perturbation_l1(q[:, use], qp[use], archive, kept, wo[l]).cpu()
        counts[which] += 1

    def observe(cache, out, run):  # after every forward: the chunk's new keys/values also go to the archive
        n, S = out.chunk.n[0], cache.length[0]
        p = out.chunk.pos[0, :n]
        arch["k"][:, :, p] = cache.k[:, 0, :, S - n : S]
        arch["v"][:, :, p] = cache.v[:, 0, :, S - n : S]
        if inner:
            inner(cache, out, run)

    def watch(cache, b, when):  # around each eviction round (untimed)
        if when == "before" and arch["evicted_at"] is not None:  # the r queries since the last round are all in
            measure(cache, "next", arch["evicted_at"])
        if when == "after":
            measure(cache, "window", 0)
            arch["evicted_at"] = cache.next_pos[0]

    for tr in traces(args, lab):
        run = run_for({"policy": policy, "budget": budget, "protect": protect}, args, tr["prompt_len"])
        inner = run.policy.observe
        # every policy needs the window's queries here, even one whose scorer reads none: a ring of r
        run.policy = replace(run.policy, window="buffer", observe=observe)
        run.watch = watch
        T = len(tr["ids"])
        kw = dict(device=model.device, dtype=model.model.embed_tokens.weight.dtype)
        arch = {"k": torch.zeros(L, H_kv, T, D, **kw), "v": torch.zeros(L, H_kv, T, D, **kw), "evicted_at": None}
        with torch.inference_mode():  # note: the last round's next queries are cut short by the trace's end: unused
            feed(model, make_cache(model, run, T), torch.tensor([tr["ids"]], device=model.device), run)
    memo[policy, budget, protect] = {k: sums[k] / counts[k] if counts[k] else None for k in sums}  # None: no round
    return memo[policy, budget, protect]


def perturbation(args, job: dict, lab: dict) -> dict:
    mine = head_perturbation(args, job["policy"], job["budget"], job["protect"], lab)
    snap = head_perturbation(args, "snapkv", job["budget"], job["protect"], lab)
    row = {}
    for k in ("window", "next"):
        if mine[k] is None:  # the traces too short for a second eviction round: nothing measured
            row |= {f"l1_{k}": None, f"better_{k}": None, f"l1_{k}_by_head": None}
            continue
        row[f"l1_{k}"] = mine[k].mean().item()
        row[f"better_{k}"] = (mine[k] < snap[k]).float().mean().item()  # share of (layer, head) below snapkv
        row[f"l1_{k}_by_head"] = mine[k].tolist()
    return row


# -----------------------------------------------------------------------------
# the driver: jobs -> rows, validated up front, saved by results.run_jobs (resume, shards), printed as Markdown


def model_settings(args) -> dict:
    """What the model computes on, in every row's key and the traces' key. note: the batch size too: batched matmuls
    may round differently in bf16 on a GPU."""
    device, dtype = resolve_device(args.device, args.dtype)
    return {"model": model_key(args.model), "device": torch.device(device).type, "dtype": str(dtype),
            "batch_size": args.batch_size}


# What a replay (fidelity, probe, perturbation) costs beyond the full cache's, per policy: scoring at each eviction
# round, and per forward for h2o and epikv's state. Measured once on this CPU (1,024-token replays of the default model
# at K = 128 and 512, rounded; the machine was shared, so about +-0.2); only --shard's balance uses it.
EXTRA = {"streaming": 0.0, "random": 0.1, "snapkv": 0.1, "vase-noreserve": 0.2, "vase-dkv": 0.3, "rkv": 0.4,
         "vase-adversary": 0.4, "vase": 0.5, "epikv": 0.5, "epikv-band": 0.5, "epikv-lag": 0.5, "vase-topk": 0.6,
         "criticalkv": 0.6, "h2o": 0.9}


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
        extra["min_tokens"] = args.min_tokens
    if args.cmd in ("fidelity", "perturbation"):
        extra = {"min_tokens": args.min_tokens}
    if args.cmd == "accuracy":  # rows graded by an earlier rule are recomputed
        extra = {"grading": GRADING}
    common = {"data": Path(args.data).name, "data_sha": file_hash(args.data), "n": args.n, "buffer": args.buffer,
              "seed": args.seed, **model_settings(args), "max_new_tokens": args.max_new_tokens}
    # the full cache never evicts, so its row is the same for every --buffer: one reference row serves them all
    return [{"task": args.cmd, **j, **extra, **common, **({"buffer": None} if j["policy"] == "full" else {})}
            for j in jobs]


def check_jobs(args, jobs: list[dict], lab: dict):
    """Refuse, in one line and before the first job runs, any setting that would fail mid-sweep."""
    for flag in ("n", "max_new_tokens", "batch_size", "min_tokens", "gap"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    model, tok = model_of(args, lab)
    rows = load_data(args.data)
    if args.cmd == "accuracy":
        lens = [len(tok.encode(tok.chat([{"role": "user", "content": r["question"] + ASK}]))) for r in rows[: args.n]]
        longest = max(lens) + args.max_new_tokens
    elif args.cmd == "probe" and args.probe == "heads":  # the model's own conversations, a fact planted in each
        pr = lab["probes"] = [plant_fact(tok, tr, i, args.seed, args.gap) for i, tr in enumerate(traces(args, lab))]
        lens, longest = [len(p["ids"]) for p in pr], max(len(p["ids"]) for p in pr)
    elif args.cmd == "probe":
        pr = lab["probes"] = [build_probe(tok, rows, i, args.seed, args.probe, args.where, args.gap)
                              for i in range(args.n)]  # every job replays these same probes
        lens, longest = [p["prompt_len"] for p in pr], max(len(p["ids"]) for p in pr)
    else:  # fidelity / perturbation: the first turns are the n shortest problems' (the conversations' openers)
        if args.n > len(rows):
            raise UsageError(f"--n {args.n} traces need at least {args.n} problems; {args.data} has {len(rows)}")
        firsts = conversation_plans(tok, [r["question"] for r in rows], args.n)
        lens = [len(turn_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p[0]}], "")[0])
                for p in firsts]
        longest = args.min_tokens + 2 * args.max_new_tokens + 1024
    limit = model.cfg.max_position_embeddings
    if longest > limit:
        raise UsageError(f"these settings need sequences of up to {longest} tokens, past the model's {limit} "
                         "positions: lower --gap, --min-tokens or --max-new-tokens")
    for j in jobs:
        run_for(j, args, lens)  # one-line refusal of a prompt that does not fit K - r, or a bad --budget/--buffer


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


# --- paired statistics over problems (Random Attention's way: every configuration answers the same problems) ---


def bootstrap_diff(a: list[bool], b: list[bool], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Accuracy of a minus accuracy of b on the same problems, with its paired bootstrap 95 % interval: resample
    the problems with replacement (a problem keeps both of its outcomes) and take the 2.5 and 97.5 percentiles."""
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)  # [n] in {-1, 0, 1}
    g = torch.Generator().manual_seed(seed)
    means = d[torch.randint(len(d), (resamples, len(d)), generator=g)].mean(1)  # [resamples]
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return d.mean().item(), lo, hi


def sign_test(a: list[bool], b: list[bool]) -> tuple[int, int, float]:
    """McNemar's exact test: on the problems where exactly one of a and b is right (n10 for a, n01 for b), is a
    50/50 split plausible? Two-sided p = 2 P[Binomial(n10 + n01, 1/2) <= min(n10, n01)], at most 1."""
    n10 = sum(x and not y for x, y in zip(a, b))
    n01 = sum(y and not x for x, y in zip(a, b))
    n = n10 + n01
    p = 2 * sum(math.comb(n, i) for i in range(min(n10, n01) + 1)) / 2**n
    return n10, n01, min(1.0, p)


def min_detectable(n: int, alpha: float = 0.05) -> float:
    """The smallest accuracy difference n problems can show at all: k discordant problems, all one way, are
    significant from k = 6 on at alpha = 0.05 (p = 2 / 2^k), so no difference below k / n can be."""
    k = next(k for k in range(1, 64) if 2 / 2**k < alpha)
    return k / n if n else float("nan")


def outcomes(row: dict) -> dict[int, bool]:
    return {o["i"]: o["correct"] for o in row.get("per_problem", [])}


def paired_accuracy(rows: list[dict], base: dict) -> str:
    """Each accuracy row against `base` on the problems both answered: the difference, its paired bootstrap 95 %
    interval, the discordant problems (row right only / base right only) and the exact sign test's p. Markdown."""
    ref = outcomes(base)
    lines = ["| policy | K | protect | accuracy | Δ vs " + base["policy"] + " | 95 % interval | discordant | p |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        got = outcomes(r)
        common = sorted(set(got) & set(ref))
        if r is base or not common:
            continue
        a, b = [got[i] for i in common], [ref[i] for i in common]
        d, lo, hi = bootstrap_diff(a, b)
        n10, n01, p = sign_test(a, b)
        lines.append(f"| {r['policy']} | {r['budget'] or '–'} | {r['protect']} | {sum(a) / len(a):.3f} | {d:+.3f} | "
                     f"[{lo:+.3f}, {hi:+.3f}] | {n10} / {n01} | {p:.3g} |")
    n = len(ref)
    return "\n".join(lines + [f"n = {n} problems: no difference below {min_detectable(n):.3f} can reach p < 0.05"])


def paired(rows: list[dict], base: str = "snapkv") -> str:
    """Every policy's per-trace KL against `base`'s on the same traces: mean difference ± standard error and in how
    many traces the policy is lower. Markdown; empty when base is not among the rows."""
    ref = {r["budget"]: r["kl_by_trace"] for r in rows if r["policy"] == base and "kl_by_trace" in r}
    lines = []
    for r in rows:
        b = ref.get(r["budget"])
        if r["policy"] in ("full", base) or b is None or len(b) != len(r.get("kl_by_trace", [])):
            continue
        d = torch.tensor(r["kl_by_trace"]) - torch.tensor(b)
        se = d.std().item() / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        lines.append(f"| {r['policy']} | {r['budget']} | {d.mean().item():+.4f} ± {se:.4f} | "
                     f"{int((d < 0).sum())}/{len(d)} |")
    head = [f"KL difference against {base} per trace (mean ± standard error; lower in x/N traces):",
            "| policy | budget | Δ KL | lower |", "|---|---|---|---|"]
    return "\n".join(head + lines) if lines else ""


# -----------------------------------------------------------------------------
# CLI

TASKS = {"fidelity": fidelity, "accuracy": accuracy, "probe": probe, "perturbation": perturbation}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)  # every subcommand, bench included
    common.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    add_device_args(common)
    common.add_argument("--policies", default="all", help="comma list of policies, or all (every registered one; "
                        "fidelity, accuracy and probe add the full cache as the reference row)")
    common.add_argument("--buffer", type=int, default=64, help="r: newest tokens never scored; eviction every r steps")
    common.add_argument("--protect-prompt", action=argparse.BooleanOptionalAction, default=None,
                        help="keep every prompt token, for all policies (default: each policy's paper setting)")
    common.add_argument("--seed", type=int, default=0, help="seeds probes and the stochastic policies")
    common.add_argument("--out", default=None, help="JSON file of rows; rerunning with the same file resumes, and "
                        "several sweeps on one machine may write one file at once")
    common.add_argument("--shard", type=shard_arg, default=None, metavar="I/N", help="run only the I-th of N slices "
                        "of the jobs (1 <= I <= N, balanced by expected cost), into a file of its own beside --out; "
                        "then `eval.py merge --out FILE`")
    shared = argparse.ArgumentParser(add_help=False, parents=[common])  # the measurements on data
    shared.add_argument("--budgets", default="128,256,512", help="comma list of K: cache slots right after an "
                        "eviction, buffer included")
    shared.add_argument("--data", default=str(DATA / "math500.jsonl"), help="jsonl with 'problem' (or 'question') "
                        "and 'answer' per line, e.g. data/gsm8k_test.jsonl")
    shared.add_argument("--n", type=int, default=12, help="problems (accuracy), probes (probe), or packed "
                        "conversations (fidelity, perturbation)")
    shared.add_argument("--max-new-tokens", type=int, default=512, help="cap on each generated answer")
    shared.add_argument("--batch-size", type=int, default=None, help="problems or conversations decoded together "
                        "(default: 16 on CPU, 64 on CUDA); in fp32 the tokens do not depend on it, but bf16 "
                        "matmuls may round differently, so it is part of a row's key")
    ap = Parser(description="Evaluate KV-cache eviction policies against the full cache.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join([*TASKS, "bench", "merge"]) + "}")
    p = sub.add_parser("fidelity", parents=[shared], help="teacher-forced KL / top-1 / NLL gap vs the full cache")
    p.add_argument("--min-tokens", type=int, default=1024, help="pack problems into each conversation until it "
                   "holds this many tokens")
    sub.add_parser("accuracy", parents=[shared], help="free generation, extracted answers, pass@1, loop rate")
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
    import bench  # the speed benchmark lives in its own file

    bench.add_arguments(sub.add_parser("bench", parents=[common], help="decode speed, eviction cost, peak memory"))
    p = sub.add_parser("merge", help="fold the --shard files beside --out into it, checking that none is missing")
    p.add_argument("--out", required=True, help="the --out the shards ran with")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "merge":
            return report(*merge(args.out), f"merged into {args.out}")
        where = result_file(args.out, args.shard)
        if where:
            check_writable(where)  # before the model loads and the first job runs
        if args.cmd == "bench":
            import bench

            jobs, job_cost = bench.jobs(args), bench.cost
            measure = lambda job: bench.measure(job, args.model)
        else:
            load_data(args.data)  # fail on a bad file before loading the model
            if args.batch_size is None:
                args.batch_size = 64 if torch.device(resolve_device(args.device, args.dtype)[0]).type == "cuda" else 16
            lab, job_cost = {}, cost
            if args.cmd == "probe" and args.probe == "heads":
                args.heads = list(range(model_of(args, lab)[0].cfg.num_key_value_heads + 1))
                args.min_tokens = args.gap + 256  # the conversations run on past the question's place
            jobs = make_jobs(args)
            check_jobs(args, jobs, lab)
            measure = lambda job: TASKS[args.cmd](args, job, lab)
        rows = run_jobs(jobs, measure, args.out, args.shard, job_cost, desc=args.cmd)
        done = f"shard {args.shard[0]}/{args.shard[1]} in {where}" if args.shard else ""
        report(jobs, rows, done and f"{done}; when every shard is done: python eval.py merge --out {args.out}")
    except (ModelError, UsageError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted: finished rows (and accuracy's finished batches) are saved; rerun the same command "
                 "to resume")
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
