"""
config.json -> ModelConfig, read the way transformers 5.24 reads it for the four model types nanokv runs, and every
key we read checked here, before anything is allocated: type, range, and (check_weights) the sizes against the
tensors in the safetensors headers. A bad value is one ModelError line naming the file, the key and the fix.
A key config.json leaves out takes the default of transformers' config class for that model_type; a key that model
type does not have (a window on Llama) is ignored, as transformers ignores it. Left out: keys only training reads.
References: transformers' configuration_{llama,mistral,qwen2,qwen3}.py, PreTrainedConfig's RoPE standardisation and
modeling_rope_utils.py, ACT2FN in activations.py.
"""

import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch.nn.functional as F


class ModelError(Exception):
    """A user-facing problem with a model directory: the message names it and the fix."""


def read_json(path: Path) -> dict:
    """A JSON object from path, or a one-line ModelError naming the file."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is not valid JSON ({e}): re-download or re-convert the model") from None
    if not isinstance(obj, dict):
        raise ModelError(f"{path} holds a JSON {type(obj).__name__}, not an object: re-download the model")
    return obj


# -----------------------------------------------------------------------------
# what we read, and what a missing key means

# hidden_act -> the MLP's gate activation, as transformers' ACT2FN defines each name ("gelu" is the exact erf form)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}

# transformers 5.24's default for each key we read, per model_type (the fields of LlamaConfig, MistralConfig,
# Qwen2Config, Qwen3Config). A key absent here is one that model type does not have, so we never read it: Llama has
# no window, Mistral no layer_types. None = derived: num_key_value_heads = num_attention_heads (Llama-1 has no GQA),
# head_dim = hidden_size // num_attention_heads.
_ANY = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=None, hidden_act="silu",
            rms_norm_eps=1e-6, tie_word_embeddings=False)  # rope_theta: rope_settings
_QWEN = dict(_ANY, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, max_position_embeddings=32768,
             use_sliding_window=False, sliding_window=4096, max_window_layers=28)
DEFAULTS = {
    "llama": dict(_ANY, vocab_size=32000, intermediate_size=11008, num_key_value_heads=None,
                  max_position_embeddings=2048, attention_bias=False, mlp_bias=False),
    "mistral": dict(_ANY, vocab_size=32000, intermediate_size=14336, num_key_value_heads=8,
                    max_position_embeddings=131072, sliding_window=4096),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=128, attention_bias=False),
}
NULL_OK = {"num_key_value_heads", "head_dim", "sliding_window"}  # null: derived as above (a window: none)


def whole(low: int, high: float = math.inf):  # JSON integers only: 30.0 is refused, as transformers refuses it
    want = f"a whole number >= {low}" if high == math.inf else f"a whole number from {low} to {high:,}"
    return lambda v: type(v) is int and low <= v <= high, want


def number(above: float = -math.inf):
    want = f"a number above {above:g}" if above > -math.inf else "a number"
    return lambda v: type(v) in (int, float) and math.isfinite(v) and v > above, want


FLAG = (lambda v: type(v) is bool, "true or false")
RULES = {  # key -> (test, what it expects)
    **dict.fromkeys(["vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "max_position_embeddings", "sliding_window", "original_max_position_embeddings"],
                    whole(1)),
    "num_hidden_layers": whole(1, 10**6),  # we list a type per layer before the weights can say 10**12 is wrong
    "max_window_layers": whole(0),
    "rms_norm_eps": number(0), "rope_theta": number(1), "factor": number(0),
    **dict.fromkeys(["low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
                     "mscale_all_dim", "partial_rotary_factor"], number()),
    **dict.fromkeys(["tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "truncate"], FLAG),
    "hidden_act": (lambda v: isinstance(v, str) and v in ACTIVATIONS,
                   f"one of {', '.join(ACTIVATIONS)} (nanokv implements no other)"),
}
ROPE_FIELDS = {  # the numbers each supported RoPE type needs (modeling_rope_utils)
    "default": (), "linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")  # may be null


def check(path: Path, key: str, v, where: str = ""):
    """v, if it passes key's rule; else a ModelError naming the file and the key. where: the dict it sits in."""
    test, want = RULES[key]
    if not test(v):
        raise ModelError(f"{path}: {where}{key} is {json.dumps(v)}, expected {want}: fix it in {path.name}")
    return v


def token_ids(v, path: Path) -> list[int]:
    """eos_token_id as config.json or generation_config.json writes it: an id, a list of ids, or null (none)."""
    ids = [] if v is None else v if isinstance(v, list) else [v]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise ModelError(f"{path}: eos_token_id is {json.dumps(v)}, expected a token id, a list of them or null: "
                         f"fix it in {path.name}")
    return ids


