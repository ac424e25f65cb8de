"""
Result files of eval.py's sweeps: row keys, shards and their merge, atomic writes, row validation, per-job progress;
and the one way the tools (tools/, eval.py plot) read rows: checked, and paired only within one setting (one_setting).

A sweep is a list of jobs (dicts of every setting that changes a result); a row is a job plus what was measured.
Rows go to --out, a JSON list; with --shard I/N a process runs the I-th of N slices of the jobs (balanced by their
expected cost) and writes a file of its own beside --out, which no other process writes, so no lock is needed and the
files may sit on NFS; `python eval.py merge --out FILE` checks that every job is there exactly once and folds them into
FILE. Every write goes to a temporary file that is then renamed over the target: a reader never sees half a file, and a
failed write (full disk, size limit) leaves what was written before. Left out: a scheduler of our own (a Slurm array,
tools/slurm_sweep.sh, or a shell loop runs the shards), and locks across machines (flock is local: share one --out on
one machine only; two merges at once on one machine are safe: the second finds the shards taken).

Laid out top to bottom: keys (digest, model_key, labels); reading rows (checks, packed text, JSON files); the tools'
reading and pairing (tool_rows, one_setting, pool_blocks, at_least); writing (atomic writes, locks, Progress);
shards, run_jobs and merge.
"""

import argparse
import base64
import fcntl
import glob
import hashlib
import heapq
import json
import math
import os
import re
import tempfile
import time
import zlib
from contextlib import contextmanager, suppress
from pathlib import Path

from tqdm import tqdm

from cli import UsageError
from weights import SIDE


# -----------------------------------------------------------------------------
# keys: what names a row


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def model_key(model: str | None) -> str:
    """A model named by its content, so that a directory edited in place computes new rows and a moved one does not:
    "default" for the embedded model, else a hash of its JSON files (config, tokenizer) and chat_template.jinja (the
    prompts), and of each weight file's name, size, safetensors header (tensor names, dtypes, shapes, offsets) and
    first and last 64 KiB of data. That reads kilobytes, not gigabytes of weights. A bare config.json (bench's random
    weights) is hashed alone."""
    if not model:
        return "default"
    path = Path(model)
    if not path.exists():
        return model  # loading it fails later, with its own message
    h = hashlib.sha256()
    for f in [path] if path.is_file() else sorted(path.iterdir()):
        if f.suffix in (".json", ".jinja") and f.name != "manifest.json":  # the manifest holds mtimes: a copy reruns
            h.update(f.name.encode() + f.read_bytes())
        elif f.suffix == ".safetensors" and f.name != SIDE:  # derived from model.safetensors' GGUF, like it (weights
            # .py): hashing it too would give every row made before it existed a new key
            size = f.stat().st_size
            with open(f, "rb") as w:
                head = min(size, 8 + int.from_bytes(w.read(8), "little") + 2**16)  # the header, then 64 KiB of data
                w.seek(0)
                h.update(f"{f.name}:{size}".encode() + w.read(head))
                w.seek(max(head, size - 2**16))
                h.update(w.read())
    return h.hexdigest()[:16]


def same(job: dict, row: dict) -> bool:
    """Whether row is job's result: it holds every key field of the job with the same value."""
    return all(row.get(k) == v for k, v in job.items())


def label(job: dict, jobs: list[dict]) -> str:
    """A job named by the fields that tell it from the others of its sweep, e.g. 'policy=snapkv budget=128'."""
    varying = [k for k in job if len({json.dumps(j.get(k)) for j in jobs}) > 1]
    return " ".join(f"{k}={job[k]}" for k in varying) or str(job.get("policy"))


def differ(a: list[dict], b: list[dict]) -> str:
    """The first key field whose values differ between two sweeps, e.g. 'budget 128,256 against 128'."""
    for k in dict.fromkeys(k for j in a + b for k in j):
        va, vb = (",".join(sorted({json.dumps(j.get(k)) for j in js})) for js in (a, b))
        if va != vb:
            return f"{k} {va} against {vb}"
    return "the same settings in another order"


# -----------------------------------------------------------------------------
# rows are checked when read: a hand-edited field is named, never a traceback later

num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # NaN is no measure
integer = lambda v: isinstance(v, int) and not isinstance(v, bool)
positive = lambda v: integer(v) and v >= 1
flag = lambda v: isinstance(v, bool)
text = lambda v: isinstance(v, str)
list_of = lambda ok: lambda v: isinstance(v, list) and all(map(ok, v))
maybe = lambda ok: lambda v: v is None or ok(v)
PROBLEM = {"i": integer, "correct": flag, "answered": flag, "loop": flag, "tokens": integer,
           "stop": lambda v: v in ("eos", "max"), "evictions": integer, "kept": num, "pred": maybe(text)}
