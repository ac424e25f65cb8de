"""The pairing tools, scripts and side files: rows checked for their own items, sealed against hand edits, keyed by
their kernel path; the exact bootstrap and "on the margin"; the scripts' and side files' one-line refusals."""

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import cli
import eval as ev
import generate as G
import plot
import results as R
import stats
import tasks as T
import triattention as TA
from model import ModelError, load_model
from test_all import HERE, acc_row, load_tool, one_line_exit, tiny_dir, tokenizer_dir

FID = lambda p, kl, n=12, **kw: {"task": "fidelity", "policy": p, "budget": None if p == "full" else 512,
                                 "buffer": None if p == "full" else 64, "protect": p in ("random", "full") or None,
                                 "model": "m", "n": n, "kl_by_trace": [kl * (1 + i / n) for i in range(n)], **kw}


# ---- rows whose items do not add up, refused wherever they are read ----


@pytest.mark.parametrize("edit, says", [
    (lambda r: r["per_problem"].__setitem__(1, {**r["per_problem"][1], "i": 0}), "holds problem i = 0 twice"),
    (lambda r: r["per_problem"].pop(), "holds 3 problems for its n = 4"),
    (lambda r: r["per_problem"][3].update(i=7), "holds problem i = 7, outside 0 .. n - 1 (n = 4)"),
])
def test_check_row_refuses_problems_that_do_not_add_up(edit, says):
    """An accuracy row must hold each of its problems 0 .. n - 1 once: a duplicated index (one problem counted twice),
    a missing one or one past n is refused in one line naming the row; a progress file's row may hold fewer."""
    row = acc_row("snapkv")
    edit(row)
    with pytest.raises(cli.UsageError) as e:
        R.check_row(row, "f.json row 2")
    assert str(e.value).startswith("f.json row 2 (snapkv, budget 64) " + says) and "\n" not in str(e.value)
    partial = acc_row("snapkv")
    partial["per_problem"].pop()
    R.check_row(partial, "f.progress.json", partial=True)  # the problems so far


def test_check_row_refuses_a_kl_list_cut_short():
    """A fidelity row's kl_by_trace holds one KL per trace, n of them: one cut to 1 of 12 (which torch would
    broadcast against 12) or to 11 of 12 (a traceback before) is refused, naming the row."""
    for k in (1, 11):
        row = FID("epikv", 0.1)
        row["kl_by_trace"] = row["kl_by_trace"][:k]
        with pytest.raises(cli.UsageError, match=rf"^f.json row 3 \(epikv, budget 512\) has {k} entries in "
                                                 r"kl_by_trace for its n = 12 traces"):
            R.check_row(row, "f.json row 3")


def test_stats_refuse_paired_lists_of_two_lengths():
    """The last guard: stats' paired functions refuse lists of two lengths rather than broadcast or cut them."""
    for f in (stats.bootstrap_diff, stats.loss_ratio):
        with pytest.raises(ValueError, match="paired lists of different lengths"):
            f([0.1], [0.1] * 12)
    with pytest.raises(ValueError):
        stats.spread_diff([[1, 0, 1]], [[1, 0]])


def study(tmp_path, fid: list[dict]):
    (tmp_path / "longfid_q15.json").write_text(json.dumps(fid))
    return tmp_path


@pytest.mark.parametrize("tool", ["seeds", "replication"])
def test_tools_refuse_a_cut_epikv_row(tool, tmp_path, capsys):
    """tools/seeds.py and tools/replication.py, on a study whose EPIKV row was cut to 1 of its 12 traces, end in one
    line naming the file and the row (before: four verdicts flipped, rc 0)."""
    rows = [FID("full", 0.0), FID("snapkv", 0.2), FID("random", 0.1), FID("epikv", 0.1, buffer=128)]
    rows[3]["kl_by_trace"] = rows[3]["kl_by_trace"][:1]
    d = study(tmp_path, rows)
    msg = one_line_exit(load_tool(tool).main, ["--study", str(d)], capsys)
    assert f"{d / 'longfid_q15.json'} row 4 (epikv, budget 512) has 1 entries in kl_by_trace" in msg


