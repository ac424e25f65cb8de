"""
nanokv's reading of config.json against transformers 5.24, on tiny random checkpoints that transformers itself saves.

    pip install transformers==5.24.0     # not a nanokv requirement, not in CI
    python tools/compare_configs.py              # every case
    python tools/compare_configs.py --only yarn  # the cases whose name contains "yarn"

Each case builds a seeded random model with transformers (one layer; two where windows differ per layer), writes it
with save_pretrained, edits config.json the way Hub checkpoints differ (a missing key, the transformers 4 layout, both
RoPE dicts, a window key on Llama, ...), then loads the directory in both. A loading case passes when nanokv's fp32
logits, in one call and token by token through its cache (the last 256 positions of a long sequence), are within 1e-4
of transformers' (max |nanokv - hf| / max |hf logit|) and 16 greedy tokens equal those of transformers' forward; a
refused case when transformers loads and runs the checkpoint and nanokv refuses it in one line. Sequences run past
every window (4,200 tokens for the default window of 4,096).
"""

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

TOL, STEPS, STEP_TAIL = 1e-4, 16, 256  # worst relative logit error allowed; greedy tokens; positions fed singly
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
DROP = "<drop>"  # an edit's value that removes the key
GROUPS = {  # group -> what its cases vary
    "basic": "default, tied, Qwen2 biases, Qwen3 q/k norms, linear / llama3 / yarn RoPE, both layouts, ignored keys",
    "window": "Mistral / Qwen2 / Qwen3 windows, layer_types on Mistral and Qwen3, window keys on Llama (ignored)",
    "act": "hidden_act gelu, gelu_pytorch_tanh, relu, swish (Llama, Qwen3)",
    "missing": "missing rms_norm_eps, num_key_value_heads (or null), head_dim, rope_theta, original length",
    "window-4096": "Mistral without sliding_window (4096) or null (none), a Qwen2 window without its size",
    "rope-keys": "a top-level original_max_position_embeddings; both rope_scaling and rope_parameters",
    "refused": "dynamic / longrope RoPE, partial_rotary_factor, o_proj / MLP biases, other model types",
}


