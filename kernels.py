"""
Triton kernels for nanokv, each beside a plain-torch reference with the same signature and a dispatcher:
Triton for CUDA tensors when triton imports, else the reference (the production path on CPU).
linear (fp32, bf16, int8 or int4 weights), rms_norm and rope run in every layer; window_attn_mass is the scorer
that SnapKV, VASE, CriticalKV, R-KV and H2O share: the softmax attention of a window of queries over the cache,
summed per key. Laid out top to bottom: the matmul dispatch and QuantWeight; int8_dots, a small C++ kernel (built
once with load_inline) of int8 activations times 4- and 8-bit codes with AVX-512 VNNI, its weights' packing and
their move onto huge pages, beside its torch reference (--quant int4x8); then the Triton kernels, each with its
reference.
Left out: backward passes, autotuning, and a fused attention for the forward pass (model.py uses SDPA).
References: Triton tutorials 02, 05 and 06 (softmax, layer norm, fused attention);
SnapKV https://arxiv.org/abs/2404.14469; H2O https://arxiv.org/abs/2306.14048.
"""

from __future__ import annotations  # lets the kernels' tl.constexpr annotations parse without triton

import functools
import mmap
import os
import shutil
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def _jit(fn):
    # triton.jit when triton is installed; without it the kernels are plain functions that are never launched
    return triton.jit(fn) if HAS_TRITON else fn


# ----------------------------------------------------------------------------------------------------------------
# The matmul of every layer, x @ w.T for an HF-shaped weight w [out, in]. No Triton here: the dispatch rule is the
# point, by the weight's kind:
# - fp32 on CPU: numpy's BLAS (OpenBLAS). On the small matrices of a decode step it reads the weights 1.3x (one row)
#   to 2x (4-16 rows) faster than torch's MKL on the AMD CPUs we measured (RESULTS.md, "Batch-1 decode beside
#   llama.cpp"). subtle: only while torch itself runs one thread (cli.cpu_threads). OpenBLAS brings its own thread
#   pool, and two pools busy-waiting on the same cores fight: decode fell from 16 to 3.4 tokens/s when both had 2.
#   model.weight() stores an fp32 CPU weight as the transpose of a contiguous [in, out] buffer, the layout both
#   BLASes read fastest.
# - bf16 (or fp32 with torch's threads): F.linear on a contiguous [out, in] weight, oneDNN's layout, 1.2-1.7x faster
#   than the transposed view (RESULTS.md, "The fast modes: int4, int8, bf16").
# - QuantWeight: weight-only int8 or int4, torch's CPU kernels; the activations keep their dtype (quant.py makes them).
#   Those kernels do not use a CPU's bf16 matrix units (AMX, AVX512-BF16) and their time grows with the rows: they win
#   while a step reads its weights (decode), and lose once it computes (many rows). So where the CPU has bf16 units
#   and a run asked for it (quant.bf16_copies), the weight also keeps its own values dequantized once into bf16, and a
#   step of DENSE_ROWS rows or more multiplies by that copy (RESULTS.md, "The fast modes").
# - a tuple of weights: row blocks of one fused matrix that could not share a kind (e.g. q and k stored as 4-bit
#   blocks, v as 6-bit ones): their outputs are concatenated.

GROUP = 32  # int4 group size: a GGUF 4-bit block's 32 values share one scale and one offset
# rows per step from which a bf16 copy beats torch's int4 kernel on an AMD EPYC with AVX512-BF16 and no AMX (2
# threads, tools/crossover.py): 0.74x of its speed at 8 rows, 1.1x at 16, 1.9x at 64. Not measured on AMX, whose
# crossover should be lower; 16 is the safe side there.
DENSE_ROWS = 16


@functools.cache
def cpu_flags() -> frozenset:
    """This CPU's feature flags, from /proc/cpuinfo (elsewhere none)."""
    with suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return frozenset(line.split())
    return frozenset()


def bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16): without them torch emulates bf16 and a dense
    copy is never faster."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


@dataclass
class QuantWeight:
    """A weight-only quantized [out, in] matrix, the two formats torch's CPU kernels run. int8: one scale per output
    row, w = q * scale. int4: groups of GROUP inputs, w = (q - 8) * scale + zero with q in 0..15 (a GGUF Q4_K or Q4_1
    block exactly, up to the rounding of scale and zero to the activations' dtype). Scales are in that dtype."""

    kind: str  # "int8" or "int4"; "dot8" or "dot4": the same numbers for int8_dots (--quant int4x8, below)
    # int8 [out, in]; int4: torch's packed layout (_convert_weight_to_int4pack_for_cpu), uint8; dot4, dot8: pack_dots
    data: Tensor
    scales: Tensor  # int8: [out]; int4: [in / GROUP, out, 2], each group's (scale, zero); dot: pack_dots, bf16
    shape: tuple  # (out, in), as the HF weight
    dense_cache: Tensor | None = None  # dense(): the matrix as the kernel sees it, [out, in], made on first use
    codes: Tensor | None = None  # int4's codes for dense(), two a byte [out, in / 2]: a quarter of a bf16 copy
    dense_rows: int = 0  # > 0: a step of this many rows or more multiplies by dense_cache (quant.bf16_copies)

    @property
    def nbytes(self) -> int:  # what a matmul reads
        return self.data.nbytes + self.scales.nbytes

    def matmul(self, x: Tensor) -> Tensor:
        """x [M, in], contiguous, in the scales' dtype -> [M, out]."""
        if self.kind in ("dot4", "dot8"):
            return int8_dots(x, self.data, self.scales, self.shape[0], int(self.kind[3]))
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, GROUP, self.scales)