def test_regrade_refuses_a_duplicated_problem_and_leaves_the_file(tmp_path, capsys):
    """tools/regrade.py on a row whose problems all say i = 0 refuses in one line and rewrites nothing (before: it
    graded one problem's text against another's answer, in place)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(3)))
    row = acc_row("snapkv", [1, 1, 1], data="d.jsonl", data_sha=T.file_hash(str(data)), grading=0)
    for p in row["per_problem"]:
        p["i"] = 0
    f = tmp_path / "rows.json"
    f.write_text(json.dumps([row]))
    before = f.read_text()
    msg = one_line_exit(load_tool("regrade").main, [str(f), "--data-dir", str(tmp_path)], capsys)
    assert "row 1 (snapkv, budget 64) holds problem i = 0 twice" in msg and f.read_text() == before


def test_seeds_refuses_a_bench_row_of_zero_ms(tmp_path, capsys):
    """tools/seeds.py --bench with a row of 0 ms per step (a multiple of it divides by zero) is one line."""
    bench = lambda p, ms: {"task": "bench", "policy": p, "budget": 256, "buffer": 64, "context": 4096, "batch": 1,
                           "ms_per_step": ms, "cpu": "X"}
    (tmp_path / "bench.json").write_text(json.dumps([bench(p, 0.0 if p == "epikv" else 40.0) for p in
                                                    ("epikv", "h2o", "raas", "scissorhands", "lagkv")]))
    d = study(tmp_path, [FID("full", 0.0), FID("snapkv", 0.2)])
    msg = one_line_exit(load_tool("seeds").main, ["--study", str(d), "--bench", str(tmp_path / "bench.json")], capsys)
    assert "bench.json row 1 (epikv) has ms_per_step 0.0" in msg


# ---- the kernel path in every row's key ----


def test_kernel_path_names_the_cpu_level_amx_and_the_matmul(monkeypatch):
    """cli.kernel_path on CPU: torch's capability, AMX or not, and plain (fp32), the int kernels (--quant, a batch-1
    step) or the bf16 copies (a step of DENSE_ROWS rows on a CPU with bf16 units)."""
    cap = torch.backends.cpu.get_cpu_capability()
    amx = "AMX" if {"amx_bf16", "amx_int8"} & set(cli.cpu_info()["flags"]) else "no AMX"
    assert cli.kernel_path("cpu", torch.float32, None, 1) == f"{cap}, {amx}, plain"
    assert cli.kernel_path("cpu", torch.bfloat16, "int4", 1) == f"{cap}, {amx}, int kernels"
    import kernels

    monkeypatch.setattr(kernels, "bf16_units", lambda: True)
    assert cli.kernel_path("cpu", torch.bfloat16, "int4", kernels.DENSE_ROWS) == f"{cap}, {amx}, bf16 copies"


def test_rows_are_keyed_by_their_kernel_path_but_traces_are_not(tmp_path, monkeypatch):
    """eval.py's jobs carry kernel_path (a row of another path neither resumes nor pairs with them); the traces' key
    leaves it out, as it leaves out the bf16 copies: a trace is text, whichever kernels wrote it, so traces saved
    under a key without it are read back without loading the model."""
    data = os.path.join(HERE, "data", "gsm8k_test.jsonl")
    args = ev.build_parser().parse_args(["fidelity", "--policies", "snapkv", "--budgets", "128", "--n", "1",
                                         "--batch-size", "1", "--data", data, "--out", str(tmp_path / "rows.json")])
    jobs = ev.make_jobs(args)
    assert {j["kernel_path"] for j in jobs} == {cli.kernel_path("cpu", torch.float32, None, args.buffer)}
    settings = {k: v for k, v in ev.model_settings(args).items() if k not in ("bf16_rows", "kernel_path")}
    key = {"data": T.file_hash(data), "n": 1, "min_tokens": args.min_tokens, "max_new_tokens": args.max_new_tokens,
           **settings}
    (tmp_path / "rows.json.traces.json").write_text(json.dumps({"key": key, "traces": [{"ids": [1, 2]}]}))
    monkeypatch.setattr(ev, "model_of", lambda *a: pytest.fail("the traces were made again"))
    assert ev.traces(args, {}) == [{"ids": [1, 2]}]


def test_tools_refuse_to_pair_two_kernel_paths_naming_both():
    """results.one_setting (every pairing tool's check, and plot's) refuses rows of two kernel paths in one line
    naming both; a row without the field reads as 'unrecorded', which pairs with another unrecorded row (the
    record's tables, all made before it) but never with a recorded path."""
    a, b = acc_row("snapkv", kernel_path="AVX512, no AMX, int kernels"), acc_row("random", kernel_path="AVX2, no AMX, "
                                                                                                    "int kernels")
    where = {id(a): "x.json row 1", id(b): "y.json row 4"}
    with pytest.raises(cli.UsageError) as e:
        R.one_setting([a, b], "the accuracy rows", where=where)
    msg = str(e.value)
    assert "\n" not in msg and "x.json row 1 on 'AVX512, no AMX, int kernels', y.json row 4 on 'AVX2, no AMX, int " \
        "kernels'" in msg
    old = acc_row("full")
    with pytest.raises(cli.UsageError, match="on 'unrecorded"):
        R.one_setting([a, old], "the accuracy rows")
    R.one_setting([acc_row("full"), acc_row("snapkv")], "the accuracy rows")  # two unrecorded rows: as before
    R.one_setting([a, acc_row("full", kernel_path=a["kernel_path"])], "the accuracy rows")
    assert not plot.same_problems(acc_row("full"), a)  # plot draws no interval across paths


# ---- a hand-edited row ----


def test_a_hand_edited_row_is_refused_at_the_rerun_and_by_plot(tmp_path, capsys):
    """A row run_jobs wrote carries a digest of its fields (row_sha): set its K to 999 in the finished --out and the
    rerun refuses in one line naming that row, rather than recompute K = 128 beside it, as does eval.py plot; rows
    without a digest (written before it) are read as they are."""
    out = tmp_path / "rows.json"
    jobs = [{"task": "fidelity", "policy": p, "budget": 128, "n": 1} for p in ("snapkv", "random")]
    measure = lambda job: {"kl": 0.5, "kl_by_trace": [0.5]}
    R.run_jobs(jobs, measure, str(out))
    rows = json.loads(out.read_text())
    assert all(r["row_sha"] == R.seal(r) for r in rows)
    rows[0]["budget"] = 999
    out.write_text(json.dumps(rows))
    with pytest.raises(cli.UsageError) as e:
        R.run_jobs(jobs, measure, str(out))
    assert str(e.value).startswith(f"{out} row 1 (snapkv, budget 999) was edited after eval.py wrote it")
    msg = one_line_exit(ev.main, ["plot", str(out), "--out", str(tmp_path / "figs")], capsys)
    assert "row 1 (snapkv, budget 999) was edited" in msg
    del rows[0]["row_sha"]  # an old row: no digest, nothing to check
    out.write_text(json.dumps(rows))
    R.read_rows(out)


# ---- the exact bootstrap, and "on the margin" ----


def test_multisets_enumerate_every_resample_with_its_chance():
    """stats.multisets(n): every multiset of n draws from n items, C(2n - 1, n) of them, with its multinomial chance
    n! / prod(c!) / n^n. n = 2: (0, 2), (1, 1), (2, 0) with 1/4, 1/2, 1/4; n = 3: (1, 1, 1) has 3! / 27 = 6/27."""
    C, p = stats.multisets(2)
    got = sorted(zip(C.tolist(), p.tolist()))
    assert [c for c, _ in got] == [[0, 2], [1, 1], [2, 0]] and [q for _, q in got] == pytest.approx([0.25, 0.5, 0.25])
    C, p = stats.multisets(3)
    assert len(C) == math.comb(5, 3) == 10 and (C.sum(1) == 3).all()
    assert p[(C == 1).all(1)].item() == pytest.approx(6 / 27) and p.sum().item() == pytest.approx(1.0)
    assert len(stats.multisets(5)[0]) == math.comb(9, 5)


def test_bootstrap_is_exact_up_to_twelve_items():
    """Differences (1, 0, 0, 0): the resampled mean is k/4 with k ~ Binomial(4, 1/4), P = .316, .422, .211, .047,
    .004, so the cumulative chance passes 2.5 % at 0 and 97.5 % at 3/4 (0.949 below it, 0.996 at it): [0, 0.75],
    the same for every seed, and its Monte Carlo band has zero width."""
    d, lo, hi, band = stats.bootstrap([1, 0, 0, 0], [0, 0, 0, 0])
    assert (d, lo, hi) == (0.25, 0.0, 0.75) and band == ((0.0, 0.0), (0.75, 0.75))
    assert all(stats.bootstrap_diff([1, 0, 0, 0], [0] * 4, seed=s) == (0.25, 0.0, 0.75) for s in range(3))
    # (1, 0, 0): P(k/3) = 8/27, 12/27, 6/27, 1/27; 26/27 = 0.963 < 0.975, so the upper end is 1
    assert stats.bootstrap_diff([1, 0, 0], [0, 0, 0]) == (pytest.approx(1 / 3), 0.0, 1.0)


def test_monte_carlo_band_of_a_percentile():
    """Past twelve items the percentiles are of 10,000 draws, and each gets the order statistics within 1.96 binomial
    standard deviations of its rank: for the values 0 .. 9999, the 2.5 % percentile 249.975 has rank 249.975 and
    spread 1.96 sqrt(10000 x 0.025 x 0.975) = 30.6, so its band is [219, 281]; the 97.5 % one's [9718, 9780]."""
    (lo, hi), band = stats.percentiles(torch.arange(10_000, dtype=torch.float64), None)
    assert (lo, hi) == (pytest.approx(249.975), pytest.approx(9749.025))
    assert band == ((219.0, 281.0), (9718.0, 9780.0))
    d, lo, hi, ((l0, l1), (h0, h1)) = stats.bootstrap([i % 3 == 0 for i in range(50)], [i % 4 == 0 for i in range(50)])
    assert l0 <= lo <= l1 and h0 <= hi <= h1


def test_a_bound_within_its_band_of_the_margin_is_on_the_margin():
    """replication.settle: a verdict that a bound's Monte Carlo band could flip is "on the margin" (upper end
    -0.00395 of a KL interval against a margin of 0.00394, its band [-0.00399, -0.00388] reaching past it); a
    zero-wide band (the exact bootstrap) or one clear of the margin keeps the rule's verdict."""
    seeds = load_tool("seeds")
    cell = lambda lo, hi, band: SimpleNamespace(margin=0.00394, kl=True, lo=lo, hi=hi, band=band)
    near = cell(-0.019, -0.00395, ((-0.02, -0.018), (-0.00399, -0.00388)))
    assert seeds.Parity.rule(near, near.lo, near.hi) == "does not hold (a better)"
    assert seeds.Parity.verdict.fget(near) == "on the margin"
    exact = cell(-0.019, -0.00395, ((-0.019, -0.019), (-0.00395, -0.00395)))
    assert seeds.Parity.verdict.fget(exact) == "does not hold (a better)"
    rep = load_tool("replication")
    below = SimpleNamespace(expect="below", kl=True, lo=-0.02, hi=-0.0001, band=((-0.02, -0.02), (-0.0003, 0.0002)))
    assert rep.settle(below, rep.Cell.rule) == "on the margin"
    below.band = ((-0.02, -0.02), (-0.0003, -0.00005))
    assert rep.settle(below, rep.Cell.rule) == "holds"


def test_the_audited_cell_has_one_verdict_whatever_the_seed():
    """The audit's cell, random against triattention on the study's 12 long traces: with 10,000 draws its upper end
    sat 7e-6 inside the margin and 47 % of seeds gave its verdict; enumerated exactly it is one interval for every
    seed, [-0.0197, -0.0039] against a margin of 0.00394, not separated."""
    path = os.path.join(HERE, "results", "study", "longfid_q15.json")
    if not os.path.exists(path):
        pytest.skip("the study's long-trace rows are not in this checkout")
    rows = {(r["policy"], r["budget"], r["buffer"], r["protect"]): r for r in json.load(open(path))
            if r["task"] == "fidelity"}
    a, b = rows["random", 512, 64, True]["kl_by_trace"], rows["triattention", 512, 64, True]["kl_by_trace"]
    seeds = load_tool("seeds")
    cells = [seeds.Parity("x", a, b, kl=True) for _ in range(2)]
    assert cells[0].lo == cells[1].lo and cells[0].hi == cells[1].hi and cells[0].band[1][0] == cells[0].band[1][1]
    assert cells[0].verdict == "not separated" and -cells[0].margin < cells[0].hi < -0.0039


# ---- the scripts check their arguments before anything runs ----


def seeds_script(tmp_path, fail=False):
    study = tmp_path / "results" / "study"
    study.mkdir(parents=True)
    shutil.copy(os.path.join(HERE, "results", "study", "seeds.sh"), study)
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && { echo CPU; exit 0; }\necho "$@" >> "$(dirname "$0")/ran"\n'
                    + ("exit 3\n" if fail else ""))
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    return lambda *a: subprocess.run(["bash", str(study / "seeds.sh"), *a], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("argv, says", [([], "usage:"), (["C"], "lane 'C'"), (["a"], "lane 'a'"),
                                        (["A", "9"], "lane A has steps 1 to 6, not 9"), (["B", "0"], "step '0'"),
                                        (["B", "4", "x;y"], "not a comma list of policies")])
def test_seeds_script_refuses_bad_arguments_before_anything_runs(tmp_path, argv, says):
    """results/study/seeds.sh with no lane, a lane other than A or B, a step its lane lacks or a bad policy list
    exits non-zero with one line, and runs and logs nothing (before: C and a ran lane B, A 9 ran nothing, rc 0)."""
    r = seeds_script(tmp_path)(*argv)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bin" / "ran").exists() and not (tmp_path / "results" / "study" / "seeds.log").exists()


def test_seeds_script_stops_at_a_failed_step_with_its_status(tmp_path):
    """A step that fails ends its lane with that step's exit status, logged, rather than rc 0 and the next step."""
    r = seeds_script(tmp_path, fail=True)("B")
    assert r.returncode == 3 and "error: lane B step 1 failed (rc 3)" in r.stderr
    assert len((tmp_path / "bin" / "ran").read_text().splitlines()) == 1
    assert "end (rc 3)" in (tmp_path / "results" / "study" / "seeds.log").read_text()


@pytest.mark.parametrize("array, argv, says", [
    ("9", ["fidelity"], "asks for task 9, but the 2 shards are tasks 1 to 2"),
    ("0", ["fidelity"], "asks for task 0"), ("1-3", ["accuracy"], "asks for task 1-3"),
    ("x", ["accuracy"], "is not a list of tasks"), ("", ["acuracy"], "'acuracy' is not a sweep of eval.py"),
    ("", ["accuracy", "--nn", "3"], "every task would fail on its eval.py arguments (unrecognized arguments: --nn"),
    ("", ["accuracy", "--shard", "1/2"], "ARGS hold --shard")])
def test_slurm_sweep_refuses_what_would_fail_in_the_queue(tmp_path, array, argv, says):
    """tools/slurm_sweep.sh refuses, in one line and before sbatch is called, a task outside 1 .. N, a misspelt
    subcommand and arguments eval.py would refuse in every task (each used to fail in the queue, the merge waiting
    for ever). A stand-in sbatch records any call."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/queued"\necho 1\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "NANOKV_PYTHON": sys.executable,
           "NANOKV_ARRAY": array}
    r = subprocess.run(["bash", os.path.join(HERE, "tools", "slurm_sweep.sh"), "2", *argv, "--out",
                        str(tmp_path / "x.json")], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (fake.parent / "queued").exists()


# ---- --triattention-stats ----


def tri_file(tmp_path, model, change) -> str:
    payload = TA.to_authors_format(TA.prepare(model), {})
    f = tmp_path / "stats.pt"
    got = change(payload)
    if isinstance(got, bytes):
        f.write_bytes(got)
    else:
        torch.save(payload if got is None else got, f)
    return str(f)


def short(p):
    p["stats"]["layer01_head02"]["q_abs_mean"] = p["stats"]["layer01_head02"]["q_abs_mean"][:3]


BAD_STATS = [
    (lambda p: b"just text\n", "cannot read the TriAttention statistics"),
    (lambda p: pickle.dumps(SimpleNamespace(a=1)), "cannot read the TriAttention statistics"),  # code: refused
    (lambda p: [1, 2, 3], "is not a TriAttention statistics file"),
    (lambda p: {"metadata": p["metadata"], "stats": [1]}, "is not a TriAttention statistics file"),
    (lambda p: p["stats"].pop("layer02_head03") and None, "has no statistics for layer02_head03"),
    (lambda p: p["metadata"].update(head_dim="16"), "gives head_dim '16', not an integer"),
    (lambda p: short(p), "holds a tensor of torch.float32 (3,) for layer01_head02's q_abs_mean, not a float tensor "
                         "of the model's D / 2 = 8"),
    (lambda p: p["stats"]["layer00_head00"].update(q_mean_real=[0.0] * 8), "holds list for layer00_head00's"),
    (lambda p: p["stats"]["layer00_head01"].update(q_mean_imag=torch.full((8,), float("nan"))),
     "holds NaN or inf in layer00_head01's q_mean_imag"),
]


@pytest.mark.parametrize("change, says", BAD_STATS)
def test_triattention_stats_checked_when_they_load(tmp_path, change, says):
    """A malformed --triattention-stats file (text, a pickle of code, a list, stats that are not a dict, a missing
    head, a head dim that is a string, a short vector, a list for a tensor, NaNs) is refused in one line when it
    loads, before the first token (before: tracebacks, one only at the first eviction; NaNs ran silently)."""
    model = load_model(tiny_dir(str(tmp_path / "m")))
    f = tri_file(tmp_path, model, change)
    with pytest.raises(ModelError) as e:
        G.make_cache(model, G.make_run("triattention", 24, 4, None, 5, stats_file=f), 40)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, says", [("", "is empty: name the file"), ("dir", "is a directory, not a file"),
                                        ("empty.pt", "is an empty file (0 bytes)"), ("none.pt", "does not exist")])
def test_triattention_stats_path_checked_before_loading(tmp_path, name, says):
    """--triattention-stats '' (ignored before), a directory ('no such file' before), an empty file (a reason-less
    'cannot read') and a missing one: one line each, before the model loads."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty.pt").write_bytes(b"")
    path = name and str(tmp_path / name)
    with pytest.raises(cli.UsageError) as e:
        G.make_run("triattention", 24, 4, None, 5, stats_file=path)
    assert says in str(e.value)


