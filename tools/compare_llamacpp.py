"""
Batch-1 decode speed of nanokv beside llama.cpp on the same weights (RESULTS.md's side-by-side tables).

    pip install llama-cpp-python    # compiles llama.cpp, several minutes; not a nanokv requirement, not in CI
    python tools/compare_llamacpp.py                                           # exact: fp32 both
    python tools/compare_llamacpp.py --model qwen2.5-coder-1.5b --quant int4   # the file as it ships
    python tools/compare_llamacpp.py --model qwen2.5-coder-1.5b --quant int4x8   # int8 dot products, as llama.cpp

Exact (no --quant): llama.cpp reads the model's own GGUF with every tensor dequantised to F32 (the numbers weights.py
converts to safetensors, in llama.cpp's layout), nanokv its fp32 path. With --quant: llama.cpp decodes the GGUF as it
ships (Q4_K_M for the 1.5B, what a CPU user would run), nanokv the same file's numbers through --quant. Each decoder
runs in a fresh process with 2 threads, prefills the default question and decodes 256 greedy tokens (the end token
masked); only the decode steps are timed. Runs alternate, so both see the same machine load; we report every run and
nanokv's ratio to llama.cpp per pair, and the CPU.

On a CPU with AMX, llama.cpp repacks Q4_K weights for its AMX backend, which crashed here on the first decode (SIGSEGV,
as in ggml-org/llama.cpp#20824); --no-repack loads the weights as stored (llama.cpp's `use_extra_bufts` off: no AMX
buffer, nor its CPU repacking), which runs.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

STEPS = 256


def write_f32_gguf(src: Path, dst: Path):
    """Copy a GGUF's metadata and write every tensor dequantised to float32, names and layout unchanged."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these itself
            continue
        if key == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_of(name: str, quant: str | None) -> Path:
    """The GGUF llama.cpp decodes: the model's own verified file (downloaded again if weights.py deleted it), as it
    ships with --quant, else a copy with every tensor in F32, written once."""
    from weights import MODEL_HOME, MODELS, download_gguf

    dst = MODEL_HOME / f"{MODELS[name].dirname}.F32.gguf"
    if quant or not dst.exists():
        src = download_gguf(name)
        if quant:
            return src
        write_f32_gguf(src, dst.with_suffix(".tmp"))
        dst.with_suffix(".tmp").rename(dst)
    return dst


def prompt_ids(name: str) -> list[int]:
    from generate import DEFAULT_PROMPT
    from tokenizer import Tokenizer
    from weights import model_dir

    tok = Tokenizer(model_dir(name))
    return tok.encode(tok.chat([{"role": "user", "content": DEFAULT_PROMPT}]))


def nanokv_tok_s(name: str, quant: str | None) -> float:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")  # before numpy loads: 2 threads, as llama.cpp gets
    import torch

    from cli import load
    from generate import generate, make_run

    model, _ = load(name, "cpu", None, quant)
    if quant:  # torch's own kernels: 2 threads, as llama.cpp gets (the exact path has OpenBLAS's 2)
        torch.set_num_threads(2)
    ids = prompt_ids(name)
    _, _, t = generate(model, [ids], make_run("full", None, 64, None, len(ids)), STEPS + 1)  # no end token: 257
    return STEPS / t["decode_s"]


def llamacpp_tok_s(name: str, quant: str | None, repack: bool = True) -> float:
    import llama_cpp.llama_cpp as lib  # the bindings Llama() calls
    import numpy as np
    from llama_cpp import Llama

    if not repack:  # Llama() starts from these defaults and exposes no flag for the field
        if "use_extra_bufts" not in dict(lib.llama_model_params._fields_):
            sys.exit("error: this llama-cpp-python has no use_extra_bufts (no repacking to turn off): drop --no-repack")
        defaults = lib.llama_model_default_params

        def as_stored():
            p = defaults()
            p.use_extra_bufts = False
            return p
        lib.llama_model_default_params = as_stored
    llm = Llama(model_path=str(gguf_of(name, quant)), n_threads=2, n_ctx=1024, verbose=False)
    eos = llm.token_eos()

    def next_token() -> int:  # the logits of the last evaluated position, end token masked
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy()
        logits[eos] = -np.inf
        return int(logits.argmax())

    llm.eval(prompt_ids(name))  # the same token ids as nanokv's prompt
    tok = next_token()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        llm.eval([tok])
        tok = next_token()
    return STEPS / (time.perf_counter() - t0)


def main():
    from weights import DEFAULT_MODEL, MODELS

    ap = argparse.ArgumentParser(description="nanokv vs llama.cpp batch-1 decode, same weights, side by side.",
                                 allow_abbrev=False)  # no prefixes of flags, as cli.Parser
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS), help="a model weights.py fetches")
    ap.add_argument("--quant", default=None, choices=["int8", "int4", "int4x8"], help="nanokv's --quant; llama.cpp then "
                    "decodes the GGUF as it ships (default: both exact, fp32)")
    ap.add_argument("--runs", type=int, default=3, help="alternating pairs of runs")
    ap.add_argument("--no-repack", action="store_true", help="llama.cpp keeps the weights as stored (no AMX or CPU "
                    "repacking: where its AMX backend crashes)")
    ap.add_argument("--one", choices=["nanokv", "llamacpp"], help=argparse.SUPPRESS)  # a single run, in its process
    args = ap.parse_args()
    if args.one:
        tok_s = nanokv_tok_s(args.model, args.quant) if args.one == "nanokv" else \
            llamacpp_tok_s(args.model, args.quant, not args.no_repack)
        print(f"{tok_s:.2f}")
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("error: llama-cpp-python is not installed: pip install llama-cpp-python (it compiles llama.cpp)")
    from cli import cpu_info

    gguf_of(args.model, args.quant)
    info = cpu_info()
    print(f"{args.model}; CPU: {info['cpu']}, {info['capability']}, {' '.join(info['flags'])}")
    mine, theirs = f"nanokv {args.quant or 'fp32'}", "llama.cpp " + ("as shipped" if args.quant else "F32") + \
        (", not repacked" * args.no_repack)
    print(f"| run | {theirs} tok/s | {mine} tok/s | ratio |\n|---|---|---|---|")
    for i in range(args.runs):
        ref, ours = one_run("llamacpp", args), one_run("nanokv", args)
        print(f"| {i + 1} | {ref:.1f} | {ours:.1f} | {ours / ref:.2f} |", flush=True)


def one_run(which: str, args) -> float:
    """One decoder's tokens/s, in a fresh process; a crash there is one line, naming it."""
    cmd = [sys.executable, __file__, "--one", which, "--model", args.model, *(["--quant", args.quant] * bool(args.quant)),
           *(["--no-repack"] * args.no_repack)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    out = done.stdout.split()
    if done.returncode or not out:
        why = f"{signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit status {done.returncode}"
        hint = " (on a CPU with AMX, llama.cpp's repacked weights crash: try --no-repack)" \
            if which == "llamacpp" and done.returncode < 0 and not args.no_repack else ""
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"error: the {which} run died ({why}){hint}: {last}")
    return float(out[-1])


if __name__ == "__main__":
    main()