def linear(x: Tensor, w) -> Tensor:
    """x [..., in] @ w.T -> [..., out] for a weight w [out, in] of any kind above, or for a stack of dense ones
    w [..., out, in] that pairs with x's leading dims (e.g. R-KV's key-key similarity k @ k.T of every head)."""
    if isinstance(w, tuple):  # row blocks of different kinds
        return torch.cat([linear(x, part) for part in w], -1)
    if isinstance(w, QuantWeight):  # the kernels take one 2-D contiguous matrix of rows
        rows = x.reshape(-1, x.shape[-1])  # [M, in]
        if w.dense_rows and rows.shape[0] >= w.dense_rows:  # compute-bound: the same values through bf16 units
            return F.linear(x, w.dense_cache)
        return w.matmul(rows.contiguous()).view(*x.shape[:-1], w.shape[0])
    if x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and torch.get_num_threads() == 1:
        if w.dim() > 2:  # one BLAS call per matrix of the stack
            return torch.from_numpy(x.numpy() @ w.numpy().swapaxes(-1, -2))
        # numpy views of both (no copy); one BLAS call for every row of every batch row
        y = x.numpy().reshape(-1, x.shape[-1]) @ w.numpy().T
        return torch.from_numpy(y).view(*x.shape[:-1], w.shape[0])
    if w.dim() == 2 and w.is_contiguous():
        return F.linear(x, w)
    return x @ w.transpose(-1, -2)


