"""
The first N problems of a data file whose prompt fits a protected budget, as a data file of their own:

    python tools/short_prompts.py --model qwen2.5-coder-1.5b --data data/gsm8k_test.jsonl --max-prompt 144 --n 100 \\
        --out results/study/gsm8k_fit144.jsonl

With --protect-prompt every prompt must fit K - r (generate.make_run refuses a batch where one does not), so the
longest prompt sets the tightest budget a sweep can run at: 172 tokens among GSM8K's first 100 problems, K >= 188 at
r = 16. A budget curve that reaches below that runs every budget on the problems whose prompt (eval.ask: the question,
the instruction and the chat template) is at most --max-prompt tokens, taken in file order; each line is copied as it
is, so the rows name the new file by its content.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

from cli import Parser, UsageError  # noqa: E402
from eval import ask  # noqa: E402
from tasks import load_data  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from weights import SetupError, model_dir  # noqa: E402


def main(argv=None):
    ap = Parser(description="Write the first --n problems of --data whose prompt is at most --max-prompt tokens.")
    ap.add_argument("--model", required=True, help="a name weights.py knows, or a model directory (its tokenizer)")
    ap.add_argument("--data", required=True, help="a jsonl data file")
    ap.add_argument("--max-prompt", type=int, required=True, help="the longest prompt kept, in tokens")
    ap.add_argument("--n", type=int, required=True, help="problems to keep")
    ap.add_argument("--out", required=True, help="the jsonl file to write")
    args = ap.parse_args(argv)
    try:
        path = Path(args.model) if Path(args.model).is_dir() else model_dir(args.model, fetch=False)
        tok = Tokenizer(path)
        rows = load_data(args.data)
        text = Path(args.data).read_text(encoding="utf-8")
        lines = [line for line in text.split("\n") if line.strip()]  # at \n only, as load_data
        fit = [i for i, r in enumerate(rows) if len(ask(tok, r["question"])) <= args.max_prompt][: args.n]
        if len(fit) < args.n:
            raise UsageError(f"{args.data} has {len(fit)} problems with prompts of at most {args.max_prompt} tokens, "
                             f"fewer than --n {args.n}: raise --max-prompt or lower --n")
        Path(args.out).write_text("".join(lines[i] + "\n" for i in fit), encoding="utf-8")
        print(f"{args.out}: problems {fit[0]}-{fit[-1]} of {args.data} less {fit[-1] + 1 - len(fit)} with longer "
              f"prompts ({', '.join(str(i) for i in range(fit[-1]) if i not in fit)})")
    except (UsageError, SetupError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
