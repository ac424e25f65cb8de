"""
What every command line of nanokv shares (generate.py, eval.py, bench.py, tools/): the one-line UsageError and
argparse errors, --device / --dtype / --quant and their resolution, the CPU's units and threads, loading a model by
name, directory or Hugging Face Hub id (hub.py), progress notes on stderr, and one-line exits when writing the output
fails.

It sits between the decode loop and the model: generate, eval and bench import it; it imports model, tokenizer
and policies (for --policies), so any command can fail on a bad setting before a model is loaded.
"""

import argparse
import errno
import os
import platform
import resource
import sys
from contextlib import suppress
from pathlib import Path

import torch

from model import ModelError, load_model, side_file
from policies import POLICIES
from quant import INT4_MODES
from tokenizer import Tokenizer, chat_template, tokenizer_config


# -----------------------------------------------------------------------------
# settings and their errors


class UsageError(Exception):
    """A bad combination of settings: the message names the numbers and the fix."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and no abbreviations: argparse would expand a prefix of a long option (`--n`
    to `--no-protect-prompt`), so a typo could silently change an experiment. Subcommands inherit both."""

    def __init__(self, *args, allow_abbrev=False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message):  # one line, not usage + traceback-looking noise
        self.exit(2, f"error: {message} (see --help)\n")


def add_device_args(ap: argparse.ArgumentParser):
    """--device, --dtype and --quant, shared with eval.py."""
    ap.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the first available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="weights and cache dtype; with --quant, the activations' and the cache's (default: bfloat16 "
                    "on CUDA, and with --quant on a CPU with bf16 units; float32 elsewhere)")
    ap.add_argument("--quant", default=None, choices=["int8", "int4", "int4x8"], help="weight-only quantized "
                    "matrices, CPU only: int8 per output row; int4 in groups of 32, a GGUF's own 4-bit blocks where "
                    "weights.py kept them, its wider blocks as int8; int4x8: int4's numbers times int8 activations "
                    "(per block of 32), VNNI dot products, a C++ kernel built once (default: none, the exact fp32 "
                    "path; quant.py)")


def policy_names(arg: str, full: bool = True) -> list[str]:
    """--policies of eval.py and bench.py: 'all' (every registered policy) or a comma list -> names;
    full=False drops 'full'."""
    names = [p for p in arg.split(",") if p]
    if not names:
        raise UsageError("--policies is empty: give a comma list of policies, or all")
    names = list(POLICIES) if names == ["all"] else names
    for p in names:
        if p not in POLICIES:
            raise UsageError(f"unknown policy {p!r} in --policies: choose from all, {', '.join(sorted(POLICIES))}")
    return [p for p in names if full or p != "full"]


def int_list(flag: str, value: str) -> list[int]:
    """A comma list of positive integers, e.g. --budgets 128,256 -> [128, 256]; one-line errors."""
    try:
        out = [int(c) for c in str(value).split(",")]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers (got {value!r})") from None
    if min(out) < 1:
        raise UsageError(f"{flag} values must be at least 1 (got {value})")
    return out


# -----------------------------------------------------------------------------
# device, threads, memory, the model


def autodetect_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resolve_device(device: str | None, dtype: str | None, quant: str | None = None) -> tuple[str, torch.dtype]:
    """--device / --dtype / --quant -> a usable device and dtype: bf16 on CUDA, fp32 elsewhere unless asked, and with
    --quant bf16 activations on every CPU. note: not only where the CPU has bf16 units: torch's int4 and int8 kernels
    are written for bf16 inputs, and with fp32 ones they run 10-44x slower even on an AVX2-only CPU (RESULTS.md)."""
    device = device or autodetect_device()
    try:
        d = torch.device(device)
    except RuntimeError:
        d = None
    if d is None or d.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {device!r} is not a device nanokv runs on: use cpu, cuda, cuda:N or mps")
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():  # first: without it, no advice about cuda
        raise UsageError(f"--device {device}: this torch sees {torch.cuda.device_count()} CUDA device(s); "
                         "use --device cpu or an existing cuda:N")
    if d.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError("--device mps: MPS is not available here; use --device cpu")
    if quant and d.type != "cpu":
        raise UsageError(f"--quant runs on the CPU only (torch's {d.type} int4 kernel packs weights another way, which "
                         f"nanokv has not tested): drop --quant on {d.type}, where bf16 is fast, or use --device cpu")
    if quant and dtype == "float16":
        raise UsageError("--quant takes --dtype bfloat16 or float32 (the activations' dtype), not float16")
    if quant == "int4x8" and dtype == "float32":  # its scales are bf16, as the int4 kernel's
        raise UsageError("--quant int4x8 takes bf16 activations: drop --dtype float32, or use --quant int4")
    if quant == "int4x8":
        from kernels import dots_missing

        if why := dots_missing():  # before any weights load; the kernel is built here, once
            raise UsageError(f"--quant int4x8 cannot run here: {why}; use --quant int4 (torch's int4 kernel)")
    if dtype:
        return device, getattr(torch, dtype)
    return device, torch.bfloat16 if d.type == "cuda" or quant else torch.float32


