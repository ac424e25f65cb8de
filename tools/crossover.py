"""
Where bf16 copies of int4/int8 weights start to beat torch's int kernels on this CPU (kernels.DENSE_ROWS): one layer
of the 1.5B's matrices (q/k/v, o, gate/up, down) as int4, and its LM head as int8, multiplied by M rows of bf16
activations, each kernel beside the other in one run. Random codes: the time does not depend on the values.

    OMP_NUM_THREADS=2 python tools/crossover.py
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernels import bf16_units, dense  # noqa: E402
from quant import int4_groups, int8_rows  # noqa: E402

LAYER = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # [out, in] of q/k/v, o, gate/up, down
HEAD = (151936, 1536)  # the LM head, int8 (the GGUF's Q6_K)


def seconds(fn, reps: int) -> float:
    fn()  # warm-up: oneDNN picks and caches its kernel
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main():
    torch.manual_seed(0)
    layer = []
    for out, inp in LAYER:
        q, s = torch.randint(0, 16, (out, inp), dtype=torch.uint8), torch.rand(out, inp // 32) / 100
        w = int4_groups(q, s, -8 * s, torch.bfloat16)
        layer.append((w, dense(w).contiguous()))
    head = int8_rows(torch.randn(HEAD) / 30, torch.bfloat16)
    head_bf16 = dense(head).contiguous()
    print(f"# {torch.backends.cpu.get_cpu_capability()}, bf16 units: {bf16_units()}, {torch.get_num_threads()} threads")
    print("| rows | int4 layer ms | bf16 layer ms | int4 / bf16 | int8 head ms | bf16 head ms | int8 / bf16 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for M in (1, 2, 4, 8, 12, 16, 24, 32, 64, 128):
        xs = [torch.randn(M, inp).bfloat16() for _, inp in LAYER]
        reps = max(3, 64 // M)
        t4 = seconds(lambda: [w.matmul(x) for (w, _), x in zip(layer, xs)], reps)
        tb = seconds(lambda: [F.linear(x, d) for (_, d), x in zip(layer, xs)], reps)
        t8 = seconds(lambda: head.matmul(xs[0]), max(2, reps // 4))
        th = seconds(lambda: F.linear(xs[0], head_bf16), max(2, reps // 4))
        print(f"| {M} | {t4 * 1e3:.2f} | {tb * 1e3:.2f} | {t4 / tb:.2f} | {t8 * 1e3:.1f} | {th * 1e3:.1f} | "
              f"{t8 / th:.2f} |", flush=True)


if __name__ == "__main__":
    main()
