"""
nanokv against transformers on the same GGUF: an independent check of weights.py's conversion, and decode speed.

    pip install transformers accelerate      # not nanokv requirements, not in CI
    python tools/compare_transformers.py parity --model qwen2.5-coder-1.5b
    python tools/compare_transformers.py speed --model qwen2.5-coder-1.5b --runs 3

transformers reads the GGUF that weights.py converts (`from_pretrained(dir, gguf_file=...)`), dequantizes it to
fp32 with its own code and builds its own tokenizer from the header, so nothing of nanokv's is shared but the file.
`parity` compares the rendered chat template, the token ids of a mixed text, the logits of every position of a chat
and 64 greedy tokens. `speed` decodes the same prompts with the full cache in both, at batch 1 and 16, each run in
a fresh process, alternating, as a kvpress user would run transformers' own `generate`.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

MIXED = ("The quick brown fox, 12345 and 3.14159; 你好，世界！数学题：一共有多少个苹果？ 🚀🤖👩‍💻 "
         "def f(x):\n    return x ** 2  # square\n\n\n\tint main() { return 0; }\n   spaces   and\r\n"
         "newlines\n\n\n<|im_start|>user 2024-12-01 $1,234.56 Ünïcödé naïve café")
CHAT = [
    {"role": "system", "content": "You are a careful math tutor. Explain every step."},
    {"role": "user", "content": "A train leaves at 09:40 and arrives at 13:15. It travels 287 km. What is its average "
     "speed in km/h? Show the steps."},
    {"role": "assistant", "content": "The trip lasts from 09:40 to 13:15, which is 3 hours and 35 minutes, or "
     "3 + 35/60 = 3.5833 hours. The average speed is distance over time: 287 / 3.5833 = 80.09 km/h. So the train "
     "averages about 80.1 km/h. Checking: 80.09 × 3.5833 ≈ 287.0 km, which matches the distance."},
    {"role": "user", "content": "Now a second train covers the same 287 km at 95 km/h, leaving at 10:05. Which train "
     "arrives first, and by how many minutes? Write the final answer in \\boxed{}."},
]
STEPS = 64  # greedy tokens compared; also the decode steps timed by `speed`


def gguf_and_dir(name: str) -> tuple[Path, Path]:
    """The verified GGUF (downloaded and joined again if weights.py already deleted it) and its converted dir."""
    from weights import download_gguf, model_dir

    return download_gguf(name), model_dir(name)


def load_transformers(gguf: Path, batch: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32").eval()
    return model, tok


def parity(args):
    import torch

    from cli import load
    from generate import feed, generate, make_cache, make_run

    gguf, path = gguf_and_dir(args.model)
    model, tok = load(str(path), "cpu", "float32")
    hf, hf_tok = load_transformers(gguf)
    ok = True

    def check(what: str, good: bool, detail: str):
        nonlocal ok
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {what}: {detail}")

    text = tok.chat(CHAT)
    hf_text = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    check("chat template", text == hf_text, f"{len(text)} characters, identical" if text == hf_text else
          f"first difference at character {next(i for i, (a, b) in enumerate(zip(text + '#', hf_text)) if a != b)}")
    ids, hf_ids = tok.encode(MIXED), hf_tok.encode(MIXED, add_special_tokens=False)
    check("token ids, mixed text", ids == hf_ids, f"{len(ids)} ids" + ("" if ids == hf_ids else f" vs {len(hf_ids)}"))
    check("decode round trip", tok.decode(ids) == MIXED, "nanokv decodes the ids back to the text")

    chat_ids = tok.encode(text)
    with torch.inference_mode():
        ref = hf(torch.tensor([chat_ids])).logits[0].float()  # [T, V]
        run = make_run("full", None, 64, None, len(chat_ids))
        ours = feed(model, make_cache(model, run, len(chat_ids)), torch.tensor([chat_ids]), run, all_logits=True)[0]
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    check(f"logits on {len(chat_ids)} chat tokens", rel <= 1e-4 and len(chat_ids) >= 200, f"max relative error {rel:.2e}")

    out = generate(model, [chat_ids], make_run("full", None, 64, None, len(chat_ids)), STEPS)[0][0]  # no end token
    with torch.inference_mode():
        hf_out = hf.generate(torch.tensor([chat_ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             attention_mask=torch.ones(1, len(chat_ids), dtype=torch.long))[0, len(chat_ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(out, hf_out)) if a != b), min(len(out), len(hf_out)))
    check(f"{STEPS} greedy tokens", out == hf_out, f"{same} identical" + ("" if out == hf_out else
          f"; nanokv: {tok.decode(out[same:same + 8])!r} transformers: {tok.decode(hf_out[same:same + 8])!r}"))
    print(f"greedy answer: {tok.decode(out)!r}")
    sys.exit(0 if ok else 1)


# -----------------------------------------------------------------------------
# speed: full-cache greedy decode, batch 1 and B, each run in its own process, alternating


def prompts(tok_encode, chat, B: int) -> list[list[int]]:
    from tasks import DATA, load_data

    rows = load_data(str(DATA / "gsm8k_test.jsonl"))[:B]
    return [tok_encode(chat([{"role": "user", "content": r["question"]}])) for r in rows]


def one_run(which: str, name: str, B: int) -> float:
    """Decode tokens/s (all rows) of STEPS greedy steps after the prefill, in this process."""
    import torch

    if which == "nanokv":
        from generate import generate, load, make_run

        model, tok = load(name, "cpu", "float32")
        ps = prompts(tok.encode, tok.chat, B)
        _, _, t = generate(model, ps, make_run("full", None, 64, None, [len(p) for p in ps]), STEPS + 1)
        return B * STEPS / t["decode_s"]
    torch.set_num_threads(int(os.environ.get("NANOKV_TF_THREADS", os.cpu_count())))
    model, tok = load_transformers(gguf_and_dir(name)[0])
    tok.padding_side = "left"  # transformers' batched generate wants the prompts aligned at their ends
    chat = lambda m: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
    ps = prompts(lambda s: tok.encode(s, add_special_tokens=False), chat, B)
    batch = tok.pad({"input_ids": ps}, return_tensors="pt")
    kw = dict(do_sample=False, pad_token_id=tok.pad_token_id or 0, **batch)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(max_new_tokens=1, min_new_tokens=1, **kw)  # the prefill alone
        t1 = time.perf_counter()
        model.generate(max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, **kw)
        t2 = time.perf_counter()
    return B * STEPS / ((t2 - t1) - (t1 - t0))  # decode time: the whole run less a prefill


def speed(args):
    print(f"full cache, greedy, {STEPS} decode steps after a prefill of GSM8K prompts; each run a fresh process")
    print("| batch | run | transformers tok/s | nanokv tok/s | nanokv ÷ transformers |\n|---|---|---|---|---|")
    for B in args.batch_sizes:
        for i in range(args.runs):
            order = ["transformers", "nanokv"] if i % 2 == 0 else ["nanokv", "transformers"]  # who goes first alternates
            got = {}
            for which in order:
                p = subprocess.run([sys.executable, __file__, "one", "--which", which, "--model", args.model,
                                    "--batch", str(B)], capture_output=True, text=True)
                if p.returncode:
                    sys.exit(f"error: the {which} run failed:\n{p.stderr[-2000:]}")
                got[which] = float(p.stdout.split()[-1])
            print(f"| {B} | {i + 1} | {got['transformers']:.2f} | {got['nanokv']:.2f} | "
                  f"{got['nanokv'] / got['transformers']:.2f} |", flush=True)


def main():
    # no prefixes of flags, as cli.Parser; a subcommand's parser needs it too (its class is plain argparse's)
    ap = argparse.ArgumentParser(description="nanokv against transformers on the same GGUF: parity and speed.",
                                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("parity", "speed", "one"):
        p = sub.add_parser(name, allow_abbrev=False)
        p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a model name weights.py knows")
    sub.choices["speed"].add_argument("--runs", type=int, default=3, help="alternating pairs per batch size")
    sub.choices["speed"].add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    sub.choices["one"].add_argument("--which", choices=["nanokv", "transformers"])
    sub.choices["one"].add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("error: transformers is not installed: pip install transformers accelerate (not a nanokv requirement)")
    if args.cmd == "one":
        print(f"{one_run(args.which, args.model, args.batch):.3f}")
    else:
        (parity if args.cmd == "parity" else speed)(args)


if __name__ == "__main__":
    main()