def cpu_info() -> dict:
    """What this CPU offers the kernels, for bench rows and speed tables: its name, torch's SIMD level, and the flags
    that decide which mode is fast (bf16 units: avx512_bf16, amx_bf16; int8 dot products: the vnni and amx_int8)."""
    name, flags = platform.processor() or platform.machine(), set()
    with suppress(OSError), open("/proc/cpuinfo") as f:  # Linux; elsewhere no flags, so no bf16 by default
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    return {"cpu": name, "capability": torch.backends.cpu.get_cpu_capability(),
            "flags": [f for f in wanted if f in flags]}


def made_on(device: torch.device) -> str:
    """The machine a result was computed on, for rows resumed across machines: greedy decoding in bf16 on two CPUs
    can part at a rounding (torch's kernels vectorize for what each CPU has), so a row says where each part ran."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = cpu_info()
    return f"{info['cpu']}, {info['capability']}"


def kernel_path(device, dtype: torch.dtype, quant: str | None, rows: int) -> str:
    """Which kernels compute a run's numbers, in every row's key (results.PAIRED): on CPU, torch's SIMD level, whether
    the CPU has AMX, and how a matmul runs: "bf16 copies" (quant.bf16_copies, steps of many rows), "int kernels"
    (--quant's own) or "plain" (fp32, bf16). e.g. 'AVX512, no AMX, int kernels'. Two paths may round differently, and
    greedy decoding parts at the first rounding: the same snapkv GSM8K setting on an Intel Xeon and an AMD EPYC
    disagreed on 9 of 100 grades. On a GPU: its name."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda, {torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return device.type
    amx = "AMX" if {"amx_bf16", "amx_int8"} & set(cpu_info()["flags"]) else "no AMX"
    how = "bf16 copies" if bf16_matmul(device, dtype, quant, rows) else "int kernels" if quant else "plain"
    return f"{torch.backends.cpu.get_cpu_capability()}, {amx}, {how}"


TORCH_THREADS = torch.get_num_threads()  # torch's own choice (all cores, or OMP_NUM_THREADS), before we change it


def cpu_threads(device, dtype: torch.dtype, quant: str | None):
    """On CPU, torch runs one thread on the exact fp32 path: its time goes to matrix products, which kernels.linear then
    hands to numpy's OpenBLAS and its own threads (all cores), and a second busy-waiting pool would fight it for the
    cores. bf16 and the int kernels are torch's own: there torch keeps its threads."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1 if dtype == torch.float32 and not quant else TORCH_THREADS)


def peak_memory_mb(device) -> float:
    """Peak memory so far in MiB (2**20 bytes, as every memory figure of nanokv): CUDA allocator peak, else the
    process's peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def local_model(model: str | None) -> str | None:
    """--model as nanokv reads it: a Hugging Face Hub id (ORG/NAME[@REVISION], hub.py) becomes its snapshot directory
    in the Hugging Face cache, downloaded on first use; a directory, a bare config.json, a name weights.py knows, or
    None (the default model) is returned as it is. The one place a Hub id is resolved: the commands call it before they
    key rows by the model's files (results.model_key), and load() calls it for everyone else."""
    from hub import hub_model_dir, is_hub_id
    from weights import MODELS

    if model in MODELS or not is_hub_id(model):
        return model
    note(f"[hub] {model}: config, tokenizer and safetensors from the Hugging Face Hub (or its cache)")
    return str(hub_model_dir(model))


def bf16_matmul(device, dtype: torch.dtype, quant: str | None, rows: int) -> bool:
    """Whether a run whose steps multiply up to `rows` rows (its batch, a replay's chunk) keeps bf16 copies of its
    quantized matrices for its big steps (quant.bf16_copies): with --quant and bf16 activations, on a CPU with bf16
    units, when a step reaches kernels.DENSE_ROWS. A batch-1 decode never does: it keeps the int kernels' memory.
    Nor does int4x8, whose int8 dot products are meant for the big steps too."""
    from kernels import DENSE_ROWS, bf16_units

    return bool(quant) and quant != "int4x8" and torch.device(device).type == "cpu" and dtype == torch.bfloat16 and \
        bf16_units() and \
        rows >= DENSE_ROWS


def load(model_dir, device, dtype, quant: str | None = None, thinking: bool | None = None, rows: int = 1):
    """Model and tokenizer from a directory, a Hub id, or a model weights.py fetches (the embedded default model when
    model_dir is None). thinking: the chat template's thinking switch (None: the template's default); rows: the most
    rows one of the run's steps multiplies (bf16_matmul)."""
    from weights import DEFAULT_MODEL, MODELS, SetupError, model_dir as named_model_dir

    device, dtype = resolve_device(device, dtype, quant)  # a bad --device fails before any download
    cpu_threads(device, dtype, quant)
    typed, model_dir = model_dir, local_model(model_dir)  # typed: what the user named, for our messages
    try:  # a name that weights.py knows (and no directory of that name) is its converted directory
        if not model_dir or model_dir in MODELS and not os.path.isdir(model_dir):
            name, model_dir = model_dir or DEFAULT_MODEL, named_model_dir(model_dir or DEFAULT_MODEL, fetch=True)
            if quant in INT4_MODES and not side_file(model_dir):  # else its 4-bit numbers would be made anew
                raise ModelError(f"--quant {quant} runs {name}'s own 4-bit blocks, which its conversion in {model_dir} "
                                 f"predates: run 'python weights.py --model {name} --force' (it downloads the model "
                                 "again)")
        elif not os.path.isdir(model_dir):
            raise ModelError(f"--model {model_dir} does not exist as a directory and is no model weights.py knows: "
                             f"pass a Hugging Face model directory, a Hub id (ORG/NAME[@REVISION]) or one of "
                             f"{', '.join(MODELS)}")
    except SetupError as e:
        raise ModelError(str(e)) from None
    if quant in INT4_MODES and minmax_int4(str(model_dir)):
        note("[quant] no GGUF 4-bit blocks beside the model: its int4 groups are made from its values, by min and max")
    # first: a --thinking the template cannot take stops before the weights load
    tok = Tokenizer(model_dir, thinking, typed or model_dir)
    model = load_model(model_dir, device, dtype, quant)
    if bf16_matmul(device, dtype, quant, rows):
        from quant import bf16_copies

        note(f"[quant] steps of many rows run the same int4/int8 values through bf16 copies "
             f"({bf16_copies(model) / 2**30:.1f} GiB more memory)")
    return model, tok


def minmax_int4(model: str | None) -> bool:
    """Whether --quant int4 makes a directory's 4-bit numbers anew (min-max groups of its values) rather than running
    a GGUF's own blocks, which weights.py keeps beside a model it converted (a named model always has them)."""
    return bool(model) and os.path.isdir(model) and not side_file(model)


def int4_source(model: str | None) -> str | None:
    """For a directory whose --quant int4 runs 4-bit blocks kept beside it: the fingerprint of the weights they belong
    to (weights.source_digest), which results.model_key's few kilobytes of each file do not see. A named model needs
    none: its manifest pins both files by sha256 on every load (weights.model_dir)."""
    from weights import source_digest

    if not model or not os.path.isdir(model) or not side_file(model):
        return None
    fp32 = Path(model) / "model.safetensors"
    return source_digest(fp32) if fp32.is_file() else None


def plain_text(model: str | None) -> bool:
    """Whether --model has no chat template, so that its prompts go in as plain text (tokenizer.Tokenizer.chat); read
    from its files, without loading it. A named model (not a directory) always has one: weights.py writes the GGUF's."""
    if not model or not os.path.isdir(model):
        return False
    return chat_template(Path(model), tokenizer_config(Path(model)))[0] is None


# -----------------------------------------------------------------------------
# output


def check_output(flag: str, path: str | None):
    """Refuse, before any work, an output file that cannot be written where it is named (None: no such output): a
    folder (one that exists, or a name ending in a separator, which open() would fail on only after the run), a
    missing folder, a folder we may not write into."""
    if path is not None and not path.strip():  # '' would write nothing, silently
        raise UsageError(f"{flag} is empty: name the file to write, e.g. {flag} out.{flag.rsplit('-', 1)[-1]}")
    if path and (Path(path).is_dir() or path.endswith(("/", os.sep))):
        raise UsageError(f"{flag} {path} names a folder: name a file in it, e.g. "
                         f"{Path(path) / ('out.' + flag.rsplit('-', 1)[-1])}")
    folder = Path(path).resolve().parent if path else None
    if path and not folder.is_dir():
        raise UsageError(f"{flag} {path}: its folder does not exist; create it or write elsewhere")
    if path and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: its folder {folder} is not writable; write elsewhere")


def distinct_outputs(**flags: str | None):
    """Refuse two output flags that name one file (e.g. --html F --kept-json F): the second would overwrite the
    first. One file under two names counts too: a symbolic or a hard link (compared with os.path.samefile).
    flags: flag name -> its path (None: not given)."""
    given = [(flag, path) for flag, path in flags.items() if path]
    for i, (flag, path) in enumerate(given):
        for other, earlier in given[:i]:
            if Path(path).resolve() == Path(earlier).resolve():
                raise UsageError(f"{other} and {flag} both name {path}: the second would overwrite the first; give "
                                 "each its own file")
            if os.path.exists(path) and os.path.exists(earlier) and os.path.samefile(path, earlier):
                raise UsageError(f"{other} and {flag} both name one file ({path} is a hard link to {earlier}): the "
                                 "second would overwrite the first; give each its own file")


def write_output(flag: str, path: str, text: str) -> int:
    """Write an output file (--kept-json, --html), or stop in one line that names it (a full disk, no permission);
    a file we half wrote is removed. Returns its size in bytes."""
    data, opened = text.encode("utf-8"), False
    try:
        with open(path, "wb") as f:
            opened = True
            f.write(data)
    except OSError as e:
        if opened and Path(path).is_file():  # not /dev/full; and never a file we could not open, which is intact
            Path(path).unlink()
        raise UsageError(f"cannot write {flag} {path}: {e.strerror or e}: {write_fix(e)}") from None
    return len(data)


def note(msg: str):
    """Progress and timings go to stderr, so stdout holds only the answer and the report."""
    print(msg, file=sys.stderr, flush=True)


def output_failed(e: OSError):
    """Exit on an OSError: quietly if stdout's reader left (`| head -2`), else in one line that names the file (one we
    cannot read), or stdout and where it goes (a full disk under `> /dev/full`: the one write that names no file)."""
    what = f"{e.filename}: {e.strerror or e}" if e.filename else (
        f"cannot write to {stdout_target()}: {e.strerror or e}: {write_fix(e)}")
    if not e.filename and e.errno == errno.ENOSPC and not stdout_full():  # another file's disk is full, not stdout's
        what = (f"a write failed: {e.strerror} (not stdout's, {stdout_target()}): free some space where nanokv "
                "writes ($NANOKV_HOME, --out) and rerun")
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
    sys.exit(1 if isinstance(e, BrokenPipeError) else f"error: {what}")


def stdout_full() -> bool:
    """Whether stdout can be what ran out of space: /dev/full, or a file on a disk with no room left (True where the
    system does not say). A terminal or a file on a disk with room cannot: another write failed."""
    try:
        fd = sys.stdout.fileno()
        target = os.readlink(f"/proc/self/fd/{fd}")
        return target == "/dev/full" or os.path.isfile(target) and os.fstatvfs(fd).f_bavail == 0
    except (OSError, ValueError):
        return True


def write_fix(e: OSError) -> str:
    return "free some space there or write elsewhere" if e.errno == errno.ENOSPC else "write elsewhere"


def stdout_target() -> str:
    """stdout and the file it goes to, e.g. 'stdout (/dev/full)'; just 'stdout' where the system does not say."""
    try:
        return f"stdout ({os.readlink(f'/proc/self/fd/{sys.stdout.fileno()}')})"
    except (OSError, ValueError):  # not Linux, or a stdout without a descriptor (a test's capture)
        return "stdout"
