"""
nanokv's tests, CPU only: consistency checks (cached decode = full forward), reference checks (an independent
naive forward; Triton kernels against their torch references in the Triton interpreter), hand-worked cases
for every scorer, eviction invariants, the default model, and one-line messages for bad input.
Run: python -m pytest -q test_all.py
"""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU, fp32 only

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import bench
import eval as ev
import generate as G
import kernels
import policies as P
from model import ModelConfig, ModelError, Tokenizer, load_model

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = dict(atol=1e-5, rtol=1e-5)

# -----------------------------------------------------------------------------
# tiny random models of each architecture, written as HF directories


ARCHS = {
    "llama-gqa": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", tie_word_embeddings=True),
    "qwen2-bias": dict(model_type="qwen2"),
    "qwen3-qknorm": dict(model_type="qwen3", head_dim=24),
    "llama3-rope": dict(model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0, original_max_position_embeddings=32)),
}


def tiny_dir(path, seed=0, **over) -> str:
    """Write config.json + random model.safetensors with the HF key names (no model.py involved)."""
    c = dict(model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=0)
    c.update(over)
    os.makedirs(path, exist_ok=True)
    json.dump(c, open(os.path.join(path, "config.json"), "w"))
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1
    H, Hk, D = c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    E, I = c["hidden_size"], c["intermediate_size"]
    sd = {"model.embed_tokens.weight": r(c["vocab_size"], E) * 10, "model.norm.weight": 1 + r(E)}
    if not c["tie_word_embeddings"]:
        sd["lm_head.weight"] = r(c["vocab_size"], E)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": r(H * D, E), p + "self_attn.k_proj.weight": r(Hk * D, E),
               p + "self_attn.v_proj.weight": r(Hk * D, E), p + "self_attn.o_proj.weight": r(E, H * D),
               p + "mlp.gate_proj.weight": r(I, E), p + "mlp.up_proj.weight": r(I, E), p + "mlp.down_proj.weight": r(E, I),
               p + "input_layernorm.weight": 1 + r(E), p + "post_attention_layernorm.weight": 1 + r(E)}
        if c["model_type"] == "qwen2":
            sd |= {p + f"self_attn.{n}_proj.bias": r(m * D) for n, m in [("q", H), ("k", Hk), ("v", Hk)]}
        if c["model_type"] == "qwen3":
            sd |= {p + "self_attn.q_norm.weight": 1 + r(D), p + "self_attn.k_norm.weight": 1 + r(D)}
    save_file(sd, os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_dir(str(tmp_path_factory.mktemp("tiny"))))


