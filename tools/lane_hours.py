"""
How long each lane of a study ran, from the start and end lines its script logs (results/study/replicate.log).

    python tools/lane_hours.py results/study/replicate.log

A lane's step runs from its `start` line to its `end` line, or to a line saying the lanes (or that lane) were stopped
by hand; a step run alone (`seeds.sh A 2` logs "lane A step 2"), or some of its policies (`seeds.sh B 4 lagkv` logs
"lane B step 4 lagkv"), is a lane of its own beside the others; a step with neither before the lane's next `start` is
open: a sitting ended without a line, so the log cannot say when it stopped, and it is listed apart with the span up
to that next start (an upper bound).
"""

import re
import sys
from datetime import datetime
from pathlib import Path

# "lane A", "lane all" (one lane running every step), "lane A step 2" or "lane B step 4 lagkv,h2o" (some of a step's
# policies), then "(Intel(R) Xeon(R) ...)":
# the lazy .*? spans its parentheses
LINE = re.compile(r"lane ((?:[AB]|all)(?: step \d+(?: [\w,-]+)?)?)(?: \(.*?\))?: (start|end) ")


def stamp(line: str, k: int) -> datetime:
    """The UTC time a log line opens with, e.g. 2026-12-05T14:03:00Z; one line naming the line where it is not one."""
    try:
        return datetime.strptime(line[:20], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:  # cut short, month 13, no time at all
        raise ValueError(f"line {k} does not open with a time such as 2026-12-05T14:03:00Z (it reads "
                         f"{line[:40]!r}): fix or delete that line") from None


def spans(lines: list[str]) -> list[tuple[str, datetime, datetime, bool, str]]:
    """(lane, from, to, closed, the line that started it) per step. Blank lines and # comments are skipped; a line
    without a time, or a step that ends before it started, is a ValueError naming the line."""
    running, out = {}, []

    def close(lane, t, closed, k):
        if lane in running:
            t0, what, k0 = running.pop(lane)
            if t < t0:  # a clock set back, or lines moved: a negative span would subtract from the total
                raise ValueError(f"line {k} ends lane {lane} at {t:%F %T}, before its start at {t0:%F %T} (line {k0}):"
                                 " fix the times of those lines")
            out.append((lane, t0, t, closed, what))

    for k, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        t, rest = stamp(line, k), line[21:]
        m = LINE.match(rest)
        if m and m[2] == "start":
            close(m[1], t, False, k)  # no end line since the last start: that step is open
            running[m[1]] = (t, rest[m.end() :], k)
        elif m:
            close(m[1], t, True, k)
        elif rest.startswith("lane A's fidelity step"):  # its python outlived its bash: the note gives the end
            close("A", t, True, k)
        elif "stopped" in rest:  # "lanes A and B stopped", "lane B stopped", "(lane A's ... left running ...)"
            for lane in "AB":
                left_running = re.search(rf"lane {lane}'s \w+ step left running", rest)
                if not left_running and (rest.startswith("lanes") or rest.startswith(f"lane {lane} ")):
                    for key in [k for k in running if k.split()[0] == lane]:  # "A" and every "A step N"
                        close(key, t, True, k)
    return out


def read_log(path: str) -> list[str]:
    """The log's lines. Split on newlines only: str.splitlines would also split at U+2028 and other separators inside
    a line, leaving a piece with no time. One line naming the problem for a missing file, a folder or bytes that are
    not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p} is {'a folder' if p.is_dir() else 'not there'}: give the log file, e.g. "
                         "results/study/replicate.log")
    data = p.read_bytes()
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        k = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{p} line {k} is not UTF-8 (byte 0x{data[e.start]:02x}): the scripts write UTF-8; fix that "
                         "line") from None


def main(path: str):
    try:
        rows = spans(read_log(path))
    except ValueError as e:
        sys.exit(f"error: {path}: {e}" if str(e).startswith("line") else f"error: {e}")
    hours = lambda a, b: (b - a).total_seconds() / 3600
    for closed in (True, False):
        print("closed steps:" if closed else "\nopen steps (to the lane's next start: an upper bound):")
        for lane, t0, t1, c, what in rows:
            if c == closed and (t1 - t0).total_seconds() > 60:
                print(f"  {lane} {t0:%m-%d %H:%M} -> {t1:%m-%d %H:%M} {hours(t0, t1):5.2f} h  {what[:90]}")
        print(f"  total {sum(hours(t0, t1) for _, t0, t1, c, _ in rows if c == closed):.2f} lane-hours")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("error: give the log, e.g. python tools/lane_hours.py results/study/replicate.log")
    main(sys.argv[1])