def test_stats_and_budget_reach_the_vs_run(tmp_path):
    """--triattention-stats goes to whichever of --policy and --vs reads it (--policy full --compare --vs
    triattention-layer: the --vs run), and --budget with --policy full to the --vs run; a setting neither reads is
    still refused."""
    f = tmp_path / "s.pt"
    f.write_bytes(b"x")
    args = G.build_parser().parse_args(["--policy", "full", "--compare", "--vs", "triattention-layer",
                                        "--triattention-stats", str(f), "--budget", "40", "--buffer", "8"])
    assert G.main_run(args, 5).budget is None and G.main_run(args, 5).stats_file is None
    other = G.compare_run(args, 5)
    assert other.stats_file == str(f) and other.budget == 40
    args = G.build_parser().parse_args(["--policy", "full", "--compare", "--vs", "snapkv", "--triattention-stats",
                                        str(f)])
    with pytest.raises(cli.UsageError, match="read by triattention and triattention-layer only"):
        G.main_run(args, 5)
    args = G.build_parser().parse_args(["--policy", "full", "--budget", "40"])
    with pytest.raises(cli.UsageError, match="--budget has no effect with --policy full"):
        G.main_run(args, 5)


# ---- tracebacks in the tools ----


LOG_OK = "2026-12-05T10:00:00Z lane A (CPU): start x\n2026-12-05T12:00:00Z lane A (CPU): end (rc 0) x\n"


