"""
Weight-only quantization: which matrices of a checkpoint run as int8 or int4 (kernels.QuantWeight), and how their
numbers get there.

    python generate.py --model qwen2.5-coder-1.5b --quant int4 --policy criticalkv --compare

Batch-1 decode reads every weight once per token, so on a CPU it runs at the memory's speed, and fewer bytes per
weight is what makes it faster (RESULTS.md, "The fast modes: int4, int8, bf16"). Two sources of numbers:
- A model that weights.py converted from a GGUF keeps the GGUF's 4-bit blocks beside it (weights.SIDE). A Q4_K or
  Q4_1 block of 32 values is already an int4 group, w = q * scale + offset with q in 0..15, so --quant int4 runs the
  file's own numbers. The side file also records every tensor's GGUF type: the wider types (Q5_0, Q6_K, Q8_0) become
  int8, one scale per output row, half the bytes of bf16 (the measured error of each choice is in RESULTS.md).
- Any other checkpoint is quantized on load, as gpt-fast does: int8 per output row, int4 per group of 32 by the
  group's min and max.
--quant int4x8 runs the same numbers as int4 (4-bit blocks, int8 rows) through int8 dot products: each matmul input is
quantized to int8 per block of 32, as llama.cpp does, and multiplied by the codes with VNNI (kernels.int8_dots).
--quant int8 makes every matrix int8 from its values. The embedding table stays a dense lookup (one row a token), and
norms and biases stay dense too, all in the activations' dtype.
Left out: int4 on CUDA (torch's CUDA kernel takes another packing: refused), activation quantization, a quantized
KV cache.
"""

import torch
from torch import Tensor

from kernels import DENSE_ROWS, GROUP, QuantWeight, dense, on_huge_pages, pack_dots
from weights import INT4_TYPES  # the format weights.py writes (numpy only: no cycle)

INT4_MODES = ("int4", "int4x8")  # --quant's modes that run the 4-bit blocks
DENSE_TYPES = ("F32", "F16", "BF16")  # unquantized in the GGUF: quantized on load, as a Hugging Face checkpoint


def plan(quant: str, gguf_type: str | None, shape: tuple) -> str:
    """What --quant makes of one [out, in] matrix: "int4" or "int8". int4 keeps 4-bit blocks as they are and
    quantizes full-precision matrices group-wise; a block type of more bits is not cut to 4 (int8 keeps it closer).
    torch's int4 packing needs out % 16 == 0 and whole groups: other shapes take int8."""
    out, inp = shape
    fits = out % 16 == 0 and inp % GROUP == 0
    if quant in INT4_MODES and fits and (gguf_type is None or gguf_type in INT4_TYPES + DENSE_TYPES):
        return "int4"
    return "int8"


def int8_rows(w: Tensor, dtype: torch.dtype) -> QuantWeight:
    """Symmetric int8 with one scale per output row: q = round(w / s), s = max |w_row| / 127."""
    w = w.float()
    s = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero row stays zero
    q = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]
    return QuantWeight("int8", q, s.to(dtype), tuple(w.shape))


def minmax_groups(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """int4 codes for a dense w [out, in]: each group of 32 inputs spans its min .. max in 15 steps (gpt-fast's
    asymmetric scheme). Returns q [out, in] in 0..15, scale and offset [out, in / 32], w ~ q * scale + offset."""
    g = w.float().unflatten(1, (-1, GROUP))  # [out, in / 32, 32]
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)  # a constant group: q = 0, w = lo
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return q.flatten(1).to(torch.uint8), scale, lo


def int4_groups(q: Tensor, scale: Tensor, offset: Tensor, dtype: torch.dtype) -> QuantWeight:
    """Codes q [out, in] in 0..15 with w = q * scale + offset per group ([out, in / 32] each) -> the kernel's form,
    w = (q - 8) * scale + zero with zero = offset + 8 * scale; (scale, zero) laid out [in / 32, out, 2]."""
    zero = offset + 8 * scale  # fp32; each is rounded once, to the activations' dtype
    scales = torch.stack([scale, zero], -1).transpose(0, 1).to(dtype).contiguous()
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    return QuantWeight("int4", data, scales, tuple(q.shape))


def int4_dots(q: Tensor, scale: Tensor, offset: Tensor) -> QuantWeight:
    """int4_groups' numbers (bf16 scale and zero = offset + 8 * scale) in int8_dots' form, for --quant int4x8."""
    w, sz = pack_dots(q, scale, offset + 8 * scale, 4)
    return QuantWeight("dot4", w, sz, tuple(q.shape))


