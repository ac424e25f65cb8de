"""
Whether a tree's uniform policies keep what another tree's keep (the per-head budgets were checked to change
nothing for them): every uniform policy, at its default protection, protected and unprotected, as a batch of three
prompts and as three single rows, greedy on the tests' tiny random model; the tokens and every round's kept positions
(`cache.pos` through `Run.watch`) go to one JSON file. Two trees that keep the same write identical files:

    git archive 8691234 | tar -x -C /tmp/old     # the code before per-head budgets
    python tools/uniform_unchanged.py /tmp/old /tmp/old.json
    python tools/uniform_unchanged.py . /tmp/new.json
    cmp /tmp/old.json /tmp/new.json
"""

import json
import sys
import tempfile

sys.path.insert(0, sys.argv[1])  # the tree under test: its generate, cache, policies and model

import generate as G  # noqa: E402
import policies as P  # noqa: E402
import test_all  # noqa: E402  (its tiny_dir writes the same random model in either tree)
from model import load_model  # noqa: E402

PROMPTS = [list(range(3, 13)), list(range(20, 47)), list(range(50, 55))]


def main():
    model = load_model(test_all.tiny_dir(tempfile.mkdtemp()))
    out = {}
    for name, policy in P.POLICIES.items():
        if getattr(policy, "per_head", False):
            continue
        for protect in (None, True, False) if name != "full" else (None,):
            protected = protect or (protect is None and policy.protect_prompt)
            for batch in ([PROMPTS], [[p] for p in PROMPTS]):
                for prompts in batch:
                    rounds = []

                    def watch(cache, b, when, scores):
                        if when == "after":
                            rounds.append((cache.rows[b], cache.pos[:, b, :, : cache.length[b]].tolist()))

                    budget = None if name == "full" else 40 if protected else 24  # a protected 27 tokens need 40
                    run = G.make_run(name, budget, 8, protect, [len(p) for p in prompts], seed=3)
                    run.watch = watch
                    ids, cache, _ = G.generate(model, prompts, run, 40)
                    final = cache.pos[:, :, :, : max(cache.length)].tolist()
                    out[f"{name}/{protect}/{len(prompts)}/{prompts[0][0]}"] = [ids, rounds, final]
    json.dump(out, open(sys.argv[2], "w"))
    print(f"{len(out)} runs written to {sys.argv[2]}")


if __name__ == "__main__":
    main()
