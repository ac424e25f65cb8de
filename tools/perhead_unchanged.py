"""
Whether a tree's per-head policies (adakv, criticalkv-ada) keep what another tree's keep: every round's kept
positions of every (layer, KV head) and the tokens, greedy, as a batch of four prompts, as four single rows and
refilled (two batch slots, four prompts), on the tests' tiny random model and on the 135M (fp32). Positions are read
per head, whatever the layout (`cache.head_pos` where the tree has it, else `cache.pos`), so a tree that lays the
heads out as one pool per layer compares with one that pads every head to the fullest. Two trees that keep the same
write identical files:

    git archive 63ee3c3 | tar -x -C /tmp/old      # the padded layout
    python tools/perhead_unchanged.py /tmp/old /tmp/old.json
    python tools/perhead_unchanged.py . /tmp/new.json
    cmp /tmp/old.json /tmp/new.json
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, sys.argv[1])  # the tree under test: its generate, cache, policies and model

import generate as G  # noqa: E402
import test_all  # noqa: E402  (its tiny_dir writes the same random model in either tree)
from cache import FREE  # noqa: E402
from model import load_model  # noqa: E402

SMALL = os.path.expanduser("~/.cache/nanokv/SmolLM2-135M-Instruct")
# (model, prompts, K, r, new tokens): the tiny model as the per-head tests run it; the 135M on token ids of its
# vocabulary, several rounds each
SETTINGS = [("tiny", [list(range(3, 13)), list(range(20, 47)), list(range(50, 55)), list(range(60, 78))], 24, 8, 60),
            ("135m", [list(range(1000 * i, 1000 * i + n)) for i, n in ((1, 30), (2, 47), (3, 12), (4, 19))], 64, 16, 120)]


def heads_of(cache, b) -> list:
    """[L][H_kv] the positions each head of batch row b holds, in order."""
    if hasattr(cache, "head_pos"):
        pos = cache.head_pos(b)  # [L, H_kv, S]
    else:
        pos = cache.pos[:, b, :, : cache.length[b]]
    return [[[p for p in h if p != FREE] for h in layer] for layer in pos.tolist()]


def main():
    out = {}
    for name, prompts, K, r, n in SETTINGS:
        if len(sys.argv) > 3 and name not in sys.argv[3:]:  # e.g. `tiny` alone: a quick check
            continue
        model = load_model(test_all.tiny_dir(tempfile.mkdtemp()) if name == "tiny" else SMALL)
        for policy in ("adakv", "criticalkv-ada"):
            for mode in ("batch", "alone", "refill"):
                # refill: two batch slots, rows ending at different steps (an end token taken from the rows' own
                # answers alone), so that rows join while the others are mid-round
                eos = () if mode != "refill" else (alone[0][n // 2], alone[2][3 * n // 4])
                for group in ([prompts] if mode != "alone" else [[p] for p in prompts]):
                    rounds = []

                    def watch(cache, b, when, scores):
                        if when == "after":
                            rounds.append((cache.rows[b], cache.next_pos[b], heads_of(cache, b)))

                    run = G.make_run(policy, K, r, False, [len(p) for p in group], seed=3)
                    run.watch = watch
                    if mode == "refill":
                        ids, _ = G.generate_refill(model, group, run, n, 2, eos_ids=eos)
                    else:
                        ids, _, _ = G.generate(model, group, run, n)
                    alone = ids if mode == "batch" else alone
                    out[f"{name}/{policy}/{mode}/{group[0][0]}"] = [ids, rounds]
                    print(name, policy, mode, len(rounds), "rounds", [len(i) for i in ids], flush=True)
    json.dump(out, open(sys.argv[2], "w"))
    print(f"{len(out)} runs written to {sys.argv[2]}")


if __name__ == "__main__":
    main()
