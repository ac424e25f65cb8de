"""
The CUDA check: run it once on a machine with a CUDA GPU, record its figures in RESULTS.md, fix what breaks.

    python tools/cuda_check.py          # ~5 minutes on one H200; without CUDA it says so in one line

1. The Triton kernels (RMSNorm, RoPE, the window-attention scorer) against their torch references on CUDA, fp32
   and bf16, irregular shapes; the CPU tests only run them in the Triton interpreter, in fp32.
2. Every policy end to end in bf16 on random weights with Qwen3-4B's shape (36 layers, hidden 2560, 32 query /
   8 KV heads, head_dim 128): 4 prompts of different lengths decoded together at K = 256, finite logits,
   evictions in every row, tokens/s.
3. `python eval.py bench` on that shape at contexts up to 32,768 with K = 2048, batch 1 and 16.
`--smoke` runs steps 1 and 2 on the CPU with a tiny shape (the tests use it to keep this script working).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project's modules, and where eval.py runs
sys.path.insert(0, str(ROOT))

QWEN3_4B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6}
TINY = {**QWEN3_4B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def check_kernels(device: str, dtypes, long_s: int = 2112) -> list[str]:
    """Each Triton kernel against its reference; returns one line per (kernel, dtype) with the max error."""
    import torch
    import kernels

    g = torch.Generator().manual_seed(0)
    lines = []
    for dtype in dtypes:
        # made on the device in the dtype before any slicing, so the strided views below stay strided there
        rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        x, w = rand(3, 37, 576), rand(576)
        cases = {"rms_norm": (kernels.rms_norm_triton, kernels.rms_norm_ref, (x, w, 1e-6))}
        q = rand(2, 37, 3 * 5 * 128)[..., : 5 * 128].view(2, 37, 5, 128).transpose(1, 2)  # strided, as from qkv
        ang = (torch.arange(37) + 1000 * torch.arange(2)[:, None])[..., None] / 1e6 ** (torch.arange(64) / 64)
        cos, sin = (torch.cat(t, -1).float().to(device) for t in ([ang.cos()] * 2, [-ang.sin(), ang.sin()]))
        cases["rope"] = (kernels.rope_triton, kernels.rope_ref, (q, cos, sin))  # tables as model.rope_cos_sin
        for W, S in ((64, long_s), (200, 37)):  # a scorer's window over a full cache; a long window over a few keys
            qs, ks = rand(2, 32, W, 128) * 0.2, rand(2, 8, S, 128)
            k_pos = torch.stack([torch.randperm(2 * S, generator=g)[:S] for _ in range(16)]).view(2, 8, S).to(device)
            q_pos = torch.randint(0, 2 * S, (2, W), generator=g).to(device)
            q_pos[:, 0] = -1  # an empty ring slot
            cases[f"window_attn_mass W={W} S={S}"] = (kernels.window_attn_mass_triton, kernels.window_attn_mass_ref,
                                                      (qs, ks, q_pos, k_pos, 128**-0.5))
        for name, (fast, ref, args) in cases.items():
            got, want = fast(*args).float(), ref(*args).float()
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)
            lines.append(f"{'ok  ' if err <= tol else 'FAIL'} {name:34s} {str(dtype):15s} max rel. error {err:.2e}")
    return lines


def check_policies(path: str, device: str, dtype, budget: int, buffer: int, new_tokens: int, lens) -> list[str]:
    """Every policy end to end: random weights of the shape in config file `path`, prompts of `lens` tokens decoded
    together."""
    import torch
    import bench
    import generate as G
    from policies import POLICIES

    model = bench.build_model(path, device, str(dtype).replace("torch.", ""))
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in lens]
    lines = []
    for name in POLICIES:
        run = G.make_run(name, None if name == "full" else budget, buffer, False if name != "full" else None,
                         [len(p) for p in prompts])
        t0 = time.perf_counter()
        outs, cache, t = G.generate(model, prompts, run, new_tokens)  # feed stops on NaN/inf logits
        ok = all(len(o) == new_tokens for o in outs) and (name == "full" or min(run.rounds) > 0)
        tok_s = len(prompts) * (new_tokens - 1) / t["decode_s"]
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name:15s} evictions per row {run.rounds}, {tok_s:8.1f} tok/s "
                     f"(batch {len(prompts)}), {time.perf_counter() - t0:6.1f} s")
    return lines


def main():
    # no prefixes of flags, as cli.Parser; not imported: torch must wait until TRITON_INTERPRET is set
    ap = argparse.ArgumentParser(description="Check the CUDA / Triton path and record its speed.", allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="steps 1-2 on the CPU with a tiny shape (for the tests)")
    ap.add_argument("--out", default="results/cuda_bench.json", help="where step 3 writes its rows")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on the CPU
    import torch

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("error: no CUDA device visible to this torch: run tools/cuda_check.py on a machine with a CUDA GPU")
    device = "cpu" if args.smoke else "cuda"
    print(f"# 1. Triton kernels against their references ({'CPU' if args.smoke else torch.cuda.get_device_name()})")
    lines = check_kernels(device, [torch.float32] if args.smoke else [torch.float32, torch.bfloat16],
                          long_s=300 if args.smoke else 2112)
    print("\n".join(lines), flush=True)
    print("# 2. every policy end to end, random weights" + (" (tiny)" if args.smoke else " of Qwen3-4B's shape, bf16"))
    with tempfile.TemporaryDirectory() as d:  # the shape as a config.json, for step 2 and step 3's bench
        path = os.path.join(d, "config.json")
        with open(path, "w") as f:
            json.dump(TINY if args.smoke else QWEN3_4B, f)
        if args.smoke:
            more = check_policies(path, device, torch.float32, 48, 16, 60, (20, 33, 41, 50))
        else:
            more = check_policies(path, device, torch.bfloat16, 256, 64, 320, (70, 130, 200, 260))
        print("\n".join(more), flush=True)
        lines += more
        failed = sum(l.startswith("FAIL") for l in lines)
        if not args.smoke:
            print("# 3. python eval.py bench, Qwen3-4B shape, K = 2048, contexts up to 32,768, batch 1 and 16")
            cmd = [sys.executable, "eval.py", "bench", "--model", path, "--policies", "full,snapkv,random,criticalkv",
                   "--budget", "2048", "--contexts", "8192,32768", "--batch-sizes", "1,16", "--steps", "128",
                   "--out", args.out]
            failed += subprocess.run(cmd, cwd=ROOT).returncode != 0
    sys.exit(f"error: {failed} check(s) failed" if failed else 0)


if __name__ == "__main__":
    main()
