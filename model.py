"""
A from-scratch Llama / Mistral / Qwen2 / Qwen3 forward pass and safetensors loading. Each forward runs a chunk of
tokens for every row of a batch (a prompt, a replayed chunk, one decode step), reading and writing the flat KV cache
of cache.py; rows may differ in length and position.

config.py reads and checks config.json (both transformers layouts); tokenizer.py holds the tokenizer and the chat
template. RoPE types: default, linear, llama3, yarn; sliding-window layers (Mistral, Qwen2/3) mask by token position.
Left out: training, dropout, dynamic-NTK RoPE (refused), MoE. References: Llama (https://arxiv.org/abs/2302.13971),
the HF `modeling_llama.py` key names and `modeling_rope_utils.py` formulas, YaRN (https://arxiv.org/abs/2309.00071),
gpt-fast and nano-vllm.
Laid out in three parts: RoPE; the modules and the forward; loading (every check on the safetensors headers first, then
each tensor read a block of rows at a time through Checkpoint, which quant.py reads from too).
"""

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from config import ACTIVATIONS, ModelConfig, ModelError, check_weights, read_json
from kernels import linear, rms_norm, rope
from quant import INT4_MODES, quantize, unpack_nibbles
from weights import SAMPLED_ROWS, SIDE, source_digest

# -----------------------------------------------------------------------------
# RoPE