def dense(w) -> Tensor:
    """The weight w [out, in] as one dense tensor, for the few readers of a weight's entries (CriticalKV's
    ||V W_O||, the perturbation probe), in the activations' dtype: int8 is q * scale; int4's packing is torch's own,
    so it is run through its kernel on the identity matrix once, exactly the matrix linear() multiplies by, and its
    codes are kept (a quarter of a bf16 copy: CriticalKV's o_proj copies were 126 MiB of the 1.5B's 2 GiB) when they
    give that matrix back bit for bit, else the matrix itself. Each later call rebuilds it (about 5 ms a 1536 x 1536).
    note: in fp32 activations torch's int kernels are slow (vectorized for bf16 inputs only); so is that first call."""
    if isinstance(w, tuple):
        return torch.cat([dense(part) for part in w])
    if not isinstance(w, QuantWeight):
        return w
    if w.dense_cache is not None:
        return w.dense_cache
    if w.kind in ("dot4", "dot8"):  # unpacked exactly: cheap, not kept
        bits, (n, k) = int(w.kind[3]), w.shape
        u, scale, zero = unpack_dots(w.data, w.scales, n, k, bits)
        return ((u.float().view(n, -1, GROUP) - DOT_CENTER[bits]) * scale[..., None] + zero[..., None]).flatten(1) \
            .to(w.scales.dtype)
    if w.kind == "int8":  # cheap to redo: not kept (but by quant.bf16_copies)
        return (w.data.float() * w.scales.float()[:, None]).to(w.scales.dtype)
    if w.codes is not None:
        return from_codes(w.codes, w.scales)
    out, k = w.shape
    made = torch.empty(out, k, dtype=w.scales.dtype, device=w.data.device)  # [out, in], as F.linear reads fastest
    codes = torch.empty(out, k // 2, dtype=torch.uint8, device=w.data.device)
    scale, zero = w.scales.float().unbind(-1)  # [in / GROUP, out] each
    for a in range(0, k, PIECE):  # PIECE inputs at a time: small transients, which the C heap reuses, not keeps
        b = min(a + PIECE, k)
        eye = torch.zeros(b - a, k, dtype=w.scales.dtype, device=w.data.device)
        eye[:, a:b] = torch.eye(b - a, dtype=w.scales.dtype, device=w.data.device)  # the identity's rows a .. b
        made[:, a:b] = w.matmul(eye).T  # columns a .. b of the kernel's matrix
        g = slice(a // GROUP, b // GROUP)
        q = (made[:, a:b].float().unflatten(1, (-1, GROUP)) - zero[g].T[..., None]) / scale[g].T[..., None] + 8
        q = q.round().clamp(0, 15).to(torch.uint8).flatten(1)  # [out, b - a]
        codes[:, a // 2 : b // 2] = q[:, 0::2] | q[:, 1::2] << 4
    if torch.equal(from_codes(codes, w.scales), made):
        w.codes = codes
    else:  # not this kernel's arithmetic (a GPU's, another rounding): keep the matrix itself
        w.dense_cache = made
    return made


PIECE = 128  # dense()'s inputs a piece: [out, 128] fp32 transients (0.75 MiB for the 1.5B's o_proj)


def from_codes(codes: Tensor, scales: Tensor) -> Tensor:
    """int4 codes [out, in / 2] (input 2j in the low nibble, 2j + 1 in the high) and the kernel's (scale, zero)
    [in / GROUP, out, 2] -> the dense [out, in], (q - 8) * scale + zero as one fused multiply-add in fp32, rounded
    once to the scales' dtype (what torch's CPU kernel computes); PIECE inputs at a time."""
    out, k = codes.shape[0], codes.shape[1] * 2
    made = torch.empty(out, k, dtype=scales.dtype, device=codes.device)
    scale, zero = scales.float().unbind(-1)  # [in / GROUP, out] each
    for a in range(0, k, PIECE):
        b, g = min(a + PIECE, k), slice(a // GROUP, min(a + PIECE, k) // GROUP)
        c = codes[:, a // 2 : b // 2]
        q = (torch.stack([c & 15, c >> 4], -1).flatten(1).float() - 8).unflatten(1, (-1, GROUP))  # [out, n, GROUP]
        made[:, a:b] = torch.addcmul(zero[g].T[..., None].expand_as(q), q, scale[g].T[..., None].expand_as(q)) \
            .flatten(1)
    return made


# ----------------------------------------------------------------------------------------------------------------
# int8 dot products (--quant int4x8), as llama.cpp computes a Q4 matrix times a Q8 row: torch's int4 kernel above
# expands every 4-bit weight to floating point and multiplies in fp32; here the activations are quantized too, to
# int8 per block of 32 inputs (x ~ a * d, a in -127..127, as a Q8_0 block), and VNNI's vpdpbusd multiplies 64 pairs
# of (unsigned 8-bit weight code, signed 8-bit activation) per instruction. A block of a row of w is u * s + o, so
#   sum_k w[n, k] x[k] = sum_blocks  s * d * (u . a)  +  o * d * sum(a)
# the integer dot product scaled once per block, the offset term through the block's activation sum.
# A weight w = (u - C) * scale + zero keeps the numbers of the int4 and int8 kernels exactly (C = 8 for 4-bit codes,
# 128 for int8 shifted to 0..255), so o = zero - C * scale, and only the activations' rounding is new.
# Layout, made once at load (pack_dots): output rows in groups of 16 (one zmm of int32 sums, one lane per row), each
# lane's 4 bytes the 4 consecutive inputs that vpdpbusd sums; 4-bit codes two a byte, inputs j and j + 16 of a block.
# Scales in bf16, as the int kernels': the 4-bit blocks' (scale, zero) [N / 16, K / 32, 2, 16]; the int8 rows' one
# scale a row [N] (symmetric: a block's sum is the integer q . a = u . a - 128 sum(a), times d, and the row's scale
# multiplies once at the end; 1.125 bytes a weight down to 1, 0.05 GB of the 1.5B's 1.18 a step). Each thread reads
# its groups in order, one stream, and asks for the bytes 4 KiB ahead (_mm_prefetch): at batch 1 the products then
# read at about 0.88 of the memory roofline instead of 0.70 on an Intel Xeon (tools/dots_prefetch.py). With many rows
# of x the arithmetic binds, so a group's tiles pass once per 8 rows, whose 16 sums each stay in a register over all
# K (1.17-1.20x at 16-32 rows against one row at a time through memory; the same numbers, bit for bit).
# References: llama.cpp's ggml_vec_dot_q4_K_q8_K (ggml-cpu/arch/x86/quants.c); Intel's VNNI (vpdpbusd) guide.

DOT_CENTER = {4: 8, 8: 128}  # C above: the code of a weight equal to `zero`
# -fopenmp: at::parallel_for splits the rows over torch's own OpenMP threads (the libgomp torch has loaded)
DOTS_FLAGS = dict(extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp"],
                  extra_ldflags=["-fopenmp"])

_DOTS_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cfloat>
#include <cmath>

// x [M, K] (fp32 or bf16) -> a [M, K] int8 and, per block of 32, d [M, K/32], d * sum(a) (the offset term's) and
// sum(a) itself (the int8 rows' centre, subtracted as an integer)
template <typename T>
static void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* a, float* d, float* dsum, int32_t* isum) {
  const int64_t nb = K / 32;
  for (int64_t i = 0; i < M * nb; i++) {
    float xb[32];  // blocks run along each row: block i of the [M * nb] blocks
    for (int t = 0; t < 32; t++) xb[t] = static_cast<float>(x[i * 32 + t]);
    float amax = 0.f;
    for (int t = 0; t < 32; t++) amax = std::max(amax, std::fabs(xb[t]));
    const float s = amax / 127.f, den = std::max(s, FLT_MIN);  // an all-zero block: a = 0
    int sum = 0;
    for (int t = 0; t < 32; t++) {
      const int v = (int)std::nearbyint(std::min(127.f, std::max(-127.f, xb[t] / den)));  // round half to even
      a[i * 32 + t] = (int8_t)v;
      sum += v;
    }
    d[i] = s;
    dsum[i] = s * (float)sum;
    isum[i] = sum;
  }
}

static inline __m512 bf16x16(const uint16_t* p) {  // 16 bf16 -> fp32: a bf16 is an fp32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

constexpr int ROWS = 8;  // rows of x whose sums a tile's pass keeps in registers (8 of the 32 zmm)

// y[m0 .. m0 + MT, group g] for MT rows of x (C: the code of a weight equal to `zero`): per block, the 16 x 32 tile
// of codes unpacked once, then for each row 8 vpdpbusd and the block's scaling into that row's register of 16 sums
// (the same operations, in the same order, as one row at a time: a row's numbers do not depend on the rows beside it)
template <int BITS, int MT>
static inline void group_rows(const uint8_t* W, const uint16_t* S, const int8_t* A, const float* D, const float* DS,
                              const int32_t* IS, int64_t g, int64_t m0, int64_t nb, int64_t K, float* Y,
                              at::BFloat16* Yb, int64_t N) {
  constexpr int64_t WB = 16 * 32 * BITS / 8;  // bytes of one (16 rows, 32 inputs) tile: 256 or 512
  constexpr int64_t PF = 4096;  // prefetch distance in bytes of weights: 16 or 8 tiles ahead
  __m512 acc[MT];
  for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* wb = W + (g * nb + b) * WB;
    // in cache by the time they are needed: the tile PF bytes ahead, and its block's scales
    for (int64_t c = 0; c < WB; c += 64) _mm_prefetch((const char*)(wb + PF + c), _MM_HINT_T0);
    if constexpr (BITS == 4) _mm_prefetch((const char*)(S + (g * nb + b + PF / WB) * 32), _MM_HINT_T0);
    __m512i u[8];  // u[j]: 16 rows x inputs 4j .. 4j + 3 of the block, one code a byte
    if constexpr (BITS == 4) {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * j);
        u[j] = _mm512_and_si512(v, low);  // inputs 4j ..
        u[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);  // inputs 16 + 4j ..
      }
    } else {
      for (int j = 0; j < 8; j++) u[j] = _mm512_loadu_si512(wb + 64 * j);
    }
    for (int i = 0; i < MT; i++) {
      const int64_t m = m0 + i;
      const int32_t* ab = reinterpret_cast<const int32_t*>(A + m * K + b * 32);  // 4 activations a word
      // two chains of 4 dependent vpdpbusd rather than one of 8: half the latency to wait out
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; j++) {
        s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_set1_epi32(ab[j]));
        s1 = _mm512_dpbusd_epi32(s1, u[j + 4], _mm512_set1_epi32(ab[j + 4]));
      }
      const __m512i s = _mm512_add_epi32(s0, s1);
      if constexpr (BITS == 4) {  // per block: s * scale * d + (zero - 8 scale) * d * sum(a)
        const __m512 scale = bf16x16(S + (g * nb + b) * 32), zero = bf16x16(S + (g * nb + b) * 32 + 16);
        const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero);  // o = zero - C * scale
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(D[m * nb + b])), acc[i]);
        acc[i] = _mm512_fmadd_ps(off, _mm512_set1_ps(DS[m * nb + b]), acc[i]);
      } else {  // per block: (u . a - 128 sum(a)) * d, exact in int32 (|q . a| < 2^19), the row's scale after
        const __m512i q = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * IS[m * nb + b]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(D[m * nb + b]), acc[i]);
      }
    }
  }
  for (int i = 0; i < MT; i++) {  // bf16: rounded to nearest even, as torch's .to(torch.bfloat16)
    if constexpr (BITS == 8) acc[i] = _mm512_mul_ps(acc[i], bf16x16(S + g * 16));
    alignas(64) float r[16];
    _mm512_store_ps(r, acc[i]);
    for (int t = 0; t < 16; t++)
      if (Yb) Yb[(m0 + i) * N + g * 16 + t] = at::BFloat16(r[t]); else Y[(m0 + i) * N + g * 16 + t] = r[t];
  }
}

