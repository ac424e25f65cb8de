"""
A from-scratch Llama / Mistral / Qwen2 / Qwen3 forward pass, safetensors loading, and the tokenizer with
its chat template. Each forward runs a chunk of tokens (a prompt, a replayed chunk, one decode step),
reading and writing the flat KV cache of cache.py.

Deliberately left out: training, dropout, sliding-window attention (we refuse sequences past the window),
rope scaling other than Llama-3's, MoE. References: Llama (https://arxiv.org/abs/2302.13971), the HF
`modeling_llama.py` key names, gpt-fast and nano-vllm for the shape of a small inference model.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kernels import rms_norm, rope

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class ModelError(Exception):
    """A user-facing problem with a model directory: the message names it and the fix."""


# -----------------------------------------------------------------------------
# config


@dataclass
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads (Qwen3 sets it explicitly)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only Llama-3's {"rope_type": "llama3", ...}
    max_position_embeddings: int = 8192  # the longest sequence we accept (lowered to a sliding window, if any)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k before RoPE
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        assert self.num_attention_heads % self.num_key_value_heads == 0, "GQA needs H_q divisible by H_kv"
        self.n_rep = self.num_attention_heads // self.num_key_value_heads  # query heads per KV head

    @classmethod
    def from_hf(cls, path: str | Path) -> "ModelConfig":
        """Read a Hugging Face config.json (a file or the directory holding it)."""
        path = Path(path)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ModelError(f"no config.json in {path.parent}: pass --model a Hugging Face model directory")
        c = json.loads(path.read_text())
        mt = c.get("model_type")
        if mt not in SUPPORTED:
            raise ModelError(f"unsupported model_type {mt!r} in {path}: nanokv supports {', '.join(SUPPORTED)}")
        scaling = c.get("rope_scaling")
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ModelError(f"unsupported rope_scaling type {kind!r} in {path}: only 'llama3' is implemented")
        max_pos = c.get("max_position_embeddings", 8192)
        # note: we attend over the whole cache, so a sliding window caps the length we can serve exactly
        window = c.get("sliding_window") if c.get("use_sliding_window", mt == "mistral") else None
        eos = c.get("eos_token_id")
        fields = cls.__dataclass_fields__
        kw = {k: v for k, v in c.items() if k in fields and v is not None}
        kw.update(
            model_type=mt,
            rope_scaling=scaling if kind == "llama3" else None,
            max_position_embeddings=min(max_pos, window or max_pos),
            qkv_bias=mt == "qwen2" or bool(c.get("attention_bias", False)),
            qk_norm=mt == "qwen3",
            eos_token_id=eos if isinstance(eos, list) else [] if eos is None else [eos],
        )
        return cls(**kw)


def rope_cos_sin(cfg: ModelConfig, pos: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, D/2] in fp32 for the token positions pos [T] (HF half-split layout)."""
    D = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, device=pos.device, dtype=torch.float64) / D)
    if cfg.rope_scaling:  # Llama-3: stretch low frequencies by `factor`, keep high ones, blend in between
        s = cfg.rope_scaling
        old = s["original_max_position_embeddings"]
        lo, hi, factor = s["low_freq_factor"], s["high_freq_factor"], s["factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0 = long wavelength, 1 = short
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    angles = pos.double()[:, None] * inv_freq[None, :]  # [T, D/2]; fp64 so position 100k stays exact
    return angles.cos().float(), angles.sin().float()


# -----------------------------------------------------------------------------
# modules: names follow the HF safetensors keys, so loading is one loop


class Linear(nn.Module):
    """Holds an HF-named weight (and bias); the matmul itself runs fused in the parent module."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def fused(rows: list[int], cols: int, bias: bool, **kw) -> tuple[Tensor, Tensor | None, list[Linear]]:
    """One [sum(rows), cols] weight whose row blocks are the HF-named Linear weights (views, no copy).
    e.g. q/k/v: decode then does one matmul instead of three; loading still copies by name."""
    w = torch.empty(sum(rows), cols, **kw)
    b = torch.zeros(sum(rows), **kw) if bias else None
    parts = [
        Linear(w[o : o + n], None if b is None else b[o : o + n])
        for o, n in zip([sum(rows[:i]) for i in range(len(rows))], rows)
    ]
    return w, b, parts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **kw), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def eager_attention(q: Tensor, keys: Tensor, values: Tensor, S0: int) -> Tensor:
    """The attention math written out: fp32 scores, causal mask, softmax, @ V. The reference SDPA must match,
    and the memory wall of methods that need the weights: q [B, H_q, T, D], keys/values [B, H_kv, S, D]."""
    n_rep = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(n_rep, 1).float(), values.repeat_interleave(n_rep, 1).float()
    att = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H_q, T, S]
    T, S = att.shape[-2:]
    causal = torch.arange(S, device=q.device)[None, :] <= torch.arange(S0, S0 + T, device=q.device)[:, None]
    return (att.masked_fill(~causal, -math.inf).softmax(-1) @ v).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, **kw):
        super().__init__()
        self.cfg = cfg
        self.eager = False  # set by Transformer.eager
        H_q, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.wqkv, self.bqkv, (self.q_proj, self.k_proj, self.v_proj) = fused(
            [H_q * D, H_kv * D, H_kv * D], cfg.hidden_size, cfg.qkv_bias, **kw
        )
        self.o_proj = Linear(torch.empty(cfg.hidden_size, H_q * D, **kw))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache, layer: int) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        B, T, _ = x.shape
        H_q, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = F.linear(x, self.wqkv, self.bqkv).view(B, T, H_q + 2 * H_kv, D)
        qk, v = qkv[:, :, : H_q + H_kv], qkv[:, :, H_q + H_kv :].transpose(1, 2)  # v: [B, H_kv, T, D]
        if cfg.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :, :H_q]), self.k_norm(qk[:, :, H_q:])], dim=2)
        # q and k rotate together in one call; keys are cached *after* RoPE so eviction never re-rotates
        qk = rope(qk.transpose(1, 2), cos, sin)  # [B, H_q + H_kv, T, D]
        q, k = qk[:, :H_q], qk[:, H_q:]
        S0 = cache.length[layer]
        keys, values = cache.append(layer, k, v, q)  # [B, H_kv, S, D], S = S0 + T
        if self.eager:  # the materialised [B, H_q, T, S] matrix attention-weight methods need (bench --eager)
            y = eager_attention(q, keys, values, S0)
        elif S0 == 0 and T > 1:  # prefill into an empty cache: plain causal attention (FlashAttention on CUDA)
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            # subtle: stack each KV head's group of query heads along the query axis, so SDPA reads every
            # cached key once per group instead of us repeating K/V n_rep times.
            qg = q.reshape(B, H_kv, cfg.n_rep * T, D)
            mask = None
            if T > 1:  # a chunk after cached slots: old slots are all earlier, new ones causal among themselves
                S = keys.shape[2]
                mask = torch.arange(S, device=x.device)[None, :] <= torch.arange(S0, S, device=x.device)[:, None]
                mask = mask.repeat(cfg.n_rep, 1)  # [n_rep * T, S]
            y = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask).view(B, H_q, T, D)
        y = F.linear(y.transpose(1, 2).reshape(B, T, H_q * D), self.o_proj.weight)
        return y, q


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, **kw):
        super().__init__()
        I = cfg.intermediate_size
        self.w13, _, (self.gate_proj, self.up_proj) = fused([I, I], cfg.hidden_size, False, **kw)
        self.down_proj = Linear(torch.empty(cfg.hidden_size, I, **kw))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.w13).chunk(2, dim=-1)  # SwiGLU
        return F.linear(F.silu(gate) * up, self.down_proj.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, **kw)


class Inner(nn.Module):  # the HF "model." prefix
    def __init__(self, cfg: ModelConfig, **kw):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw).requires_grad_(False)
        self.layers = nn.ModuleList([Block(cfg, **kw) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


@dataclass
class Output:
    logits: Tensor  # [B, T, V] (or [B, 1, V] for the last position only)
    hidden: list[Tensor] | None = None  # per layer, its output residual stream [B, T, hidden]
    queries: list[Tensor] | None = None  # per layer, the post-RoPE queries [B, H_q, T, D]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device="cpu", dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        kw = dict(device=device, dtype=dtype)
        self.model = Inner(cfg, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw))

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

    def forward(self, tokens: Tensor, cache, all_logits: bool = False, collect: bool = False) -> Output:
        """Run tokens [B, T] at positions cache.next_pos ... + T - 1, appending their K/V to the cache.
        all_logits=False returns only the last position's logits (a long prefill never builds [T, V]).
        collect=True also hands back each layer's hidden state and queries, for the scorers."""
        T = tokens.shape[1]
        pos = torch.arange(cache.next_pos, cache.next_pos + T, device=tokens.device)
        cos, sin = rope_cos_sin(self.cfg, pos)  # once per forward, shared by every layer
        x = self.model.embed_tokens(tokens)  # [B, T, hidden]
        hidden, queries = ([], []) if collect else (None, None)
        for i, blk in enumerate(self.model.layers):
            a, q = blk.self_attn(blk.input_layernorm(x), cos, sin, cache, i)
            x = x + a
            x = x + blk.mlp(blk.post_attention_layernorm(x))
            if collect:
                hidden.append(x)
                queries.append(q)
        cache.advance(T)
        x = self.model.norm(x if all_logits else x[:, -1:])
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return Output(F.linear(x, w).float(), hidden, queries)


# -----------------------------------------------------------------------------
# loading


def load_model(path: str | Path, device="cpu", dtype=torch.float32) -> Transformer:
    """Build the model for path's config.json and copy in its safetensors (single file or sharded)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist: pass --model a Hugging Face model directory")
    cfg = ModelConfig.from_hf(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    files = [path / f for f in files] or sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors weights in {path}: convert the checkpoint to safetensors first")
    model = Transformer(cfg, device, dtype)
    want = dict(model.named_parameters())
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in want:
                        tied = name == "lm_head.weight" and cfg.tie_word_embeddings
                        if tied or name.endswith("rotary_emb.inv_freq"):
                            continue  # derived or tied: nothing to load
                        raise ModelError(f"tensor {name} in {file.name} has no place in nanokv's {cfg.model_type} "
                                         "model (e.g. an o_proj or MLP bias): this checkpoint variant is unsupported")
                    t, p = f.get_tensor(name), want.pop(name)
                    if t.shape != p.shape:
                        raise ModelError(f"tensor {name} in {file.name} has shape {list(t.shape)}, expected "
                                         f"{list(p.shape)}: the weights do not match config.json")
                    p.copy_(t)
        except (SafetensorError, OSError) as e:
            raise ModelError(f"corrupt safetensors file {file}: {e} (re-download or re-convert it)") from None
    if want:
        raise ModelError(f"tensor {next(iter(want))} missing from the checkpoint in {path} "
                         f"({len(want)} missing in all): the weights do not match config.json")
    return model.eval()


# -----------------------------------------------------------------------------
# tokenizer and chat template


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelError(f"no tokenizer.json in {path}: nanokv needs a Hugging Face fast tokenizer")
        self.tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tc = path / "tokenizer_config.json"
        self.config = json.loads(tc.read_text()) if tc.exists() else {}
        template = self.config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        self.template = template
        special = lambda k: (lambda t: t["content"] if isinstance(t, dict) else t)(self.config.get(k)) or ""
        self.bos_token, self.eos_token = special("bos_token"), special("eos_token")
        cfg = ModelConfig.from_hf(path)
        gen = path / "generation_config.json"
        extra = json.loads(gen.read_text()).get("eos_token_id", []) if gen.exists() else []
        eos = set(cfg.eos_token_id) | set(extra if isinstance(extra, list) else [extra])
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos.add(self.tok.token_to_id(self.eos_token))
        self.eos_ids = sorted(eos)

    def encode(self, text: str) -> list[int]:
        # the chat template already writes BOS (if any) as text, so we add no special tokens here
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's own Jinja chat template, as HF's apply_chat_template does."""
        if not self.template:  # a base model: plain text, turn after turn
            return "\n".join(m["content"] for m in messages) + "\n"
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ModelError(f"chat template error: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token,
        )
