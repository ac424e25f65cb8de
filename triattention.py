"""
TriAttention (https://arxiv.org/abs/2604.04921, code: WeianMao/triattention): score cached keys by the attention that
*future* queries are expected to pay them, predicted from RoPE's frequencies and per-head query statistics measured
once on calibration text. The family of scorers that read positions and frequencies, not attention.

Parts: the statistics (`FreqStats`; `calibrate` runs one forward pass over the repository's own MATH-500 text;
`load_authors_file` reads the authors' `torch.save` format; `prepare` caches them beside the model, keyed by its
weights); the score (`head_scores`, the fast form; `triattention`, the authors' z-score and their two aggregations).

Keys here are cached after RoPE; the authors un-rotate them by their positions. We rotate the query statistics
instead: a post-RoPE key is k' = k e^{i w p} per frequency pair, so q̄ conj(k) e^{i w (t - p + o)} = q̄ e^{i w (t + o)}
conj(k'). That is one rotation per (head, frequency) and round instead of one per cached slot, and it is exact.
Left out: the authors' 1e-6 tie-breaking noise (ties between float scores do not occur), sampled-head subsets.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from cache import KVCache
from config import ModelError

CAL_TOKENS = 4096  # calibration length: the authors allow <= 32k; 4k tokens of MATH-500 keep it near a minute on a CPU
CAL_CHUNK = 1024  # tokens per forward pass of the calibration (its memory stays that of a 1k prefill)
OFFSETS = [2.0**i for i in range(17)]  # the authors' future offsets 1, 2, 4, ..., 65536 (offset_max_length 65536)
CAL_TEXT = Path(__file__).parent / "data" / "math500.jsonl"


class CalibrationError(ModelError):
    """Statistics that do not fit the model: one line for the user (generate.main prints ModelError's)."""


@dataclass
class FreqStats:
    """Per layer, query head and RoPE frequency f: the complex mean q̄ of pre-RoPE queries and the mean modulus E|q_f|;
    the model's frequencies w_f. Complex pairs are (x_f, x_{f + D/2}), HF's half-split layout."""

    q_mean: Tensor  # [L, H_q, F] complex64
    q_abs: Tensor  # [L, H_q, F] float32
    inv_freq: Tensor  # [F] float64

    def offset_weight(self) -> Tensor:
        """mean over offsets o of e^{i w_f o}, [F] complex128: the mean over the 17 future queries, folded."""
        o = torch.tensor(OFFSETS, dtype=torch.float64, device=self.inv_freq.device)
        angle = o[:, None] * self.inv_freq  # [17, F]
        return torch.polar(torch.ones_like(angle), angle).mean(0)


# -----------------------------------------------------------------------------
# calibration


def calibration_ids(tok, vocab: int, n: int) -> list[int]:
    """n token ids of the MATH-500 problems and solutions shipped in data/ (tok=None: the text's bytes, for the tests'
    random models, which have no tokenizer)."""
    rows = [json.loads(line) for line in CAL_TEXT.read_text().splitlines()]
    text = "\n\n".join(r["problem"] + "\n" + r["solution"] for r in rows)
    ids = tok.encode(text[: 8 * n]) if tok else [b % vocab for b in text.encode()]  # ~4 characters a token
    return ids[:n]


@torch.inference_mode()
def calibrate(model, ids: list[int]) -> FreqStats:
    """One pass of ids through the model (chunks of CAL_CHUNK, a full cache): per layer and query head, the complex
    mean and mean modulus of each frequency of the pre-RoPE queries, as the authors' scripts/calibrate.py computes them.
    The model hands back post-RoPE queries; we un-rotate them by their positions (and RoPE's attention scaling).
    subtle: the authors' queries are q_proj's output, taken before q_norm. On a model with q_norm (Qwen3's layout)
    those are not the queries it attends with, and the authors' run-time scoring reads its statistics file against
    the cached (k_norm'ed) keys as it is: so we take q_proj's output there too (queries_before_norm), and an authors'
    file and our own hold the same statistic. Without q_norm the two are the same numbers up to rounding."""

    cfg, dev = model.cfg, model.device
    L, H_q, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    F = D // 2
    cache = KVCache(L, 1, cfg.num_key_value_heads, D, len(ids), device=dev, dtype=model.model.embed_tokens.weight.dtype)
    q_sum = torch.zeros(L, H_q, F, dtype=torch.complex128, device=dev)
    abs_sum = torch.zeros(L, H_q, F, dtype=torch.float64, device=dev)
    for s in range(0, len(ids), CAL_CHUNK):
        x = torch.tensor([ids[s : s + CAL_CHUNK]], device=dev)  # [1, T]
        out = model(x, cache, collect=True)
        angle = -out.chunk.pos[0, :, None].double() * model.inv_freq  # [T, F]
        back = torch.polar(torch.ones_like(angle), angle)  # e^{-i w p}: RoPE undone
        pre = queries_before_norm(model, x, out) if cfg.qk_norm else None
        for l, q in enumerate(out.queries):  # [1, H_q, T, D] post-RoPE
            if pre is None:  # [H_q, T, F]
                z = torch.complex(q[0, ..., :F].double(), q[0, ..., F:].double()) * back / model.rope_scale
            else:
                z = torch.complex(pre[l][..., :F].double(), pre[l][..., F:].double())  # pre-RoPE already
            q_sum[l] += z.sum(1)
            abs_sum[l] += z.abs().sum(1)
    n = len(ids)
    return FreqStats((q_sum / n).to(torch.complex64), (abs_sum / n).float(), model.inv_freq.double())


def queries_before_norm(model, x: Tensor, out) -> list[Tensor]:
    """Per layer, q_proj's output for the chunk x [1, T] (bias included, before q_norm and RoPE), [H_q, T, D]: what the
    authors' calibration hook computes from each attention layer's input. out: the chunk's forward with collect=True."""
    from kernels import linear

    cfg = model.cfg
    H_q, D = cfg.num_attention_heads, cfg.head_dim
    h, qs = model.model.embed_tokens(x), []  # the residual stream entering layer 0, [1, T, hidden]
    for l, blk in enumerate(model.model.layers):
        att = blk.self_attn  # the fused q/k/v matmul, as the forward runs it (any weight kind), then q's rows
        qkv = linear(blk.input_layernorm(h), att.wqkv)
        q = (qkv if att.bqkv is None else qkv + att.bqkv)[0, :, : H_q * D]  # [T, H_q * D]
        qs.append(q.view(-1, H_q, D).transpose(0, 1))
        h = out.hidden[l]  # layer l's output: layer l + 1's input
    return qs


def to_authors_format(stats: FreqStats, meta: dict) -> dict:
    """The authors' file layout: {"metadata": {...}, "stats": {"layerXX_headYY": {q_mean_real, q_mean_imag,
    q_abs_mean}}}, every head listed in metadata["sampled_heads"]."""
    L, H_q, F = stats.q_abs.shape
    heads = [[l, h] for l in range(L) for h in range(H_q)]
    body = {f"layer{l:02d}_head{h:02d}": {"q_mean_real": stats.q_mean[l, h].real.cpu(),
                                          "q_mean_imag": stats.q_mean[l, h].imag.cpu(),
                                          "q_abs_mean": stats.q_abs[l, h].cpu()} for l, h in heads}
    return {"metadata": {"head_dim": 2 * F, "rope_style": "half", "num_traces": 1, "sampled_heads": heads, **meta},
            "stats": body}


FIELDS = ("q_mean_real", "q_mean_imag", "q_abs_mean")  # per head, each [D / 2]


def from_authors_format(payload, cfg, inv_freq: Tensor, name: str) -> FreqStats:
    """FreqStats of a loaded authors' file, every value checked here, when it loads, rather than at the first eviction
    after decoding began: one line naming what is wrong (not a dict, a head missing, a head dim that is not a number,
    a vector of the wrong length or type, NaN or inf) or made for another shape of model."""
    fix = "make one with the authors' scripts/calibrate.py, or drop the flag (nanokv then calibrates it itself)"
    bad = lambda what: CalibrationError(f"{name} {what}: {fix}")
    if not isinstance(payload, dict) or not isinstance(payload.get("metadata"), dict) or \
            not isinstance(payload.get("stats"), dict):
        raise bad("is not a TriAttention statistics file (a torch.save dict with a 'metadata' dict and a 'stats' dict)")
    meta, body = payload["metadata"], payload["stats"]
    pair = lambda x: isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                          for v in x)
    if not isinstance(meta.get("sampled_heads"), (list, tuple)) or not all(map(pair, meta["sampled_heads"])):
        raise bad("has no metadata 'sampled_heads' as a list of [layer, head] pairs of integers")
    heads = {tuple(x) for x in meta["sampled_heads"]}
    L, H_q, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    d = meta.get("head_dim", D)
    if not isinstance(d, int) or isinstance(d, bool):
        raise bad(f"gives head_dim {d!r}, not an integer")
    n_layers, n_heads = len({l for l, _ in heads}), len({h for _, h in heads})
    if (n_layers, n_heads, d) != (L, H_q, D) or heads != {(l, h) for l in range(L) for h in range(H_q)}:
        raise CalibrationError(f"{name} holds {n_layers} layers x {n_heads} query heads of dim {d} ({len(heads)} "
                               f"heads); the model has {L} x {H_q} of dim {D}: calibrate for this model, or drop the "
                               "flag (nanokv then calibrates it itself)")
    if meta.get("rope_style", "half") != "half":
        raise CalibrationError(f"{name} pairs RoPE dims as {meta['rope_style']!r}; nanokv's are half-split")
    for l, h in sorted(heads):
        key = f"layer{l:02d}_head{h:02d}"
        entry = body.get(key)
        if not isinstance(entry, dict):
            raise bad(f"has no statistics for {key} (a dict of {', '.join(FIELDS)}), though its sampled_heads list it")
        for k in FIELDS:
            v = entry.get(k)
            if not isinstance(v, Tensor) or not v.is_floating_point() or tuple(v.shape) != (D // 2,):
                got = f"a tensor of {v.dtype} {tuple(v.shape)}" if isinstance(v, Tensor) else type(v).__name__
                raise bad(f"holds {got} for {key}'s {k}, not a float tensor of the model's D / 2 = {D // 2} "
                          "frequencies")
            if not v.isfinite().all():
                raise bad(f"holds NaN or inf in {key}'s {k}")
    get = lambda l, h, k: body[f"layer{l:02d}_head{h:02d}"][k].float()
    grid = lambda k: torch.stack([torch.stack([get(l, h, k) for h in range(H_q)]) for l in range(L)])  # [L, H_q, F]
    dev = inv_freq.device
    return FreqStats(torch.complex(grid("q_mean_real"), grid("q_mean_imag")).to(dev), grid("q_abs_mean").to(dev),
                     inv_freq.double())


def load_authors_file(path: str, cfg, inv_freq: Tensor) -> FreqStats:
    """The authors' file at path, read by torch's safe loader (weights_only: a pickle of code is refused, never run)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001: text, a pickle of code, a truncated zip: each its own exception type
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CalibrationError(f"cannot read the TriAttention statistics {path} ({why}): pass a torch.save file in "
                               "the authors' format (scripts/calibrate.py), or drop the flag") from None
    return from_authors_format(payload, cfg, inv_freq, path)


def weights_key(model) -> str:
    """What the statistics depend on: the weight files (name, size, modification time: a model converted again is
    new), how they are run (quantization, dtype), and the calibration text and length."""
    files = sorted(Path(model.path).glob("*.safetensors")) if getattr(model, "path", None) else []
    parts = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    parts += [model.quant, str(model.model.embed_tokens.weight.dtype), CAL_TOKENS, CAL_CHUNK,
              hashlib.sha256(CAL_TEXT.read_bytes()).hexdigest()]
    parts += ["q_proj before q_norm"] if model.cfg.qk_norm else []  # statistics saved before that rule are stale
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def prepare(model, stats_file: str | None = None) -> FreqStats:
    """The statistics the scorer reads: from stats_file (the authors' format), else from triattention-stats*.pt beside
    the model when its key matches, else calibrated now (and saved there, in the authors' format)."""
    if stats_file:
        return load_authors_file(stats_file, model.cfg, model.inv_freq)
    path = getattr(model, "path", None)
    key = weights_key(model)
    where = Path(path) / f"triattention-stats{'-' + model.quant if model.quant else ''}.pt" if path else None
    if where and where.is_file():
        try:
            payload = torch.load(where, map_location="cpu", weights_only=True)
            if payload["metadata"].get("nanokv_key") == key:
                return from_authors_format(payload, model.cfg, model.inv_freq, str(where))
        except (OSError, RuntimeError, EOFError, KeyError, CalibrationError):
            pass  # unreadable or stale: calibrate again
    tok = None
    if path and any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        from tokenizer import Tokenizer

        tok = Tokenizer(path)
    n = min(CAL_TOKENS, model.cfg.max_position_embeddings)
    stats = calibrate(model, calibration_ids(tok, model.cfg.vocab_size, n))
    if where:
        try:
            torch.save(to_authors_format(stats, {"nanokv_key": key, "text": CAL_TEXT.name, "tokens": n}), where)
        except OSError:
            pass  # a read-only model directory: calibrate again next time
    return stats


# -----------------------------------------------------------------------------
# the score


def head_scores(stats: FreqStats, layer: int, keys: Tensor, t: Tensor) -> Tensor:
    """The authors' per-query-head score of each post-RoPE key [B, H_kv, S, D] for the round at next position t [B]:
        mean over offsets o of  sum_f |q̄_f| |k_f| cos(w_f (t - p + o) + arg(q̄_f conj(k_f)))  +  sum_f (E|q_f| - |q̄_f|) |k_f|
    with the mean over o folded into one complex weight a_f = q̄_f e^{i w_f t} mean_o e^{i w_f o}, so the first sum is
    Re(sum_f a_f conj(k'_f)): one matmul of the keys with [Re a, Im a]; the second one of |k'_f| with the gaps.
    (RoPE's attention scaling, which the authors square in, is one constant per model: no ranking changes.) -> [B, H_q, S]"""
    B, H_kv, S, D = keys.shape
    F = D // 2
    H_q = stats.q_abs.shape[1]
    angle = t.double()[:, None] * stats.inv_freq  # [B, F]
    turn = torch.polar(torch.ones_like(angle), angle)  # e^{i w t}
    a = stats.q_mean[layer] * (turn * stats.offset_weight()).to(torch.complex64)[:, None]  # [B, H_q, F]
    gap = (stats.q_abs[layer] - stats.q_mean[layer].abs()).expand(B, H_q, F)  # [B, H_q, F]
    group = lambda x: x.reshape(B, H_kv, H_q // H_kv, -1).transpose(-1, -2)  # [B, H_q, n] -> [B, H_kv, n, rep]
    k = keys.float()
    s = k @ group(torch.cat([a.real, a.imag], -1))  # [B, H_kv, S, rep]: Re(a . conj(k'))
    s += torch.hypot(k[..., :F], k[..., F:]) @ group(gap)  # |k'_f| = |k_f|: RoPE turns, never stretches
    return s.transpose(-1, -2).reshape(B, H_q, S)


def zscore(s: Tensor, candidates: Tensor) -> Tensor:
    """Each head's scores [B, H, S] standardised over its candidate slots (bool [B, H, S]), population std, floor 1e-6
    (the authors' normalize_scores)."""
    m = candidates.float()
    n = m.sum(-1, keepdim=True).clamp(min=1)
    mean = (s * m).sum(-1, keepdim=True) / n
    std = (((s - mean) * m).square().sum(-1, keepdim=True) / n).sqrt().clamp(min=1e-6)
    return (s - mean) / std


def layer_vote(ctx, layer: int, keys: Tensor) -> Tensor:
    """One layer's vote [B, H_kv, S]: each query head's score z-scored over the candidates, max over the GQA group."""
    B, H_kv, S, _ = keys.shape
    stats = ctx.stats if ctx.stats is not None else uncalibrated(ctx)
    t = ctx.pos.flatten(1).amax(-1) + 1  # [B]: every held slot is in the past; the newest is the last token fed
    s = head_scores(stats, layer, keys, t)  # [B, H_q, S]
    cand = ~ctx.protected.repeat_interleave(s.shape[1] // H_kv, dim=1)  # [B, H_q, S]
    return zscore(s, cand).view(B, H_kv, -1, S).amax(2)


def triattention(ctx, shared: bool = True) -> Tensor:
    """TriAttention (https://arxiv.org/abs/2604.04921). shared=True, the authors' default (per_head_pruning): one index
    set per KV head for every layer, the mean over layers of each layer's vote, computed once a round. Every layer
    then keeps the same positions, so slot j means the same token in all of them. shared=False
    (per_layer_perhead_pruning): each layer keeps by its own vote."""
    if not shared:
        return layer_vote(ctx, ctx.layer, ctx.keys)
    if "tri" not in ctx.memo:
        keys = ctx.all_kv[0]  # [L, B, H_kv, S, D]
        ctx.memo["tri"] = torch.stack([layer_vote(ctx, l, keys[l]) for l in range(len(keys))]).mean(0)
    return ctx.memo["tri"]


def uncalibrated(ctx) -> FreqStats:
    """Statistics for a ScoreCtx built by hand without any (the tests' random contexts): q̄ = 0 and E|q_f| = 1, so a
    key scores sum_f |k_f|. generate.make_cache always hands the scorer real ones."""
    cfg = ctx.cfg
    L, H_q, F = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim // 2
    inv = 1.0 / 10000.0 ** (torch.arange(F, dtype=torch.float64, device=ctx.keys.device) / F)
    return FreqStats(torch.zeros(L, H_q, F, dtype=torch.complex64, device=ctx.keys.device),
                     torch.ones(L, H_q, F, device=ctx.keys.device), inv)