def int8_dots_of(m: QuantWeight) -> QuantWeight:
    """An int8 QuantWeight's numbers in int8_dots' form: codes q + 128 in 0..255 (VNNI multiplies unsigned by signed
    bytes), its row's scale (bf16 already: exact); a shape the kernel's tiles do not fit keeps torch's int8 kernel."""
    out, inp = m.shape
    if out % 16 or inp % GROUP:
        return m
    w, sz = pack_dots((m.data.to(torch.int16) + 128).to(torch.uint8), m.scales, None, 8)
    return QuantWeight("dot8", w, sz, m.shape)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """[out, in / 2] uint8, two codes a byte, the even column in the low nibble (weights.pack_nibbles) -> [out, in]
    in 0..15."""
    return torch.stack([packed & 15, packed >> 4], -1).flatten(1)


def int4_codes(ckpt, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """A matrix's int4 codes, scales and offsets: the GGUF's own where weights.py kept them, else min-max groups of its
    values, made a block of rows at a time (groups run along a row)."""
    kept = ckpt.blocks(name)
    if kept:
        return unpack_nibbles(kept["q"]), kept["scale"], kept["offset"]
    return tuple(map(torch.cat, zip(*(minmax_groups(w) for _, w in ckpt.blocks_of_rows(name)))))


def int8_values(ckpt, name: str, dtype: torch.dtype) -> QuantWeight:
    """int8_rows of a matrix, a block of rows at a time: each row has its own scale, so this is the same numbers as
    quantizing it whole, without its full-precision copy (the 1.5B's LM head: 0.9 GB in fp32)."""
    out, inp = ckpt.shape(name)
    q, s = torch.empty(out, inp, dtype=torch.int8), torch.empty(out, dtype=dtype)  # filled in place: no second copy
    for rows, w in ckpt.blocks_of_rows(name):
        part = int8_rows(w, dtype)
        q[rows], s[rows] = part.data, part.scales
    return QuantWeight("int8", q, s, (out, inp))


def fused_int8(items: list[QuantWeight]) -> QuantWeight:
    """Row blocks of int8 (each row its own scale) as one matrix."""
    if len(items) == 1:
        return items[0]
    return QuantWeight("int8", torch.cat([m.data for m in items]), torch.cat([m.scales for m in items]),
                       (sum(m.shape[0] for m in items), items[0].shape[1]))


def quantize(model, quant: str, ckpt):
    """Fill in every matrix of the model (placeholders until now, model.Transformer) in its quantized form, one at a
    time, from ckpt (model.Checkpoint: dense values, and the GGUF's 4-bit blocks and types where weights.py kept
    them). Row blocks of one fused matrix (q/k/v, gate/up) that get the same kind are fused; else they stay a tuple
    of parts, which kernels.linear concatenates."""
    dtype = model.model.embed_tokens.weight.dtype  # the activations'
    for owner, attr, names in model.matrices():
        runs = []  # [kind, its row blocks: int4 (q, scale, offset) or int8 QuantWeights] per run of one kind
        for name in names:
            kind = plan(quant, ckpt.types.get(name), ckpt.shape(name))
            item = int4_codes(ckpt, name) if kind == "int4" else int8_values(ckpt, name, dtype)
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(item)
            else:
                runs.append([kind, [item]])
        # int4x8: the same numbers in int8_dots' form
        four = int4_dots if quant == "int4x8" else lambda *codes: int4_groups(*codes, dtype)
        eight = int8_dots_of if quant == "int4x8" else lambda m: m
        made = [four(*map(torch.cat, zip(*items))) if kind == "int4" else eight(fused_int8(items))
                for kind, items in runs]
        if quant == "int4x8":  # streamed once a step: on 2 MiB pages where Linux gives them (kernels.py)
            on_huge_pages([m for m in made if m.kind in ("dot4", "dot8")])
        owner._parameters.pop(attr, None)  # a Linear's weight was a Parameter: a plain attribute from now on
        setattr(owner, attr, made[0] if len(made) == 1 else tuple(made))


def bf16_copies(model) -> int:
    """Give every quantized matrix a bf16 copy of its own values (kernels.dense: exactly what its kernel multiplies
    by, rounded once to bf16), which kernels.linear takes for steps of kernels.DENSE_ROWS rows or more. For batched
    sweeps and replays, on a CPU with bf16 units (kernels.bf16_units): the 1.5B's copies take 2.9 GiB beside its int4
    and int8 matrices. Returns their bytes."""
    made = 0
    for owner, attr, _ in model.matrices():
        w = getattr(owner, attr)
        for part in w if isinstance(w, tuple) else (w,):
            part.dense_cache = dense(part).to(torch.bfloat16).contiguous()
            part.codes = None  # dense() reads the copy from now on
            part.dense_rows = DENSE_ROWS
            made += part.dense_cache.nbytes
    return made