# fields of a problem that rows made before them lack: text_z, the generated text, packed; made_on, the machine; a
# thinking model's token counts and whether its thinking closed
LATER = {"text_z": text, "made_on": text, "think_tokens": integer, "answer_tokens": integer,  # thinking models'
         "think_closed": maybe(flag)}
problem = lambda p: isinstance(p, dict) and PROBLEM.keys() <= p.keys() <= PROBLEM.keys() | LATER.keys() and all(
    ok(p[k]) for k, ok in (PROBLEM | LATER).items() if k in p)
# a labelled trace's sentence measures (traces.sentence_summary); None where a trace never evicted
SENTENCES = {k: maybe(num) for k in ("top", "all", "rho", "kl_after", "kl_else")} | {
    f"{k}_by_layer": maybe(list_of(maybe(num))) for k in ("top", "all", "rho")}
sentences = lambda s: s is None or isinstance(s, dict) and s.keys() == SENTENCES.keys() and all(
    ok(s[k]) for k, ok in SENTENCES.items())
TRACE = {"kl": num, "top1": num, "gap": num, "tokens": integer, "evictions": integer, "kept": num}  # fidelity's sums
trace = lambda t: isinstance(t, dict) and TRACE.keys() <= t.keys() <= TRACE.keys() | {"sentences"} and all(
    ok(t[k]) for k, ok in (TRACE | {"sentences": sentences}).items() if k in t)
FIELDS = {  # the fields that code reads back (tables, paired statistics, figures); any other must be a plain JSON value
    "task": text, "policy": text, "budget": maybe(positive), "kl": num, "accuracy": num, "context": integer,
    "batch": integer, "ms_per_step": num, "kl_by_trace": list_of(num), "per_trace": list_of(trace),
    "per_problem": list_of(problem), "recall_by_probe": list_of(num), "l1_window_by_head": maybe(list_of(list_of(num))),
    "l1_next_by_head": maybe(list_of(list_of(num))), "sets": list_of(list_of(integer)), "recall_by_set": list_of(num),
    "logprob_by_set": list_of(num), "model": text, "data": text, "data_sha": text, "n": positive,
    "buffer": maybe(integer), "protect": maybe(flag), "top1": num, "nll_gap": num, "tokens": integer, "recall": num,
    "logprob": num, "heads": integer, "gap_tokens": num, "l1_window": maybe(num), "l1_next": maybe(num),
    "better_window": maybe(num), "better_next": maybe(num), "row_sha": text, "kernel_path": text,
    "trace_ids": list_of(text), "sentences_by_trace": list_of(sentences),
}
plain = lambda v: v is None or isinstance(v, (str, int, float, bool))


def check_row(row, where: str, needs: dict[str, tuple] | None = None, partial: bool = False):
    """Refuse, in one line that names it, a row that is not an object with a task, lacks a field its reader needs for
    its task (`needs`, e.g. plot's {"fidelity": ("policy", "budget", "kl"), ...}), has a field of the wrong type, was
    edited after it was written (its row_sha), or whose items do not add up (consistent). partial: a progress file's
    row, which holds the items finished so far."""
    if not isinstance(row, dict) or "task" not in row:
        raise UsageError(f"{where} is not a row (a JSON object with a 'task'): delete it, then rerun")
    name = f"{where} ({row.get('policy')}, budget {row.get('budget')})"
    missing = [k for k in (needs or {}).get(row["task"], ()) if k not in row]
    if missing:
        raise UsageError(f"{name} has no {missing[0]!r}, which a {row['task']} row needs here: fix or delete that row, "
                         "then rerun")
    for k, v in row.items():
        if not FIELDS.get(k, plain)(v):
            raise UsageError(f"{name} has a bad {k!r}: {json.dumps(v)[:60]}: fix or delete that row, then rerun")
    if "row_sha" in row and seal(row) != row["row_sha"]:
        raise UsageError(f"{name} was edited after eval.py wrote it (its row_sha no longer matches its fields): delete "
                         "that row (a rerun of its sweep computes it again), or put back what was changed")
    bad = consistent(row, partial)
    if bad:
        raise UsageError(f"{name} {bad}: a pair of rows would compare other items than it says; delete that row (a "
                         "rerun of its sweep computes it again)")


