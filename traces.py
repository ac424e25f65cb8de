"""
The fidelity traces: conversations that the full cache writes itself and that eval then teacher-forces through each
compressed cache. A small instruct model answers a MATH problem in a few hundred tokens, so each trace packs several:
a short system message, problem, greedy full-cache answer, next problem, ... until it holds --min-tokens. `replay`
feeds a token sequence through a cache on the generation cadence (one chunk per eviction), which is what fidelity,
the probes and the output perturbation measure on.

Reasoning traces that another model wrote (data/reasoning_traces.jsonl, `eval.py fidelity --traces`) are replayed
the same way: the problem as the user's turn, the trace as the assistant's, and where the trace comes with sentences
labelled by how much the answer depends on them (Thought Anchors, Bogdan et al. 2025, arXiv 2506.19143), each sentence's
characters mapped to its token positions (`token_spans`), so that eval can ask which sentences a policy keeps.

Left out: sampled traces.
"""

from math import nan


import torch
from tqdm import tqdm

from cli import UsageError
from generate import feed, generate, make_cache, make_run
from model import ModelError
from stats import spearman
from tasks import is_loop, jsonl

SYSTEM = "Solve each problem step by step and put the final answer in \\boxed{}."  # short: fits a small K - r


def turn_ids(tok, messages: list[dict], text: str) -> tuple[list[int], str]:
    """Tokens that the chat template adds after `text` (what the conversation already holds) for messages."""
    full = tok.chat(messages)
    if not full.startswith(text):
        raise ModelError("the chat template rewrites earlier turns, so conversations cannot be packed")
    return tok.encode(full[len(text) :]), full


def trace_cap(args) -> int:
    """The packed conversations' cache: --min-tokens, then the answer that crosses it, one more problem's turn (up to
    1,024 tokens) and its answer. A later problem that does not fit ends its conversation."""
    return args.min_tokens + 2 * args.max_new_tokens + 1024


def first_turns(tok, plans: list[list[str]]) -> list[int]:
    """Tokens of each conversation's first turn, the system message and its first problem (what --protect-prompt
    keeps)."""
    return [len(first_turn(tok, p[0])) for p in plans]


def check_first_turns(lens: list[int], args, limit: int):
    """Refuse, naming the numbers, a conversation whose first turn and answer do not fit. Past the model's `limit`
    positions only fewer conversations (they open with the shortest problems) or shorter answers help; below it, a
    larger --min-tokens, which sizes the traces' cache."""
    first, M = max(lens), args.max_new_tokens
    need = first + M
    if need > limit:
        fits = sum(n + M <= limit for n in lens)
        fixes = [f"lower --n to {fits} (conversations open with the shortest problems)"] if fits else []
        fixes += [f"lower --max-new-tokens to {limit - first}"] if first < limit else []
        fix = " or ".join(fixes) or "no problem of this file is short enough; pass shorter ones"
        raise UsageError(f"{args.data}: a conversation's first turn is {first} tokens (the system message and its "
                         f"problem), {need} with its answer (--max-new-tokens {M}), past the model's {limit} "
                         f"positions: {fix}")
    if need > trace_cap(args):
        raise UsageError(f"{args.data}: a conversation's first turn is {first} tokens, {need} with its answer "
                         f"(--max-new-tokens {M}), past the traces' cache of {trace_cap(args)} (--min-tokens + 2 x "
                         f"--max-new-tokens + 1024): raise --min-tokens to at least {first - M - 1024}")


def conversation_plans(tok, questions: list[str], n: int) -> list[list[str]]:
    """n conversations: each opens with one of the n shortest problems, so that its first turn (what
    --protect-prompt keeps) fits a small K - r; then the other problems follow, dealt round-robin in file order,
    as many as each conversation needs. Each conversation is independent of the others and of the batch size."""
    order = sorted(range(len(questions)), key=lambda i: (len(tok.encode(questions[i])), i))
    openers, rest = order[:n], sorted(order[n:])
    return [[questions[openers[c]]] + [questions[i] for i in rest[c::n]] for c in range(n)]


def first_turn(tok, question: str) -> list[int]:
    """A conversation's first turn: the system message and one problem (what --protect-prompt keeps)."""
    return turn_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], "")[0]


