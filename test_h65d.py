"""Tests of the loop check (tasks.is_loop) and of the shipped reasoning traces (data/reasoning_traces.jsonl)."""

import hashlib
import json
import os
import random
import re

import pytest

import tasks as T
from test_all import HERE, load_tool

TRACES = os.path.join(HERE, "data", "reasoning_traces.jsonl")
QWEN = os.path.join(os.path.expanduser(os.environ.get("NANOKV_HOME") or "~/.cache/nanokv"),
                    "Qwen2.5-Coder-1.5B-Instruct")  # the reading model's tokenizer, counted the traces' tokens


def shipped() -> list[dict]:
    with open(TRACES, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# -----------------------------------------------------------------------------
# the loop check


def test_repeat_share_hand_worked():
    """repeat_share counts the second half's windows seen earlier: the docstring's cases, and a half with no window."""
    assert T.repeat_share([1, 2, 3, 1, 2, 3, 1, 2], n=2) == 1.0
    assert T.repeat_share(list(range(1, 9)), n=2) == 0.0
    assert T.repeat_share([1, 2, 1, 2, 5, 6, 1, 2], n=2) == 1 / 3  # (5,6) (6,1) new, (1,2) seen
    assert T.repeat_share([1, 1, 1], n=4) == 0.0  # shorter than a window


def test_is_loop_any_period():
    """A verbatim loop is caught whatever its period, 349 tokens included (the short-period check misses it); text
    that never repeats 32 tokens is not a loop."""
    rng = random.Random(0)
    prose = [rng.randrange(50_000) for _ in range(4096)]
    period = prose[:349]
    looping = prose[:600] + period * 10  # sets in at 600, as a study trace's did
    looping = looping[:4096]
    assert T.is_loop(looping) and T.repeat_share(looping) == 1.0
    assert not T.is_short_loop(looping, 4096)  # the check it replaces for traces
    assert not T.is_loop(prose) and T.repeat_share(prose) == 0.0
    # a loop that sets in late covers less than half of the second half: not a loop yet
    assert not T.is_loop(prose[:3600] + prose[:496])


def test_is_loop_old_study_traces():
    """The 12 long traces of the earlier study (the 1.5B's greedy answers) all loop: 11 repeat every 32-token window of
    their second half, the 12th numbers its repeats (about 0.7); the short-period check caught 4."""
    with open(os.path.join(HERE, "results", "study", "longfid_q15.json.traces.json")) as f:
        traces = [t["ids"][t["prompt_len"]:] for t in json.load(f)["traces"]]
    shares = [T.repeat_share(ids) for ids in traces]
    assert len(traces) == 12 and all(T.is_loop(ids) for ids in traces)
    assert sum(s == 1.0 for s in shares) == 11 and 0.6 < min(shares) < 0.8
    assert sum(T.is_short_loop(ids, 4096) for ids in traces) == 4


def test_is_loop_keyword_only():
    """The capped check's old positional call (ids, max_new_tokens, eos_ids) fails loudly on is_loop, never silently
    reading 4096 as the window length."""
    with pytest.raises(TypeError):
        T.is_loop([1] * 200, 150, (0,))


# -----------------------------------------------------------------------------
# the shipped traces


def test_reasoning_traces_file():
    """data/reasoning_traces.jsonl is the file data/README.md describes (sha256), with the agreed fields, 40 labelled
    Thought Anchors traces whose chunks tile the thinking in order, and at least 30 traces of >= 2,000 tokens and 10 of
    >= 6,000, none of them a loop by its stored share."""
    with open(TRACES, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(HERE, "data", "README.md"), encoding="utf-8") as f:
        assert digest in f.read()
    rows = shipped()
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) >= {"id", "source", "writer", "problem", "gold", "trace", "correct", "n_tokens", "repeat_share"}
        assert r["repeat_share"] <= T.LOOP_SHARE and r["correct"] in (True, False, None)
    ta = [r for r in rows if r["source"] == "thought-anchors"]
    assert len(ta) == 40
    assert all(re.fullmatch(r"ta/r1-(qwen-14b|llama-8b)/(in)?correct/problem_\d+", r["id"]) for r in ta)
    for r in ta:
        t, chunks = r["trace"], r["chunks"]
        assert t.startswith("<think>\n") and t.count("</think>") == 1 and chunks[0]["start"] == len("<think>\n")
        for a, b in zip(chunks, chunks[1:]):  # in order, only whitespace between
            assert a["start"] < a["end"] <= b["start"] and not t[a["end"] : b["start"]].strip()
        assert t[chunks[-1]["end"] :].lstrip().startswith("</think>")  # the thinking, all of it
        assert all(0 <= d < len(chunks) for c in chunks for d in c["depends_on"])
    n = [r["n_tokens"] for r in rows]
    assert sum(k >= 2000 for k in n) >= 30 and sum(k >= 6000 for k in n) >= 10


@pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN, "tokenizer.json")),
                    reason="the 1.5B's tokenizer is not here (python weights.py --model qwen2.5-coder-1.5b)")
def test_reasoning_traces_tokens():
    """Each trace's n_tokens and repeat share are the Qwen2.5 tokenizer's, no trace loops, and the DeepSeek-R1-Distill-
    Qwen traces (the reading model's tokenizer) come back whole from decode(encode(text))."""
    from tokenizer import Tokenizer

    tok = Tokenizer(QWEN)
    for r in shipped():
        ids = tok.encode(r["trace"])
        assert len(ids) == r["n_tokens"] and not T.is_loop(ids)
        assert round(T.repeat_share(ids), 4) == r["repeat_share"]
        if r["writer"] == "DeepSeek-R1-Distill-Qwen-14B":
            assert tok.decode(ids) == r["trace"]


def test_chunk_spans_hand_worked():
    """A chunk that the chunker rejoined with a space maps to its span over the line break; the span is by characters
    (multi-byte ones count one); a chunk that is not the next text is refused in one line."""
    tool = load_tool("reasoning_traces")
    assert tool.chunk_spans("Correct.\n\n2. Then", ["Correct. 2.", "Then"]) == ([(0, 12), (13, 17)], 1)
    assert tool.chunk_spans("kπ = 1.  ⇒ x", ["kπ = 1.", "⇒ x"]) == ([(0, 7), (9, 12)], 2)
    with pytest.raises(tool.UsageError, match="chunk 1"):
        tool.chunk_spans("a b. c d.", ["a b.", "d."])


def test_reasoning_traces_missing_clone(tmp_path, capsys):
    """The rebuild names a missing clone, or a folder that is not one, in one line with the command that fixes it."""
    tool = load_tool("reasoning_traces")
    for argv, says in [([str(tmp_path / "none"), str(tmp_path)], "git clone"),
                       ([str(tmp_path), str(tmp_path)], "is not a clone")]:
        with pytest.raises(SystemExit) as e:
            tool.main([*argv, "--out", str(tmp_path / "out.jsonl")])  # refused before the tokenizer loads
        assert str(e.value).startswith("error: ") and says in str(e.value) and "\n" not in str(e.value)


def test_reasoning_traces_refuses_a_prefix(monkeypatch, capsys):
    """The rebuild's parser refuses a prefix of one of its flags (argparse would expand --tok to --tokenizer)."""
    import runpy

    monkeypatch.setattr("sys.argv", ["tools/reasoning_traces.py", "a", "b", "--tok", "x"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(HERE, "tools", "reasoning_traces.py"), run_name="__main__")
    assert e.value.code == 2 and "unrecognized arguments: --tok" in capsys.readouterr().err
