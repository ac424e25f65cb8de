import json
import math
from types import SimpleNamespace

import pytest
import torch

import eval as E
import stats
import traces as TR
from test_all import tiny, tiny_lab  # noqa: F401  (fixtures)


class Pieces:
    """A tokenizer stand-in whose tokens are the given byte pieces."""

    def __init__(self, pieces):
        self.pieces = pieces

    def token_bytes(self, ids):
        return [self.pieces[i] for i in ids]


def test_token_spans_hand_worked_with_a_character_split_across_tokens():
    """Characters to tokens on "Hé. Go!" whose é is split over two tokens: a token is its last byte's sentence; a token
    ending in a gap between sentences belongs to none."""
    tok = Pieces([b"H", b"\xc3", b"\xa9.", b" Go", b"!"])  # bytes 0 | 1 | 2-3 | 4-6 | 7
    ids = [0, 1, 2, 3, 4]
    assert TR.token_spans(tok, "Hé. Go!", ids, [(0, 3), (3, 7)]) == [(0, 3), (3, 5)]
    # "Hé" and "Go!": the token "\xa9." ends on the '.', in the gap; " Go" ends inside the second
    assert TR.token_spans(tok, "Hé. Go!", ids, [(0, 2), (4, 7)]) == [(0, 2), (3, 5)]
    with pytest.raises(E.ModelError, match="do not spell"):
        TR.token_spans(tok, "Hé. Go!!", ids, [(0, 3)])


def test_token_spans_partition_a_real_byte_level_tokenization():
    """On SmolLM2's byte-level BPE and text with multi-byte characters, contiguous sentences map to contiguous token
    ranges that cover every token once."""
    from tokenizer import Tokenizer
    from weights import default_model_dir

    tok = Tokenizer(default_model_dir())
    text = "Le café coûte 3 €. 温度は 20°C です。 Then x² = 4, so x = ±2.\n\nDone ✓."
    cuts = [0, text.index(" 温"), text.index(" Then"), text.index("\n\nDone"), len(text)]
    spans = TR.token_spans(tok, text, tok.encode(text), list(zip(cuts, cuts[1:])))
    assert spans[0][0] == 0 and spans[-1][1] == len(tok.encode(text))
    assert all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:])) and all(a < b for a, b in spans)


def test_ranks_and_spearman_hand_worked():
    """Tied values share their mean rank; Spearman of [1, 2, 3, 4] and [1, 3, 2, 4] is 1 - 6*2/(4*15) = 0.8."""
    assert stats.ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [2.5, 0.0, 2.5, 1.0]
    assert stats.spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 3, 2, 4])) == pytest.approx(0.8)
    assert math.isnan(stats.spearman(torch.tensor([1.0, 2, 3]), torch.tensor([5.0, 5, 5])))


def sentence_trace():
    # 10 trace tokens (no prompt), five sentences of two tokens; |importance| ranks sentence 4 top
    return {"prompt_len": 0, "ids": list(range(10)), "sentences": [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)],
            "importance": [0.5, -0.1, 0.2, 0.05, 0.9]}


def test_sentence_share_hand_worked():
    """After a round, one layer, two KV heads holding positions {0, 1, 2, 8} and {0, 4, 8, 9} of 10 fed: all 0.4,
    top (sentence 4's positions 8, 9) 0.75, and rho = 9 / sqrt(90) (worked by hand from the held shares
    .75, .25, .25, 0, .75 against |importance| .5, .1, .2, .05, .9)."""
    run = SimpleNamespace(watch=None)
    rounds = TR.sentence_share(run, sentence_trace())
    FREE = torch.iinfo(torch.long).max
    pos = torch.tensor([[[0, 1, 2, 8, FREE], [0, 4, 8, 9, FREE]]])  # [L=1, H_kv=2, S=5], a free slot in each
    cache = SimpleNamespace(length=[5], next_pos=[10], pos=pos[:, None])  # [L, B=1, H_kv, S]
    run.watch(cache, 0, "before", None)
    run.watch(cache, 0, "after", None)
    (r,) = rounds
    assert r["fed"] == 10 and r["all"] == [pytest.approx(0.4)] and r["top"] == [pytest.approx(0.75)]
    assert r["rho"] == [pytest.approx(9 / math.sqrt(90))]


