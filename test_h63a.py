"""
Tests for the silently-wrong items of the outside rounds: protected slots under per-head budgets, thinking read from
the template's own generation prompt, tie rules that hold at any thread count (curdkv, raas). Folded into test_all.py.
"""

import math

import pytest
import torch

import budgets
import generate as G
import policies_attention as PA
import policies_values as PV
import scoring as SC
from cache import FREE
from test_all import PROMPTS, QWEN3_TEMPLATE, R1_TEMPLATE, T_, ctx_for, generate_rows, think_dir, tiny  # noqa: F401
from tokenizer import Tokenizer


# ---- a protected slot survives every budget rule ----


def lost_protected(model, name, K, r, protect, prompt):
    """Generate with policy `name` and report every (round, layer, head, position) where a protected position (the
    prompt, or the 4 sinks) was missing from a head's kept slots right after an eviction."""
    run = G.make_run(name, K, r, protect, len(prompt))
    below, lost = run.protect_below[0], []

    def watch(cache, b, when, scores):
        if when == "after":
            for l, layer in enumerate(cache.pos[:, b]):  # [H_kv, cap]
                for h, p in enumerate(layer):
                    lost.extend((run.rounds[0], l, h, q) for q in set(range(below)) - set(p.tolist()))

    run.watch = watch
    G.generate(model, [prompt], run, 3 * (K + r))
    assert run.evictions >= 2
    return lost


@pytest.mark.parametrize("name", ["adakv", "criticalkv-ada"])
@pytest.mark.parametrize("protect", [True, False])
def test_per_head_budgets_never_evict_a_protected_slot(tiny, name, protect):
    """Whatever a head's budget rule gives, every KV head of every layer still holds every protected position (the
    whole prompt with --protect-prompt, else the 4 sinks) after every round, over a range of budgets from the
    smallest the settings allow (where FFY0's rounding, b_h = round(0.8 n + int(0.2 n)), fell one short) upwards."""
    prompt, r = list(range(3, 11)), 8  # 8 tokens: n = K - r = 8 candidates all protected gave round(7.4) = 7
    low = (len(prompt) if protect else SC.N_SINK) + r
    for K in range(low, low + 12):
        assert lost_protected(tiny, name, K, r, protect, prompt) == [], f"K = {K}"


def test_adakv_budget_is_raised_to_the_protected_count():
    """budgets.adakv, hand-worked: one head of n = 8 candidates all protected (+inf) wins 8 of the pool, and FFY0's
    blend round(0.8 * 8 + int(1.6)) = round(7.4) = 7 would drop one; the budget is raised to its 8 protected slots.
    The other head keeps its blend; a head never gets more than it holds."""
    s = torch.cat([torch.full((1, 1, 8), math.inf), torch.rand(1, 1, 8)], 1)  # [1, 2, 8]
    assert budgets.pooled_counts(s, 8).tolist() == [[8, 8]]
    assert budgets.adakv(s, 8).tolist() == [[8, 7]]


def test_evict_per_head_refuses_a_budget_below_the_protected_slots():
    """cache.evict_per_head is the last guard: a head asked to keep fewer slots than it has protected ones stops with
    an error that names the numbers, instead of dropping a +inf slot."""
    import cache as C

    kv = C.KVCache(1, 1, 2, 4, 16)
    kv.pos[0, 0, :, :12] = torch.arange(12)
    kv.length = [12]
    protected = kv.protected(0, slice(0, 1), torch.tensor([6]), 2)  # 6 prompt + 2 recent = 8 per head
    with pytest.raises(RuntimeError, match="8 protected"):
        kv.evict(slice(0, 1), [torch.rand(1, 2, 12)], [protected], [torch.tensor([[8, 7]])], span=12)


# ---- thinking is what the template opened, never the user's words ----


def test_thought_ignores_think_in_the_users_own_words(tmp_path):
    """Tokenizer.thought reads only what the chat template wrote after the last turn: with Qwen3's thinking on, a user
    who writes <think> in the question ("Say <think> twice.") opens no thinking, so an answer that does not think is
    all answer and is graded; R1's own generation prompt still opens it, even after a user's </think>."""
    import eval as ev

    q3, r1 = Tokenizer(think_dir(tmp_path / "q3", QWEN3_TEMPLATE)), Tokenizer(think_dir(tmp_path / "r1", R1_TEMPLATE))
    prompt = q3.encode(q3.chat([{"role": "user", "content": "Say <think> twice."}]))
    out = q3.encode("Sure: <think> <think>. \\boxed{4}<eos>")
    assert q3.thought(prompt, out) == T_(0, None, "Sure: <think> <think>. \\boxed{4}<eos>")
    assert ev.answer_of(q3, out, "4", prompt)[2] == "4"
    prompt = r1.encode(r1.chat([{"role": "user", "content": "Why </think>?"}]))
    out = r1.encode("hmm</think>\\boxed{4}<eos>")
    assert r1.thought(prompt, out) == T_(len("hmm") + 1, True, "\\boxed{4}<eos>")
    assert r1.thought([], out) == T_(0, None, "hmm</think>\\boxed{4}<eos>")  # no prompt: nothing opened it
    assert q3.generation_prompt() == "<|im_start|>assistant\n"
    assert r1.generation_prompt() == "<｜Assistant｜><think>\n"


# ---- ties get a rule: the newer slot wins ----