def rope_frequencies(cfg: ModelConfig) -> tuple[Tensor, float]:
    """inv_freq [D/2] (fp64) and the attention scaling that multiplies cos and sin, for cfg's RoPE type.
    The formulas are transformers' modeling_rope_utils (HF half-split layout)."""
    D, theta = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    s = cfg.rope_scaling or {"rope_type": "default"}
    kind = s["rope_type"]
    if kind == "linear":  # position interpolation: every frequency slowed by `factor`
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":  # stretch low frequencies by `factor`, keep high ones, blend in between
        old = s["original_max_position_embeddings"]
        lo, hi, factor = s["low_freq_factor"], s["high_freq_factor"], s["factor"]
        smooth = ((old * inv_freq / (2 * math.pi) - lo) / (hi - lo)).clamp(0, 1)  # 0 = long wavelength
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    if kind == "yarn":  # interpolate the dimensions that rotate fewer than beta_slow times over the old context,
        # keep those that rotate more than beta_fast times, ramp linearly in between; then sharpen attention
        factor, old = s["factor"], s["original_max_position_embeddings"]  # config.py fills in the latter
        fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
        dim = lambda rotations: D * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = dim(fast), dim(slow)
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, D - 1)
        ramp = ((torch.arange(D // 2, dtype=torch.float64) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
        mscale = lambda m=1: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1
        scale = s.get("attention_factor")
        if scale is None:
            scale = mscale(s["mscale"]) / mscale(s["mscale_all_dim"]) if s.get("mscale") and s.get("mscale_all_dim") \
                else mscale()
        return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(scale)
    return inv_freq, 1.0


def rope_cos_sin(inv_freq: Tensor, scale: float, pos: Tensor) -> tuple[Tensor, Tensor]:
    """The RoPE tables for the token positions pos [B, T]: cos = [c, c] and sin = [-s, s], [B, T, D] fp32, so that
    rope(x) = x * cos + roll(x, D/2) * sin is HF's x * cos + rotate_half(x) * sin (kernels.rope)."""
    angles = pos.double()[..., None] * inv_freq  # fp64 so that position 100k stays exact
    c, s = (angles.cos() * scale).float(), (angles.sin() * scale).float()
    return torch.cat([c, c], -1), torch.cat([-s, s], -1)


# -----------------------------------------------------------------------------
# modules: names follow the HF safetensors keys, so loading is one loop


def weight(rows: int, cols: int, device="cpu", dtype=torch.float32) -> Tensor:
    """An HF-shaped [rows, cols] weight, i.e. [out, in]. The one layout rule: an fp32 weight on CPU is stored
    transposed, as a contiguous [in, out] buffer seen through a transposed view, the layout numpy's BLAS reads
    fastest (decode is a matrix-vector product per weight). The view keeps HF's names and shapes for loading;
    kernels.linear computes x @ w.T, which is x @ buffer. bf16 on CPU (oneDNN) and CUDA's GEMMs read [out, in]
    fastest, so there we keep it."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        return torch.empty(cols, rows, device=device, dtype=dtype).T
    return torch.empty(rows, cols, device=device, dtype=dtype)


class Linear(nn.Module):
    """Holds an HF-named weight (and bias); the matmul itself runs fused in the parent module."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def fused(rows: list[int], cols: int, bias: bool, kw: dict, mat: dict) -> tuple[Tensor, Tensor | None, list[Linear]]:
    """One [sum(rows), cols] weight whose row blocks are the HF-named Linear weights (views, no copy).
    e.g. q/k/v: decode then does one matmul instead of three; loading still copies by name.
    kw: device and dtype of the bias; mat: of the matrix (see Transformer)."""
    w = weight(sum(rows), cols, **mat)
    b = torch.zeros(sum(rows), **kw) if bias else None
    starts = [sum(rows[:i]) for i in range(len(rows))]
    parts = [Linear(w[o : o + n], None if b is None else b[o : o + n]) for o, n in zip(starts, rows)]
    return w, b, parts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **kw), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def attention_mask(k_pos: Tensor, q_pos: Tensor, window: int = 0) -> Tensor:
    """[B, H_kv, T, S] True where a query may read a slot: keys at or before its position (free slots sit at
    cache.FREE, after every query) and, on a sliding-window layer, less than `window` positions back.
    k_pos [B, H_kv, S] per head (heads keep different positions), q_pos [B, T]."""
    k, q = k_pos[:, :, None, :], q_pos[:, None, :, None]
    mask = k <= q
    return mask & (k > q - window) if window else mask


def eager_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """The attention math written out: fp32 scores, mask, softmax, @ V. The reference SDPA must match, and
    the memory wall of methods that need the weights: q [B, H_q, T, D], keys/values [B, H_kv, S, D]."""
    n_rep = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(n_rep, 1).float(), values.repeat_interleave(n_rep, 1).float()
    att = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H_q, T, S]
    if mask is not None:
        att = att.masked_fill(~mask.repeat_interleave(n_rep, 1), -math.inf)
    return (att.softmax(-1) @ v).to(q.dtype)


def pool_attention(q: Tensor, pool_k: Tensor, pool_v: Tensor, cache, layer: int, q_pos: Tensor, window: int = 0,
                   eager: bool = False) -> Tensor:
    """Attention over a pooled layer (cache.pool): query group h reads head h's segment alone, through one SDPA over
    the whole pool with a mask, no copy. q [B, H_q, T, D], pool_k/pool_v [B, 1, P, D], q_pos [B, T] -> [B, H_q, T, D].
    subtle: every query head stacks on the query axis of one head, so each pool slot is read once per step, as a
    uniform cache's slots are; the scores of the other heads' slots are computed and masked (H_kv x the products)."""
    B, H_q, T, D = q.shape
    own = cache.owners(layer)  # [B, H_kv, P]
    H_kv, P = own.shape[1:]
    pos = cache.pos[layer].view(B, 1, P)
    mask = own[:, :, None] & attention_mask(pos, q_pos, window)  # [B, H_kv, T, P]
    if eager:  # the written-out reference: each head's view of the pool (expanded, no copy), the same mask
        return eager_attention(q, pool_k.expand(B, H_kv, P, D), pool_v.expand(B, H_kv, P, D), mask)
    mask = mask.repeat_interleave(H_q // H_kv, 1).view(B, 1, H_q * T, P)  # query head i reads KV head i // n_rep
    y = F.scaled_dot_product_attention(q.reshape(B, 1, H_q * T, D), pool_k, pool_v, attn_mask=mask)
    return y.view(B, H_q, T, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kw: dict, mat: dict):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else 0
        self.eager = False  # set by Transformer.eager
        H_q, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.wqkv, self.bqkv, (self.q_proj, self.k_proj, self.v_proj) = fused(
            [H_q * D, H_kv * D, H_kv * D], cfg.hidden_size, cfg.qkv_bias, kw, mat
        )
        self.o_proj = Linear(weight(cfg.hidden_size, H_q * D, **mat))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache, chunk) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        B, T, _ = x.shape
        H_q, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = linear(x, self.wqkv)  # [B, T, (H_q + 2 H_kv) D]
        qkv = (qkv if self.bqkv is None else qkv + self.bqkv).view(B, T, H_q + 2 * H_kv, D).transpose(1, 2)
        qk, v = qkv[:, : H_q + H_kv], qkv[:, H_q + H_kv :]  # [B, H_q + H_kv, T, D], [B, H_kv, T, D]
        if cfg.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :H_q]), self.k_norm(qk[:, H_q:])], dim=1)
        # q and k rotate together in one call; keys are cached *after* RoPE so eviction never re-rotates
        q, k = rope(qk, cos, sin).split([H_q, H_kv], dim=1)  # [B, H_q, T, D], [B, H_kv, T, D]
        keys, values = cache.append(self.layer, k, v, q, chunk)  # [B, H_kv, S, D]; pooled: [B, 1, P, D]
        window = self.window if chunk.end > self.window else 0  # the window binds once a query is W past 0
        if cache.pooled:  # per-head budgets: each head's slots are a segment of one pool per (row, layer)
            y = pool_attention(q, keys, values, cache, self.layer, chunk.pos, window, self.eager)
        elif chunk.start is not None and T > 1 and not window and not self.eager:
            # every row alike: the held slots are all older than the chunk, which is causal among itself, i.e. a
            # causal mask aligned to the bottom right; SDPA takes it without building it (FlashAttention on CUDA),
            # and as plain is_causal when the chunk is all there is (T = S)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(T, keys.shape[2]),
                                               enable_gqa=True)
        else:
            # in a decode step of equally long rows every query reads every held slot; else mask by position
            plain = T == 1 and chunk.start is not None and not window
            mask = None if plain else attention_mask(cache.pos[self.layer, :, :, : keys.shape[2]], chunk.pos, window)
            if self.eager:  # the materialised [B, H_q, T, S] matrix attention-weight methods need (bench --eager)
                y = eager_attention(q, keys, values, mask)
            else:
                # subtle: stack each KV head's group of query heads along the query axis, so SDPA reads every
                # cached key once per group instead of us repeating K/V n_rep times
                qg = q.reshape(B, H_kv, cfg.n_rep * T, D)
                mask = None if mask is None else mask.repeat(1, 1, cfg.n_rep, 1)  # [B, H_kv, n_rep * T, S]
                y = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask).view(B, H_q, T, D)
        y = linear(y.transpose(1, 2).reshape(B, T, H_q * D), self.o_proj.weight)
        return y, q


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kw: dict, mat: dict):
        super().__init__()
        I = cfg.intermediate_size
        self.w13, _, (self.gate_proj, self.up_proj) = fused([I, I], cfg.hidden_size, False, kw, mat)
        self.down_proj = Linear(weight(cfg.hidden_size, I, **mat))
        self.act = ACTIVATIONS[cfg.hidden_act]  # SiLU (SwiGLU) in most configs; hidden_act may name GELU or ReLU

    def forward(self, x: Tensor) -> Tensor:
        gate, up = linear(x, self.w13).chunk(2, dim=-1)  # [B, T, I] each
        return linear(self.act(gate) * up, self.down_proj.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kw: dict, mat: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, layer, kw, mat)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, kw, mat)


