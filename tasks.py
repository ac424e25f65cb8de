"""
What eval.py's sweeps read and how they judge an answer: the jsonl datasets in data/ (GSM8K, MATH-500,
AIME 2024), answer extraction and light normalisation (conventions in data/README.md), and the loop
detector for free generation. Left out: model-judged equivalence and symbolic (sympy) comparison.
"""

import hashlib
import json
import re
from pathlib import Path

from generate import UsageError

DATA = Path(__file__).resolve().parent / "data"  # shipped with the project: data/README.md
# in every accuracy row's key, per kind of answer; raise one when what counts as correct for it changes (2: cut-off
# answers need a box; MATH 3: \sqrt2 = \sqrt{2}, 'x = 5' = '5'). tools/regrade.py regrades old rows from their answers.
GRADING = {"gsm8k": 2, "math": 3}


def grading(rows: list[dict]) -> int:
    """The grading rule's version for a dataset: GSM8K's numbers (answers with '####') or MATH's LaTeX."""
    return GRADING["gsm8k" if rows and "####" in rows[0]["answer"] else "math"]


def load_data(path: str) -> list[dict]:
    """Rows of a jsonl file with a question ('problem' or 'question') and an 'answer'; one-line errors."""
    if not Path(path).is_file():
        what = "is not a regular file (a pipe or a device: save it to a file first)" if Path(path).exists() \
            else "does not exist"
        raise UsageError(f"data file {path} {what} (the shipped sets are in data/, see data/README.md)")
    try:  # lines end at \n only: U+2028 or U+0085 inside a question is valid JSON, which str.splitlines would cut
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise UsageError(f"data file {path} is not UTF-8 text (byte {e.start}): pass a jsonl file") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {i}: not valid JSON ({e.msg}): fix or delete that line") from None
        except RecursionError:  # the decoder recurses once per level of [ or {
            raise UsageError(f"{path} line {i}: JSON nested too deeply to read: fix or delete that line") from None
        q = row.get("problem", row.get("question")) if isinstance(row, dict) else None
        if not isinstance(q, str) or "answer" not in row:
            missing = "'answer'" if isinstance(q, str) else "'problem' (or 'question')"
            raise UsageError(f"{path} line {i}: missing field {missing}")
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
    """Light MATH normalisation: '\\left( 3, \\dfrac{\\pi}{2} \\right)' -> '(3,\\pi/2)', '90^\\circ' -> '90',
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


def extract_answer(text: str, gsm8k: bool, stop: str) -> str | None:
    """The answer of a generation that stopped on its own end token (stop "eos") or at --max-new-tokens ("max"): the
    last \\boxed{}. For GSM8K, an answer that ended by itself and has no box falls back to its last number, but a
    cut-off one does not: a number mid-way through unfinished reasoning is not an answer (it counts as unanswered).
    e.g. GSM8K "... 6 + 12 = 18 eggs." -> "18" at "eos", None at "max"; "so \\boxed{18}, then 20" -> "18" at either."""
    boxed = last_boxed(text)
    if boxed is not None or not gsm8k or stop != "eos":
        return boxed
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].rstrip(",") if nums else None


def is_correct(pred: str | None, answer: str) -> bool:
    """answer is the dataset's field: GSM8K's full solution ending in '#### 18', or MATH's LaTeX."""
    if pred is None:
        return False
    if "####" in answer:
        gold, got = as_number(answer.split("####")[-1]), as_number(normalise(pred))
        return gold is not None and got is not None and abs(gold - got) < 1e-6
    bare = lambda t: re.sub(r"^[A-Za-z]\w?=(?!=)", "", t)  # 'x=5' -> '5', as the MATH grader drops a short name
    a, b = bare(normalise(pred)), bare(normalise(answer))
    x, y = as_number(a), as_number(b)
    return a == b or (x is not None and y is not None and abs(x - y) < 1e-6)


# -----------------------------------------------------------------------------
# loops


def is_loop(ids: list[int], max_new_tokens: int, eos_ids=(), tail: int = 128, max_period: int = 64) -> bool:
    """An answer loops when it ran to max_new_tokens without an end token and its last `tail` tokens repeat with
    a period of at most `max_period`: x[i] == x[i - p] for every i >= p in that tail, for some p <= max_period.
    e.g. tail=6, max_period=2: [..., 7, 8, 7, 8, 7, 8] loops (p = 2); [..., 7, 8, 9, 7, 8, 9] does not (p = 3)."""
    if len(ids) < max_new_tokens or set(ids) & set(eos_ids) or len(ids) < tail:
        return False
    x = ids[-tail:]
    return any(all(x[i] == x[i - p] for i in range(p, tail)) for p in range(1, max_period + 1))