# -----------------------------------------------------------------------------
# the config


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
    hidden_act: str = "silu"  # the MLP's gate activation, a key of ACTIVATIONS
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3" | "yarn", ...}; None = default RoPE
    max_position_embeddings: int = 8192  # the longest sequence we accept
    sliding_window: int = 0  # W: a sliding layer's query at q sees keys q - W < k <= q (0 = none)
    layer_types: list[str] = field(default_factory=list)  # per layer "full_attention" or "sliding_attention"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k before RoPE
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.n_rep = self.num_attention_heads // self.num_key_value_heads  # query heads per KV head
        self.layer_types = self.layer_types or ["full_attention"] * self.num_hidden_layers

    @classmethod
    def from_hf(cls, path: str | Path) -> "ModelConfig":
        """Read and check a Hugging Face config.json (a file or the directory holding it), in either layout."""
        path = Path(path)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ModelError(f"no config.json in {path.parent}: pass --model a Hugging Face model directory")
        c = read_json(path)
        mt = c.get("model_type")
        if not isinstance(mt, str) or mt not in DEFAULTS:
            raise ModelError(f"unsupported model_type {mt!r} in {path}: nanokv supports {', '.join(DEFAULTS)}")
        default = DEFAULTS[mt]

        def get(key):  # config.json's value, else transformers' default for this model type; checked
            v = c.get(key, default[key])
            return None if v is None and key in NULL_OK else check(path, key, v)

        kw = {k: get(k) for k in default if k in cls.__dataclass_fields__}
        H, E = kw["num_attention_heads"], kw["hidden_size"]
        kw["num_key_value_heads"] = kw["num_key_value_heads"] or H
        if kw["head_dim"] is None and E < H:
            raise ModelError(f"{path}: hidden_size {E} // num_attention_heads {H} leaves no head_dim: set head_dim "
                             "or fix the two sizes")
        kw["head_dim"] = kw["head_dim"] or E // H
        if kw["head_dim"] % 2:
            raise ModelError(f"{path}: head_dim is {kw['head_dim']}, but RoPE rotates pairs of dimensions: it must be "
                             f"even (fix head_dim, hidden_size or num_attention_heads in {path.name})")
        if H % kw["num_key_value_heads"]:
            how = "" if "num_key_value_heads" in c else f" (transformers' {mt} default, as {path.name} has none)"
            raise ModelError(f"{path}: num_attention_heads {H} is not a multiple of num_key_value_heads "
                             f"{kw['num_key_value_heads']}{how}: GQA needs whole groups, fix num_key_value_heads")
        for key in ("attention_bias", "mlp_bias"):  # Llama's and Qwen3's attention_bias biases o_proj as well
            if key in default and get(key):
                raise ModelError(f"{path}: {key} is true, which gives {mt} an {'o_proj' if key[0] == 'a' else 'MLP'} "
                                 "bias: nanokv has none, so it refuses this variant")
        theta, scaling = rope_settings(c, path, kw["max_position_embeddings"])
        kw.update(model_type=mt, rope_theta=theta, rope_scaling=scaling, qkv_bias=mt == "qwen2", qk_norm=mt == "qwen3",
                  eos_token_id=token_ids(c.get("eos_token_id"), path),
                  **sliding_settings(c, mt, kw["num_hidden_layers"], get, path))
        return cls(**kw)