@torch.inference_mode()
def long_answers(model, tok, questions: list[str], args) -> list[dict]:
    """Long-trace fidelity's traces (--long T): one problem each, answered greedily with the full cache (up to
    --max-new-tokens), taken in file order, --batch-size problems at a time, keeping the answers that run to at least T
    tokens until --n are found. Where a reasoning trace is long, not where several short ones are packed."""
    out = []
    for i in range(0, len(questions), args.batch_size):
        prompts = [first_turn(tok, q) for q in questions[i : i + args.batch_size]]
        run = make_run("full", None, args.buffer, None, [len(p) for p in prompts])
        for p, a in zip(prompts, generate(model, prompts, run, args.max_new_tokens, eos_ids=tok.eos_ids)[0]):
            a = a[:-1] if a[-1] in tok.eos_ids else a  # the end token is the template's, as in pack_conversations
            if len(a) >= args.long:
                out.append({"ids": p + a, "prompt_len": len(p), "spans": [(len(p), len(p) + len(a))]})
        if len(out) >= args.n:
            return out[: args.n]
    fix = f"lower --n to {len(out)} or --long" if out else "lower --long"
    raise UsageError(f"{len(out)} of the {len(questions)} problems in {args.data} have greedy answers of --long "
                     f"{args.long} tokens or more (up to --max-new-tokens {args.max_new_tokens}): {fix}, or pass more "
                     "or harder problems")


@torch.inference_mode()
def pack_conversations(model, tok, plans: list[list[str]], args) -> list[dict]:
    """Greedy full-cache conversations, one batch row each: problem, answer, next problem, ... until the row holds
    --min-tokens. Rows decode together; a row whose answer ends feeds its next problem's turn in the same step as
    the others' next token. Returns per conversation its ids, prompt length (first turn) and the answer spans."""
    cap = trace_cap(args)
    run = make_run("full", None, args.buffer, None, [1] * len(plans))
    cache = make_cache(model, run, cap)
    convs = [{"messages": [{"role": "system", "content": SYSTEM}], "text": "", "ids": [], "spans": [],
              "todo": list(p), "answer": []} for p in plans]

    def next_turn(c) -> list[int] | None:  # the next problem's turn, added to the conversation; None = it is done
        if len(c["ids"]) >= args.min_tokens or not c["todo"]:
            return None
        c["messages"].append({"role": "user", "content": c["todo"].pop(0)})
        new, c["text"] = turn_ids(tok, c["messages"], c["text"])
        if len(c["ids"]) + len(new) + args.max_new_tokens > cap:  # the conversation ends here
            assert c["ids"], "a first turn that does not fit is refused before packing (check_first_turns)"
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


# -----------------------------------------------------------------------------
# reasoning traces that another model wrote, with their sentences