def seal(row: dict) -> str:
    """The digest of a row's fields but row_sha, which run_jobs writes beside them: a row edited by hand (its K set to
    999, a problem's verdict flipped) no longer matches it and is refused wherever it is read, a rerun of the sweep
    included, rather than drawn or paired. A check against mistakes, not a signature: rows written before it have no
    row_sha and are read as they are."""
    return digest({k: v for k, v in row.items() if k != "row_sha"})


def consistent(row: dict, partial: bool = False) -> str | None:
    """What does not add up in a row's items, or None: per_problem must hold each of the problems 0 .. n - 1 once
    (accuracy runs the first n of its data file), kl_by_trace and per_trace one entry per trace (n of them); a
    progress file's row (partial) holds some of them, each once. e.g. a 100-problem row whose problems all say i = 0
    is one problem counted 100 times, and a KL list cut to 1 of 12 traces pairs one trace with another's."""
    n = row.get("n")
    if row.get("per_problem"):  # an empty one: the readers that pair say "holds no problems" (one_setting, regrade)
        seen = [p["i"] for p in row["per_problem"]]
        twice = next((i for k, i in enumerate(seen) if i in seen[:k]), None)
        if twice is not None:
            return f"holds problem i = {twice} twice"
        outside = next((i for i in seen if not 0 <= i < (n or 0)), None) if n is not None else None
        if outside is not None:
            return f"holds problem i = {outside}, outside 0 .. n - 1 (n = {n})"
        if not partial and n is not None and len(seen) != n:
            return f"holds {len(seen)} problems for its n = {n}"
    for k in ("kl_by_trace", "per_trace", "trace_ids", "sentences_by_trace"):
        if k in row and n is not None and (len(row[k]) > n or not partial and len(row[k]) != n):
            return f"has {len(row[k])} entries in {k} for its n = {n} traces"
    if "sets" in row and {len(row[k]) for k in ("sets", "recall_by_set", "logprob_by_set") if k in row} != \
            {len(row["sets"])}:
        return "has sets, recall_by_set and logprob_by_set of different lengths"
    return None


def pack_text(s: str) -> str:
    """A generated answer as a short string for a row: UTF-8, zlib, base64 (a third of the JSON-escaped text)."""
    return base64.b64encode(zlib.compress(s.encode("utf-8", "surrogatepass"), 9)).decode("ascii")


def unpack_text(z: str) -> str:
    return zlib.decompress(base64.b64decode(z)).decode("utf-8", "surrogatepass")


def parse_json(path: Path):
    """A JSON file's content, or None where it is not JSON (damaged, truncated, not UTF-8, nested too deeply to
    decode); a folder or a file that cannot be read is one line."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory: pass a file path, e.g. {path / 'rows.json'}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deeply
        return None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


def read_json(path: Path, kind: type, fix: str = "move it away or pick another --out"):
    """A JSON file's content, which must be a `kind` (list or dict); one-line errors that end in `fix`."""
    obj = parse_json(path)
    if not isinstance(obj, kind):
        raise UsageError(f"{path} is not {'a JSON list of rows' if kind is list else 'a JSON object'}: {fix}")
    return obj


def read_rows(path: Path | None, needs: dict[str, tuple] | None = None,
              fix: str = "move it away or pick another --out") -> list[dict]:
    rows = read_json(path, list, fix) if path and path.exists() else []
    for i, row in enumerate(rows):
        check_row(row, f"{path} row {i + 1}", needs)
    return rows


# -----------------------------------------------------------------------------
# what the tools read (tools/, eval.py plot): every file through read_json and check_row; pairs of one setting only

READ_FIX = "pass a result file of eval.py (its --out)"
# a model, a mode, a data file, an n, and the kernels that computed them (cli.kernel_path): greedy decoding on two
# kernel paths can part at a rounding (9 of 100 GSM8K grades, the same snapkv setting on two CPUs)
PAIRED = ("model", "device", "dtype", "quant", "template", "data_sha", "n", "kernel_path")
UNRECORDED = "unrecorded"  # the kernel path of rows written before rows recorded it


