"""
The time of one eviction round (score every layer, then cache.evict) alone, per policy, at the attention
shapes of Qwen2.5-Coder-1.5B (28 layers, 12 / 2 heads, head dim 128, bf16 cache) with K + r slots held at synthetic
positions that end at --context. No weights are loaded: the model has the 1.5B's attention shapes and a token MLP, the
scorers read only the cache (TriAttention gets random query statistics: its cost does not depend on their values).
The per-step observers (h2o, scissorhands, raas) are timed apart: their cost is paid every decode step, not per round.
`eval.py bench` measures the same rounds inside decoding, with the share of a step; this isolates them, side by side
in one process. `python tools/evict_cost.py --batch 1 --context 16384`
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import torch  # noqa: E402

import generate as G  # noqa: E402
import triattention as TA  # noqa: E402
from cli import cpu_info  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="random,snapkv,triattention,triattention-layer,curdkv,lagkv,scissorhands,raas")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--context", type=int, default=16384, help="the newest held position + 1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per policy (after one untimed)")
    args = ap.parse_args()
    cfg = ModelConfig(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                      num_hidden_layers=28, intermediate_size=64, vocab_size=256, rope_theta=1e6,
                      max_position_embeddings=32768)
    torch.manual_seed(0)
    model = Transformer(cfg, "cpu", torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    B, K, r, C = args.batch, args.budget, args.buffer, args.context
    S, prompt = K + r, 64
    info = cpu_info()
    print(f"# {info['cpu']} {info['capability']}, torch threads {torch.get_num_threads()}, B={B} K={K} r={r} "
          f"context {C}")
    print("policy,round_ms,observe_ms_per_step")
    for name in args.policies.split(","):
        run = G.make_run(name, K, r, None, [prompt] * B)
        if run.policy.prepare:  # random statistics of the right shape: the cost does not depend on them
            F_ = cfg.head_dim // 2
            run.stats = TA.FreqStats(torch.randn(28, 12, F_, dtype=torch.complex64), torch.rand(28, 12, F_) + 1,
                                     model.inv_freq)
        cache = G.make_cache(model, run, C)
        pos = torch.cat([torch.arange(prompt), torch.linspace(prompt, C - r - 1, S - r - prompt).long(),
                         torch.arange(C - r, C)])  # [S] sorted, the newest r contiguous
        k0 = torch.randn(cfg.num_hidden_layers, B, 2, S, 128).bfloat16()
        v0 = torch.randn_like(k0)
        side0 = {n: torch.rand(cfg.num_hidden_layers, B, 2, S) for n in cache.side}

        def fill():
            cache.k[:, :, :, :S], cache.v[:, :, :, :S] = k0, v0
            cache.pos[:, :, :, :S] = pos
            for n, s in side0.items():
                cache.side[n][:, :, :, :S] = s
            cache.q_ring.normal_()
            cache.q_pos[:] = torch.arange(C - cache.q_pos.shape[1], C) if cache.q_pos.shape[1] else cache.q_pos
            cache.length, cache.next_pos = [S] * B, [C] * B
            for row in range(B):
                run.rounds[row] = 1

        times = []
        with torch.inference_mode():
            for i in range(args.rounds + 1):
                fill()
                t0 = time.perf_counter()
                G.evict_round(model, cache, run, 0, B)
                times.append(time.perf_counter() - t0)
            obs = float("nan")
            if run.policy.observe:  # one decode step's observation at S held slots
                fill()
                cache.length = [S - 1] * B
                cache.next_pos = [C - 1] * B
                out = model(torch.zeros(B, 1, dtype=torch.long), cache, collect=True)
                ts = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    run.policy.observe(cache, out, run)
                    ts.append(time.perf_counter() - t0)
                obs = sorted(ts)[len(ts) // 2] * 1e3
        med = sorted(times[1:])[len(times[1:]) // 2] * 1e3
        print(f"{name},{med:.2f},{obs:.2f}", flush=True)


if __name__ == "__main__":
    main()