@dataclass
class Case:
    name: str
    group: str  # a key of GROUPS
    model_type: str  # transformers' config class (AutoConfig.for_model)
    config: dict = field(default_factory=dict)  # its arguments on top of TINY
    edit: dict = field(default_factory=dict)  # config.json keys set after save_pretrained ("a.b": b in dict a)
    tokens: int = 64  # the sequence compared: longer than every window
    old_layout: bool = False  # config.json as transformers 4 wrote it: top-level rope_theta / rope_scaling
    stray: bool = False  # a consolidated.safetensors beside model.safetensors, in Mistral's own layout
    embed: float = 1.0  # the embeddings' scale: small where rms_norm_eps must matter (hidden states ~ sqrt(eps))


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32, rope_theta=10000.0)
rope = lambda **p: dict(rope_parameters=p)
W24 = dict(use_sliding_window=True, sliding_window=24, num_hidden_layers=2)  # + max_window_layers or layer_types
ONE_SLIDES = ["sliding_attention", "full_attention"]
CASES = [
    Case("llama", "basic", "llama"),
    Case("llama-tied", "basic", "llama", dict(tie_word_embeddings=True)),
    Case("mistral", "basic", "mistral"),
    Case("mistral-attention-bias", "basic", "mistral", edit=dict(attention_bias=True)),  # MistralConfig has none
    Case("mistral-consolidated", "basic", "mistral", stray=True),
    Case("qwen2-biases", "basic", "qwen2"),
    Case("qwen3-qk-norm", "basic", "qwen3"),
    Case("qwen3-tied", "basic", "qwen3", dict(tie_word_embeddings=True)),
    Case("llama-linear", "basic", "llama", rope(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    Case("llama-llama3", "basic", "llama", rope(**LLAMA3)),
    Case("qwen2-yarn", "basic", "qwen2", rope(**dict(YARN, rope_theta=1e6))),
    Case("qwen3-yarn-mscale", "basic", "qwen3", rope(**YARN, mscale=0.707, mscale_all_dim=1.0)),
    Case("qwen3-yarn-attention-factor", "basic", "qwen3", rope(**YARN, attention_factor=1.3)),
    Case("qwen3-yarn-no-truncate", "basic", "qwen3", rope(**YARN, truncate=False)),
    Case("llama-llama3-old-layout", "basic", "llama", rope(**dict(LLAMA3, rope_theta=5e5)), old_layout=True),
    Case("qwen2-yarn-old-layout", "basic", "qwen2", rope(**YARN), old_layout=True),

    Case("mistral-window", "window", "mistral", dict(sliding_window=24)),
    Case("mistral-layer-types", "window", "mistral", dict(sliding_window=24, num_hidden_layers=2),
         edit=dict(layer_types=ONE_SLIDES)),  # transformers reads it as Ministral
    Case("qwen2-window", "window", "qwen2", dict(W24, max_window_layers=1)),
    Case("qwen2-window-old-layout", "window", "qwen2", dict(W24, max_window_layers=1), old_layout=True),
    Case("qwen3-window", "window", "qwen3", dict(W24, max_window_layers=1)),
    Case("qwen3-layer-types", "window", "qwen3", dict(W24, layer_types=ONE_SLIDES)),
    Case("llama-window-keys", "window", "llama", edit=dict(use_sliding_window=True, sliding_window=24)),
    Case("llama-layer-types", "window", "llama", dict(num_hidden_layers=2),
         edit=dict(sliding_window=24, layer_types=ONE_SLIDES)),

    *[Case(f"{mt}-{act}", "act", mt, dict(hidden_act=act))
      for mt, acts in [("llama", ["gelu", "gelu_pytorch_tanh", "relu", "swish"]), ("qwen3", ["gelu", "relu"])]
      for act in acts],

    Case("llama-no-rms-norm-eps", "missing", "llama", dict(rms_norm_eps=1e-5), edit=dict(rms_norm_eps=DROP),
         embed=3e-3),
    Case("llama-no-kv-heads", "missing", "llama", dict(num_key_value_heads=4), edit=dict(num_key_value_heads=DROP)),
    Case("llama-null-kv-heads", "missing", "llama", dict(num_key_value_heads=4), edit=dict(num_key_value_heads=None)),
    Case("mistral-no-kv-heads", "missing", "mistral", dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8),
         edit=dict(num_key_value_heads=DROP, head_dim=DROP)),
    Case("qwen3-no-head-dim", "missing", "qwen3", dict(head_dim=128), edit=dict(head_dim=DROP)),
    Case("llama-no-rope-theta", "missing", "llama", rope(rope_type="default", rope_theta=1e4),
         edit={"rope_parameters.rope_theta": DROP}),
    Case("qwen2-no-rope-theta-old-layout", "missing", "qwen2", old_layout=True, edit=dict(rope_theta=DROP)),
    Case("llama-llama3-no-original", "missing", "llama", dict(rope(**LLAMA3), max_position_embeddings=128),
         edit={"rope_parameters.original_max_position_embeddings": DROP}),

    Case("mistral-no-window-key", "window-4096", "mistral", dict(sliding_window=4096), dict(sliding_window=DROP), 4200),
    Case("mistral-null-window", "window-4096", "mistral", dict(sliding_window=None), tokens=4200),
    Case("qwen2-window-no-size", "window-4096", "qwen2", dict(W24, max_window_layers=1),
         dict(sliding_window=DROP, layer_types=DROP), 4200),

    Case("qwen3-yarn-top-original", "rope-keys", "qwen3", rope(**YARN), edit=dict(original_max_position_embeddings=12)),
    Case("llama-llama3-top-original", "rope-keys", "llama", rope(**LLAMA3),
         edit=dict(original_max_position_embeddings=128)),
    Case("llama-both-rope-dicts", "rope-keys", "llama", edit=dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    Case("qwen2-both-rope-dicts-theta", "rope-keys", "qwen2", rope(rope_type="linear", factor=2.0, rope_theta=1e6),
         edit=dict(rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"}, rope_theta=5e4)),

    Case("llama-dynamic-rope", "refused", "llama", rope(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
    Case("llama-longrope", "refused", "llama", rope(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 8,
                                                    long_factor=[2.0] * 8, original_max_position_embeddings=32)),
    Case("llama-partial-rotary", "refused", "llama", dict(partial_rotary_factor=0.5)),
    Case("llama-attention-bias", "refused", "llama", dict(attention_bias=True)),
    Case("qwen3-attention-bias", "refused", "qwen3", dict(attention_bias=True)),
    Case("llama-mlp-bias", "refused", "llama", dict(mlp_bias=True)),
    Case("gemma", "refused", "gemma"),
    Case("phi3", "refused", "phi3", dict(pad_token_id=0)),
    Case("mixtral", "refused", "mixtral", dict(num_local_experts=4)),
    Case("qwen3-moe", "refused", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
]


def edited(c: dict, edit: dict, old_layout: bool = False) -> dict:
    """config.json c after a case's edits (c is left as it was). old_layout first moves rope_parameters to the top-level
    rope_theta and rope_scaling (null for default RoPE) and drops layer_types, as transformers 4 wrote them.
    Examples: edited({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, {"a": 1}, True)
    == {"rope_theta": 1e4, "rope_scaling": None, "a": 1}; edited({"a": {"b": 1, "c": 2}}, {"a.b": DROP})
    == {"a": {"c": 2}}."""
    c = json.loads(json.dumps(c))  # a deep copy
    if old_layout:
        p = c.pop("rope_parameters")
        c["rope_theta"] = p.pop("rope_theta")
        c["rope_scaling"] = None if p["rope_type"] == "default" else p
        c.pop("layer_types", None)
    for key, value in edit.items():
        *outer, last = key.split(".")
        d = c
        for k in outer:
            d = d[k]
        if value == DROP:
            d.pop(last, None)
        else:
            d[last] = value
    return c


# -----------------------------------------------------------------------------
# one case


def build(case: Case, path: Path):
    """transformers' random model for the case, seeded and saved to path, then config.json edited."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(case.model_type, **(TINY | case.config)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers' init is near zero (flat logits, zero biases): spread everything out
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if name.endswith("norm.weight") else case.embed * r if "embed" in name else 0.1 * r)
    hf.save_pretrained(path)
    f = path / "config.json"
    f.write_text(json.dumps(edited(json.loads(f.read_text()), case.edit, case.old_layout), indent=2))
    if case.stray:  # Mistral repos ship their own layout too; neither transformers nor nanokv may read it
        save_file({"tok_embeddings.weight": torch.zeros(3, 64)}, path / "consolidated.safetensors")


def compare(case: Case, path: Path) -> tuple[bool, str, float | None, bool | None]:
    """(passed, what happened, worst rel, greedy identical) for one case built in path."""
    import torch
    from transformers import AutoModelForCausalLM

    from generate import feed, generate, make_cache, make_run
    from model import ModelError, load_model

    build(case, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # nanokv's generate runs to max_new_tokens too
    tokens = torch.randint(0, TINY["vocab_size"], (case.tokens,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = hf(tokens[None]).logits[0].float()  # [T, V]
    if not ref.isfinite().all():
        return False, "transformers gives NaN/inf logits", None, None
    try:
        model = load_model(path, "cpu", torch.float32)
    except ModelError as e:
        msg = str(e)
        good = case.group == "refused" and "\n" not in msg
        return good, ("refused: " if good else "WRONGLY refused: ") + msg.replace(str(path), "DIR"), None, None
    if case.group == "refused":
        return False, "WRONGLY accepted (transformers loads it too, but nanokv must refuse it)", None, None

    run = make_run("full", None, 64, None, case.tokens)
    with torch.inference_mode():
        cache = make_cache(model, run, case.tokens)
        whole = feed(model, cache, tokens[None], run, all_logits=True)[0]  # one call: [T, V]
        # token by token through the cache: the last STEP_TAIL positions (all of a short sequence), after one call
        # for the rest, so a long sequence steps across its window without 4,000 single steps
        cache, split = make_cache(model, run, case.tokens), max(0, case.tokens - STEP_TAIL)
        parts = [tokens[:split]] * (split > 0) + list(tokens[split:, None])
        steps = torch.cat([feed(model, cache, t[None], run, all_logits=True)[0] for t in parts])  # [T, V]
        # subtle: the reference is transformers' greedy run without its cache (use_cache=False): its cache slides the
        # layers of a Llama whose config.json has window keys, which its Llama masks ignore. The cached run only
        # adds a note where the two differ
        mask = torch.ones_like(tokens)[None]
        hf_out, hf_cached = (hf.generate(tokens[None], attention_mask=mask, use_cache=c, max_new_tokens=STEPS,
                                         do_sample=False, pad_token_id=0)[0, case.tokens:].tolist()
                             for c in (False, True))
    rel = max((x - ref).abs().max().item() for x in (whole, steps)) / ref.abs().max().item()
    out = generate(model, [tokens.tolist()], make_run("full", None, 64, None, case.tokens), STEPS)[0][0]
    same = out == hf_out
    note = "" if hf_cached == hf_out else "; transformers' cached generate gives other tokens than its forward"
    return rel <= TOL and same, f"{case.tokens} tokens{note}", rel, same


# -----------------------------------------------------------------------------
# all cases, one table


def main():
    ap = argparse.ArgumentParser(description="nanokv's config.json reading against transformers 5.24 on tiny "
                                             "random checkpoints: the same logits, or a one-line refusal.",
                                 allow_abbrev=False)  # no prefixes of flags, as cli.Parser
    ap.add_argument("--only", default="", help="run only the cases whose name contains this text")
    args = ap.parse_args()
    try:
        import transformers
    except ImportError:
        sys.exit("error: transformers is not installed: pip install transformers==5.24.0 (not a nanokv requirement)")
    transformers.logging.set_verbosity_error()  # its notes on edited configs, and its progress bars
    transformers.utils.logging.disable_progress_bar()
    cases = [c for c in CASES if args.only in c.name]
    print(f"transformers {transformers.__version__}; {len(cases)} cases; pass: rel <= {TOL:g} and {STEPS} greedy "
          "tokens identical, or a one-line refusal\n")
    print("| case | group | worst rel | greedy identical | note |\n|---|---|---|---|---|")
    t0, failed, worst = time.perf_counter(), [], {}
    for case in cases:
        with tempfile.TemporaryDirectory() as d:
            try:
                ok, note, rel, same = compare(case, Path(d))
            except Exception as e:  # a case transformers itself cannot build or load is a broken case: say so
                ok, note, rel, same = False, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}", None, None
        failed += [] if ok else [case.name]
        if rel is not None:
            worst[case.group] = max(worst.get(case.group, 0.0), rel)
        print(f"| {case.name} | {case.group} | {'-' if rel is None else f'{rel:.1e}'} | "
              f"{'-' if same is None else 'yes' if same else 'NO'} | {note} |", flush=True)
    print(f"\n| group | cases | worst rel | what varies |\n|---|---|---|---|")
    for group, what in GROUPS.items():
        n = sum(c.group == group for c in cases)
        if n:
            w = f"{worst[group]:.1e}" if group in worst else "-"
            print(f"| {group} | {n} | {w} | {what} |")
    print(f"\n{len(cases) - len(failed)} of {len(cases)} cases pass; wall time {time.perf_counter() - t0:.0f} s")
    if failed:
        sys.exit(f"FAILED: {', '.join(failed)}")


if __name__ == "__main__":
    main()
