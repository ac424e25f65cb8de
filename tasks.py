"""
What eval.py's sweeps read and how they judge an answer: the jsonl datasets in data/ (GSM8K, MATH-500,
AIME 2024), answer extraction, grading, and the loop checks (of any trace, and of a capped answer). MATH and AIME
answers are compared by math-verify (https://github.com/huggingface/Math-Verify), the symbolic grader the field scores
these sets with; nanokv extracts the answer (the last \\boxed{}) itself. Left out: model-judged equivalence.
"""

import hashlib
import json
import re
import threading
from pathlib import Path

from math_verify import parse as mv_parse, verify as mv_verify

from generate import UsageError
from tokenizer import lone_surrogate

DATA = Path(__file__).resolve().parent / "data"  # shipped with the project: data/README.md
# in every accuracy row's key, per kind of answer; raise one when what counts as correct for it changes (2: cut-off
# answers need a box; MATH 3: \sqrt2 = \sqrt{2}, 'x = 5' = '5'; MATH 4: math-verify). tools/regrade.py regrades old
# rows from their answers.
GRADING = {"gsm8k": 2, "math": 4}


def grading(rows: list[dict]) -> int:
    """The grading rule's version for a dataset: GSM8K's numbers (answers with '####') or MATH's LaTeX."""
    return GRADING["gsm8k" if rows and "####" in rows[0]["answer"] else "math"]


def jsonl(path: str, what: str = "data file", shipped: str = "the shipped sets are in data/, see data/README.md"):
    """(line number, value) of each non-blank line of a jsonl file; a file that is missing, not a regular file, not
    UTF-8 or holds a line that is not JSON is one line naming it (what: how to call the file; shipped: where good
    ones are)."""
    if not Path(path).is_file():
        how = "is not a regular file (a pipe or a device: save it to a file first)" if Path(path).exists() \
            else "does not exist"
        raise UsageError(f"{what} {path} {how} ({shipped})")
    try:  # lines end at \n only: U+2028 or U+0085 inside a question is valid JSON, which str.splitlines would cut
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte {e.start}): pass a jsonl file") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {i}: not valid JSON ({e.msg}): fix or delete that line") from None
        except RecursionError:  # the decoder recurses once per level of [ or {
            raise UsageError(f"{path} line {i}: JSON nested too deeply to read: fix or delete that line") from None


def load_data(path: str) -> list[dict]:
    """Rows of a jsonl file with a question ('problem' or 'question') and an 'answer'; one-line errors."""
    rows = []
    for i, row in jsonl(path):
        q = row.get("problem", row.get("question")) if isinstance(row, dict) else None
        if not isinstance(q, str) or "answer" not in row:
            missing = "'answer'" if isinstance(q, str) else "'problem' (or 'question')"
            raise UsageError(f"{path} line {i}: missing field {missing}")
        bad = next(((f, k) for f, v in (("question", q), ("answer", str(row["answer"]))) if (k := lone_surrogate(v))
                    is not None), None)
        if bad:  # valid JSON ("\ud800"), but no character: the tokenizer cannot encode it
            raise UsageError(f"{path} line {i}: the {bad[0]} holds a lone surrogate at character {bad[1]} (half of a "
                             "UTF-16 pair, e.g. \\ud800 without its partner): fix that escape or delete that line")
        if not q.strip():  # as generate.py refuses an empty --prompt
            raise UsageError(f"{path} line {i}: the question is empty: fix or delete that line")
        if rows and ("####" in str(row["answer"])) != ("####" in rows[0]["answer"]):  # graded by one rule (GRADING)
            kind = lambda a: "GSM8K's ('#### N')" if "####" in a else "MATH's (LaTeX)"
            raise UsageError(f"{path} line {i}: its answer is {kind(str(row['answer']))}, the first row's "
                             f"{kind(rows[0]['answer'])}: a data file holds one kind of problem, graded by one rule; "
                             "split it into two files")
        rows.append({"question": q, "answer": str(row["answer"]), "solution": row.get("solution", str(row["answer"]))})
    if not rows:
        raise UsageError(f"data file {path} has no rows")
    return rows


