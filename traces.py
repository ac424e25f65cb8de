"""
The fidelity traces: conversations that the full cache writes itself and that eval then teacher-forces through each
compressed cache. A small instruct model answers a MATH problem in a few hundred tokens, so each trace packs several:
a short system message, problem, greedy full-cache answer, next problem, ... until it holds --min-tokens. `replay`
feeds a token sequence through a cache on the generation cadence (one chunk per eviction), which is what fidelity,
the probes and the output perturbation measure on.

Left out: sampled traces, and a reasoning model's own long chains of thought (run eval.py with such a model instead).
"""

import torch
from tqdm import tqdm

from cli import UsageError
from generate import feed, generate, make_cache, make_run
from model import ModelError

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


def compare(ref: torch.Tensor, logits: torch.Tensor, nxt: torch.Tensor, rows: int = 4) -> dict:
    """Sums over positions of KL(p || q), top-1 agreement, and log p - log q of the trace's own next token nxt [N, 1],
    where p and q are the softmaxes of the full cache's logits ref and a policy's logits, both [N, V]; a few positions
    at a time: a long trace's log-probs over a 152k vocabulary are gigabytes, and 4 rows of them (2.4 MB) stay in the
    CPU's cache through the passes below (a 2,048-token trace: 0.5 s, against 3.4 s at 256 rows; issue 53)."""
    kl = top1 = gap = 0.0
    for s in range(0, len(ref), rows):
        p, q = (x[s : s + rows].float().log_softmax(-1) for x in (ref, logits))
        kl += (p.exp() * (p - q)).sum().item()
        top1 += (p.argmax(-1) == q.argmax(-1)).sum().item()
        gap += (p.gather(1, nxt[s : s + rows]) - q.gather(1, nxt[s : s + rows])).sum().item()
    return {"kl": kl, "top1": top1, "gap": gap}