// y [M, N] = x [M, K] @ w.T for w packed by kernels.pack_dots, BITS 4 or 8: x quantized, then group_rows
template <int BITS>
torch::Tensor dots(torch::Tensor x, torch::Tensor w, torch::Tensor sz, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0 && N % 16 == 0, "int8_dots: x [M, K] with K % 32 == 0, N % 16");
  TORCH_CHECK(w.is_contiguous() && sz.is_contiguous() && sz.scalar_type() == at::kBFloat16, "int8_dots: layout");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32, G = N / 16;
  constexpr int64_t WB = 16 * 32 * BITS / 8;  // bytes of one (16 rows, 32 inputs) tile: 256 or 512
  TORCH_CHECK(w.numel() == G * nb * WB && sz.numel() == (BITS == 4 ? G * nb * 32 : N),
              "int8_dots: w and scales do not match N, K");
  const bool bf = x.scalar_type() == at::kBFloat16;  // read and written as they are: no copies in fp32
  TORCH_CHECK(x.is_contiguous() && (bf || x.scalar_type() == at::kFloat), "int8_dots: x contiguous, fp32 or bf16");
  auto a = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto d = torch::empty({M, nb}, x.options().dtype(at::kFloat)), ds = torch::empty_like(d);
  auto is = torch::empty({M, nb}, x.options().dtype(at::kInt));
  int8_t* qa = a.data_ptr<int8_t>();
  int32_t* IS = is.data_ptr<int32_t>();
  if (bf) quantize_rows(x.data_ptr<at::BFloat16>(), M, K, qa, d.data_ptr<float>(), ds.data_ptr<float>(), IS);
  else quantize_rows(x.data_ptr<float>(), M, K, qa, d.data_ptr<float>(), ds.data_ptr<float>(), IS);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* W = w.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  const int8_t* A = a.data_ptr<int8_t>();
  const float *D = d.data_ptr<float>(), *DS = ds.data_ptr<float>();
  float* Y = bf ? nullptr : y.data_ptr<float>();
  at::BFloat16* Yb = bf ? y.data_ptr<at::BFloat16>() : nullptr;
  // threads split the groups of 16 output rows: each reads its own weights once from memory, for all M rows of x
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) {  // the group's tiles again from cache for each ROWS rows of x
        const int64_t mt = std::min<int64_t>(ROWS, M - m0);
        switch (mt) {  // each row's sums stay in a register over all K: a tile size the compiler unrolls
          case 1: group_rows<BITS, 1>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N); break;
          case 2: group_rows<BITS, 2>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N); break;
          case 3: group_rows<BITS, 3>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N); break;
          case 4: group_rows<BITS, 4>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N); break;
          case 5: group_rows<BITS, 5>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N); break;
          case 6: group_rows<BITS, 6>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N); break;
          case 7: group_rows<BITS, 7>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N); break;
          default: group_rows<BITS, ROWS>(W, S, A, D, DS, IS, g, m0, nb, K, Y, Yb, N);
        }
      }
  });
  return y;
}

