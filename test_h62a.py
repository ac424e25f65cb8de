"""The record's layout: results/ by study, no sweep's progress files in it, the tools pointed at the new folders."""

import os
import re
import subprocess

import pytest

from test_all import HERE, load_tool


def git(*args) -> subprocess.CompletedProcess:
    """git in the repository root; skips where the tree is not a git checkout (an unpacked archive)."""
    try:
        got = subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if got.returncode == 128:
        pytest.skip(f"not a git checkout: {got.stderr.strip()}")
    return got


def test_results_hold_studies_and_no_progress_files():
    """No tracked folder under results/ is named by a tracker number, and no sweep's .progress file is tracked."""
    files = git("ls-files", "results").stdout.splitlines()
    assert files, "git ls-files found nothing under results/"
    assert [f for f in files if re.match(r"results/issue\d", f)] == []
    assert [f for f in files if ".progress-" in os.path.basename(f)] == []


@pytest.mark.parametrize("folder", ["study", "baselines", "throughput", "perhead"])
def test_a_new_progress_file_is_ignored(folder):
    """A sweep's per-job progress file written beside its rows in any study folder stays out of git."""
    assert git("check-ignore", "-q", f"results/{folder}/rows.progress-0123456789abcdef.json").returncode == 0
    assert git("check-ignore", "-q", f"results/{folder}/rows.json").returncode == 1  # the rows themselves are not


def test_seeds_reads_the_baselines_bench_by_default():
    """tools/seeds.py's default --bench is the baselines' bench file, and that file is in the record."""
    seeds = load_tool("seeds")
    assert seeds.BENCH == seeds.STUDY.parent / "baselines" / "bench_q15_int4.json" and seeds.BENCH.is_file()


def test_no_test_is_named_by_a_tracker_number():
    """No test, helper or comment in test_all.py names an issue of this project's tracker."""
    text = open(os.path.join(HERE, "test_all.py"), encoding="utf-8").read()
    assert re.findall(r".*\bissue ?\d+.*", text, flags=re.I) == []
