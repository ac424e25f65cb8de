"""
What eval measures below the level of a whole answer: recall probes and the per-head measures.

- Passcode and planted-fact probes (Random Attention's passcode probe; a fact asked --gap tokens later): a secret
  said once, a long teacher-forced trace, then the question; `build_probe` makes the token sequence.
- The head-redundancy probe (Random Attention): a fact planted in the model's own answer and kept in only k KV
  heads of every layer (`plant_fact`, `masked_recall`, `head_probe`).
- CriticalKV's output perturbation ||o - o_hat||_1 per layer and attention head, against an archive of every key
  and value the compressed run produced (`head_perturbation`, `perturbation_row`).
Each function takes the model and the token sequences; eval.py runs them over policies x budgets.
"""

import itertools
import math
import random
from dataclasses import replace

import torch
from torch import Tensor

from cache import FREE
from generate import feed, make_cache, make_run
from kernels import dense
from traces import turn_ids


# -----------------------------------------------------------------------------
# passcode and planted-fact probes


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


# -----------------------------------------------------------------------------
# Random Attention's head-redundancy probe: a planted fact kept in only some KV heads

FACT_NAME = "zorb"  # the planted variable (in the rows' key): a name the traces never use


def plant_fact(tok, trace: dict, i: int, seed: int, gap: int) -> dict:
    """A probe built from one of the model's own full-cache conversations (the fidelity traces): 'Let zorb = NNNN.'
    is planted in its first answer, the conversation runs on for about `gap` tokens, then a user turn asks for zorb
    and the assistant's turn opens with 'The value of zorb is'. Returns ids, the fact's span and the answer's span (the
    digits only, where the tokenizer writes them apart from the space before them).
    note: the name is one no solution uses: with x, GSM8K answers define x themselves ('Let x be Jerry's age'), and
    the 1.5B's full cache answered at chance (log-probability -9.3 for 4 digits, 4 ln 10 = 9.2)."""
    rng = random.Random(f"{seed}:{i}:heads")
    secret = "".join(rng.choice("0123456789") for _ in range(4))
    a, b = trace["spans"][0]
    at = a + min(64, (b - a) // 2)  # inside the first answer, after some of its reasoning
    fact = tok.encode(f"\n\nLet {FACT_NAME} = {secret}.\n\n")
    body = trace["ids"][:at] + fact + trace["ids"][at:]
    end = min(len(body), at + len(fact) + gap)  # cut the conversation about `gap` tokens after the fact
    msgs = [{"role": "user", "content": "Q"}]  # the question turn, as the template writes it after an answer
    turns = msgs + [{"role": "assistant", "content": "X"},
                    {"role": "user", "content": f"What is the value of {FACT_NAME}?"}]
    prefix = f"The value of {FACT_NAME} is"
    said = tok.encode(prefix + " " + secret)[len(tok.encode(prefix)) :]  # e.g. [' ', '4', '2', '5', '9']
    # only the digits are scored: the separator before them is not the fact (the 1.5B's full cache gives the digits
    # log-probability 0.00 each, but would write ' given' before them, so scoring ' ' too made its recall 0)
    k = next((k for k in range(len(said)) if tok.decode(said[k:]) == secret), 0)
    tail = turn_ids(tok, turns, tok.chat(msgs) + "X")[0] + tok.encode(prefix) + said[:k]
    answer = said[k:]
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
    heads (8 drawn at random where there are more), each probe, averaged; and per set, averaged over the probes."""
    sets = [list(c) for c in itertools.combinations(range(model.cfg.num_key_value_heads), k)]
    sets = random.Random(f"{seed}:{k}").sample(sets, 8) if len(sets) > 8 else sets
    got = [masked_recall(model, pr, sets) for pr in probes]  # [probe][set] of (recall, logprob)
    flat = [x for g in got for x in g]
    by_set = list(zip(*got))  # [set][probe]: which heads carry the fact, as the authors report their carrier heads
    mean = lambda pairs, i: sum(x[i] for x in pairs) / len(pairs)  # i = 0: recall, 1: log-probability
    return {"recall": mean(flat, 0), "logprob": mean(flat, 1), "head_sets": len(sets),
            "recall_by_probe": [mean(g, 0) for g in got], "sets": sets,
            "recall_by_set": [mean(g, 0) for g in by_set], "logprob_by_set": [mean(g, 1) for g in by_set],
            "gap_tokens": sum(pr["question"] - pr["fact"][1] for pr in probes) / len(probes)}


# -----------------------------------------------------------------------------
# output perturbation against the uncompressed cache (CriticalKV's measure)


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


def head_perturbation(model, traces: list[dict], run_of) -> dict:
    """CriticalKV's measure on the fidelity traces, for the run that run_of(prompt_len) makes. Every key and value the
    compressed run produces also goes to an archive that is never evicted. At each eviction round we compare, per
    (layer, KV head), the attention output over the archive with that over the kept slots, for two sets of queries:
    the window queries the scorers just used (the paper's setting, "window"), and the next r queries decoding meets
    ("next", measured when they are all in, at the next round). Returns {"window": [L, H_q], "next": [L, H_q]} per
    attention head, means over rounds (None where no round was measured)."""
    cfg = model.cfg
    L, H_kv, H_q, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    wo = [dense(blk.self_attn.o_proj.weight) for blk in model.model.layers]  # [hidden, H_q * D] each
    sums = {"window": torch.zeros(L, H_q), "next": torch.zeros(L, H_q)}
    counts = {"window": 0, "next": 0}

    def measure(cache, which: str, q_from: int):  # the ring's queries at positions >= q_from against the archive
        for l in range(L):
            q, qp = cache.q_ring[l, 0], cache.q_pos[0]
            use = qp >= q_from
            S, n = cache.length[0], cache.next_pos[0]
            if cache.pooled:  # per-head budgets: each head's slots copied out of the layer's pool, FREE behind
                k, v, pos, _, _ = cache.head_view(l, slice(0, 1), S, S)
                kept = (k[0], v[0], pos[0])
            else:
                kept = (cache.k[l, 0, :, :S], cache.v[l, 0, :, :S], cache.pos[l, 0, :, :S])
            archive = (arch["k"][l, :, :n], arch["v"][l, :, :n], torch.arange(n, device=qp.device).expand(H_kv, n))
            sums[which][l] += perturbation_l1(q[:, use], qp[use], archive, kept, wo[l]).cpu()
        counts[which] += 1

    def observe(cache, out, run):  # after every forward: the chunk's new keys/values also go to the archive
        n, S = out.chunk.n[0], cache.length[0]
        p = out.chunk.pos[0, :n]
        if out.chunk.at is not None:  # a pooled cache: the chunk's tokens went behind each head's segment
            layer = torch.arange(L, device=p.device)[:, None, None]
            for x, name in ((cache.k, "k"), (cache.v, "v")):
                arch[name][:, :, p] = x[:, 0].flatten(1, 2)[layer, out.chunk.at].transpose(1, 2)  # [L, H_kv, n, D]
        else:
            arch["k"][:, :, p] = cache.k[:, 0, :, S - n : S]
            arch["v"][:, :, p] = cache.v[:, 0, :, S - n : S]
        if inner:
            inner(cache, out, run)

    def watch(cache, b, when, scores):  # around each eviction round (untimed)
        if when == "before" and arch["evicted_at"] is not None:  # the r queries since the last round are all in
            measure(cache, "next", arch["evicted_at"])
        if when == "after":
            measure(cache, "window", 0)
            arch["evicted_at"] = cache.next_pos[0]

    for tr in traces:
        run = run_of(tr["prompt_len"])
        inner = run.policy.observe
        # every policy needs the window's queries here, even one whose scorer reads none: a ring of r
        run.policy = replace(run.policy, window="buffer", observe=observe)
        run.watch = watch
        T = len(tr["ids"])
        kw = dict(device=model.device, dtype=model.model.embed_tokens.weight.dtype)
        arch = {"k": torch.zeros(L, H_kv, T, D, **kw), "v": torch.zeros(L, H_kv, T, D, **kw), "evicted_at": None}
        with torch.inference_mode():  # note: the last round's next queries are cut short by the trace's end: unused
            feed(model, make_cache(model, run, T), torch.tensor([tr["ids"]], device=model.device), run)
    return {k: sums[k] / counts[k] if counts[k] else None for k in sums}  # None: no round


def perturbation_row(mine: dict, snap: dict) -> dict:
    """A perturbation row's fields from head_perturbation's result for the policy and for snapkv at its budget."""
    row = {}
    for k in ("window", "next"):
        if mine[k] is None:  # the traces too short for a second eviction round: nothing measured
            row |= {f"l1_{k}": None, f"better_{k}": None, f"l1_{k}_by_head": None}
            continue
        row[f"l1_{k}"] = mine[k].mean().item()
        row[f"better_{k}"] = (mine[k] < snap[k]).float().mean().item()  # share of (layer, head) below snapkv
        row[f"l1_{k}_by_head"] = mine[k].tolist()
    return row