def rope_settings(c: dict, path: Path, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5's rope_parameters or transformers 4's top-level keys."""
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(c.get(key) or {}, dict):
            raise ModelError(f"{path}: {key} is {json.dumps(c[key])}, expected a dict of RoPE settings or null")
    if any(isinstance(v, dict) for v in (c.get("rope_parameters") or {}).values()):
        raise ModelError(f"{path}: rope_parameters must be one dict of RoPE settings (per-layer-type RoPE, as in "
                         "Gemma 3, is not supported)")
    # transformers' precedence (PreTrainedConfig.convert_rope_params_to_dict): a non-empty rope_scaling wins over
    # rope_parameters; rope_theta then comes from the winning dict, else the top-level key, else 10000
    where = "rope_scaling." if c.get("rope_scaling") else "rope_parameters."
    s = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    theta = check(path, "rope_theta", s.pop("rope_theta") if "rope_theta" in s else c.get("rope_theta", 10000.0))
    kind = s.pop("rope_type", s.pop("type", "default"))
    partial_factor = s.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial_factor is not None and check(path, "partial_rotary_factor", partial_factor) != 1:
        raise ModelError(f"{path}: partial_rotary_factor {partial_factor} would rotate part of each head; nanokv "
                         "rotates whole heads (transformers 5.24 ignores the key for default RoPE and fails for scaled "
                         "RoPE), so it refuses this config")
    if kind == "dynamic":
        raise ModelError(f"{path}: dynamic-NTK RoPE re-rotates every position as the sequence grows, which "
                         "post-RoPE cached keys cannot follow: nanokv refuses it (use a default/yarn config)")
    if not isinstance(kind, str) or kind not in ROPE_FIELDS:
        raise ModelError(f"{path}: unsupported RoPE type {kind!r}: nanokv implements {', '.join(ROPE_FIELDS)}")
    if kind in ("llama3", "yarn"):
        # subtle: a top-level original_max_position_embeddings (as some long-context checkpoints write it) wins over
        # the dict's, as in transformers' standardize_rope_params; without either it is max_position_embeddings
        old = "original_max_position_embeddings"
        s[old] = check(path, old, c[old]) if old in c else s.get(old, max_pos)
    for key in ROPE_FIELDS[kind]:
        if key not in s:
            raise ModelError(f"{path}: RoPE type {kind!r} needs {where}{key}: add it to {path.name}")
        check(path, key, s[key], where)
    for key in YARN_OPTIONAL if kind == "yarn" else ():
        if s.get(key) is not None:
            check(path, key, s[key], where)
    if kind == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        raise ModelError(f"{path}: llama3 RoPE blends between low_freq_factor and high_freq_factor, so "
                         f"high_freq_factor must exceed low_freq_factor: fix them in {path.name}")
    return float(theta), None if kind == "default" else {"rope_type": kind, **s}


def sliding_settings(c: dict, mt: str, L: int, get, path: Path) -> dict:
    """sliding_window and the per-layer types, as transformers decides them: Llama has no window (it ignores window
    keys); Mistral slides every layer when sliding_window is set (default 4096); Qwen2/3 only with use_sliding_window,
    from layer max_window_layers on. An explicit layer_types wins (transformers reads such a Mistral as Ministral)."""
    if mt == "llama":
        return {"sliding_window": 0, "layer_types": ["full_attention"] * L}
    window = get("sliding_window")
    qwen = mt in ("qwen2", "qwen3")
    window = window if not qwen or get("use_sliding_window") else None
    types = c.get("layer_types")
    if types is None:
        first = get("max_window_layers") if qwen else 0
        types = ["sliding_attention" if window and i >= first else "full_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or not all(isinstance(t, str) for t in types):
        raise ModelError(f"{path}: layer_types must list one type for each of the {L} layers")
    bad = set(types) - {"full_attention", "sliding_attention"}
    if bad:
        raise ModelError(f"{path}: unsupported layer type {sorted(bad)[0]!r}: nanokv runs full_attention and "
                         "sliding_attention layers")
    if not window:  # a sliding layer without a window size sees everything (transformers 5.24 refuses such a config)
        types = ["full_attention"] * L
    return {"sliding_window": window or 0, "layer_types": types}


# -----------------------------------------------------------------------------
# the sizes against the weights


def check_weights(cfg: ModelConfig, shapes: dict[str, tuple[str, list[int]]], path: Path):
    """config.json's sizes against the tensors (name -> (file, shape), from the safetensors headers), before the model
    is allocated: vocab_size 10**12 would ask for petabytes, and 100,000 layers would take minutes to build."""
    cfg_file = path / "config.json"
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if not layers:
        raise ModelError(f"no model.layers.* tensors in the weights of {path}: not a Hugging Face Llama-style "
                         "checkpoint")
    if cfg.num_hidden_layers != max(layers) + 1 and layers == set(range(max(layers) + 1)):  # else a damaged name
        raise ModelError(f"{cfg_file}: num_hidden_layers is {cfg.num_hidden_layers}, but the weights hold layers 0 to "
                         f"{max(layers)}: set num_hidden_layers to {max(layers) + 1}")
    H_q, H_kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for name, dim, want, key in [
        ("model.embed_tokens.weight", 0, cfg.vocab_size, "vocab_size"),
        ("model.embed_tokens.weight", 1, cfg.hidden_size, "hidden_size"),
        ("model.layers.0.mlp.gate_proj.weight", 0, cfg.intermediate_size, "intermediate_size"),
        ("model.layers.0.self_attn.q_proj.weight", 0, H_q * D, f"num_attention_heads x head_dim ({H_q} x {D})"),
        ("model.layers.0.self_attn.k_proj.weight", 0, H_kv * D, f"num_key_value_heads x head_dim ({H_kv} x {D})"),
    ]:
        file, shape = shapes.get(name, (None, None))
        if shape is not None and len(shape) == 2 and shape[dim] != want:
            raise ModelError(f"{cfg_file}: {key} is {want}, but {name} in {file} has {shape[dim]} "
                             f"{'rows' if dim == 0 else 'columns'}: fix {key.split(' (')[0].replace(' x ', ' or ')} "
                             "in config.json")