def tool_rows(paths, needs: dict[str, tuple] | None = None, where: dict | None = None) -> list[dict]:
    """The rows of result files that a tool reads, each checked as the sweeps check theirs (check_row, with the
    fields the tool needs per task); a file that is missing, a folder, damaged or not a list of rows is one line.
    where: filled with id(row) -> 'FILE row N', for the messages of `one_setting`."""
    rows = []
    for p in map(Path, paths):
        if not p.exists():
            raise UsageError(f"no file {p}: {READ_FIX}")
        for i, row in enumerate(read_rows(p, needs, READ_FIX)):
            rows.append(row)
            if where is not None:
                where[id(row)] = f"{p} row {i + 1}"
    return rows


def differs(a: dict, b: dict, keys=PAIRED) -> str | None:
    """The first of keys in which two rows differ, or None. A row without a kernel_path reads as UNRECORDED: two such
    rows pair (the record's tables, all made before the field), but one never pairs with a recorded path, since
    nothing shows that it ran on that path."""
    get = lambda r, k: r.get(k, UNRECORDED) if k == "kernel_path" else r.get(k)
    return next((k for k in keys if get(a, k) != get(b, k)), None)


def machines_of(row: dict) -> dict[int, str]:
    """Problem -> the machine it ran on, for a row that records its kernel path (eval.py writes each problem's
    made_on, cli.made_on); {} for the record's rows made before the path was (they pair as before; RESULTS.md says
    which cells pair machines) and for rows without problems (fidelity rows)."""
    if "kernel_path" not in row:
        return {}
    return {p["i"]: p["made_on"] for p in row.get("per_problem") or [] if p.get("made_on")}


def other_machine(a: dict, b: dict) -> tuple[int, str, str] | None:
    """The first problem that two rows ran on two machines, with both machines, or None: a pair is problem by problem,
    so a row resumed across two CPUs pairs only with rows whose problems ran where its own did."""
    ma, mb = machines_of(a), machines_of(b)
    return next(((i, ma[i], mb[i]) for i in sorted(ma.keys() & mb.keys()) if ma[i] != mb[i]), None)


def one_setting(rows: list[dict], what: str, keys=PAIRED, where: dict | None = None):
    """Refuse rows that a tool would pair (problem by problem, trace by trace) but that do not share a model, a mode
    (device, dtype, quant, template), a data file, an n and a kernel path: their differences would measure the
    setting, not the policy. One line, naming the field, two rows and their values; and a row without problems. what:
    e.g. 'the accuracy rows'. The one check of every tool that pairs rows (tools/claims.py, replication.py, seeds.py,
    compare_modes.py, which compares two modes and so leaves the mode and kernel path out of keys); each row's own
    items are checked where it is read (check_row). Rows that record their kernel path must also have run each problem
    on one machine, compare_modes' two modes included: one path on two CPUs (an Intel Xeon and an AMD EPYC, both
    'AVX512, no AMX, bf16 copies') can still part at a rounding (other_machine)."""
    name = lambda r: (where or {}).get(id(r)) or f"the {r.get('policy')} row"
    anchor = next((r for r in rows if machines_of(r)), None)  # the first row that says where its problems ran
    for r in rows:
        k = differs(rows[0], r, keys)
        if k == "kernel_path":
            path = lambda r: r.get("kernel_path", f"{UNRECORDED} (a row made before rows recorded it)")
            raise UsageError(f"{what} ran on two kernel paths: {name(rows[0])} on {path(rows[0])!r}, {name(r)} on "
                             f"{path(r)!r}; greedy decoding on two paths can part at a rounding, so a pair would "
                             "measure the machines: rerun one of them on the other's machine and mode")
        two = None if k or anchor is None else other_machine(anchor, r)
        if two:
            raise UsageError(f"{what} ran on two machines: problem {two[0]} of {name(anchor)} on {two[1]}, of "
                             f"{name(r)} on {two[2]}; one kernel path on two CPUs can still part at a rounding, so a "
                             "pair would measure the machines: rerun one of them on the other's machine")
        if k:
            raise UsageError(f"{what} do not share one setting: {name(rows[0])} has {k} {json.dumps(rows[0].get(k))}, "
                             f"{name(r)} {json.dumps(r.get(k))}; a pair compares policies on one model, mode, data "
                             "file and n: pass the files of one setting")
        if "per_problem" in r and not r["per_problem"]:
            raise UsageError(f"{name(r)} holds no problems (its per_problem is empty): rerun its sweep, or delete "
                             "that row")


# A study of many traces runs in blocks (eval.py fidelity --traces --skip S --n N: the traces S + 1 .. S + N), each
# block its own rows, so that a sitting adds traces to what the last one measured. The rows of one setting pool into
# one over every block's traces; a setting that misses a block the others have is left out of the pool, and said.
FIDELITY_SUMS = ("kl", "top1", "nll_gap")  # per token; mean_evictions and mean_kept are per trace
BY_TRACE = ("kl_by_trace", "trace_ids", "sentences_by_trace")