def file_hash(path: str) -> str:
    """A short content hash: a result's key names its data by content, so another file under the same name reruns."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


# -----------------------------------------------------------------------------
# answers


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced: 'so \\boxed{\\frac{1}{2}}.' -> '\\frac{1}{2}'."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed")
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 1 : j]
    return None  # unclosed: the generation was cut off


def normalise(s: str) -> str:
    """Light LaTeX normalisation, before a GSM8K box is read as a number (MATH's answers go to math-verify as they are):
    '\\left( 3, \\dfrac{\\pi}{2} \\right)' -> '(3,\\pi/2)', '90^\\circ' -> '90',
    '11\\sqrt2' -> '11\\sqrt{2}'."""
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)\b", "", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s).replace("\\%", "").replace("$", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)  # \frac12
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)  # \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\[,;:! ]", "", s)  # LaTeX spacing
    return s.replace(" ", "").rstrip(".")


def as_number(s: str | None) -> float | None:
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def extract_answer(text: str, gsm8k: bool, stop: str, think_closed: bool | None = None) -> str | None:
    """The answer of a generation that stopped on its own end token (stop "eos") or at --max-new-tokens ("max"): the
    last \\boxed{}. For GSM8K, an answer that ended by itself and has no box falls back to its last number, but a
    cut-off one does not: a number mid-way through unfinished reasoning is not an answer (it counts as unanswered).
    e.g. GSM8K "... 6 + 12 = 18 eggs." -> "18" at "eos", None at "max"; "so \\boxed{18}, then 20" -> "18" at either.
    A thinking model's text is only what follows </think> (tokenizer.Thought.answer), so a box inside the thinking is
    never read; think_closed False (the thinking never ended) is no answer."""
    if think_closed is False:
        return None
    boxed = last_boxed(text)
    if boxed is not None or not gsm8k or stop != "eos":
        return boxed
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].rstrip(",") if nums else None


def is_correct(pred: str | None, answer: str) -> bool:
    """answer is the dataset's field: GSM8K's full solution ending in '#### 18' (compared as numbers), or MATH's and
    AIME's LaTeX (compared by math-verify)."""
    if pred is None:
        return False
    if "####" in answer:
        gold, got = as_number(answer.split("####")[-1]), as_number(normalise(pred))
        return gold is not None and got is not None and abs(gold - got) < 1e-6
    return math_equal(pred, answer)


def math_equal(pred: str, answer: str) -> bool:
    """math-verify's verdict on two LaTeX answers, gold first (its comparison is not symmetric: a gold interval or set
    decides how the prediction is read). e.g. '52' = '52_8' (a base given as asked), '7i - 2' = '-2 + 7i',
    '\\frac{1}{\\tan x}' = '\\cot x', '\\sqrt{117}' = '3\\sqrt{13}', 'x = 5' = '5'; '53' != '52_8',
    '[1,2)' != '[1,2]'."""
    # note: its time limits use signal.alarm, which only the main thread may set; elsewhere we run without one
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv_parse(f"${answer}$", parsing_timeout=limit)
    got = mv_parse(f"${pred}$", parsing_timeout=limit)
    return bool(gold and got) and mv_verify(gold, got, timeout_seconds=limit)


# -----------------------------------------------------------------------------
# loops


LOOP_N, LOOP_SHARE = 32, 0.5  # is_loop: windows of 32 tokens; a loop repeats more than half of its second half's


def repeat_share(ids: list[int], n: int = LOOP_N) -> float:
    """The share of the n-token windows that start in the second half of ids and already occurred earlier in ids (at
    any earlier start, overlaps allowed). A trace that repeats one passage verbatim from before its midpoint on scores
    1.0 whatever the passage's length (its period), up to half the trace; text that does not copy itself scores near 0.
    It is seq-rep-n of Welleck et al. (2020, https://arxiv.org/abs/1908.04319), the share of repeated n-grams, with
    long windows: 32 tokens outlast the formula or phrase that reasoning quotes again, so only copied passages count.
    e.g. n=2: [1, 2, 3, 1, 2, 3, 1, 2] -> the windows from index 4, (2,3) (3,1) (1,2), were all seen -> 1.0;
    [1, 2, ..., 8] -> 0.0."""
    half, last = len(ids) // 2, len(ids) - n  # windows start at 0..last
    if last < half:
        return 0.0  # the second half holds no whole window
    seen = {tuple(ids[j : j + n]) for j in range(half)}  # every window before the second half's first
    repeated = 0
    for i in range(half, last + 1):
        window = tuple(ids[i : i + n])
        repeated += window in seen
        seen.add(window)
    return repeated / (last + 1 - half)


def is_loop(ids: list[int], *, n: int = LOOP_N, share: float = LOOP_SHARE) -> bool:
    """A trace loops when more than `share` of its second half's n-token windows repeat earlier ones (repeat_share):
    the check every trace of a long-trace study passes, written by nanokv or imported. It reads the trace alone (no
    cap, no end token), so it also judges other models' text. Measured on real reasoning (data/README.md) it stays
    below 0.5, a verbatim loop scores 1.0, and one that numbers its repeats ("38. Use the fact that ...") about 0.7."""
    return repeat_share(ids, n) > share


def is_short_loop(ids: list[int], max_new_tokens: int, eos_ids=(), tail: int = 128, max_period: int = 64) -> bool:
    """The loop flag of eval.py accuracy's rows, kept as their rates were counted: an answer ran to max_new_tokens
    without an end token and its last `tail` tokens repeat with a period of at most `max_period`: x[i] == x[i - p] for
    every i >= p in that tail, for some p <= max_period. It misses longer periods (is_loop does not).
    e.g. tail=6, max_period=2: [..., 7, 8, 7, 8, 7, 8] loops (p = 2); [..., 7, 8, 9, 7, 8, 9] does not (p = 3)."""
    if len(ids) < max_new_tokens or set(ids) & set(eos_ids) or len(ids) < tail:
        return False
    x = ids[-tail:]
    return any(all(x[i] == x[i - p] for i in range(p, tail)) for p in range(1, max_period + 1))