def naive_forward(path, tokens):
    """An independent reference: plain matmuls, explicit softmax, HF rotate-half RoPE. tokens [T] -> logits [T, V]."""
    from safetensors.torch import load_file

    c, w = json.load(open(os.path.join(path, "config.json"))), load_file(os.path.join(path, "model.safetensors"))
    H, Hk, E = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    D, T = c.get("head_dim", E // H), len(tokens)
    rms = lambda x, g: x / torch.sqrt((x * x).mean(-1, keepdim=True) + c["rms_norm_eps"]) * g
    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, D, 2).double() / D)
    if c.get("rope_scaling"):  # Llama-3 piecewise: low frequencies / factor, high kept, linear blend between
        s = c["rope_scaling"]
        lo_w, hi_w = s["original_max_position_embeddings"] / s["low_freq_factor"], s["original_max_position_embeddings"] / s["high_freq_factor"]
        new = []
        for f in inv.tolist():
            wl = 2 * math.pi / f
            if wl < hi_w:
                new.append(f)
            elif wl > lo_w:
                new.append(f / s["factor"])
            else:
                a = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
                new.append((1 - a) * f / s["factor"] + a * f)
        inv = torch.tensor(new, dtype=torch.float64)
    ang = torch.arange(T).double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()  # [T, D]
    rot = lambda x: x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        proj = lambda n: h @ w[p + f"self_attn.{n}_proj.weight"].T + w.get(p + f"self_attn.{n}_proj.bias", 0)
        q, k, v = proj("q").view(T, H, D), proj("k").view(T, Hk, D), proj("v").view(T, Hk, D)
        if c["model_type"] == "qwen3":
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        heads = []
        for hd in range(H):
            qh, kh, vh = rot(q[:, hd]), rot(k[:, hd // (H // Hk)]), v[:, hd // (H // Hk)]
            s = qh @ kh.T / math.sqrt(D) + torch.full((T, T), -1e9).triu(1)
            e = (s - s.max(-1, keepdim=True).values).exp()
            heads.append((e / e.sum(-1, keepdim=True)) @ vh)
        x = x + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def full_logits(model, tokens, chunks=None):
    """Logits [T, V] of tokens [T] through a full cache, fed in one go or in the given chunk sizes."""
    run = G.make_run("full", None, 64, None, 1)
    cache = G.make_cache(model, run, len(tokens))
    with torch.inference_mode():
        parts = torch.split(tokens, chunks or len(tokens))
        return torch.cat([G.feed(model, cache, t[None], run, all_logits=True)[0] for t in parts])


# -----------------------------------------------------------------------------
# model


@pytest.mark.parametrize("arch", ARCHS)
def test_model_matches_naive_reference(arch, tmp_path):
    """model.py's forward equals a naive matmul-and-softmax forward for each architecture variant."""
    path = tiny_dir(str(tmp_path), **ARCHS[arch])
    tokens = torch.randint(0, 101, (45,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(full_logits(load_model(path), tokens), naive_forward(path, tokens), atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    """A checkpoint split in two shards with model.safetensors.index.json loads to the same logits."""
    from safetensors.torch import load_file

    path = tiny_dir(str(tmp_path / "one"))
    sd, shard = load_file(os.path.join(path, "model.safetensors")), str(tmp_path / "two")
    tiny_dir(shard)
    os.remove(os.path.join(shard, "model.safetensors"))
    names = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in parts.items():
        save_file({n: sd[n] for n in ns}, os.path.join(shard, f))
    json.dump({"weight_map": {n: f for f, ns in parts.items() for n in ns}}, open(os.path.join(shard, "model.safetensors.index.json"), "w"))
    tokens = torch.arange(1, 20)
    torch.testing.assert_close(full_logits(load_model(shard), tokens), full_logits(load_model(path), tokens))


def test_cached_decode_equals_full_forward(tiny):
    """Token-by-token decode through the cache gives the logits of one full forward (fp32)."""
    tokens = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(full_logits(tiny, tokens, 1), full_logits(tiny, tokens), **TOL)
    torch.testing.assert_close(full_logits(tiny, tokens, 7), full_logits(tiny, tokens), **TOL)


def test_eager_attention_matches_sdpa(tiny):
    """The materialised-matrix attention (bench --eager) gives the SDPA path's logits."""
    tokens = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(3))
    ref = full_logits(tiny, tokens)
    tiny.eager = True
    try:
        torch.testing.assert_close(full_logits(tiny, tokens, 8), ref, **TOL)
    finally:
        tiny.eager = False


# -----------------------------------------------------------------------------
# kernels: Triton (in the interpreter) against the torch references, on irregular shapes


def cos_sin(T, D):
    ang = torch.arange(T).float()[:, None] / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("shape", [(3, 37), (5, 64), (2, 3, 576)])
def test_rms_norm_triton_matches_ref(shape):
    """The RMSNorm kernel equals the HF-semantics reference, including 3-d input."""
    x, w = torch.randn(shape), torch.randn(shape[-1])
    torch.testing.assert_close(kernels.rms_norm_triton(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6), **TOL)


@pytest.mark.parametrize("T,D", [(1, 64), (37, 64), (37, 128)])
def test_rope_triton_matches_ref_on_strided_view(T, D):
    """The RoPE kernel equals the reference on a non-contiguous view cut from a fused qkv projection."""
    x = torch.randn(2, T, 3 * 3 * D)[..., : 3 * D].view(2, T, 3, D).transpose(1, 2)  # [B, H, T, D], strided
    torch.testing.assert_close(kernels.rope_triton(x, *cos_sin(T, D)), kernels.rope_ref(x, *cos_sin(T, D)), **TOL)


def test_rope_ref_is_a_rotation():
    """RoPE keeps each head vector's norm and is the identity at position 0."""
    x = torch.randn(1, 2, 5, 8)
    y = kernels.rope_ref(x, *cos_sin(5, 8))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), **TOL)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0], **TOL)