def pool_blocks(rows: list[dict], where: dict | None = None, note=print) -> list[dict]:
    """Fidelity rows of other models' traces (trace_ids) that share every key but n, skip and long -> one row per
    setting over all their traces, in trace order: the per-trace lists joined, the sums per token weighted by
    tokens, the means per trace by traces. Two rows holding one trace are refused in one line; a setting without
    every block that another holds is dropped with a note (a pair needs the same traces on both sides). Other rows
    pass unchanged. e.g. random on traces 1-8 (n 8) and 9-16 (skip 8, n 8) -> random on 16, kl weighted by each
    block's tokens. The pooled row keeps its first block's long (the lowest)."""
    # long and skip only select traces: a block of the longest traces (--long 6000) pools with blocks of --long 2000
    result = set(FIDELITY_SUMS) | set(BY_TRACE) | {"tokens", "mean_evictions", "mean_kept", "n", "skip", "long",
                                                   "row_sha"}
    setting = lambda r: json.dumps({k: v for k, v in r.items() if k not in result}, sort_keys=True)
    name = lambda r: (where or {}).get(id(r)) or f"the {r.get('policy')} row"
    groups, out = {}, []
    for r in rows:
        if r.get("task") == "fidelity" and "trace_ids" in r:
            groups.setdefault(setting(r), []).append(r)
        else:
            out.append(r)
    pooled = {}
    for key, rs in groups.items():
        rs = sorted(rs, key=lambda r: (r.get("long") or 0, r.get("skip", 0)))  # one order for every policy
        for a, b in zip(rs, rs[1:]):
            both = set(a["trace_ids"]) & set(b["trace_ids"])
            if both:
                raise UsageError(f"{name(a)} and {name(b)} both hold trace {sorted(both)[0]}: a trace counted twice "
                                 "would weigh double; pass one file of each block")
        if len(rs) == 1:
            pooled[key] = rs[0]
            continue
        tokens = [r["tokens"] for r in rs]
        # a block of unlabelled traces (Sky-T1's) has no sentences: None for each of its traces, as within a row
        joined = {k: [x for r in rs for x in r.get(k, [None] * r["n"])] for k in BY_TRACE if any(k in r for r in rs)}
        n = sum(r["n"] for r in rs)
        pooled[key] = {**{k: v for k, v in rs[0].items() if k not in ("skip", "row_sha")}, **joined, "n": n,
                       "tokens": sum(tokens),
                       **{k: sum(r[k] * t for r, t in zip(rs, tokens)) / sum(tokens) for k in FIDELITY_SUMS},
                       **{k: sum(r[k] * r["n"] for r in rs) / n for k in ("mean_evictions", "mean_kept")}}
    # a pair needs the same traces on both sides: the rows of the widest cover stay (of two as wide, the commoner)
    cover = {k: tuple(r["trace_ids"]) for k, r in pooled.items()}
    widest = max(cover.values(), key=lambda c: (len(c), list(cover.values()).count(c)), default=())
    for key, r in pooled.items():
        if cover[key] == widest:
            out.append(r)
        else:
            note(f"note: {r['policy']} (K {r['budget']}, r {r['buffer']}) holds {len(cover[key])} traces, not the "
                 f"{len(widest)} that the widest rows hold: left out (run its missing blocks, eval.py fidelity --skip)")
    return out