torch::Tensor int8_dots(torch::Tensor x, torch::Tensor w, torch::Tensor sz, int64_t n, int64_t bits) {
  return bits == 4 ? dots<4>(x, w, sz, n) : dots<8>(x, w, sz, n);
}
"""


@functools.cache
def dots_missing() -> str | None:
    """Why int8_dots cannot run its C++ kernel here, or None where it can: the CPU needs AVX-512 VNNI, and the kernel
    is compiled once, at first use, with torch's cpp_extension (a C++ compiler and ninja; cached in torch's extension
    folder, $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)."""
    if not {"avx512bw", "avx512_vnni"} <= cpu_flags():
        return "this CPU has no AVX-512 VNNI (avx512_vnni in /proc/cpuinfo)"
    if not shutil.which(os.environ.get("CXX", "c++")):
        return "no C++ compiler (c++) on PATH to build the kernel: install one (Debian: apt-get install g++)"
    if not shutil.which("ninja"):  # torch's cpp_extension builds with it
        return "no ninja on PATH to build the kernel: pip install ninja"
    try:
        _dots_module()
    except Exception as e:  # noqa: BLE001 -- a compiler's failure in any form is one line
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        return f"its C++ kernel did not build ({last[:200]})"
    return None


@functools.cache
def _dots_module():
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    name = "nanokv_int8_dots"
    if not any(Path(_get_build_directory(name, False)).glob("*.so")):
        print("[kernels] compiling the int8-dot kernel, once (about a minute)", file=sys.stderr)
    return load_inline(name, cpp_sources=_DOTS_CPP, functions=["int8_dots"], **DOTS_FLAGS)


def pack_dots(u: Tensor, scale: Tensor, zero: Tensor | None, bits: int) -> tuple[Tensor, Tensor]:
    """Codes u [N, K] -> int8_dots' (w, scales). bits 4: u in 0..15, w = (u - 8) * scale + zero per group of 32
    (scale, zero [N, K / 32]); bits 8: u in 0..255, w = (u - 128) * scale, one scale a row (scale [N], zero None).
    w: uint8 [N / 16, K / 32, bits, 16, 4] (a byte per code at 8 bits; at 4, the byte of inputs 4j + t holds input
    16 + 4j + t in its high nibble); scales: bf16 [N / 16, K / 32, 2, 16] at 4 bits, [N] at 8."""
    N, K = u.shape
    G, nb = N // 16, K // GROUP
    if bits == 8:
        w = u.view(G, 16, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [G, nb, j, n, t]
        return w.to(torch.uint8).contiguous().flatten(), scale.to(torch.bfloat16).contiguous()
    t = u.view(G, 16, nb, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [G, nb, j, n, t, half]: half 1 is inputs 16 ..
    sz = torch.stack([scale, zero], -1).view(G, 16, nb, 2).permute(0, 2, 3, 1)  # [G, nb, 2, 16]
    return (t[..., 0] | t[..., 1] << 4).to(torch.uint8).contiguous().flatten(), sz.to(torch.bfloat16).contiguous()


def unpack_dots(w: Tensor, sz: Tensor, n: int, k: int, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """pack_dots undone: codes u [n, k] uint8, and scale, zero [n, k / 32] fp32 (at 8 bits the row's scale in every
    group, and zero 0)."""
    G, nb = n // 16, k // GROUP
    if bits == 8:
        u = w.view(G, nb, 8, 16, 4).permute(0, 3, 1, 2, 4)  # [G, n, nb, j, t]
        scale = sz.float()[:, None].expand(n, nb)
        return u.reshape(n, k), scale, torch.zeros_like(scale)
    t = w.view(G, nb, 4, 16, 4)
    u = torch.stack([t & 15, t >> 4], -1).permute(0, 3, 1, 5, 2, 4)  # [G, n, nb, half, j, t]
    s = sz.view(G, nb, 2, 16).permute(0, 3, 1, 2).reshape(n, nb, 2).float()
    return u.reshape(n, k), s[..., 0], s[..., 1]


def on_huge_pages(weights: list[QuantWeight]) -> bool:
    """Move the weights' packed codes and scales into one buffer that Linux is asked to back with 2 MiB pages
    (madvise MADV_HUGEPAGE, honoured where /sys/kernel/mm/transparent_hugepage/enabled says madvise or always).
    quant.py moves each matrix as it is made, so memory holds two copies of one matrix at most. Why: a batch-1 step
    streams every matrix once (the 1.5B's 1.13 GB); in 4 KiB pages that is 275,000 pages a step, each a TLB miss,
    and the CPU's prefetchers stop at each page's end. On an AMD EPYC the products ran 1.07-1.09x faster on the
    model's matrices, 1.15x on random codes (tools/dots_prefetch.py --pages). The same bytes, so the same numbers.
    Returns whether the advice was taken (elsewhere the buffer has ordinary pages)."""
    slots = [(w, name) for w in weights for name in ("data", "scales")]  # no tensor held here: each old one can go
    if not slots:
        return False
    sizes = [-(-getattr(w, name).nbytes // 64) * 64 for w, name in slots]  # each tensor starts on a cache line
    # private and anonymous (no memory until written): a shared mapping would be shmem, whose huge pages are off
    buf = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised = hasattr(mmap, "MADV_HUGEPAGE")  # Linux only
    if advised:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            advised = False
    arena, at = torch.frombuffer(buf, dtype=torch.uint8), 0  # the tensor keeps buf alive
    for (w, name), size in zip(slots, sizes):
        t = getattr(w, name)
        moved = arena[at : at + t.nbytes].view(t.dtype).view(t.shape)
        moved.copy_(t)
        setattr(w, name, moved)  # the old tensor is freed here
        at += size
    return advised


def int8_dots_ref(x: Tensor, w: Tensor, sz: Tensor, n: int, bits: int) -> Tensor:
    """x [M, K] @ w.T -> [M, n] for w packed by pack_dots, the kernel's arithmetic in torch: x quantized per block
    of 32 to int8 (d = max |x| / 127, a = round(x / d)), integer dot products per block, scaled after."""
    M, K = x.shape
    u, scale, zero = unpack_dots(w, sz, n, K, bits)
    xb = x.float().view(M, -1, GROUP)  # [M, K / 32, 32]
    d = xb.abs().amax(-1) / 127  # [M, K / 32]
    a = (xb / d.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127).round()
    # exact in fp32: |a| <= 127 and u <= 255, so every partial sum of 32 products is an integer below 2^24
    dots = torch.einsum("mbk,nbk->mnb", a, u.float().view(n, -1, GROUP))  # [M, n, K / 32]
    off = zero - DOT_CENTER[bits] * scale  # [n, K / 32]
    return ((dots * scale * d[:, None]).sum(-1) + (d * a.sum(-1)) @ off.T).to(x.dtype)


def int8_dots(x: Tensor, w: Tensor, sz: Tensor, n: int, bits: int) -> Tensor:
    """The C++ kernel where it builds (dots_missing), else the reference: the same numbers up to fp32 rounding."""
    if dots_missing() is None:
        if x.dtype in (torch.float32, torch.bfloat16):  # the kernel reads and writes these as they are
            return _dots_module().int8_dots(x.contiguous(), w, sz, n, bits)
        return _dots_module().int8_dots(x.float().contiguous(), w, sz, n, bits).to(x.dtype)
    return int8_dots_ref(x, w, sz, n, bits)


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm: one program per row, the whole row in one block (D is at most a few thousand).


@_jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    # masked lanes load 0, so they add nothing to the sum; we divide by the true D
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    # subtle: Llama rounds to the input dtype *before* the weight multiply; we round at the same point as HF
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs_d, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    D = x.shape[-1]
    assert x.stride(-1) == 1, "rms_norm: the last dim of x must be contiguous"
    assert weight.shape == (D,) and weight.is_contiguous() and weight.dtype == x.dtype
    x2 = x.reshape(-1, D)  # [N, D]; a view unless the leading dims are scattered
    out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), D, eps,
                                     BLOCK_D=triton.next_power_of_2(D))
    return out.view(x.shape)


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    # the mean of squares as sum / D: torch's mean costs two more small ops, and decode runs this 2L + 1 times a token
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps)).to(x.dtype) * weight


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm_triton(x, weight, eps) if HAS_TRITON and x.is_cuda else rms_norm_ref(x, weight, eps)


# ----------------------------------------------------------------------------------------------------------------
# RoPE, HF half-split layout: y = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]. We fold the minus
# into the table, sin = [-s, s], so the reference is one roll and two multiplies: y = x * cos + roll(x, D/2) * sin.
# cos and sin are [B, T, D] fp32 (each row of a batch has its own positions); the kernel reads their second halves.
# Each program rotates BLOCK_T positions of one (b, h).


@_jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, T, HALF,
                 stride_xb, stride_xh, stride_xt, stride_xd,
                 stride_ob, stride_oh, stride_ot, stride_cb, stride_ct,
                 BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid_t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_t < T)[:, None] & (offs_d < HALF)[None, :]  # [BLOCK_T, BLOCK_HALF]
    x1_ptrs = x_ptr + b * stride_xb + h * stride_xh + offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)  # first half of each row
    x2 = tl.load(x1_ptrs + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)  # second half
    cs_offs = b * stride_cb + offs_t[:, None] * stride_ct + HALF + offs_d[None, :]  # the tables' second halves
    cos = tl.load(cos_ptr + cs_offs, mask=mask, other=1.0)
    sin = tl.load(sin_ptr + cs_offs, mask=mask, other=0.0)
    o1_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_t[:, None] * stride_ot + offs_d[None, :]
    tl.store(o1_ptrs, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptrs + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rope_triton(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    B, H, T, D = x.shape
    assert D % 2 == 0 and cos.shape == sin.shape == (B, T, D)
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    out = torch.empty((B, H, T, D), dtype=x.dtype, device=x.device)  # contiguous, whatever x was
    BLOCK_T = min(32, triton.next_power_of_2(T))  # decode has T=1: don't waste a 32-row tile on it
    grid = (triton.cdiv(T, BLOCK_T), H, B)
    _rope_kernel[grid](x, cos, sin, out, T, D // 2, *x.stride(), *out.stride()[:3], cos.stride(0), cos.stride(1),
                       BLOCK_T=BLOCK_T, BLOCK_HALF=triton.next_power_of_2(D // 2))
    return out


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = x.float()  # [B, H, T, D]; cos, sin [B, T, D] broadcast over the heads
    return (xf * cos[:, None] + xf.roll(x.shape[-1] // 2, -1) * sin[:, None]).to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return rope_triton(x, cos, sin) if HAS_TRITON and x.is_cuda else rope_ref(x, cos, sin)


# ----------------------------------------------------------------------------------------------------------------
# Window attention mass: out[b, h, s] = sum_w softmax_s(q_w . k_s * scale | k_pos <= q_pos)[s], with per-row
# query positions q_pos [B, W] (-1 = an empty ring slot) and per-head key positions k_pos [B, H_kv, S].
# One program per (b, h_q) with two passes over S (the online-softmax trick of tutorial 06, then a recompute),
# so [B, H_q, W, S] never exists in memory. We chose (b, h_q) over (b, h_kv): the GQA group would share each K
# tile, but the per-head column sums would need a [n_rep, W, S] reshape inside the kernel; the repeated K reads
# of a group should mostly hit L2. BLOCK_S is fixed at 64; tuning it with @triton.autotune is left as an exercise.


@_jit
def _window_attn_mass_kernel(q_ptr, k_ptr, qpos_ptr, kpos_ptr, out_ptr, W, S, D, n_rep, scale,
                             stride_qb, stride_qh, stride_qw, stride_qd,
                             stride_kb, stride_kh, stride_ks, stride_kd,
                             stride_pb, stride_ph, stride_ps, stride_qpb, stride_qpw,
                             stride_ob, stride_oh,
                             BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    h_kv = h // n_rep  # GQA: consecutive query heads share one kv head
    offs_w = tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s0 = tl.arange(0, BLOCK_S)
    # the window's queries stay in registers for both passes: [BLOCK_W, BLOCK_D]
    q_ptrs = q_ptr + b * stride_qb + h * stride_qh + offs_w[:, None] * stride_qw + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_w < W)[:, None] & (offs_d < D)[None, :], other=0.0)
    # padded rows read -1, the same "empty ring slot" marker the cache uses, so they never attend
    q_pos = tl.load(qpos_ptr + b * stride_qpb + offs_w * stride_qpw, mask=offs_w < W, other=-1)
    k_base = k_ptr + b * stride_kb + h_kv * stride_kh
    p_base = kpos_ptr + b * stride_pb + h_kv * stride_ph

    # pass 1: running row max m and row sum l of exp(logit - m) over every key each query may see
    m = tl.full((BLOCK_W,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_W,), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + offs_s0
        k = tl.load(k_base + offs_s[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=(offs_s < S)[:, None] & (offs_d < D)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        k_pos = tl.load(p_base + offs_s * stride_ps, mask=offs_s < S, other=0)
        # causal by token position, not by slot: heads keep different subsets, so slot order means nothing
        valid = (k_pos[None, :] <= q_pos[:, None]) & (q_pos >= 0)[:, None] & (offs_s < S)[None, :]
        # note: "ieee" keeps fp32 logits exact (tf32 errs ~1e-3 and could flip near-tied ranks); it only
        # changes fp32 operands, bf16 ones take the tensor cores either way
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_W, BLOCK_S], fp32
        logits = tl.where(valid, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        # subtle: a row that has seen no valid key keeps m = -inf; shift by 0 there so we never compute -inf - -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        m = m_new
    # log-sum-exp per query; +inf for a query with no valid key turns all its probabilities into exp(-inf) = 0
    # (both sides of tl.where are evaluated, so we feed log a 1 rather than a 0 there)
    lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("inf"))

    # pass 2: recompute each tile's logits, normalise, and sum the probabilities over the window's queries
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + offs_s0
        mask_s = offs_s < S
        k = tl.load(k_base + offs_s[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=mask_s[:, None] & (offs_d < D)[None, :], other=0.0)
        k_pos = tl.load(p_base + offs_s * stride_ps, mask=mask_s, other=0)
        valid = (k_pos[None, :] <= q_pos[:, None]) & (q_pos >= 0)[:, None] & mask_s[None, :]
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        p = tl.where(valid, tl.exp(logits - lse[:, None]), 0.0)  # [BLOCK_W, BLOCK_S]
        # out is accumulated into, so the wrapper can feed a long window in chunks of queries
        o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_s
        acc = tl.load(o_ptrs, mask=mask_s, other=0.0)
        tl.store(o_ptrs, acc + tl.sum(p, axis=0), mask=mask_s)


def window_attn_mass_triton(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float) -> Tensor:
    B, H_q, W, D = q.shape
    _, H_kv, S, _ = k.shape
    assert k.shape == (B, H_kv, S, D) and H_q % H_kv == 0 and q.dtype == k.dtype
    assert q_pos.shape == (B, W) and k_pos.shape == (B, H_kv, S)
    assert q_pos.dtype == k_pos.dtype == torch.int64
    out = torch.zeros((B, H_q, S), dtype=torch.float32, device=q.device)  # zeros: the kernel adds into it
    # tl.dot needs every block dim >= 16; 128 queries per launch bounds the registers a program holds
    CHUNK_W = 128
    BLOCK_D = max(16, triton.next_power_of_2(D))
    for w0 in range(0, W, CHUNK_W):
        qc, pc = q[:, :, w0:w0 + CHUNK_W], q_pos[:, w0:w0 + CHUNK_W]  # views: strides carry the offset
        BLOCK_W = max(16, triton.next_power_of_2(qc.shape[2]))
        _window_attn_mass_kernel[(B, H_q)](qc, k, pc, k_pos, out, qc.shape[2], S, D, H_q // H_kv, scale,
                                           *qc.stride(), *k.stride(), *k_pos.stride(), *pc.stride(),
                                           out.stride(0), out.stride(1),
                                           BLOCK_W=BLOCK_W, BLOCK_S=64, BLOCK_D=BLOCK_D)
    return out


def window_attn_mass_ref(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float) -> Tensor:
    B, H_q, W, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    n_rep = H_q // H_kv
    # group the queries by kv head instead of repeating k: one batched matmul per kv head, k read once
    qg = (q.float() * scale).unflatten(1, (H_kv, n_rep))  # [B, H_kv, n_rep, W, D]
    kt = k.float().transpose(-1, -2)  # [B, H_kv, D, S]
    out = torch.zeros((B, H_kv, n_rep, 1, S), dtype=torch.float32, device=q.device)
    # passes over chunks of queries and of rows bound the [rows, H_kv, n_rep, chunk, S] logits to ~16 MB when H2O
    # feeds a whole prefill chunk. subtle: the query chunk depends on S but on no row count, so rows that hold the
    # same S (as every row of one eviction round does) sum their queries in the same order alone or in a batch
    chunk = max(1, 2**22 // (H_q * S))
    rows = max(1, 2**22 // (H_q * max(1, min(W, chunk)) * S))
    for b0 in range(0, B, rows):
        b = slice(b0, b0 + rows)
        for w0 in range(0, W, chunk):
            qc, pc = qg[b, :, :, w0:w0 + chunk], q_pos[b, w0:w0 + chunk]  # pc [Bc, Wc]
            Bc, Wc = qc.shape[0], qc.shape[3]
            logits = (qc.reshape(Bc, H_kv, n_rep * Wc, D) @ kt[b]).view(Bc, H_kv, n_rep, Wc, S)
            # causal by token position, not by slot, as one bias broadcast over the group: [Bc, H_kv, 1, Wc, S] (an
            # empty ring slot, -1, is after no key: its row is all masked, and `live` below drops it). note: for any
            # finite logit below ~1e31 adding the bias gives the bits a masked_fill_ gives (x + 0 = x, x + min = min),
            # and a masked_fill_ broadcast over the group took 3x as long on CPU
            pc = pc[:, None, None, :, None]  # [Bc, 1, 1, Wc, 1]
            # subtle: the most negative float, not -inf, so a query with no valid key gets a uniform row and no NaN;
            # any valid key still pushes the masked ones to exp(-huge) = 0
            bias = torch.where(k_pos[b, :, None, None, :] > pc, torch.finfo(torch.float32).min, 0.0)
            probs = torch.softmax(logits.add_(bias), dim=-1)
            # sum over the chunk's queries as a matmul whose 0/1 weights also drop the keyless queries' rows: a query
            # sees some key when it is not an empty slot and not older than the head's oldest key
            live = ((pc >= 0) & (pc >= k_pos[b, :, None, None].amin(-1, keepdim=True))).float()  # [Bc, H_kv, 1, Wc, 1]
            out[b] += live.transpose(-1, -2) @ probs  # [Bc, H_kv, n_rep, 1, S]
    return out.view(B, H_q, S)


def window_attn_mass(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float) -> Tensor:
    if HAS_TRITON and q.is_cuda:
        return window_attn_mass_triton(q, k, q_pos, k_pos, scale)
    return window_attn_mass_ref(q, k, q_pos, k_pos, scale)