@pytest.mark.parametrize("content, says", [
    (None, "is not there"), ("dir", "is a folder"),
    (b"2026-12-05T10:00:0", "line 1 does not open with a time"),
    (b"2026-13-05T10:00:00Z lane A (CPU): start x\n", "line 1 does not open with a time"),
    ("2026-12-05T12:00:00Z lane A (CPU): start x\n2026-12-05T10:00:00Z lane A (CPU): end (rc 0) x\n",
     "line 2 ends lane A at 2026-12-05 10:00:00, before its start at 2026-12-05 12:00:00 (line 1)"),
    (LOG_OK.encode() + b"2026-12-05T13:00:00Z caf\xe9\n", "line 3 is not UTF-8 (byte 0xe9)"),
])
def test_lane_hours_refuses_a_bad_log_in_one_line(tmp_path, content, says):
    """tools/lane_hours.py on a missing file, a folder, a line cut mid-time, month 13, an end before its start and a
    latin-1 byte: one line each (before: tracebacks, and "-2.00 lane-hours")."""
    f = tmp_path / "log"
    if content == "dir":
        f.mkdir()
    elif content is not None:
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "lane_hours.py"), str(f)], capture_output=True,
                       text=True)
    assert r.returncode != 0 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_lane_hours_skips_blank_and_comment_lines_and_keeps_u2028(tmp_path):
    """Blank lines and # comments are skipped, and U+2028 inside a line is a character, not a line break (as
    str.splitlines would take it): the two hours of the step are counted."""
    f = tmp_path / "log"
    f.write_text("# lane hours\n\n" + LOG_OK.replace("start x", "start x\u2028y"), encoding="utf-8")
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "lane_hours.py"), str(f)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "total 2.00 lane-hours" in r.stdout, r.stderr