def at_least(rows: list[dict], min_tokens: int, lengths: dict[str, int], sha: str, where: dict | None = None
             ) -> list[dict]:
    """Fidelity rows of other models' traces cut to the traces of at least min_tokens tokens: the study's longest
    traces out of its blocks, without replaying them again. lengths: each trace's tokens (the traces file's n_tokens),
    sha: that file's tasks.file_hash. Kept: the per-trace lists, n, and tokens recounted; dropped: the per-token sums
    and per-trace means, which a row holds over all its traces only. Refused in one line: a row of another file, or
    whose traces' lengths do not add up to its tokens (another tokenizer read them). Other rows pass unchanged."""
    name = lambda r: (where or {}).get(id(r)) or f"the {r.get('policy')} row"
    out = []
    for r in rows:
        if r.get("task") != "fidelity" or "trace_ids" not in r:
            out.append(r)
            continue
        if r.get("data_sha") != sha:
            raise UsageError(f"{name(r)} replayed another traces file ({r.get('data')}, {r.get('data_sha')}) than the "
                             f"one whose lengths were read ({sha}): pass that file")
        n = [lengths.get(t) for t in r["trace_ids"]]
        if None in n or sum(n) != r["tokens"]:
            raise UsageError(f"{name(r)}'s traces hold {r['tokens']} tokens, not the file's n_tokens "
                             f"({'a trace is missing' if None in n else sum(n)}): its model's tokenizer is not the one "
                             "that counted them, so its long traces cannot be told apart here")
        keep = [i for i, k in enumerate(n) if k >= min_tokens]
        if not keep:
            continue  # none of its traces is that long: its cells read 'not run'
        cut = {k: [r[k][i] for i in keep] for k in BY_TRACE if k in r}
        drop = set(FIDELITY_SUMS) | {"mean_evictions", "mean_kept"}
        out.append({**{k: v for k, v in r.items() if k not in drop}, **cut, "n": len(keep),
                    "tokens": sum(n[i] for i in keep), "long": max(min_tokens, r.get("long") or 0)})
    return out


# -----------------------------------------------------------------------------
# writes that survive anything


HOST = os.uname().nodename  # temporary files name their writer by host and process id, so a stale one can be told
STALE_S = 3600  # seconds after which a temporary file no live process of ours is seen writing is stale (a write
# takes seconds)


def temp_beside(path: Path) -> tuple[int, str]:
    """A new temporary file beside path for this process to write and rename over it, named after its writer:
    rows.json.HOST.PID.XXXXXXXX.tmp (mkstemp's random part). Returns (fd, its name). Stale ones go first
    (clear_stale)."""
    clear_stale(path)
    return tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.{HOST}.{os.getpid()}.", suffix=".tmp")


def clear_stale(path: Path):
    """Remove the temporary files of path's writers that are gone: a write killed between making its file and renaming
    it leaves one (a sweep's rows, a reference's logits of gigabytes) that nothing else would ever remove. Ours on this
    host go as soon as their process is dead; others (another host's on a shared disk, older names) after STALE_S."""
    for tmp in path.parent.glob(glob.escape(path.name) + ".*.tmp"):
        writer = tmp.name[len(path.name) + 1: -len(".tmp")].rsplit(".", 2)  # [HOST, PID, random] when it is ours
        mine = len(writer) == 3 and writer[0] == HOST and writer[1].isdigit()
        with suppress(OSError):  # another process may be removing it too
            if mine and not alive(int(writer[1])) or time.time() - tmp.stat().st_mtime > STALE_S:
                tmp.unlink()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_json(path: Path, obj):
    """Write to a temporary file of this process's own, flush it to disk, then rename it over path: a reader never sees
    half a file, and a write that fails (read-only directory, full disk, file-size limit) leaves path as it was."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # e.g. results/ in a fresh checkout
        fd, tmp = temp_beside(path)
        mask = os.umask(0o022)  # the umask is read by setting it,
        os.umask(mask)  # and put back
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp's file is 0600: a result is as readable as any file open() makes
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp:
            with suppress(OSError):
                os.remove(tmp)
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)  # a file where a folder goes
        why = f"{blocker} is a file, not a directory" if blocker else e.strerror or str(e)
        raise UsageError(f"cannot write {path} ({why}): what was written before is kept; fix that or pick another "
                         "--out, then rerun the same command to resume") from None


def check_writable(path: Path):
    """Fail in one line before the first job, not after an hour of work, when path cannot be written."""
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory: pass a file path, e.g. {path / 'rows.json'}")
    probe = path.with_name(path.name + ".probe")
    write_json(probe, [])  # its own stale temporary files go first (clear_stale)
    probe.unlink()


@contextmanager
def locked(path: Path):
    """An exclusive flock on path's directory, held while we read, merge and write path: writers on one machine take
    turns. A directory that holds path cannot be deleted under us, as a lock file could (and was: rows were lost)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Progress:
    """A job's partial row (accuracy: the per_problem outcomes so far), saved after every finished problem (fidelity:
    trace) beside its result file under a name made from the job's full key, so that a killed job loses only the
    problems it was decoding."""

    def __init__(self, result: Path | None, job: dict):
        self.job, self.path = job, progress_path(result, job) if result else None
        saved = read_json(self.path, dict) if self.path and self.path.exists() else {}
        if saved:
            check_row(saved, str(self.path), partial=True)
        self.part = {k: v for k, v in saved.items() if k not in job} if same(job, saved) else {}

    def save(self, **part):
        self.part = part
        if self.path:
            write_json(self.path, {**self.job, **part})


