"""
How much nanokv's departures from TriAttention's code move its kept sets, on the default model's keys over
1,100 tokens of MATH-500 text (K = 512, r = 64, a 64-token prompt): the z-score over the candidates against the
authors' over every non-prompt slot (the buffer included), and the calibration's length. `python
tools/triattention_departures.py` (about a minute on a CPU).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from cli import load
import generate as G, policies as P, triattention as TA

model, tok = load(None, "cpu", "float32")
cfg = model.cfg
ids = TA.calibration_ids(tok, cfg.vocab_size, 4096)
trace = ids[-1100:]  # text the calibration below does not see
run = G.make_run("full", None, 64, None, 1)
cache = G.make_cache(model, run, len(trace))
with torch.inference_mode():
    G.feed(model, cache, torch.tensor([trace]), run)
S, prompt, r, K = cache.length[0], 64, 64, 512
keep = K - prompt - r
pos = cache.pos[0, :, :, :S]
def kept(stats, cand_for_z):
    out = []
    for l in range(cfg.num_hidden_layers):
        keys = cache.k[l, :, :, :S]
        s = TA.head_scores(stats, l, keys, torch.tensor([S]))
        cand = cand_for_z.repeat_interleave(cfg.n_rep, 1)
        out.append(TA.zscore(s, cand).view(1, cfg.num_key_value_heads, -1, S).amax(2))
    v = torch.stack(out).mean(0)
    protected = (pos < prompt) | (torch.arange(S) >= S - r)
    return P.top_candidates(v, protected, keep)
def jac(a, b):
    return ((a & b).sum(-1) / (a | b).sum(-1)).flatten().tolist()
full = TA.calibrate(model, ids[:2048])
nanokv_cand = ~((pos < prompt) | (torch.arange(S) >= S - r))
authors_cand = ~(pos < prompt)
a = kept(full, nanokv_cand)
print("z-score over the candidates vs over every non-prompt slot (buffer included): Jaccard per KV head",
      [round(x, 3) for x in jac(a, kept(full, authors_cand))])
for n in (256, 1024):
    print(f"calibration on {n} tokens vs 2048: Jaccard per KV head",
          [round(x, 3) for x in jac(a, kept(TA.calibrate(model, ids[:n]), nanokv_cand))])
rnd = P.top_candidates(torch.rand(1, cfg.num_key_value_heads, S, generator=torch.Generator().manual_seed(0)),
                       (pos < prompt) | (torch.arange(S) >= S - r), keep)
print("random's kept set vs triattention's (chance level): Jaccard per KV head", [round(x, 3) for x in jac(a, rnd)])