def keep_of(scores, ctx, keep):
    """The positions each head of row 0 keeps when cache.evict ranks scores [1, H_kv, S] (ctx's protection), as sets."""
    import cache as C

    B, H, S, D = ctx.keys.shape
    kv = C.KVCache(1, B, H, D, S)
    kv.pos[0, :, :, :S], kv.length = ctx.pos, [S] * B
    kv.evict(slice(0, B), [scores], [ctx.protected], keep)
    return [set(p[:keep].tolist()) for p in kv.pos[0, 0]]


def test_ranked_orders_ties_by_position():
    """scoring.ranked, hand-worked: ranks ascending by score, equal scores by position (newer higher, whatever the slot
    order); with bits, scores within the grid tie; a NaN ranks lowest."""
    pos = torch.tensor([[[0, 1, 2, 3]]])
    assert SC.ranked(torch.tensor([[[3.0, 1.0, 3.0, 2.0]]]), pos).tolist() == [[[2.0, 0.0, 3.0, 1.0]]]
    assert SC.ranked(torch.tensor([[[3.0, 1.0, 3.0, 2.0]]]), pos.flip(-1)).tolist() == [[[3.0, 0.0, 2.0, 1.0]]]
    assert SC.ranked(torch.tensor([[[1.0, 1.1, 0.5, math.nan]]]), pos, bits=2).tolist() == [[[2.0, 3.0, 1.0, 0.0]]]
    assert SC.ranked(torch.tensor([[[1.1, 1.0, 0.5, 0.7]]]), pos, bits=8).tolist() == [[[3.0, 2.0, 0.0, 1.0]]]


def test_raas_equal_timestamps_keep_the_newer_slots():
    """RaaS's cut inside a block of equal timestamps keeps the block's newest slots: the scores rise with position
    inside the block, and cache.evict keeps, of 8 slots stamped alike, the 2 newest beside a newer stamp."""
    ctx = ctx_for(S=16, B=1, budget=8, buffer=2, prompt=3)
    ts = torch.tensor([0, 1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 13, 14, 15.0])  # slots 5-12 stamped 9 at one step
    ctx.side["raas"] = ts.expand(1, 2, 16).clone()
    s = PA.raas(ctx)
    assert (s[0, :, 5:13].diff(dim=-1) > 0).all()  # inside the block, the newer slot ranks higher
    assert keep_of(s, ctx, 8) == [{0, 1, 2, 11, 12, 13, 14, 15}] * 2  # prompt 3, 13, the block's newest 2, r = 2


def test_curdkv_near_ties_go_to_the_newer_slot():
    """curdkv: two slots of one 16-slot window with the same value and the same key up to a rounding (1e-6 relative,
    as a row batched and alone differ; a repeated token after RoPE) tie, and the newer one is kept whichever of the
    two keys is the larger: the kept set does not depend on last-bit rounding. The exact score follows it."""
    ctx = ctx_for(S=24, B=1, budget=10, buffer=4, prompt=4)
    kept = []
    for up in (True, False):
        k, v = ctx.keys.clone(), ctx.values.clone()
        k[:, :, 6] = k[:, :, 9] = torch.linspace(1, 2, k.shape[-1]) * 3  # slots 6 and 9: the largest leverage
        v[:, :, 6] = v[:, :, 9] = torch.linspace(2, 1, v.shape[-1]) * 3
        k[:, :, 6] *= 1 + (1e-6 if up else -1e-6)
        c = ctx_for(S=24, B=1, budget=10, buffer=4, prompt=4)
        c.keys, c.values = k, v
        exact = PV.cur_leverage(k, window=16) * PV.cur_leverage(v, window=16)  # kvpress's score, before the rule
        assert (exact[0, :, 6] > exact[0, :, 9]).all() == up  # the exact scores follow the nudge
        kept.append(keep_of(PV.curdkv(c), c, 4 + 1 + 4))  # sinks, one candidate, the buffer
    assert kept[0] == kept[1] == [{0, 1, 2, 3, 9, 20, 21, 22, 23}] * 2


# ---- TriAttention's statistics on a q_norm model: the authors' queries ----


def test_triattention_calibration_on_qk_norm_reads_q_proj_before_q_norm(tmp_path):
    """On a Qwen3-layout model (q_norm), calibrate takes the authors' queries: q_proj's output on each layer's normed
    input, before q_norm (scripts/calibrate.py's hook; their run-time scoring reads that file as it is). They differ
    from the queries the model attends with, which the un-rotated post-RoPE path would have measured."""
    import triattention as TA
    from test_all import ARCHS, load_model, tiny_dir

    model = load_model(tiny_dir(str(tmp_path / "q3"), **ARCHS["qwen3-qknorm"]))
    cfg = model.cfg
    H_q, D, T = cfg.num_attention_heads, cfg.head_dim, 40
    ids = list(range(3, 3 + T))
    got = TA.calibrate(model, ids)
    cache = G.make_cache(model, G.make_run("full", None, 8, None, 1), T)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), cache, collect=True)
        h = model.model.embed_tokens(torch.tensor([ids]))
        for l, blk in enumerate(model.model.layers):
            q = (blk.input_layernorm(h) @ blk.self_attn.q_proj.weight.T)[0].view(T, H_q, D).transpose(0, 1)
            qc = torch.complex(q[..., : D // 2].double(), q[..., D // 2 :].double())  # [H_q, T, D / 2]
            torch.testing.assert_close(got.q_mean[l], qc.mean(1).to(torch.complex64), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.q_abs[l], qc.abs().mean(1).float(), atol=1e-5, rtol=1e-5)
            normed = blk.self_attn.q_norm(q)  # what the model attends with, before RoPE
            assert (normed.abs().mean() - q.abs().mean()).abs() > 1e-3  # so the two statistics differ
            h = out.hidden[l]
