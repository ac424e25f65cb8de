"""
How fast the int8-dot kernel (kernels.int8_dots, --quant int4x8) reads its weights at each prefetch distance: how its
PF constant was chosen; and with --pages, in 4 KiB pages against 2 MiB ones (why quant.py puts them on huge pages).

    OMP_NUM_THREADS=2 python tools/dots_prefetch.py                              # 0, 2, 4 and 8 KiB; batch 1
    OMP_NUM_THREADS=2 python tools/dots_prefetch.py --rows 1,16,32 --rounds 5
    OMP_NUM_THREADS=2 python tools/dots_prefetch.py --pages --rounds 21

The kernel is compiled once per distance (its source with PF replaced; distance 0 drops the prefetch). Each then
reads the 1.5B's matrices as a decode step reads them: 28 layers of fused q/k/v, o, gate/up and down (4-bit), then
the LM head (int8), 1.05 GB of random codes, each read once a step, so none is still in cache. The distances (or
the two kinds of pages) take turns round by round. Each prints its median ms a step and GB/s, beside the fp32 read
roofline (bench.matvec_bandwidth) measured in the same process. Time it on an idle machine.
"""

import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

import torch  # noqa: E402

import bench  # noqa: E402
import kernels  # noqa: E402
from cli import Parser, UsageError, cpu_info, int_list  # noqa: E402
from kernels import QuantWeight  # noqa: E402

LAYERS = 28  # Qwen2.5-1.5B: hidden 1,536, intermediate 8,960, 12 query and 2 KV heads of 128, vocabulary 151,936
SHAPES = [(2048, 1536, 4), (1536, 1536, 4), (17920, 1536, 4), (1536, 8960, 4)]  # (out, in, bits) a layer
HEAD = (151936, 1536, 8)


def shipped_distance() -> int:
    """The PF that kernels._DOTS_CPP compiles with."""
    return int(re.search(r"constexpr int64_t PF = (\d+);", kernels._DOTS_CPP).group(1))


def with_distance(pf: int):
    """The kernel compiled with prefetch distance pf bytes (0: no prefetch); the shipped one as it is."""
    from torch.utils.cpp_extension import load_inline

    if pf == shipped_distance():
        return kernels._dots_module()
    src = re.sub(r"constexpr int64_t PF = \d+;", f"constexpr int64_t PF = {pf};", kernels._DOTS_CPP)
    if pf == 0:
        src = src.replace("_mm_prefetch(", "(void)(")  # the addresses are computed, nothing is asked for
    return load_inline(f"nanokv_int8_dots_pf{pf}", cpp_sources=src, functions=["int8_dots"], **kernels.DOTS_FLAGS)


def main(argv=None):
    ap = Parser(description="The int8-dot kernel's read speed at each prefetch distance, the 1.5B's matrices.")
    ap.add_argument("--distances", default="0,2048,4096,8192", help="prefetch distances in bytes (0: none)")
    ap.add_argument("--rows", default="1", help="rows multiplied at once (the batch), a comma list")
    ap.add_argument("--pages", action="store_true", help="instead of the distances: the shipped kernel with its "
                    "weights in 4 KiB pages and in 2 MiB pages (kernels.on_huge_pages)")
    ap.add_argument("--rounds", type=int, default=9, help="steps per distance, taken in turns (the first is warm-up)")
    args = ap.parse_args(argv)
    try:
        distances = [int(d) for d in args.distances.split(",") if d.strip()]
        if not distances or min(distances) < 0 or any(d % 64 for d in distances):
            raise UsageError(f"--distances {args.distances}: pass byte counts, multiples of 64, 0 or more")
        rows = int_list("--rows", args.rows)
        if args.rounds < 2:
            raise UsageError("--rounds must be at least 2 (the first is a warm-up)")
        if (why := kernels.dots_missing()) is not None:
            raise UsageError(f"the int8-dot kernel cannot run here: {why}")
    except (UsageError, ValueError) as e:
        sys.exit(f"error: {e}" if isinstance(e, UsageError) else f"error: --distances {args.distances}: not integers")
    g = torch.Generator().manual_seed(0)
    mats = []  # pack_dots' sizes; the values do not matter to the speed
    for out, inp, bits in SHAPES * LAYERS + [HEAD]:
        w = torch.randint(0, 256, (out * inp * bits // 8,), dtype=torch.uint8, generator=g)
        n_scales = out * inp // 16 if bits == 4 else out  # a (scale, zero) per block of 32; int8: a scale per row
        mats.append(QuantWeight(f"dot{bits}", w, (torch.rand(n_scales, generator=g) * 1e-2).bfloat16(), (out, inp)))
    nbytes = sum(m.nbytes for m in mats)
    if args.pages:  # the shipped kernel, its weights in ordinary pages and in a copy on huge pages
        huge = [QuantWeight(m.kind, m.data.clone(), m.scales.clone(), m.shape) for m in mats]
        given = "" if kernels.on_huge_pages(huge) else " (not given here)"
        runs = {"4 KiB pages": (kernels._dots_module(), mats), f"2 MiB pages{given}": (kernels._dots_module(), huge)}
    else:
        runs = {f"{pf} bytes ahead": (with_distance(pf), mats) for pf in distances}
    roof = bench.matvec_bandwidth(torch.device("cpu"), torch.float32)
    cpu = cpu_info()
    print(f"{cpu['cpu']}, {cpu['capability']}, {torch.get_num_threads()} threads; {nbytes / 1e9:.2f} GB a step; "
          f"fp32 read {roof / 1e9:.1f} GB/s; shipped distance {shipped_distance()}")
    print("| rows | kernel, weights | ms a step (median) | GB/s | of the fp32 read |\n|---|---|---|---|---|")
    for M in rows:
        xs = {k: torch.randn(M, k, generator=g).bfloat16() for k in {s[1] for s in SHAPES}}
        took = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (mod, ws) in runs.items():
                t0 = time.perf_counter()
                for m in ws:
                    mod.int8_dots(xs[m.shape[1]], m.data, m.scales, m.shape[0], int(m.kind[3]))
                took[name].append(time.perf_counter() - t0)
        for name, ts in took.items():
            s = statistics.median(ts[1:])
            print(f"| {M} | {name} | {s * 1e3:.1f} | {nbytes / s / 1e9:.1f} | {nbytes / s / roof:.2f} |", flush=True)


if __name__ == "__main__":
    main()