@pytest.mark.parametrize("drop", ["budget", "policy"])
def test_plot_refuses_a_kept_map_without_budget_or_policy(tmp_path, drop, capsys):
    """eval.py plot on a --kept-json map without its budget or policy (a KeyError in plot.py before) is one line."""
    m = {"kind": "kept", "policy": "snapkv", "budget": 8, "buffer": 2, "layer": 0, "prompt_len": 2, "positions": 6,
         "heads": [[0, 1, 4, 5]]}
    del m[drop]
    f = tmp_path / "kept.json"
    f.write_text(json.dumps(m))
    msg = one_line_exit(ev.main, ["plot", str(f), "--out", str(tmp_path / "figs")], capsys)
    assert "a kept map needs policy (a name), budget" in msg


def test_a_lone_surrogate_is_refused_in_one_line(tmp_path):
    """A question holding a lone surrogate ("\\ud800": valid JSON, no character) is refused naming the data line,
    and the tokenizer refuses one from any other way in, in one line, rather than fail inside the Rust tokenizer."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "a \\ud800 b", "answer": "1"}\n')
    with pytest.raises(cli.UsageError, match=r"line 1: the question holds a lone surrogate at character 2"):
        T.load_data(str(f))
    from tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir(tmp_path / "m"))
    with pytest.raises(ModelError, match="lone surrogate at character 2"):
        tok.encode("a \ud800 b")