class Inner(nn.Module):  # the HF "model." prefix
    def __init__(self, cfg: ModelConfig, kw: dict, mat: dict):
        super().__init__()
        # tied: the table is also the LM head's weight, so it takes the matmul layout (a lookup reads either); under
        # --quant the LM head has a matrix of its own (mat on the meta device) and the table is a lookup only
        tied = cfg.tie_word_embeddings and mat is kw
        table = weight(cfg.vocab_size, cfg.hidden_size, **kw) if tied else torch.empty(cfg.vocab_size,
                                                                                         cfg.hidden_size, **kw)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table, _freeze=True)
        self.layers = nn.ModuleList([Block(cfg, i, kw, mat) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


@dataclass
class Output:
    logits: Tensor  # [B, T, V], or [B, 1, V]: each row's last real position
    chunk: object  # the cache.Chunk this forward filled: real tokens per row, positions
    hidden: list[Tensor] | None = None  # per layer, its output residual stream [B, T, hidden]
    queries: list[Tensor] | None = None  # per layer, the post-RoPE queries [B, H_q, T, D]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device="cpu", dtype=torch.float32, quant: str | None = None):
        super().__init__()
        self.cfg, self.quant = cfg, quant
        kw = dict(device=device, dtype=dtype)
        # with --quant, quant.py fills in every matrix after loading: until then they are placeholders that take no
        # memory, and a tied LM head gets a matrix of its own (the embedding table stays a dense lookup)
        mat = dict(kw, device="meta") if quant else kw
        self.model = Inner(cfg, kw, mat)
        self.lm_head = None if cfg.tie_word_embeddings and not quant else \
            Linear(weight(cfg.vocab_size, cfg.hidden_size, **mat))
        inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.inv_freq = inv_freq.to(device)  # fp64, not a parameter: derived from the config, never loaded

    @property
    def eager(self) -> bool:
        return self.model.layers[0].self_attn.eager

    @eager.setter
    def eager(self, on: bool):
        for blk in self.model.layers:
            blk.self_attn.eager = on

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    def matrices(self):
        """(owner, attribute, HF names of its row blocks) for every matrix the forward multiplies by: what quant.py
        fills in, and what each decode step reads in full (bench's roofline)."""
        for i, blk in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            yield blk.self_attn, "wqkv", [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
            yield blk.self_attn.o_proj, "weight", [f"{p}self_attn.o_proj.weight"]
            yield blk.mlp, "w13", [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
            yield blk.mlp.down_proj, "weight", [f"{p}mlp.down_proj.weight"]
        tied = self.cfg.tie_word_embeddings
        yield (self.model.embed_tokens if self.lm_head is None else self.lm_head), "weight", \
            ["model.embed_tokens.weight" if tied else "lm_head.weight"]

    def forward(self, tokens: Tensor, cache, n: list[int] | None = None, all_logits: bool = False,
                collect: bool = False) -> Output:
        """Run tokens [B, T] at each row's next positions, appending their K/V to the cache. Row b takes its
        first n[b] tokens (default all T); the rest of its columns is padding, computed and dropped.
        all_logits=False returns only each row's last real position's logits (a long prefill never builds
        [T, V]). collect=True also hands back each layer's hidden state and queries, for the scorers."""
        B, T = tokens.shape
        chunk = cache.chunk(T, n)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, chunk.pos)  # once per forward, for every layer
        x = self.model.embed_tokens(tokens)  # [B, T, hidden]
        hidden, queries = ([], []) if collect else (None, None)
        for blk in self.model.layers:
            a, q = blk.self_attn(blk.input_layernorm(x), cos, sin, cache, chunk)
            x = x + a
            x = x + blk.mlp(blk.post_attention_layernorm(x))
            if collect:
                hidden.append(x)
                queries.append(q)
        cache.advance(chunk)
        if not all_logits:  # each row's last real token (padding columns sit after it)
            x = x[:, -1:] if chunk.start is not None else x[torch.arange(B), chunk.last][:, None]
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return Output(linear(x, w).float(), chunk, hidden, queries)


# -----------------------------------------------------------------------------
# loading


def weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers reads: model.safetensors, else those model.safetensors.index.json names.
    Any other file beside them (e.g. Mistral's consolidated.safetensors, the same weights in another layout) is left."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise ModelError(f"no model.safetensors or model.safetensors.index.json in {path}: convert the checkpoint to "
                         "Hugging Face safetensors first")
    names = read_json(index).get("weight_map")
    if not isinstance(names, dict) or not names or not all(isinstance(f, str) for f in names.values()):
        raise ModelError(f"{index}: weight_map must map each tensor name to its file name: re-download the model")
    files = [path / f for f in sorted(set(names.values()))]
    for f in files:
        if not f.is_file():
            raise ModelError(f"{index} names {f.name}, which is not in {path}: download the missing shard")
    return files


@contextmanager
def opened(file: Path):
    """safe_open(file) on the CPU; a damaged file is one ModelError line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise ModelError(f"corrupt safetensors file {file}: {e} (re-download or re-convert it)") from None


FLOAT_DTYPES = ("F32", "F64", "F16", "BF16")  # safetensors' names for the dtypes a weight may be stored in


def garbled(name: str, missing: list[str]) -> str | None:
    """Whether an unknown tensor name is a damaged copy of an expected one: the missing name of the same length that
    differs from it in the fewest characters (at most 4, or a third of the name), or "" for a name with bytes no tensor
    name holds; None for a name that is not damaged (a variant's extra tensor, such as an o_proj bias, matches no
    missing name)."""
    near = [(sum(a != b for a, b in zip(m, name)), m) for m in missing if len(m) == len(name)]
    if near and min(near)[0] <= max(4, len(name) // 3):  # a few bytes overwritten in place (a run of 8 too)
        return min(near)[1]
    return "" if not name.isascii() or not name.isprintable() else None


def load_model(path: str | Path, device="cpu", dtype=torch.float32, quant: str | None = None) -> Transformer:
    """Build the model for path's config.json and copy in its safetensors (single file or sharded). Every check
    reads only the safetensors headers and a model on the meta device, so a mismatch stops before any allocation.
    quant ("int8", "int4" or "int4x8"): the matrices are made weight-only quantized, one at a time (quant.py)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist: pass --model a Hugging Face model directory")
    cfg = ModelConfig.from_hf(path)
    files = weight_files(path)
    shapes, dtypes = {}, {}  # tensor name -> (file name, shape); -> its stored dtype ("F32", "BF16", "I8", ...)
    for file in files:
        with opened(file) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shapes[name], dtypes[name] = (file.name, sl.get_shape()), sl.get_dtype()
    check_weights(cfg, shapes, path)  # config.json's sizes against the tensors, each mismatch naming its key
    want = {name: list(p.shape) for name, p in Transformer(cfg, "meta").named_parameters()}  # costs no memory
    missing = [name for name in want if name not in shapes]
    for name, (file, shape) in shapes.items():
        if name not in want:
            if name == "lm_head.weight" and cfg.tie_word_embeddings or name.endswith("rotary_emb.inv_freq"):
                continue  # tied or derived: nothing to load
            damaged = garbled(name, missing)
            if damaged is not None:
                where = f" where nanokv's {cfg.model_type} model expects {damaged!r}" if damaged else ""
                raise ModelError(f"{path / file} is corrupt: its header names a tensor {name!r}{where}: re-download "
                                 "or re-convert it")
            if missing:  # a variant adds tensors (a bias) to a complete set; a header that lacks one is damaged
                raise ModelError(f"{path / file} is corrupt: its header names a tensor {name!r} that nanokv's "
                                 f"{cfg.model_type} model has no place for, and lacks {missing[0]!r}: re-download or "
                                 "re-convert it")
            raise ModelError(f"tensor {name} in {file} has no place in nanokv's {cfg.model_type} model: this "
                             "checkpoint variant is unsupported")
        if dtypes[name] not in FLOAT_DTYPES:  # nanokv's own int8/int4 are made on load, or kept apart (weights.SIDE)
            raise ModelError(f"tensor {name} in {file} is stored as {dtypes[name]}: nanokv reads weights stored as "
                             f"{', '.join(FLOAT_DTYPES)} (for 8 or 4 bits, load such a checkpoint with --quant)")
        if shape != want[name]:
            raise ModelError(f"tensor {name} in {file} has shape {shape}, expected {want[name]}: the weights do not "
                             "match config.json")
    if missing:
        raise ModelError(f"tensor {missing[0]} missing from the checkpoint in {path} ({len(missing)} missing in all): "
                         "the weights do not match config.json")
    ckpt = Checkpoint(path, shapes)
    if quant in INT4_MODES:
        ckpt.check_side()  # before the model takes memory
    model = Transformer(cfg, device, dtype, quant)
    for name, p in model.named_parameters():
        if name in shapes and not p.is_meta:  # a matrix to quantize is a placeholder
            for rows, block in ckpt.blocks_of_rows(name):  # a few MB at a time: no second copy of the embedding
                p[rows].copy_(block)
    if quant:
        quantize(model, quant, ckpt)
    model.path = path  # where it came from: what a policy calibrates on it is cached beside it (triattention.py)
    return model.eval()


STORED = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}


def header(file: Path) -> tuple[dict, dict]:
    """A safetensors file's tensor entries by name (dtype, shape, data_offsets, and where they sit: file, start) and
    its metadata, from its header (checked by opened() before)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    meta = head.pop("__metadata__", None) or {}
    return {name: dict(e, file=file, start=8 + n) for name, e in head.items()}, meta


READ_BYTES = 2**24  # how much of a tensor is read at a time


def side_file(path: str | Path) -> Path | None:
    """The 4-bit blocks weights.py kept beside a model (weights.SIDE), or None where there are none. Something else of
    that name (a folder, a dangling link, a device) is refused: taking it for "none" would make --quant int4 quantize
    anew by min and max, another model's numbers, behind one note."""
    side = Path(path) / SIDE
    if side.is_file():
        return side
    if os.path.lexists(side):
        what = "a folder" if side.is_dir() else "a link to nothing" if side.is_symlink() and not side.exists() else \
            "not a regular file"
        raise ModelError(f"{side} is {what}, not the 4-bit blocks weights.py writes: remove it (--quant int4 then "
                         "quantizes by min and max) or convert the model again")
    return None


class Checkpoint:
    """A checkpoint's tensors by HF name, read a block of rows at a time, for loading and quant.py; and what weights.py
    kept beside a model it converted from a GGUF (quant.SIDE): the 4-bit matrices' codes, scales and offsets, and every
    tensor's GGUF type. note: we read with plain file reads at the header's offsets, not through safetensors' memory
    map: the pages of a mapped file count in the process's resident memory while it is open, so loading the 1.5B
    through it peaked at 5.4 GB for 1.8 GB of model (RESULTS.md, "Memory of a plain int4 run")."""

    def __init__(self, path: Path, shapes: dict):
        self.path, self.shapes, self.side = path, shapes, path / SIDE  # shapes: name -> (file name, shape)
        self.types, self.kept, self.entries = {}, set(), {}  # entries: name -> its header entry (dtype, shape, offsets)
        for file in sorted({f for f, _ in shapes.values()}):
            self.entries |= {name: e for name, e in header(path / file)[0].items() if name in shapes}
        self.source = None  # the fingerprint of the weights the side file was made beside (weights.source_digest)
        if self.side.is_file():  # read for --quant int4 only, which refuses anything else of its name (side_file)
            with opened(self.side):  # a damaged side file is one line
                pass
            parts, meta = header(self.side)
            self.entries |= parts  # "<name>.q", "<name>.scale", "<name>.offset"
            self.types = self.side_types(meta.get("gguf_types", "{}"), {k: e["shape"] for k, e in parts.items()})
            self.source = meta.get("source")
            self.kept = {k.rsplit(".", 1)[0] for k in parts}

    def check_side(self):
        """Refuse 4-bit blocks made beside other weights than this directory's model.safetensors (replaced or edited
        since): --quant int4 would run the old model's numbers, silently. The side file records its source's
        fingerprint; one made before that field is checked by its content instead: SAMPLED_ROWS rows of each kept
        matrix, q * scale + offset, must be the fp32 file's values (weights.convert writes them so, bit for bit)."""
        fp32 = self.path / "model.safetensors"
        side_file(self.path)  # a folder or a dangling link of its name is refused, not taken for none
        if not self.kept:
            return
        if self.source is not None:
            ok = fp32.is_file() and source_digest(fp32) == self.source
        else:
            ok = all(self.kept_rows_match(name) for name in self.kept)
        if not ok:
            raise ModelError(f"{self.side} was not made from the weights in {fp32} (they were replaced or edited "
                             f"since): delete {self.side.name} to quantize these weights anew by min and max, or "
                             "convert the model again (python weights.py --force for a named one)")

    def kept_rows_match(self, name: str) -> bool:
        if name not in self.entries:
            return False
        n, inp = self.shape(name)
        if self.entries[f"{name}.q"]["shape"] != [n, inp // 2]:
            return False
        for r in sorted({round(i * (n - 1) / (SAMPLED_ROWS - 1)) for i in range(SAMPLED_ROWS)}):  # as source_digest
            q, scale, offset = (self.rows(f"{name}.{part}", r, r + 1) for part in ("q", "scale", "offset"))
            made = unpack_nibbles(q).float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
            if not torch.allclose(made, self.rows(name, r, r + 1).float(), rtol=1e-6, atol=1e-7):
                return False
        return True

    def side_types(self, types: str, got: dict) -> dict:
        """The side file's GGUF types (name -> type), after checking that it is this model's: its types a JSON object of
        this model's tensors, and per kept matrix [out, in] its codes [out, in / 2], scales and offsets [out, in / 32].
        One line naming the file where not (another model's, or damaged), never a traceback in quant.py."""
        fix = f"{self.side} is not this model's ({{}}): delete it, or for a named model rerun 'python weights.py " \
            "--force'"
        try:
            types = json.loads(types)
        except (ValueError, RecursionError):
            types = None
        if not isinstance(types, dict) or not all(isinstance(v, str) for v in types.values()):
            raise ModelError(fix.format("its gguf_types is not a JSON object of tensor types"))
        stray = next((n for n in types if n not in self.shapes), None)
        if stray:
            raise ModelError(fix.format(f"it types a tensor {stray!r} that the model does not have"))
        for key, shape in got.items():
            name, part = key.rsplit(".", 1) if "." in key else (key, "")
            if name not in self.shapes or part not in ("q", "scale", "offset"):
                raise ModelError(fix.format(f"it holds {key!r}, which is no part of the model's matrices"))
            out, inp = self.shape(name)
            want = [out, inp // 2] if part == "q" else [out, inp // 32]
            if list(shape) != want:
                raise ModelError(fix.format(f"{key} has shape {list(shape)}, where {name} {[out, inp]} needs {want}"))
        return types

    def shape(self, name: str) -> tuple:
        return tuple(self.shapes[name][1])

    def rows(self, name: str, a: int, b: int) -> Tensor:
        """Rows a .. b - 1 of a stored tensor (its whole self for a 1-D one), in its stored dtype: one read."""
        e = self.entries[name]
        shape, vector = e["shape"], len(e["shape"]) == 1
        a, b, shape = (0, 1, (1, *shape)) if vector else (a, b, shape)  # a vector is read as one row
        dtype = STORED[e["dtype"]]
        row = math.prod(shape[1:]) * dtype.itemsize  # bytes per row
        with open(e["file"], "rb") as f:
            data = bytearray(os.pread(f.fileno(), (b - a) * row, e["start"] + e["data_offsets"][0] + a * row))
        t = torch.frombuffer(data, dtype=dtype).view(b - a, *shape[1:])
        return t[0] if vector else t

    def blocks_of_rows(self, name: str):
        """(slice, rows) over a tensor, READ_BYTES at a time: what its loading holds beside the model."""
        shape = self.shape(name)
        if len(shape) < 2:
            yield slice(None), self.rows(name, 0, 1)
            return
        step = max(1, READ_BYTES // (math.prod(shape[1:]) * STORED[self.entries[name]["dtype"]].itemsize))
        for a in range(0, shape[0], step):
            b = min(a + step, shape[0])
            yield slice(a, b), self.rows(name, a, b)

    def read(self, name: str) -> Tensor:
        return self.rows(name, 0, self.entries[name]["shape"][0])

    def blocks(self, name: str) -> dict | None:
        if name not in self.kept:
            return None
        return {part: self.read(f"{name}.{part}") for part in ("q", "scale", "offset")}
