"""
Read what the grader read: decode chosen problems of an `eval.py accuracy` sweep again (full cache, greedy, the
sweep's prompt) and print the end of each answer beside what the grader extracted, the dataset's answer and the
verdict, so a person can check the grading by hand.

    python tools/show_answers.py --model qwen2.5-coder-1.5b --data data/gsm8k_test.jsonl --problems 0,1,2,3,4
    python tools/show_answers.py --model qwen2.5-coder-0.5b --data data/math500.jsonl --problems 0,5 \
        --max-new-tokens 1024 --row results/study/full_q05.json

With --row, each problem's extracted answer is also compared with the one the sweep's `full` row stored for it
(per_problem), which names any problem whose answer came out differently this time (the sweep decoded 16 rows at
a time; fp32 batches of another size can round differently).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

from cli import Parser, UsageError  # noqa: E402
from eval import answer_of, ask  # noqa: E402
from generate import generate, load, make_run  # noqa: E402
from model import ModelError  # noqa: E402
from results import model_key, tool_rows  # noqa: E402
from tasks import file_hash, is_correct, load_data  # noqa: E402


def stored(path: str, data: str, max_new_tokens: int, model: str | None) -> dict:
    """problem index -> the extracted answer the sweep's full-cache row holds (same model, data file and token limit),
    read through the sweeps' row checks (results.tool_rows); none such is one line."""
    rows = [r for r in tool_rows([path], {"accuracy": ("policy", "per_problem")}) if r["task"] == "accuracy"
            and r["policy"] == "full" and r.get("data_sha") == file_hash(data)
            and r.get("max_new_tokens") == max_new_tokens]
    same = [r for r in rows if r.get("model") == model_key(model)]
    if rows and not same:
        raise UsageError(f"--row {path}: its full-cache row of this --data and --max-new-tokens is another model's "
                         f"({rows[0].get('model')}): pass that --model")
    if not same:
        raise UsageError(f"--row {path} holds no full-cache accuracy row of this --data and --max-new-tokens: pass "
                         "the sweep's own")
    return {p["i"]: p["pred"] for p in same[0]["per_problem"]}


def main(argv=None):
    ap = Parser(description="Decode chosen problems again and show what the grader read.")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--problems", required=True, help="comma list of problem indices (0-based, in file order)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--tail", type=int, default=400, help="characters of each answer's end to print")
    ap.add_argument("--row", help="an accuracy result file whose full-cache row to compare with")
    args = ap.parse_args(argv)
    try:
        show(args)
    except (UsageError, ModelError) as e:
        sys.exit(f"error: {e}")


def show(args):
    rows = load_data(args.data)
    try:
        idx = [int(i) for i in args.problems.split(",")]
    except ValueError:
        idx = [-1]
    if min(idx) < 0 or max(idx) >= len(rows):
        raise UsageError(f"--problems takes indices 0 to {len(rows) - 1} of {args.data} (got {args.problems!r})")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    old = stored(args.row, args.data, args.max_new_tokens, args.model) if args.row else {}  # before the model loads
    model, tok = load(args.model, "cpu", "float32")
    prompts = [ask(tok, rows[i]["question"]) for i in idx]
    outs, _, _ = generate(model, prompts, make_run("full", None, 16, None, [len(p) for p in prompts]),
                          args.max_new_tokens, eos_ids=tok.eos_ids)
    for i, prompt, ids in zip(idx, prompts, outs):
        r, text = rows[i], tok.decode(ids)
        _, stop, pred = answer_of(tok, ids, r["answer"], prompt)
        gold = r["answer"].split("####")[-1].strip()
        print(f"\n=== problem {i}: {len(ids)} tokens, stopped at {stop} ===\n{r['question'][:300]}\n--- answer's end ---\n"
              f"...{text[-args.tail:]}\n--- extracted {pred!r} | dataset {gold!r} | "
              f"{'correct' if is_correct(pred, r['answer']) else 'wrong'}"
              + (f" | the sweep extracted {old[i]!r}" + (" (same)" if old[i] == pred else " (DIFFERS)") if i in old else ""))


if __name__ == "__main__":
    main()