def token_spans(tok, text: str, ids: list[int], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token ranges [a, b) of character spans [start, end) of text, whose tokens are ids. A token belongs to the span
    that holds its last byte: byte-level BPE glues a word to the space before it (" The"), and a character that spans
    tokens (a multi-byte one) is counted where it ends. A span that holds no token's last byte gets (a, a).
    e.g. text "Hé. Go!" tokenized ["H", "é", ".", " Go", "!"] (bytes 0, 1-2, 3, 4-6, 7), spans [(0, 3), (3, 7)]
    -> [(0, 3), (3, 5)]: " Go" ends inside the second sentence, so it is the second's."""
    ends, n = [], 0  # the byte offset just past each token's last byte
    for piece in tok.token_bytes(ids):
        n += len(piece)
        ends.append(n)
    if n != len(text.encode()):
        raise ModelError("the tokens do not spell the trace's text (a tokenizer that normalizes it): the sentences "
                         "cannot be mapped to positions")
    out, t = [], 0
    for start, end in spans:
        a, b = len(text[:start].encode()), len(text[:end].encode())
        while t < len(ends) and ends[t] <= a:  # tokens that end before this span: an earlier span's, or a gap's
            t += 1
        first = t
        while t < len(ends) and ends[t] <= b:
            t += 1
        out.append((first, t))
    return out


def read_traces(path: str) -> list[dict]:
    """Rows of a reasoning-traces jsonl (data/README.md): `id`, `problem`, `trace`, optionally `chunks` with `start`,
    `end` (characters of `trace`) and `importance`; one-line errors naming the line."""
    rows = []
    for i, row in jsonl(path, "--traces file", "the shipped traces: data/reasoning_traces.jsonl"):
        bad = [k for k in ("id", "problem", "trace") if not isinstance(row.get(k) if isinstance(row, dict) else None,
                                                                         str) or not row[k].strip()]
        if bad:
            raise UsageError(f"{path} line {i}: missing or empty field '{bad[0]}' (a string)")
        for c in row.get("chunks") or []:
            if not (isinstance(c, dict) and all(isinstance(c.get(k), int) for k in ("start", "end"))
                    and 0 <= c["start"] <= c["end"] <= len(row["trace"])
                    and isinstance(c.get("importance"), (int, float))):
                raise UsageError(f"{path} line {i}: a chunk needs integer 'start' <= 'end' within the trace and a "
                                 "numeric 'importance'")
        rows.append(row)
    if not rows:
        raise UsageError(f"--traces {path} holds no traces")
    return rows


def reasoning_traces(tok, path: str, n: int, min_tokens: int | None, loops: bool, skip: int = 0) -> list[dict]:
    """The first n traces of the file with at least min_tokens tokens, after the first `skip` of them (a study's next
    block), read by tok: the problem as the user's turn, rendered by the model's chat template, then the trace as the
    assistant's answer. A trace that loops (tasks.is_loop) is left out and named, unless loops. Each keeps its
    sentences' token positions and importance."""
    out, looped = [], []
    for row in read_traces(path):
        prompt = tok.encode(tok.chat([{"role": "user", "content": row["problem"]}]))
        said = tok.encode(row["trace"])
        if min_tokens and len(said) < min_tokens:
            continue
        if not loops and is_loop(said):
            looped.append(row["id"])
            continue
        P = len(prompt)
        chunks = row.get("chunks") or []
        spans = token_spans(tok, row["trace"], said, [(c["start"], c["end"]) for c in chunks])
        out.append({"id": row["id"], "ids": prompt + said, "prompt_len": P, "spans": [(P, P + len(said))],
                    "sentences": [(P + a, P + b) for a, b in spans],
                    "importance": [float(c["importance"]) for c in chunks]})
        if len(out) == skip + n:
            break
    if looped:
        print(f"note: {len(looped)} looping trace(s) left out (--loops keeps them): {', '.join(looped)}")
    if len(out) < skip + n:
        raise UsageError(f"{path} has {len(out)} traces of --long {min_tokens or 0} tokens or more that do not loop, "
                         f"not --skip {skip} + --n {n}: lower --n, --skip or --long")
    return out[skip:]


TOP_SHARE = 0.1  # the most important sentences: the top 10 % of a trace's, by |importance|
AFTER = 32  # the positions after an important sentence whose KL is measured apart from the rest


def top_sentences(importance: list[float]) -> list[int]:
    """The indices of a trace's most important sentences: the top TOP_SHARE of them (at least one) by |importance|,
    since a sentence whose resampling moves accuracy either way matters."""
    imp = torch.tensor(importance).abs()
    return imp.topk(max(1, round(TOP_SHARE * len(imp)))).indices.tolist()


def sentence_share(run, trace: dict) -> list[dict]:
    """Watch run's evictions on a trace with labelled sentences. After each round, per layer (a mean over KV heads),
    of the trace tokens fed so far: `top`, the share of the top sentences' tokens held; `all`, the share of all of
    them held; `rho`, the rank correlation between a fully fed sentence's |importance| and the share of it held (NaN
    with fewer than 5 such sentences or no spread). Returns the list each round appends to."""
    P, T = trace["prompt_len"], len(trace["ids"])
    imp = torch.tensor(trace["importance"]).abs()  # a sentence whose resampling moves accuracy either way matters
    n = len(imp)
    sent = torch.full((T + 1,), n, dtype=torch.long)  # position -> its sentence; n: none (prompt, gaps, free slots)
    for s, (a, b) in enumerate(trace["sentences"]):
        sent[a:b] = s
    top = torch.zeros(n + 1, dtype=torch.bool)
    top[top_sentences(trace["importance"])] = True
    is_top = top[sent]  # [T + 1] position in a top sentence
    lens = torch.bincount(sent[:T], minlength=n + 1)[:n]  # tokens per sentence
    ends = torch.tensor([b for _, b in trace["sentences"]])
    rounds, prev = [], run.watch

    def watch(cache, b, when, scores):
        if prev:
            prev(cache, b, when, scores)
        if when != "after":
            return
        fed = cache.next_pos[b]  # positions < fed have gone through the model
        pos = cache.head_pos(b).clamp(max=T)  # [L, H_kv, S]; a free slot (FREE) reads as position T: no sentence
        held_all = ((pos >= P) & (pos < T)).sum(-1).double().mean(-1) / (fed - P)  # [L]
        fed_top = is_top[:fed].sum()
        held_top = is_top[pos].sum(-1).double().mean(-1) / fed_top if fed_top else torch.full_like(held_all, nan)
        L, H = pos.shape[:2]
        ones = torch.ones(pos.shape, dtype=torch.double)
        counts = torch.zeros(L, H, n + 1, dtype=torch.double).scatter_add_(-1, sent[pos], ones)  # slots per sentence
        done = (ends <= fed) & (lens > 0)  # sentences fed whole
        frac = (counts[..., :n] / lens.clamp(min=1)).mean(1)[:, done]  # [L, sentences fed] share of each held
        rho = [spearman(imp[done], f) for f in frac] if done.sum() >= 5 else [nan] * L
        rounds.append({"fed": fed, "top": held_top.tolist(), "all": held_all.tolist(), "rho": rho})

    run.watch = watch
    return rounds


def sentence_summary(trace: dict, rounds: list[dict], at: torch.Tensor, kl_at: torch.Tensor) -> dict:
    """One trace's sentence measures: per layer, `top`, `all` and `rho` averaged over the rounds (NaN-free ones);
    their means over layers; and the mean KL of the AFTER predictions that follow a top sentence (`kl_after`) against
    the other predictions (`kl_else`), both counted from the first eviction on (before it every policy is the full
    cache). No rounds (the trace never filled the budget): every field None."""
    if not rounds:
        return {k: None for k in ("top", "all", "rho", "kl_after", "kl_else", "top_by_layer", "all_by_layer",
                                  "rho_by_layer")}
    per = {k: torch.tensor([r[k] for r in rounds], dtype=torch.double).nanmean(0) for k in ("top", "all", "rho")}
    top = top_sentences(trace["importance"])
    said = at + 1  # the token each prediction is scored on
    after = torch.zeros(len(at), dtype=torch.bool)
    for s in top:
        end = trace["sentences"][s][1]
        after |= (said >= end) & (said < end + AFTER)
    late = said >= rounds[0]["fed"]
    mean = lambda m: kl_at[m].mean().item() if m.any() else None
    out = {k: v.nanmean().item() for k, v in per.items()}
    out = {k: None if v != v else v for k, v in out.items()}  # NaN (no defined round) -> None, JSON-safe
    return {**out, "kl_after": mean(after & late), "kl_else": mean(~after & late),
            **{f"{k}_by_layer": [None if x != x else round(x, 6) for x in v.tolist()] for k, v in per.items()}}


def targets(trace: dict) -> torch.Tensor:
    """Positions whose logits predict a generated token: each span [a, b) is predicted from a - 1 ... b - 2."""
    return torch.tensor([t - 1 for a, b in trace["spans"] for t in range(a, b)])


@torch.inference_mode()
def replay(model, ids: list[int], run, start: int = 0, most: int | None = None):
    """Teacher-force ids through run's cache on the generation cadence; logits [T - start, V] from `start`. most (a
    long trace): at most this many tokens a forward pass (the full cache's replay is otherwise one pass, whose
    activations take gigabytes), and the logits kept in the model's dtype, in which they were computed (a 7k-token
    trace's: 2.2 GB in bf16, not 4.4 in fp32)."""
    cache = make_cache(model, run, len(ids))
    x = torch.tensor([ids], device=model.device)
    if start:
        feed(model, cache, x[:, :start], run, most=most)
    dtype = model.model.norm.weight.dtype if most else None
    return feed(model, cache, x[:, start:], run, all_logits=True, most=most, dtype=dtype)[0]


def compare(ref: torch.Tensor, logits: torch.Tensor, nxt: torch.Tensor, rows: int = 4, at: bool = False) -> dict:
    """Sums over positions of KL(p || q), top-1 agreement, and log p - log q of the trace's own next token nxt [N, 1],
    where p and q are the softmaxes of the full cache's logits ref and a policy's logits, both [N, V]; a few positions
    at a time: a long trace's log-probs over a 152k vocabulary are gigabytes, and 4 rows of them (2.4 MB) stay in the
    CPU's cache through the passes below (a 2,048-token trace: 0.5 s, against 3.4 s at 256 rows). at: also "kl_at",
    each position's KL [N]."""
    kl = top1 = gap = 0.0
    each = []
    for s in range(0, len(ref), rows):
        p, q = (x[s : s + rows].float().log_softmax(-1) for x in (ref, logits))
        each.append((p.exp() * (p - q)).sum(-1))  # [rows]
        kl += each[-1].sum().item()
        top1 += (p.argmax(-1) == q.argmax(-1)).sum().item()
        gap += (p.gather(1, nxt[s : s + rows]) - q.gather(1, nxt[s : s + rows])).sum().item()
    return {"kl": kl, "top1": top1, "gap": gap, **({"kl_at": torch.cat(each)} if at else {})}
