"""
What every command line of nanokv shares (generate.py, eval.py, bench.py, tools/): the one-line UsageError and
argparse errors, --device / --dtype and their resolution, CPU threads, loading a model by name or directory,
progress notes on stderr, and one-line exits when writing the output fails.

It sits between the decode loop and the model: generate, eval and bench import it; it imports model, tokenizer
and policies (for --policies), so any command can fail on a bad setting before a model is loaded.
"""

import argparse
import errno
import os
import resource
import sys
from pathlib import Path

import torch

from model import ModelError, load_model
from policies import POLICIES
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
    """--device and --dtype, shared with eval.py."""
    ap.add_argument("--device", default=None, help="cuda, cuda:N, mps or cpu (default: the first available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="weights and cache dtype (default: bfloat16 on CUDA, float32 elsewhere)")


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


def resolve_device(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """--device / --dtype -> a usable device and dtype: bf16 on CUDA, fp32 elsewhere unless asked."""
    device = device or autodetect_device()
    try:
        d = torch.device(device)
    except RuntimeError:
        d = None
    if d is None or d.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {device!r} is not a device nanokv runs on: use cpu, cuda, cuda:N or mps")
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this torch sees {torch.cuda.device_count()} CUDA device(s); "
                         "use --device cpu or an existing cuda:N")
    if d.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError("--device mps: MPS is not available here; use --device cpu")
    return device, getattr(torch, dtype) if dtype else torch.bfloat16 if d.type == "cuda" else torch.float32


def cpu_threads(device):
    """On CPU, torch keeps one thread: decode's time goes to matrix products, which kernels.linear then hands to
    numpy's OpenBLAS and its own threads (all cores). A second busy-waiting pool would fight it for the cores."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)


def peak_memory_mb(device) -> float:
    """Peak memory so far: CUDA allocator peak, else the process's peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def load(model_dir, device, dtype):
    """Model and tokenizer from a directory, or the embedded default model (fetched on first use)."""
    from weights import DEFAULT_MODEL, MODELS, SetupError, model_dir as named_model_dir

    device, dtype = resolve_device(device, dtype)  # a bad --device fails before any download
    cpu_threads(device)
    try:  # a name that weights.py knows (and no directory of that name) is its converted directory
        if not model_dir or model_dir in MODELS and not os.path.isdir(model_dir):
            model_dir = named_model_dir(model_dir or DEFAULT_MODEL, fetch=True)
        elif not os.path.isdir(model_dir):
            raise ModelError(f"--model {model_dir} does not exist as a directory and is no model weights.py knows: "
                             f"pass a Hugging Face model directory or one of {', '.join(MODELS)}")
    except SetupError as e:
        raise ModelError(str(e)) from None
    return load_model(model_dir, device, dtype), Tokenizer(model_dir)


def plain_text(model: str | None) -> bool:
    """Whether --model has no chat template, so that its prompts go in as plain text (tokenizer.Tokenizer.chat); read
    from its files, without loading it. A named model (not a directory) always has one: weights.py writes the GGUF's."""
    if not model or not os.path.isdir(model):
        return False
    return chat_template(Path(model), tokenizer_config(Path(model)))[0] is None


# -----------------------------------------------------------------------------
# output


def note(msg: str):
    """Progress and timings go to stderr, so stdout holds only the answer and the report."""
    print(msg, file=sys.stderr, flush=True)


def output_failed(e: OSError):
    """Exit on an OSError: quietly if stdout's reader left (`| head -2`), else in one line that names the file (one we
    cannot read), or stdout and where it goes (a full disk under `> /dev/full`: the one write that names no file)."""
    what = f"{e.filename}: {e.strerror or e}" if e.filename else (
        f"cannot write to {stdout_target()}: {e.strerror or e}: {write_fix(e)}")
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
    sys.exit(1 if isinstance(e, BrokenPipeError) else f"error: {what}")


def write_fix(e: OSError) -> str:
    return "free some space there or write elsewhere" if e.errno == errno.ENOSPC else "write elsewhere"


def stdout_target() -> str:
    """stdout and the file it goes to, e.g. 'stdout (/dev/full)'; just 'stdout' where the system does not say."""
    try:
        return f"stdout ({os.readlink(f'/proc/self/fd/{sys.stdout.fileno()}')})"
    except (OSError, ValueError):  # not Linux, or a stdout without a descriptor (a test's capture)
        return "stdout"