def window_case(B, H_q, H_kv, W, S, D, seed=0):
    """Random q/k, each head holding a shuffled subset of positions, an empty ring slot and a keyless query."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H_q, W, D, generator=g), torch.randn(B, H_kv, S, D, generator=g)
    k_pos = torch.stack([torch.randperm(2 * S, generator=g)[:S] + 1 for _ in range(B * H_kv)], -1)
    k_pos = k_pos.view(S, B, H_kv).permute(1, 2, 0)  # [B, H_kv, S], non-contiguous
    q_pos = torch.randint(0, 2 * S, (W,), generator=g)
    if W > 1:
        q_pos[0], q_pos[-1] = -1, 0  # an empty ring slot; a query older than every key
    return q, k, q_pos, k_pos


@pytest.mark.parametrize("S", [37, 130])
@pytest.mark.parametrize("W", [1, 8, 64])
@pytest.mark.parametrize("H_q,H_kv", [(4, 4), (8, 2)])
def test_window_attn_mass_triton_matches_ref(S, W, H_q, H_kv):
    """The two-pass fused scorer equals the materialising reference: GQA, causal positions, empty queries."""
    args = (*window_case(2, H_q, H_kv, W, S, 16), 0.25)
    torch.testing.assert_close(kernels.window_attn_mass_triton(*args), kernels.window_attn_mass_ref(*args), **TOL)


def test_window_attn_mass_triton_long_window():
    """A window longer than one 128-query launch (W=200, D=64) still matches the reference."""
    args = (*window_case(1, 2, 1, 200, 37, 64, seed=1), 0.125)
    torch.testing.assert_close(kernels.window_attn_mass_triton(*args), kernels.window_attn_mass_ref(*args), **TOL)


def test_window_attn_mass_hand_worked():
    """One query, two keys with logits 0 and ln 3: masses 1/4 and 3/4; a keyless query adds 0, not NaN."""
    q, k = torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[[[0.0, 5.0], [math.log(3.0), 0.0]]]])
    for fn in (kernels.window_attn_mass_ref, kernels.window_attn_mass_triton):
        torch.testing.assert_close(fn(q, k, torch.tensor([1]), torch.tensor([[[0, 1]]]), 1.0), torch.tensor([[[0.25, 0.75]]]))
        assert (fn(q, k, torch.tensor([1]), torch.tensor([[[3, 4]]]), 1.0) == 0).all()


# -----------------------------------------------------------------------------
# scorers on hand-made tensors


def ctx_for(S=24, B=1, H_kv=2, n_rep=2, D=8, w=6, seed=0, budget=12, buffer=4, prompt=3, dtype=torch.float32, rnd=0,
            qscale=1.0):
    """A ScoreCtx over random keys/values at positions 0..S-1, the last w positions as queries."""
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(hidden_size=16, num_attention_heads=H_kv * n_rep, num_key_value_heads=H_kv, head_dim=D,
                      num_hidden_layers=2)
    k, v = (torch.randn(B, H_kv, S, D, generator=g).to(dtype) for _ in range(2))
    pos = torch.arange(S).expand(B, H_kv, S)
    protected = (pos < prompt) | (pos >= S - buffer)
    side = {"h2o": torch.rand(B, H_kv, S, generator=g), "epikv": torch.randn(B, 1, S, generator=g).expand(B, H_kv, S),
            "vnorm": torch.zeros(B, H_kv, S)}
    all_kv = (torch.stack([k, k.flip(2)]), torch.stack([v, v.flip(2)]))
    return P.ScoreCtx(0, k, v, pos, protected, (qscale * torch.randn(B, H_kv * n_rep, w, D, generator=g)).to(dtype),
                      torch.arange(S - w, S), torch.randn(16, H_kv * n_rep * D, generator=g).to(dtype), side, all_kv,
                      cfg, budget, buffer, torch.Generator().manual_seed(100 + rnd), 0)


def explicit_window_attention(ctx):
    """softmax(q k^T / sqrt(D)) of the window queries with a causal mask, mean over queries: [B, H_q, S]."""
    n_rep = ctx.queries.shape[1] // ctx.keys.shape[1]
    k = ctx.keys.repeat_interleave(n_rep, 1)
    s = ctx.queries @ k.transpose(-1, -2) / math.sqrt(k.shape[-1])  # [B, H_q, w, S]
    s = s.masked_fill(ctx.pos.repeat_interleave(n_rep, 1)[:, :, None] > ctx.q_pos[:, None], -math.inf)
    return s.softmax(-1).mean(2)


def test_snapkv_matches_explicit_softmax():
    """snapkv = explicit softmax window attention, avg-pooled over 5 keys, averaged over the GQA group."""
    ctx = ctx_for()
    ref = F.avg_pool1d(explicit_window_attention(ctx), 5, 1, 2)
    torch.testing.assert_close(P.snapkv(ctx), ref.view(1, 2, 2, -1).mean(2), **TOL)


def test_h2o_accumulates_explicit_softmax(tiny):
    """H2O's side state after decoding = the sum over steps and group heads of each query's explicit softmax."""
    run = G.make_run("h2o", 60, 4, False, 5)  # no eviction: positions stay 0..S-1
    cache = G.make_cache(tiny, run, 12)
    toks = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        G.feed(tiny, cache, toks[:, :5], run)
        qs = []
        for t in range(5, 12):  # capture each step's layer-1 queries with the model's own collect output
            out = tiny(toks[:, t : t + 1], cache, collect=True)
            P.h2o_observe(cache, out, run.state)
            qs.append(out.queries[1])
    k = cache.get(1)[0].repeat_interleave(2, 1)  # [1, H_q, 12, D]
    expect = torch.zeros(1, 4, 12)
    for i, q in enumerate(qs):
        s = (q @ k.transpose(-1, -2))[:, :, 0, : 6 + i] / math.sqrt(16)
        expect[:, :, : 6 + i] += s.softmax(-1)
    got = cache.side["h2o"][1, :, :, :12]
    prefill_part = got - expect.view(1, 2, 2, 12).sum(2)  # what the 5-token prefill added
    assert (prefill_part[..., 5:].abs() < 1e-5).all() and (prefill_part[..., :5] > 0).all()


def test_criticalkv_stage1_kept_and_stage2_formula():
    """criticalkv: stage-1 top alpha*(K-r) by SnapKV are always kept; the rest score (s + 1e-4)*||V_h W_O,h||_1."""
    ctx = ctx_for()
    scores = P.criticalkv(ctx)
    s = P.snapkv(ctx_for())
    n1 = int(0.5 * (ctx.budget - ctx.buffer))
    stage1 = s.masked_fill(ctx.protected, -1).topk(n1, -1).indices
    assert (scores.gather(-1, stage1) == P.BIG).all()
    wo = ctx.wo.view(16, 4, 8)  # [hidden, H_q, D]
    direct = torch.zeros(1, 2, 24)
    for h in range(4):  # each query head projects its KV head's values through its own W_O slice
        direct[:, h // 2] += (ctx.values[:, h // 2] @ wo[:, h].T).abs().sum(-1) / 2
    rest = scores != P.BIG
    torch.testing.assert_close(scores[rest], ((s + 1e-4) * direct)[rest], **TOL)


def test_vase_reserves_value_range_and_samples_by_attention():
    """vase: the top K/4 value-range tokens are always kept; the sample changes with the seed; heavier
    attention is kept more often over many draws."""
    mk = lambda r=0: ctx_for(S=40, budget=20, buffer=4, prompt=0, rnd=r, qscale=3.0)  # peaked attention
    ctx = mk()
    vr = ctx.values.amax(-1) - ctx.values.amin(-1)
    top = vr.masked_fill(ctx.protected, -1).topk(5, -1).indices
    keep = lambda c: c.keys.new_zeros(1, 2, 40).scatter_(-1, P.vase(c).topk(20 - 4, -1).indices, 1)
    kept = torch.stack([keep(mk(r)) for r in range(300)])
    assert (kept[:, 0, 0, top[0, 0]] == 1).all() and not torch.equal(kept[0], kept[1])
    attn = P.snapkv(ctx).masked_fill(ctx.protected, 0)[0, 0]
    freq = kept[:, 0, 0].mean(0)
    free = torch.ones(40, dtype=torch.bool)
    free[top[0, 0]], free[36:] = False, False
    a, f = attn[free], freq[free]  # heavier half kept more often than the lighter half
    order = a.argsort()
    assert f[order[len(order) // 2 :]].mean() > f[order[: len(order) // 2]].mean() + 0.1


def test_vase_dkv_redraws_sketch_each_round():
    """vase-dkv: a new G each eviction round, so two rounds on the same tensors pick differently."""
    a, b = P.vase_dkv(ctx_for(rnd=0)), P.vase_dkv(ctx_for(rnd=1))
    assert not torch.equal(a.topk(6, -1).indices, b.topk(6, -1).indices)


def test_random_is_seeded_and_per_head():
    """random: same generator seed -> same scores; KV heads differ; another seed changes them."""
    a, b, c = P.random_(ctx_for(rnd=0)), P.random_(ctx_for(rnd=0)), P.random_(ctx_for(rnd=1))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a[:, 0], a[:, 1])


def test_rkv_redundancy_spares_the_newest_copy():
    """rkv: of three identical keys the newest is penalised least (its own look-alikes are not counted)."""
    ctx = ctx_for(S=6, H_kv=1, n_rep=1, budget=4, buffer=1, prompt=0)
    k = torch.eye(8)[:6].clone()
    k[1] = k[3] = k[4] = torch.ones(8)  # positions 1, 3, 4 repeat one key
    ctx.keys = k.view(1, 1, 6, 8)
    s = P.rkv(ctx, lam=0.0)  # redundancy alone
    assert s[0, 0, 4] > s[0, 0, 3] and s[0, 0, 4] > s[0, 0, 1]


def test_rolling_z_hand_worked():
    """EPIKV's rolling z: window [1, 3, 5] -> (5 - 3) / 1.633 = 1.2247; fewer than 2 values -> 0; window slides."""
    z = P.rolling_z(torch.tensor([1.0, 3.0]), torch.tensor([5.0]))
    torch.testing.assert_close(z, torch.tensor([1.2247]), atol=1e-4, rtol=0)
    torch.testing.assert_close(P.rolling_z(torch.zeros(0), torch.tensor([4.0, 6.0])), torch.tensor([0.0, 1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(P.rolling_z(torch.tensor([100.0, 1.0]), torch.tensor([3.0]), window=2), torch.tensor([1.0]), atol=1e-5, rtol=0)


def test_epikv_lag_hand_worked():
    """epikv-lag: chunk 2 is normalised by chunk 1's per-channel min/max, chunk 1 by its own (std over D)."""
    x = torch.tensor([[0.0, 2.0], [2.0, 4.0], [1.0, 3.0], [2.0, 2.0]])  # [S=4, D=2], chunk = 2
    kv = x.view(1, 1, 1, 4, 2)
    ctx = ctx_for()
    ctx.all_kv = (kv, kv)
    got = P.epikv_lag(ctx, chunk=2)[0, 0]
    # chunk 1 by itself: rows [0, 0], [1, 1] -> std [0, 0]; chunk 2 by chunk 1's min [0, 2], range [2, 2]:
    # rows [0.5, 0.5], [1, 0] -> std [0, 0.5]; K and V are equal here, so the score doubles
    torch.testing.assert_close(got, 2 * torch.tensor([0.0, 0.0, 0.0, 0.5]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(set(P.POLICIES) - {"full"}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_scorer_is_finite(name, dtype):
    """Every scorer returns finite [B, H_kv or 1, S] scores on fp32/bf16, a 1-token prompt and S = K + r."""
    ctx = ctx_for(S=16, budget=12, buffer=4, prompt=1, dtype=dtype)
    s = P.POLICIES[name].score(ctx)
    assert s.shape[-1] == 16 and s.shape[1] in (1, 2) and torch.isfinite(s).all()


# -----------------------------------------------------------------------------
# eviction in generation


@pytest.mark.parametrize("name", sorted(P.POLICIES))
def test_large_budget_equals_full_cache(tiny, name):
    """With K at or above the sequence length nothing is evicted: greedy output equals the full cache's."""
    prompt = list(range(3, 13))
    ref, _, _ = G.generate(tiny, prompt, G.make_run("full", None, 8, None, 10), 40)
    budget = None if name == "full" else 64
    out, _, _ = G.generate(tiny, prompt, G.make_run(name, budget, 8, None, 10), 40)
    assert out == ref


@pytest.mark.parametrize("name", sorted(set(P.POLICIES) - {"full"}))
@pytest.mark.parametrize("protect", [True, False])
def test_eviction_invariants(tiny, name, protect):
    """At every step: at most K + r slots, the newest r present, prompt (or sinks) present, slots in order."""
    K, r, prompt = 16, 4, list(range(3, 11))
    run = G.make_run(name, K, r, protect, len(prompt), seed=1)
    cache = G.make_cache(tiny, run, 60)
    with torch.inference_mode():
        G.feed(tiny, cache, torch.tensor([prompt]), run)
        for t in range(50):
            G.feed(tiny, cache, torch.tensor([[(t * 7) % 101]]), run)
            S, n = cache.length[0], cache.next_pos
            pos = cache.pos[:, :, :, :S]  # [L, B, H_kv, S]
            assert S <= K + r and all(l == S for l in cache.length)
            assert (pos[..., 1:] > pos[..., :-1]).all()
            assert (pos[..., -min(r, S):] == torch.arange(n - min(r, S), n)).all()
            must = len(prompt) if protect else G.N_SINK
            assert (pos[..., :must] == torch.arange(must)).all()
    assert run.rounds > 5 and run.max_slots == K + r


def test_epikv_scores_are_causal_and_shared(tiny):
    """epikv: a token's frozen score does not change when later tokens change, and all heads/layers keep one set."""
    def scores(tail):
        run = G.make_run("epikv", 20, 4, True, 6)
        cache = G.make_cache(tiny, run, 40)
        with torch.inference_mode():
            G.feed(tiny, cache, torch.tensor([list(range(1, 7)) + list(range(20, 30)) + tail]), run)
            return cache.side["epikv"][:, :, :, :16].clone()

    torch.testing.assert_close(scores([40, 41, 42]), scores([90, 91, 92]))
    run = G.make_run("epikv", 12, 4, True, 6)
    cache = G.make_cache(tiny, run, 60)
    with torch.inference_mode():
        G.feed(tiny, cache, torch.randint(0, 101, (1, 50), generator=torch.Generator().manual_seed(5)), run)
    pos = cache.pos[:, :, :, : cache.length[0]]
    assert run.rounds > 0 and (pos == pos[0, 0, 0]).all()


def test_show_kept_map(tiny):
    """--show-kept draws one row per KV head, full where the prompt is protected and the buffer sits."""
    run = G.make_run("random", 16, 4, True, 6)
    _, cache, _ = G.generate(tiny, list(range(1, 7)), run, 40)
    lines = G.show_kept(cache, 1, 6, 4, width=46).splitlines()
    assert len(lines) == 2 + 2 and lines[1].strip().startswith("PPPPPP") and lines[1].strip().endswith("RRRR")
    assert lines[2][9:15] == "██████" and lines[2].endswith("████") and " " in lines[2][9:]


# -----------------------------------------------------------------------------
# bad input: one line, non-zero exit, no traceback


@pytest.mark.parametrize("args,needle", [
    (["--policy", "nope"], "invalid choice"),
    (["--policy", "snapkv", "--budget", "64", "--buffer", "64"], "must exceed --buffer"),
    (["--policy", "snapkv", "--buffer", "0"], "--buffer must be at least 1"),
    (["--policy", "random", "--budget", "80"], "--budget >= "),
    (["--policy", "full", "--budget", "100"], "--budget has no effect"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", "9000"], "exceeds the model's 8192 positions"),
    (["--model", "/nonexistent"], "does not exist"),
    (["--show-kept", "30"], "layers 0 to 29"),
    (["--device", "cuda:99"], "CUDA device(s)"),
    (["--device", "gpu"], "is not a device"),
])
def test_bad_cli_input_one_line(args, needle, capsys):
    """Each user mistake exits non-zero with one line naming the problem and the fix."""
    with pytest.raises(SystemExit) as e:
        G.main(args)
    msg = str(e.value.code) if e.value.code not in (0, 2) else capsys.readouterr().err
    assert e.value.code != 0 and needle in msg and len(msg.strip().splitlines()) == 1


def bad_dir(tmp_path, kind):
    path = tiny_dir(str(tmp_path))
    f = os.path.join(path, "model.safetensors")
    if kind == "no-config":
        os.remove(os.path.join(path, "config.json"))
    elif kind == "no-weights":
        os.remove(f)
    elif kind == "arch":
        json.dump(dict(json.load(open(os.path.join(path, "config.json"))), model_type="gpt2"), open(os.path.join(path, "config.json"), "w"))
    elif kind == "extra":  # e.g. Llama with attention_bias: an o_proj bias the model has no slot for
        from safetensors.torch import load_file
        save_file({**load_file(f), "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, f)
    elif kind == "corrupt":
        open(f, "r+b").write(b"\xff" * 16)
    else:
        from safetensors.torch import load_file
        sd = load_file(f)
        if kind == "missing":
            del sd["model.layers.1.mlp.up_proj.weight"]
        else:
            sd["model.norm.weight"] = torch.ones(7)
        save_file(sd, f)
    return path


@pytest.mark.parametrize("kind,needle", [("extra", "has no place in nanokv's llama model"),
                                         ("no-config", "no config.json"), ("no-weights", "no *.safetensors"),
                                         ("arch", "unsupported model_type 'gpt2'"), ("corrupt", "corrupt safetensors"),
                                         ("missing", "model.layers.1.mlp.up_proj.weight missing"),
                                         ("shape", "model.norm.weight in model.safetensors has shape [7]")])
def test_bad_model_dir_messages(tmp_path, kind, needle):
    """A broken model directory raises ModelError naming the file or tensor and the fix."""
    with pytest.raises(ModelError) as e:
        load_model(bad_dir(tmp_path, kind))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_default_model_missing_offline(tmp_path):
    """Without the converted default model and without network, generate.py says which command fetches it."""
    env = dict(os.environ, NANOKV_HOME=str(tmp_path), PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    p = subprocess.run([sys.executable, "generate.py"], cwd=HERE, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "python weights.py" in p.stderr.strip().splitlines()[-1]


# -----------------------------------------------------------------------------
# the embedded default model (fetched by the README's setup command)


@pytest.fixture(scope="module")
def smollm():
    from weights import default_model_dir

    path = default_model_dir(fetch=False)
    return load_model(path), Tokenizer(path)


def test_default_model_answers_paris(smollm):
    """SmolLM2-135M-Instruct, converted from the GGUF, greedily answers the capital of France with Paris."""
    model, tok = smollm
    ids = tok.encode(tok.chat([{"role": "user", "content": "What is the capital of France?"}]))
    out, _, _ = G.generate(model, ids, G.make_run("full", None, 64, None, len(ids)), 12, eos_ids=tok.eos_ids)
    assert "Paris" in tok.decode(out)


def test_tokenizer_round_trip_and_chat_template(smollm):
    """The tokenizer round-trips unicode, splits digits, keeps special tokens whole; the template is ChatML."""
    _, tok = smollm
    text = "Héllo wörld ∑ 日本 🚀 x=3.14159\n<|im_start|>"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("12345")) == 5 and tok.encode("<|im_start|>") == [1] and tok.eos_ids == [2]
    assert tok.chat([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# -----------------------------------------------------------------------------
# the cost benchmark


BENCH_TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": True}
BENCH_FIELDS = {"policy", "context", "ms_per_token", "tok_s", "roofline", "evict_ms", "evict_share", "peak_mb", "slots"}


def test_bench_rows(tmp_path):
    """The bench's JSON rows have the issue's fields and sane values (tiny random model, 2 contexts, 2 policies)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(BENCH_TINY))
    args = SimpleNamespace(model=str(cfg), policies="full,snapkv", budget=64, buffer=16, contexts="160,288",
                           steps=32, prompt_len=8, eager=False, seed=0, device="cpu", dtype=None, threads=1)
    todo = bench.jobs(args)
    assert [(j["policy"], j["context"]) for j in todo] == [("full", 160), ("full", 288), ("snapkv", 160), ("snapkv", 288)]
    for i, job in enumerate(todo):  # one row through the real path (a fresh subprocess), the rest in-process
        row = bench.measure(args, job) if i == len(todo) - 1 else bench.measure_here({**vars(args), **job})
        json.dumps(row)  # plain JSON
        assert BENCH_FIELDS <= row.keys(), row
        assert row["ms_per_token"] > 0 and row["tok_s"] > 0 and row["roofline"] > 0 and row["peak_mb"] > 0
        if row["policy"] == "full":
            assert row["slots"] == row["context"] and row["evict_ms"] is None and row["evict_share"] == 0
        else:  # 32 steps with r = 16: two evictions land in the timed window
            assert row["slots"] <= 64 + 16 and row["evictions"] == 2
            assert row["evict_ms"] > 0 and 0 < row["evict_share"] < 1


def test_bench_jobs_eager_and_errors(tmp_path):
    """--eager adds full-cache eager rows; a context too short for the window is refused with the numbers."""
    args = SimpleNamespace(policies="all", budget=512, buffer=64, contexts="1024,2048", steps=128, prompt_len=64,
                           eager=True)
    todo = bench.jobs(args)
    assert len(todo) == 2 * len(P.POLICIES) + 2 and todo[-1] == {"policy": "full", "context": 2048, "eager": True}
    args.contexts = "150"
    with pytest.raises(bench.UsageError, match="--steps 128"):
        bench.jobs(args)


# -----------------------------------------------------------------------------
# evaluation: fidelity, replay cadence, answers, probes, resume, errors


def trace_lab(model, T=160, prompt_len=10):
    ids = torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    return {"model": model, "tok": None, "traces": [{"ids": ids, "prompt_len": prompt_len, "spans": [[prompt_len, T]]}]}


def args_for(*argv):
    return ev.build_parser().parse_args(list(argv))


# -----------------------------------------------------------------------------
# fidelity and replay


def test_fidelity_full_against_itself(tiny):
    """The full cache replayed against its own reference gives kl = 0, top1 = 1, nll_gap = 0."""
    args = args_for("fidelity", "--buffer", "8")
    row = ev.fidelity(args, {"policy": "full", "budget": None, "protect": None}, trace_lab(tiny))
    assert row["kl"] == 0 and row["top1"] == 1 and row["nll_gap"] == 0 and row["tokens"] == 150


def test_fidelity_sees_eviction(tiny):
    """A small budget that evicts gives a positive KL on the same trace."""
    args = args_for("fidelity", "--buffer", "8")
    row = ev.fidelity(args, {"policy": "streaming", "budget": 24, "protect": False}, trace_lab(tiny))
    assert row["kl"] > 1e-4 and row["tokens"] == 150


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o", "rkv", "vase", "criticalkv", "epikv", "epikv-lag"])
def test_chunked_replay_equals_token_by_token(tiny, policy):
    """Feeding the r tokens between evictions as one chunk gives the logits and kept slots of one-at-a-time decode."""
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(2))
    out = []
    for chunked in (True, False):
        run = G.make_run(policy, 24, 8, None if policy in ("streaming", "snapkv") else False, 10, seed=3)
        cache = G.make_cache(tiny, run, 100)
        with torch.inference_mode():
            if chunked:
                logits = G.feed(tiny, cache, ids, run, all_logits=True)
            else:
                logits = torch.cat([G.feed(tiny, cache, ids[:, i : i + 1], run, all_logits=True) for i in range(100)], 1)
        out.append((logits, cache.pos[:, :, :, : cache.length[0]].clone(), run.rounds))
    (a, pa, ra), (b, pb, rb) = out
    assert ra == rb > 0
    assert torch.equal(pa, pb)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_perturbation_snapkv_against_itself(tiny):
    """Perturbation rows: snapkv is never better than itself, and the measure is positive when tokens go."""
    args = args_for("perturbation", "--buffer", "8")
    row = ev.perturbation(args, {"policy": "snapkv", "budget": 24, "protect": False}, trace_lab(tiny))
    assert row["mean_l1"] > 0 and row["heads_better_than_snapkv"] == 0


# -----------------------------------------------------------------------------
# answers


@pytest.mark.parametrize("output, answer, ok", [
    ("She pays 16 - 3 = 13, so $18 in total.", "... #### 18", True),  # last number
    ("The answer is \\boxed{18} (not 20).", "... #### 18", True),  # the box wins over the last number
    ("It drops by -12 degrees", "... #### -12", True),  # negative numbers
    ("Total: 1,234 apples", "... #### 1234", True),  # thousands separator
    ("So 7.", "... #### 8", False),
])
def test_gsm8k_answers(output, answer, ok):
    """GSM8K: '####' gold against the last \\boxed{} or else the last number, compared as numbers."""
    assert ev.is_correct(ev.extract_answer(output, gsm8k=True), answer) == ok


@pytest.mark.parametrize("output, answer, ok", [
    ("so $\\boxed{\\dfrac{3}{4}}$.", "\\frac{3}{4}", True),  # dfrac = frac
    ("\\boxed{3/4}", "\\frac34", True),  # a/b = \frac{a}{b}
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("the angle is \\boxed{90^\\circ}.", "90", True),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", True),
    ("\\boxed{-5}", "-5", True),
    ("\\boxed{5}", "-5", False),
    ("first \\boxed{2}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),  # the last box
    ("no box, the answer is 4", "4", False),  # MATH needs a box
    ("\\boxed{\\frac{1", "1", False),  # cut off mid-box
])
def test_math_answers(output, answer, ok):
    """MATH-500 / AIME: last \\boxed{} with the data README's light normalisation."""
    assert ev.is_correct(ev.extract_answer(output, gsm8k=False), answer) == ok


def test_last_boxed_nested():
    """Braces are balanced: nested \\frac inside the box is kept whole."""
    assert ev.last_boxed("x \\boxed{\\frac{\\sqrt{3}}{2}} y") == "\\frac{\\sqrt{3}}{2}"


# -----------------------------------------------------------------------------
# probes


@pytest.mark.parametrize("kind, where", [("passcode", "prompt"), ("passcode", "trace"), ("fact", "trace")])
def test_probes_are_deterministic(smollm, kind, where):
    """A probe is a pure function of (data, index, seed): same seed, same tokens; the secret sits where asked."""
    tok = smollm[1]
    rows = ev.load_data(str(ev.DATA / "math500.jsonl"))[:5]
    a = ev.build_probe(tok, rows, 1, 0, kind, where, 300)
    assert a == ev.build_probe(tok, rows, 1, 0, kind, where, 300)
    assert a["ids"] != ev.build_probe(tok, rows, 1, 1, kind, where, 300)["ids"]
    s, e = a["answer"]
    secret = tok.decode(a["ids"][s:e]).strip()
    assert secret.isdigit() and e == len(a["ids"])
    said = tok.decode(a["ids"][: a["prompt_len"]]).count(secret)
    assert said == (kind == "passcode" and where == "prompt")
    assert tok.decode(a["ids"][:s]).count(secret) == 1  # said exactly once before the question


# -----------------------------------------------------------------------------
# the driver: resume, atomic writes, one-line errors


def test_rerun_skips_finished_rows(tmp_path):
    """A rerun with an existing --out keeps the finished rows and measures only the missing ones."""
    out = tmp_path / "rows.json"
    args = args_for("fidelity", "--policies", "snapkv,random", "--budgets", "128,256", "--out", str(out))
    jobs = ev.make_jobs(args)
    calls = []
    measure = lambda job: calls.append(job) or {"kl": 0.5}
    ev.run_jobs(args, jobs[:3], measure)  # an "interrupted" sweep
    assert len(calls) == 3
    rows = ev.run_jobs(args, jobs, measure)
    assert len(calls) == 5 and len(rows) == 5 and rows[:3] == json.loads(out.read_text())[:3]
    ev.run_jobs(args, jobs, measure)
    assert len(calls) == 5 and not list(tmp_path.glob("*.tmp"))
    assert [r["policy"] for r in rows] == ["full", "snapkv", "snapkv", "random", "random"]


@pytest.mark.parametrize("argv, msg", [
    (["fidelity", "--data", "/nonexistent.jsonl"], "does not exist"),
    (["fidelity", "--policies", ""], "--policies is empty"),
    (["fidelity", "--policies", "snapkv,nope"], "unknown policy 'nope'"),
    (["fidelity", "--budgets", "128,big"], "comma-separated integers"),
])
def test_bad_input_is_one_line(argv, msg):
    """User mistakes end with one 'error: ...' line, no traceback."""
    with pytest.raises(SystemExit) as e:
        ev.main(argv)
    assert str(e.value.code).startswith("error:") and msg in str(e.value.code) and "\n" not in str(e.value.code)


def test_bad_jsonl_row_names_line_and_field(tmp_path):
    """A jsonl row without the expected field names its line and the field."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n')
    with pytest.raises(SystemExit) as e:
        ev.main(["accuracy", "--data", str(bad)])
    assert e.value.code == f"error: {bad} line 2: missing field 'answer'"


def test_unknown_subcommand_is_one_line(capsys):
    """An unknown subcommand gets argparse's one-line error."""
    with pytest.raises(SystemExit):
        ev.main(["speed"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "invalid choice: 'speed'" in err and "\n" not in err


def test_markdown_hoists_constant_columns():
    """Key columns equal in every row move to a caption line, results never do; None prints as a dash."""
    md = ev.markdown([{"policy": "full", "budget": None, "n": 3, "kl": 0.0, "top1": 1.0},
                      {"policy": "snapkv", "budget": 128, "n": 3, "kl": 0.25, "top1": 1.0}], keys={"policy", "n"})
    assert md.splitlines()[0] == "n=3" and "| full | – | 0 | 1 |" in md and "| snapkv | 128 | 0.25 | 1 |" in md


def test_traces_use_each_problem_once(smollm, tmp_path):
    """Packing conversations terminates and answers every --n problem exactly once, even with no spare problems."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(3)))
    args = args_for("fidelity", "--data", str(data), "--n", "3", "--max-new-tokens", "4", "--min-tokens", "40")
    trs = ev.traces(args, {"model": smollm[0], "tok": smollm[1]})
    text = "".join(smollm[1].decode(t["ids"]) for t in trs)
    assert [text.count(f"What is {i} + {i}?") for i in range(3)] == [1, 1, 1]
