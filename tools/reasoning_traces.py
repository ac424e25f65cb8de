"""
Builds data/reasoning_traces.jsonl, reasoning that other models wrote, from clones of the two public repositories
that hold it (any clone that has the commits below; the checked-out branch does not matter):

    python tools/reasoning_traces.py THOUGHT_ANCHORS_CLONE SKYTHOUGHT_CLONE

Every file is read at a fixed commit (`git show COMMIT:PATH`) and the lines are written in a fixed order, so two runs
give the same bytes (data/README.md has the sha256). Thought Anchors (Bogdan et al., 2025,
https://arxiv.org/abs/2506.19143): 40 traces of two DeepSeek-R1 distills on 10 MATH problems, each one's thinking cut
into sentences with their counterfactual importance, function tags and dependencies. SkyThought: a fixed subset of
the Sky-T1 models' traces on AIME 2024, AMC 2023 and MATH-500, without labels (SKY_RULE). Every trace kept passes
tasks.is_loop. Token counts are the Qwen2.5 tokenizer's (the reading model's, whoever wrote the text).
"""

import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

from cli import Parser, UsageError, check_output  # noqa: E402
from config import ModelError  # noqa: E402
from tasks import DATA, is_loop, repeat_share  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

TA_URL = "https://github.com/interp-reasoning/thought-anchors.com"  # MIT
TA_COMMIT = "68acc04a666716c58273ae70837d4b80bf3e1c69"
SKY_URL = "https://github.com/NovaSky-AI/SkyThought"  # Apache-2.0
SKY_COMMIT = "f7bcf0b4e7d429e798a39524acd4a68031c905ba"
TA_DIR = "src/app/data"
TA_WRITERS = {  # folder -> (short name in the id, the model that wrote the traces)
    "deepseek-r1-distill-qwen-14b": ("r1-qwen-14b", "DeepSeek-R1-Distill-Qwen-14B"),
    "deepseek-r1-distill-llama-8b": ("r1-llama-8b", "DeepSeek-R1-Distill-Llama-8B"),
}
THINK = "<think>\n"  # where each Thought Anchors prompt ends: the writer's thinking starts after it
SKY_DIR = "skythought/Qwen2.5-Math/evaluation/outputs/home/ubuntu/skyov1-dl"
SKY_FILES = [  # (writer, set): the Sky-T1 outputs read, each {SKY_DIR}/{writer}/{set}_eval/{set}/test_Sky-T1_...jsonl
    ("Sky-T1-math-correct-5K-14B", "aime24"), ("Sky-T1-math-correct-5K-14B", "amc23"),
    ("Sky-T1-math-correct-5K-27B", "aime24"), ("Sky-T1-math-correct-5K-27B", "amc23"),
    ("Sky-T1-math-correct-5K-27B", "math500"),
    ("Sky-T1-math-wrong-5K-14B", "aime24"), ("Sky-T1-math-wrong-5K-14B", "amc23"),
    ("Sky-T1-math-wrong-5K-27B", "aime24"), ("Sky-T1-math-wrong-5K-27B", "amc23"),
]
SKY_END = "<|end_of_solution|>"  # a Sky-T1 trace that got this far finished its answer
SKY_MIN, SKY_LONG, SKY_EVERY = 2000, 6000, 5
SKY_RULE = (f"a trace is kept when it finished ({SKY_END}), has at least {SKY_MIN} tokens and is no loop; all of "
            f"{SKY_LONG} tokens or more, and of the shorter ones, sorted by writer, set and problem index, every "
            f"{SKY_EVERY}th from the first")