def test_sentence_summary_counts_kl_after_a_top_sentence_from_the_first_eviction():
    """KL after the top sentence (the predictions of tokens 10 .. 41, here 10 .. 11) against elsewhere, both from the
    first round's position on: predictions of tokens before it are left out of both."""
    tr = {**sentence_trace(), "ids": list(range(12)),
          "sentences": [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]}
    rounds = [{"fed": 6, "top": [0.5], "all": [0.4], "rho": [0.1]}, {"fed": 10, "top": [0.7], "all": [0.4],
                                                                     "rho": [math.nan]}]
    at = torch.arange(11)  # predictions of tokens 1 .. 11
    kl = torch.tensor([9.0, 9, 9, 9, 9, 1, 1, 1, 1, 4, 4])  # tokens 1-5 before the first round, 10-11 after the top
    s = TR.sentence_summary(tr, rounds, at, kl)
    assert s["kl_after"] == pytest.approx(4.0) and s["kl_else"] == pytest.approx(1.0)
    assert s["top"] == pytest.approx(0.6) and s["all"] == pytest.approx(0.4) and s["rho"] == pytest.approx(0.1)
    assert TR.sentence_summary(tr, [], at, kl)["top"] is None


def write_traces(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_fidelity_replays_labelled_traces_and_leaves_loops_out(tiny_lab, tmp_path, capsys):  # noqa: F811
    """eval.py fidelity --traces: each trace replayed after its problem's turn; the rows carry the traces' ids and per
    trace sentence measures (shares in [0, 1]); a looping trace is left out and named, and --loops keeps it."""
    g = torch.Generator().manual_seed(0)
    letters = lambda n: "".join(chr(97 + int(c)) for c in torch.randint(26, (n,), generator=g))
    text = " ".join(letters(2 + i % 5) + "." for i in range(90))  # random letters: no 32-character window repeats
    cuts = [0] + [i + 1 for i, c in enumerate(text) if c == "."]
    chunks = [{"start": a, "end": b, "importance": (k % 7) / 7} for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    rows = [{"id": "loop", "problem": "What is 3 + 3?", "trace": "ab cd. " * 80},
            {"id": "real", "problem": "What is 2 + 2?", "trace": text, "chunks": chunks}]
    f = write_traces(tmp_path / "t.jsonl", rows)
    argv = ["fidelity", "--model", tiny_lab.model, "--traces", f, "--policies", "snapkv", "--budgets", "96",
            "--buffer", "16", "--no-protect-prompt"]
    E.main(argv + ["--n", "1", "--out", str(tmp_path / "r.json")])
    assert "1 looping trace(s) left out (--loops keeps them): loop" in capsys.readouterr().out
    full, snap = json.loads((tmp_path / "r.json").read_text())
    assert snap["trace_ids"] == ["real"] and snap["data"] == "t.jsonl" and snap["replay"] == "traces"
    (s,) = snap["sentences_by_trace"]
    assert 0 <= s["top"] <= 1 and 0 < s["all"] < 1 and -1 <= s["rho"] <= 1 and s["kl_else"] >= 0
    E.main(argv + ["--n", "2", "--loops", "--out", str(tmp_path / "l.json")])
    rows2 = json.loads((tmp_path / "l.json").read_text())
    assert rows2[1]["trace_ids"] == ["loop", "real"] and rows2[1]["sentences_by_trace"][0] is None
    with pytest.raises(SystemExit, match="1 traces of --long 0 tokens or more that do not loop"):
        E.main(argv + ["--n", "2"])


@pytest.mark.parametrize("line, msg", [("{\"id\": \"a\", \"problem\": \"p\"}", "missing or empty field 'trace'"),
                                       ("not json", "not valid JSON"),
                                       ('{"id": "a", "problem": "p", "trace": "xy", "chunks": [{"start": 0, "end": 9, '
                                        '"importance": 1}]}', "a chunk needs")])
def test_bad_traces_file_is_one_line(tiny_lab, tmp_path, line, msg):  # noqa: F811
    """A traces file with a missing field, a bad line or a chunk past its trace ends in one line naming the line."""
    (tmp_path / "t.jsonl").write_text(line + "\n")
    with pytest.raises(SystemExit, match=msg):
        E.main(["fidelity", "--model", tiny_lab.model, "--traces", str(tmp_path / "t.jsonl"), "--policies",
                "snapkv", "--budgets", "96"])


def test_replay_in_pieces_equals_one_pass(tiny):  # noqa: F811
    """The full cache's replay fed at most `most` tokens a pass gives one pass's logits (fp32, up to rounding)."""
    from generate import make_run

    ids = torch.randint(0, 101, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    run = lambda: make_run("full", None, 16, None, 1)
    torch.testing.assert_close(TR.replay(tiny, ids, run(), most=37), TR.replay(tiny, ids, run()), atol=1e-5, rtol=1e-5)
