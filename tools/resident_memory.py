"""
What a policy keeps resident, apart from what the C heap keeps of its freed transients: the model loaded, the heap
trimmed (bench.trim_heap) and the peak reset, then K + r random tokens and the first eviction round, then `--steps`
decode steps; after each, the resident set and its peak (/proc/self/status), and the resident set once more after a
trim. eval.py bench's peak_mb is the peak without a trim, so it also counts the freed transients glibc still holds,
a different amount run to run; the trimmed figure is what the policy holds. One policy a process (the peak never
goes down).

    python tools/resident_memory.py --policy criticalkv-ada     # the 1.5B in int4, K = 512, r = 64
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402
from cli import Parser, UsageError, local_model, policy_names  # noqa: E402
from generate import feed, make_cache, make_run  # noqa: E402


def status(field: str) -> int:
    """A /proc/self/status figure in MiB (VmRSS: resident now, VmHWM: its peak since bench.reset_peak)."""
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) // 1024


def main(argv=None):
    ap = Parser(description="A policy's resident memory, with and without the heap's freed transients.")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192, help="the cache's capacity (slots allocated)")
    ap.add_argument("--steps", type=int, default=70)
    args = ap.parse_args(argv)
    try:
        policy_names(args.policy, full=False)  # one line for a name that is not a policy
        if not Path("/proc/self/status").is_file():
            raise UsageError("this tool reads /proc/self/status: run it on Linux")
        model = bench.build_model(local_model(args.model), "cpu", "bfloat16", args.quant)
    except UsageError as e:
        sys.exit(f"error: {e}")
    torch.set_num_threads(1)
    bench.reset_peak("cpu")  # trims the heap first
    say = lambda what: print(f"{args.policy}: {what}: resident {status('VmRSS')} MiB, peak {status('VmHWM')} MiB")
    say("loaded, trimmed")
    run = make_run(args.policy, args.budget, args.buffer, True, [64], 0)
    cache = make_cache(model, run, args.context)
    ids = torch.randint(model.cfg.vocab_size, (1, args.budget + args.buffer), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = feed(model, cache, ids, run)  # K + r slots: the first round
        say("K + r tokens and the first round")
        bench.trim_heap()
        say("then trimmed")
        for _ in range(args.steps):
            logits = feed(model, cache, logits[:, -1].argmax(-1, keepdim=True), run)
    say(f"{args.steps} decode steps later")


if __name__ == "__main__":
    main()