def git_show(clone: str, commit: str, path: str) -> bytes:
    """A file's bytes at a commit of a clone (bare or not)."""
    r = subprocess.run(["git", "-C", clone, "show", f"{commit}:{path}"], capture_output=True)
    if r.returncode:
        why = (r.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
        raise UsageError(f"{clone}: cannot read {path} at {commit[:12]} ({why}): use a full clone that has that commit")
    return r.stdout


def git_ls(clone: str, commit: str, path: str) -> list[str]:
    r = subprocess.run(["git", "-C", clone, "ls-tree", "-r", "--name-only", commit, path], capture_output=True,
                       text=True)
    return r.stdout.split()


def check_clone(clone: str, url: str, commit: str):
    """One line naming the fix when the folder is missing, is no git repository, or lacks the commit."""
    if not Path(clone).is_dir():
        raise UsageError(f"{clone} does not exist: clone {url} there first (git clone {url} {clone})")
    try:
        r = subprocess.run(["git", "-C", clone, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    except FileNotFoundError:
        raise UsageError("git is not installed: the rebuild reads the clones with it; install git") from None
    if r.returncode:
        raise UsageError(f"{clone} is not a clone of {url} holding commit {commit[:12]}: clone it into a new folder "
                         f"(git clone {url} DIR) and pass that")


# -----------------------------------------------------------------------------
# Thought Anchors: the traces and their labelled sentences


def chunk_spans(text: str, chunks: list[str]) -> tuple[list[tuple[int, int]], int]:
    """Each chunk's [start, end) character span in text, and how many chunks are text[start:end] verbatim. The
    chunker joined a sentence's pieces with one space where the trace had a line break, so we match the chunks in
    order with whitespace ignored, and require that only whitespace lies between one chunk and the next: the chunks
    tile the text. e.g. text "Correct.\\n\\n2. Then" with chunks ["Correct. 2.", "Then"] -> [(0, 12), (13, 17)], 1."""
    keep = [i for i, c in enumerate(text) if not c.isspace()]  # the text's index of each non-space character
    bare = "".join(text[i] for i in keep)
    spans, at, verbatim = [], 0, 0
    for k, chunk in enumerate(chunks):
        b = "".join(chunk.split())
        if not b or not bare.startswith(b, at):
            raise UsageError(f"chunk {k} ({chunk[:40]!r}...) is not the trace's next text, whitespace aside: the "
                             "source changed; check the commit")
        start, end = keep[at], keep[at + len(b) - 1] + 1
        spans.append((start, end))
        verbatim += text[start:end] == chunk
        at += len(b)
    return spans, verbatim


def thought_anchors(clone: str) -> tuple[list[dict], dict]:
    """The 40 traces, each with its chunks, and counts of how the chunks were mapped."""
    rows, mapped = [], {"chunks": 0, "verbatim": 0}
    names = git_ls(clone, TA_COMMIT, TA_DIR)
    for folder, (short, writer) in sorted(TA_WRITERS.items()):
        for kind in ("correct", "incorrect"):
            base = f"{TA_DIR}/{folder}/{kind}_base_solution/"
            problems = sorted({n[len(base):].split("/")[0] for n in names if n.startswith(base)},
                              key=lambda p: int(p.split("_")[1]))
            for p in problems:
                read = lambda f: json.loads(git_show(clone, TA_COMMIT, base + p + "/" + f))
                problem, solution = read("problem.json"), read("base_solution.json")
                chunks = read("chunks_labeled.json")
                # the writer saw its prompt end with <think>; full_cot is that prompt and the text it wrote
                if not solution["prompt"].endswith(THINK) or \
                        solution["full_cot"] != solution["prompt"] + solution["solution"]:
                    raise UsageError(f"{base + p}/base_solution.json: its prompt, full_cot and solution do not fit "
                                     "together as at the commit: check the clone")
                trace = THINK + solution["solution"]
                if [c["chunk_idx"] for c in chunks] != list(range(len(chunks))):
                    raise UsageError(f"{base + p}/chunks_labeled.json: chunks out of order: check the clone")
                try:
                    spans, verbatim = chunk_spans(solution["solution"], [c["chunk"] for c in chunks])
                except UsageError as e:
                    raise UsageError(f"{base + p}/chunks_labeled.json: {e}") from None
                mapped["chunks"] += len(chunks)
                mapped["verbatim"] += verbatim
                rows.append({
                    "id": f"ta/{short}/{kind}/{p}", "source": "thought-anchors", "writer": writer,
                    "problem": problem["problem"], "gold": problem["gt_answer"], "trace": trace,
                    "correct": solution["is_correct"],
                    # importance: the paper's counterfactual importance, the KL divergence between the answers of the
                    # resamples whose replacement sentence means something else and those of the resamples from the
                    # next sentence (analyze_rollouts.py); importance_accuracy: the same two groups' accuracy gap
                    "chunks": [{"start": s + len(THINK), "end": e + len(THINK),
                                "importance": c["counterfactual_importance_kl"],
                                "importance_accuracy": c["counterfactual_importance_accuracy"],
                                "tags": c["function_tags"], "depends_on": [int(d) for d in c["depends_on"]]}
                               for (s, e), c in zip(spans, chunks)],
                })
    if len(rows) != 40:
        raise UsageError(f"{clone}: found {len(rows)} Thought Anchors traces at {TA_COMMIT[:12]}, not 40: the clone "
                         "is incomplete; clone it again")
    return rows, mapped


# -----------------------------------------------------------------------------
# SkyThought: Sky-T1's traces, a fixed subset


def skythought(clone: str, tok: Tokenizer) -> tuple[list[dict], int]:
    """The kept traces (SKY_RULE), and how many traces were read."""
    pool, read = [], 0
    for writer, name in SKY_FILES:
        path = f"{SKY_DIR}/{writer}/{name}_eval/{name}/test_Sky-T1_-1_seed0_t0.0_s0_e-1.jsonl"
        for line in git_show(clone, SKY_COMMIT, path).decode("utf-8").split("\n"):  # not splitlines: see load_data
            if not line.strip():
                continue
            r = json.loads(line)
            read += 1
            trace = r["code"][0]
            ids = tok.encode(trace)
            if SKY_END not in trace or len(ids) < SKY_MIN or is_loop(ids):
                continue
            pool.append(((writer, name, int(r["idx"])), len(ids), {
                "id": f"sky/{writer}/{name}/{r['idx']}", "source": "skythought", "writer": writer,
                "problem": r["question"], "gold": r["gt"], "trace": trace, "correct": r["score"][0]}))
    pool.sort(key=lambda x: x[0])
    short = set([key for key, n, _ in pool if n < SKY_LONG][::SKY_EVERY])
    return [row for key, n, row in pool if n >= SKY_LONG or key in short], read  # in the pool's order


# -----------------------------------------------------------------------------


def build(ta: str, sky: str, tok: Tokenizer) -> tuple[bytes, list[dict], dict]:
    """The file's bytes, its rows (with their token ids) and what the build counted."""
    rows, mapped = thought_anchors(ta)
    sky_rows, read = skythought(sky, tok)
    out = []
    for row in rows + sky_rows:
        ids = tok.encode(row["trace"])
        share = repeat_share(ids)
        if is_loop(ids):
            raise UsageError(f"{row['id']} loops (repeat share {share:.3f}): the selection is broken")
        # fields in one order for every line: the file is compared byte for byte
        line = {k: row[k] for k in ("id", "source", "writer", "problem", "gold", "trace", "correct")}
        line.update(n_tokens=len(ids), repeat_share=round(share, 4))
        if "chunks" in row:
            line["chunks"] = row["chunks"]
        out.append((line, ids))
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line, _ in out)
    return text.encode("utf-8"), out, {**mapped, "sky_read": read}


def band(n: int) -> str:
    return "< 2,000" if n < 2000 else "2,000-5,999" if n < 6000 else "6,000-11,999" if n < 12000 else ">= 12,000"


def summary(out: list, counts: dict, tok: Tokenizer):
    """What the build gives, printed: counts by source and length band, median lengths, the loop check's values,
    the traces that do not survive decode(encode(text))."""
    print(f"chunks: {counts['chunks']}, {counts['verbatim']} verbatim, the rest with whitespace that differs; "
          f"SkyThought traces read: {counts['sky_read']}")
    for source in ("thought-anchors", "skythought"):
        lines = [(line, ids) for line, ids in out if line["source"] == source]
        n = [line["n_tokens"] for line, _ in lines]
        bands = {b: sum(band(k) == b for k in n) for b in ("< 2,000", "2,000-5,999", "6,000-11,999", ">= 12,000")}
        print(f"{source}: {len(n)} traces, tokens median {statistics.median(n):.0f}, {min(n)}-{max(n)}; by band "
              + ", ".join(f"{b}: {c}" for b, c in bands.items()) + f"; repeat share max "
              f"{max(line['repeat_share'] for line, _ in lines):.4f}, median "
              f"{statistics.median(line['repeat_share'] for line, _ in lines):.4f}")
        for writer in sorted({line["writer"] for line, _ in lines}):
            mine = [(line, ids) for line, ids in lines if line["writer"] == writer]
            bad = [line["id"] for line, ids in mine if tok.decode(ids) != line["trace"]]
            print(f"  {writer}: {len(mine)} traces, decode(encode(trace)) == trace for {len(mine) - len(bad)}"
                  + (f" (not: {', '.join(bad)})" if bad else ""))
    n = [line["n_tokens"] for line, _ in out]
    print(f"all: {len(n)} traces, {sum(k >= 2000 for k in n)} of >= 2,000 tokens, {sum(k >= 6000 for k in n)} of "
          f">= 6,000, median {statistics.median(n):.0f}")


def main(argv=None):
    from weights import MODEL_HOME, source_of

    ap = Parser(description="Build data/reasoning_traces.jsonl from clones of Thought Anchors' and SkyThought's "
                            "repositories (read at fixed commits).")
    ap.add_argument("thought_anchors", help=f"a clone of {TA_URL} (holding commit {TA_COMMIT[:12]})")
    ap.add_argument("skythought", help=f"a clone of {SKY_URL} (holding commit {SKY_COMMIT[:12]})")
    ap.add_argument("--out", default=str(DATA / "reasoning_traces.jsonl"),
                    help="the file to write (default: %(default)s)")
    ap.add_argument("--tokenizer", default=str(MODEL_HOME / source_of("qwen2.5-coder-1.5b").dirname),
                    help="the model folder whose tokenizer.json counts the tokens (default: the 1.5B's, %(default)s)")
    args = ap.parse_args(argv)
    try:
        check_output("--out", args.out)  # before a minute of reading
        check_clone(args.thought_anchors, TA_URL, TA_COMMIT)
        check_clone(args.skythought, SKY_URL, SKY_COMMIT)
        if not (Path(args.tokenizer) / "tokenizer.json").is_file():
            raise UsageError(f"no tokenizer.json in {args.tokenizer}: run 'python weights.py --model "
                             "qwen2.5-coder-1.5b' once, or pass --tokenizer DIR with a Qwen2.5 model folder")
        tok = Tokenizer(args.tokenizer)
        data, out, counts = build(args.thought_anchors, args.skythought, tok)
        Path(args.out).write_bytes(data)
    except (UsageError, ModelError) as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: cannot write {args.out} ({e.strerror}): pass --out with a writable path")
    summary(out, counts, tok)
    print(f"wrote {args.out}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