def progress_path(result: Path, job: dict) -> Path:
    return result.with_name(f"{result.stem}.progress-{digest(job)}{result.suffix}")


# -----------------------------------------------------------------------------
# shards


def shard_arg(value: str) -> tuple[int, int]:
    """--shard I/N, the I-th of N slices (1 <= I <= N): '2/4' -> (2, 4). An argparse type."""
    m = re.fullmatch(r"(\d+)/(\d+)", value.strip())
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise argparse.ArgumentTypeError(f"takes I/N with 1 <= I <= N, e.g. 2/4 (got {value!r}); for a Slurm array "
                                         "use --array=1-N")
    return int(m[1]), int(m[2])


def plan(costs: list[float], n: int) -> list[int]:
    """Which shard (1 .. n) runs each job: the dearest job first, each to the shard with the least cost so far (ties:
    the lower shard), as in LPT scheduling. A pure function of the costs, so every shard and merge agree.
    e.g. costs [3, 1, 2, 2], n = 2: 3 -> shard 1, 2 -> 2, 2 -> 2 (2 < 3), 1 -> 1 (3 < 4): [1, 1, 2, 2], 4 and 4."""
    # a heap of (cost so far, shard); past len(costs) shards the rest get no job, so they need no place in it
    loads = [(0.0, s) for s in range(1, min(n, len(costs)) + 1)]
    owner = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: -costs[j]):  # stable: equal costs keep job order
        load, s = heapq.heappop(loads)
        owner[j] = s
        heapq.heappush(loads, (load + costs[j], s))
    return owner


def result_file(out: str | None, shard: tuple[int, int] | None) -> Path | None:
    """Where this process writes its rows: --out, or with --shard I/N its own file beside it, rows.shard-I-of-N.json."""
    if shard and not out:
        raise UsageError("--shard needs --out: each shard writes its rows beside it, for `eval.py merge`")
    if not shard:
        return Path(out) if out else None
    p = Path(out)
    return p.with_name(f"{p.stem}.shard-{shard[0]}-of-{shard[1]}{p.suffix}")


def read_shard(path: Path) -> dict:
    s = read_json(path, dict)
    if s.keys() != {"jobs", "plan", "shard", "rows"}:
        raise UsageError(f"{path} is not a shard file (jobs, plan, shard, rows): move it away")
    for i, row in enumerate(s["rows"]):
        check_row(row, f"{path} row {i + 1}")
    return s


def todo(jobs: list[dict], rows: list[dict]) -> list[dict]:
    """The jobs that no row holds yet."""
    return [j for j in jobs if not any(same(j, r) for r in rows)]


def run_jobs(jobs: list[dict], measure, out: str | None = None, shard: tuple[int, int] | None = None,
             cost=lambda job: 1.0, desc: str = "jobs") -> list[dict]:
    """Measure every job of this shard (all, without --shard) that neither --out nor the shard's file holds yet, and
    save each row as it finishes: into the shard's file, or merged into --out under its directory's lock. A row with
    an "error" is shown but not saved (a failed job is not a result: a rerun retries it). Returns the shard's rows in
    job order."""
    path, rows = result_file(out, shard), read_rows(Path(out) if out else None)
    mine, saved = jobs, []
    if shard:
        owner = plan([cost(j) for j in jobs], shard[1])
        head = {"jobs": jobs, "plan": owner, "shard": list(shard)}
        mine = [j for j, s in zip(jobs, owner) if s == shard[0]]
        if path.exists():
            old = read_shard(path)
            if any(old[k] != head[k] for k in head):
                raise UsageError(f"{path} holds shard {shard[0]}/{shard[1]} of another sweep "
                                 f"({differ(jobs, old['jobs'])}): merge it first (python eval.py merge --out {out}) "
                                 "or move it away")
            saved = old["rows"]
        write_json(path, {**head, "rows": saved})  # at once, even for an empty slice: merge sees that it ran
        rows += saved
    failed = []
    for job in tqdm(todo(mine, rows), desc=desc):
        if not shard and path and any(same(job, r) for r in read_rows(path)):
            continue  # another sweep on the same --out finished it meanwhile
        row = {**job, **measure(job)}
        if "error" in row:
            failed.append(row)
            continue
        row["row_sha"] = seal(row)  # a later hand edit is refused where the row is read (check_row)
        rows.append(row)
        if shard:
            saved.append(row)
            write_json(path, {**head, "rows": saved})
        elif path:
            with locked(path):
                write_json(path, [r for r in read_rows(path) if not same(job, r)] + [row])
        if path:
            progress_path(path, job).unlink(missing_ok=True)
    rows = (rows if shard or not path else read_rows(path)) + failed
    return [next(r for r in rows if same(j, r)) for j in mine if any(same(j, r) for r in rows)]


