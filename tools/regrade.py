"""
Grade accuracy rows again from the answers they hold, without decoding anything:

    python tools/regrade.py results/study/full_q15.json results/study/full_q05.json

Every accuracy row keeps each problem's extracted answer (per_problem[i]["pred"]), since the replication study its generated text
(per_problem[i]["text_z"], packed by results.pack_text), and in its key the version of the rule that graded it
(tasks.GRADING, per kind of answer). When the rule changes, `eval.py accuracy` would decode
an old row's problems again; this tool grades the stored answers by the current rule instead, against the data file
the row names (looked up in --data-dir, checked by its hash), and rewrites the rows in place under the same lock the
sweeps take, so a rerun of the sweep finds them done. Rows already graded by the current rule are left as they are.
Rows that keep their text have their answers extracted again too; an older row's answers are graded as extracted
then (a change to tasks.extract_answer needs those decoded again).
"""

import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

from cli import Parser, UsageError  # noqa: E402
from results import READ_FIX, locked, read_rows, seal, unpack_text, write_json  # noqa: E402
from tasks import DATA, extract_answer, file_hash, grading, is_correct, load_data  # noqa: E402


NEEDS = {"accuracy": ("policy", "data", "data_sha", "accuracy", "per_problem")}  # what a regrade reads of a row


def regrade(row: dict, data: list[dict], where: str) -> tuple[dict, list[int]]:
    """row graded by the current rule, and the problems whose verdict changed. A problem that keeps its generated text
    (text_z) has its answer extracted again too; an older one is graded from its stored answer. A problem index outside
    the data file (a hand-edited row: the file's hash is the row's) is refused, naming the row; a negative one would
    count back."""
    if not row["per_problem"]:
        raise UsageError(f"{where} ({row['policy']}) holds no problems (its per_problem is empty): rerun its sweep, or "
                         "delete that row")
    bad = next((p["i"] for p in row["per_problem"] if not 0 <= p["i"] < len(data)), None)
    if bad is not None:
        raise UsageError(f"{where} ({row['policy']}, budget {row.get('budget')}) holds problem {bad}, but its data "
                         f"file {row['data']} has problems 0 to {len(data) - 1}: fix or delete that row, then rerun")
    per, changed = [], []
    for p in row["per_problem"]:
        gold = data[p["i"]]["answer"]
        text = text_of(p, where) if "text_z" in p else None
        if text is not None and p.get("think_closed"):  # a thinking model's answer: what follows its </think>
            text = text.split("</think>", 1)[1]
        pred = extract_answer(text, "####" in gold, p["stop"], p.get("think_closed")) if text is not None else p["pred"]
        ok = is_correct(pred, gold)
        changed += [p["i"]] if ok != p["correct"] else []
        per.append({**p, "pred": pred, "answered": pred is not None, "correct": ok})
    mean = lambda field: sum(p[field] for p in per) / len(per)
    new = {**row, "grading": grading(data), "accuracy": mean("correct"), "answered": mean("answered"),
           "per_problem": per}
    return {**new, "row_sha": seal(new)} if "row_sha" in row else new, changed  # sealed again: this edit is ours


def text_of(p: dict, where: str) -> str:
    """A problem's generated text, unpacked (results.pack_text); a damaged one is one line naming the row."""
    try:
        return unpack_text(p["text_z"])
    except (ValueError, zlib.error):  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise UsageError(f"{where}: problem {p['i']}'s text_z is damaged (not base64 of zlib-packed UTF-8): delete "
                         "that field to grade its stored answer, or rerun the sweep for that row") from None


def data_of(name: str, sha: str, data_dir: Path) -> list[dict]:
    """The data file a row names, checked against the row's hash."""
    path = data_dir / name
    if not path.is_file() or file_hash(str(path)) != sha:
        raise UsageError(f"{path} is not the data file this row was run on ({name}, hash {sha}): pass --data-dir "
                         "with the folder that holds it")
    return load_data(str(path))


def main(argv=None):
    ap = Parser(description="Grade accuracy rows again by the current rule, from their answers.")
    ap.add_argument("files", nargs="+", help="result files of eval.py accuracy (their --out)")
    ap.add_argument("--data-dir", default=str(DATA), help="where the rows' data files are (default: data/)")
    args = ap.parse_args(argv)
    read = {}  # (name, hash) -> the data file's rows, read and checked once per run
    try:
        for f in map(Path, args.files):
            if not f.is_file():
                raise UsageError(f"{f} is not a file: pass result files of eval.py accuracy")
            with locked(f):  # a sweep writing f waits, as sweeps wait for each other
                rows, out = read_rows(f, NEEDS, READ_FIX), []
                if not any(r["task"] == "accuracy" for r in rows):  # else it would end in silence, rc 0
                    raise UsageError(f"{f} holds no accuracy rows: pass result files of eval.py accuracy")
                for k, r in enumerate(rows, 1):
                    key = (r["data"], r["data_sha"]) if r.get("task") == "accuracy" else None
                    if key and key not in read:
                        read[key] = data_of(*key, Path(args.data_dir))
                    data = read.get(key)
                    if data is None or r.get("grading") == grading(data):
                        out.append(r)
                        continue
                    new, changed = regrade(r, data, f"{f} row {k}")
                    print(f"{f}: {r['policy']} on {r['data']} (n = {len(r['per_problem'])}): grading "
                          f"{r.get('grading')} -> {new['grading']}, accuracy {r['accuracy']:.2f} -> "
                          f"{new['accuracy']:.2f}, changed: {changed or 'none'}")
                    out.append(new)
                if out != rows:
                    write_json(f, out)
                else:
                    print(f"{f}: every accuracy row is graded by the current rule already")
    except UsageError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
