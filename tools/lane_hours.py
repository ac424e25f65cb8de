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

# "lane A", "lane A step 2" or "lane B step 4 lagkv,h2o" (some of a step's policies), then "(Intel(R) Xeon(R) ...)":
# the lazy .*? spans its parentheses
LINE = re.compile(r"lane ([AB](?: step \d+(?: [\w,-]+)?)?)(?: \(.*?\))?: (start|end) ")


def spans(lines: list[str]) -> list[tuple[str, datetime, datetime, bool, str]]:
    """(lane, from, to, closed, the line that started it) per step."""
    running, out = {}, []

    def close(lane, t, closed):
        if lane in running:
            t0, what = running.pop(lane)
            out.append((lane, t0, t, closed, what))

    for line in lines:
        t, rest = datetime.strptime(line[:20], "%Y-%m-%dT%H:%M:%SZ"), line[21:]
        m = LINE.match(rest)
        if m and m[2] == "start":
            close(m[1], t, False)  # no end line since the last start: that step is open
            running[m[1]] = (t, rest[m.end() :])
        elif m:
            close(m[1], t, True)
        elif rest.startswith("lane A's fidelity step"):  # its python outlived its bash: the note gives the end
            close("A", t, True)
        elif "stopped" in rest:  # "lanes A and B stopped", "lane B stopped", "(lane A's ... left running ...)"
            for lane in "AB":
                left_running = re.search(rf"lane {lane}'s \w+ step left running", rest)
                if not left_running and (rest.startswith("lanes") or rest.startswith(f"lane {lane} ")):
                    for key in [k for k in running if k.split()[0] == lane]:  # "A" and every "A step N"
                        close(key, t, True)
    return out


def main(path: str):
    rows = spans(open(path).read().splitlines())
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