def merge(out: str) -> tuple[list[dict], list[dict]]:
    """Fold the shard files beside out into it, after checking that they ran one sweep and hold each of its jobs
    exactly once (or out already holds it); one-line errors name the shard and the jobs. The shard files are removed
    once out holds their rows. Returns the sweep's jobs and its rows in job order."""
    path = Path(out)
    pattern = re.compile(re.escape(path.stem) + r"\.shard-(\d+)-of-(\d+)" + re.escape(path.suffix))
    found = {(int(m[1]), int(m[2])): f for f in sorted(path.parent.glob("*")) if (m := pattern.fullmatch(f.name))}
    if not found:  # never run, or another merge took them (it removes the files it folds in): say both
        taken = f"another merge may have taken them ({out} holds {len(read_rows(path))} rows), or " if \
            path.exists() else ""
        raise UsageError(f"no shard files beside {out} (such as {result_file(out, (1, 2)).name}), so nothing to "
                         f"merge: {taken}run the sweep with --shard I/N and the same --out first (a merge removes the "
                         "files it folds in)")
    counts = sorted({n for _, n in found})
    if len(counts) > 1:
        raise UsageError(f"shard files of {' and '.join(map(str, counts))} shards beside {out}: move the stale set "
                         "away, then merge again")
    n = counts[0]
    taken = lambda: UsageError(f"another merge took these shards: their files beside {out} went while this merge "
                               f"read them, and their rows are in {out}; nothing is left to merge")
    try:
        shards = {i: read_shard(f) for (i, _), f in sorted(found.items())}
    except UsageError:
        if all(f.exists() for f in found.values()):
            raise
        raise taken() from None
    first = min(shards)
    jobs, owner = shards[first]["jobs"], shards[first]["plan"]
    for i, s in shards.items():
        if s["jobs"] != jobs or s["plan"] != owner:
            raise UsageError(f"shard {i}/{n} ran other settings than shard {first}/{n} ({differ(s['jobs'], jobs)}): "
                             f"rerun it with the same arguments, then merge again")
    have, where = read_rows(path), {}  # job index -> (which shard, its row)
    for i, s in shards.items():
        for row in s["rows"]:
            k = next((k for k, j in enumerate(jobs) if same(j, row)), None)
            if k is None:
                raise UsageError(f"{found[i, n]} holds a row that is not a job of its sweep: delete it, then merge "
                                 "again")
            if k in where:
                raise UsageError(f"{label(jobs[k], jobs)} is in shard {where[k][0]}/{n} and again in shard {i}/{n}: "
                                 "delete one copy, then merge again")
            where[k] = (i, row)
    missing = {}  # shard -> labels of its jobs that no file holds
    for k, job in enumerate(jobs):
        old = next((r for r in have if same(job, r)), None)
        if k not in where and old is None:
            missing.setdefault(owner[k], []).append(label(job, jobs))
        elif k in where and old not in (None, where[k][1]):
            raise UsageError(f"{out} already holds another row for {label(job, jobs)}: move {out} away or delete "
                             "that row, then merge again")
    if missing:
        say = lambda s: f"shard {s}/{n}" + ("" if s in shards else f" never ran (no {result_file(out, (s, n)).name})")
        raise UsageError(f"{sum(map(len, missing.values()))} of {len(jobs)} rows missing: " + "; ".join(
            f"{say(s)}: {', '.join(m)}" for s, m in sorted(missing.items())) + ". Rerun those shards, then merge again")
    with locked(path):  # another sweep may share out on this machine, and another merge may have run meanwhile
        if not all(f.exists() for f in found.values()):
            raise taken()
        have = read_rows(path)
        new = [row for k, (_, row) in sorted(where.items()) if not any(same(jobs[k], r) for r in have)]
        write_json(path, have + new)
        for f in found.values():  # under the lock: a second merge waiting for it then finds them gone
            f.unlink(missing_ok=True)
    rows = read_rows(path)
    return jobs, [next(r for r in rows if same(j, r)) for j in jobs]
