"""--quant int4x8: int8 dot products for int4 (and int8) weights, VNNI's vpdpbusd in a C++ kernel beside its torch
reference."""

import os
import sys
from pathlib import Path

import pytest
import torch

import cli
import eval as ev
import generate as G
import kernels
import quant
from model import load_model
from test_all import one_line_exit, tiny_dir

# skipped where the kernel cannot build, but under CI (.ci/run installs g++ and ninja) only on a CPU without VNNI
needs_dots = pytest.mark.skipif(kernels.dots_missing() is not None and not (
    os.environ.get("CI") == "true" and "avx512_vnni" in kernels.cpu_flags()), reason=f"{kernels.dots_missing()}")


def packed(bits: int, N: int, K: int, seed: int = 0):
    """Random codes, scales and zeros packed for int8_dots: (w, scales, codes, scale, zero)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, K // 32, generator=g) * 0.1
    zero = torch.randn(N, K // 32, generator=g) * 0.1
    return (*kernels.pack_dots(u, scale, zero, bits), u, scale, zero)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_dots_round_trips(bits):
    """unpack_dots undoes pack_dots: every code in place, scale and zero rounded once to bf16."""
    w, sz, u, scale, zero = packed(bits, 48, 96)
    assert w.dtype == torch.uint8 and w.numel() == 48 * 96 * bits // 8 and sz.shape == (3, 3, 2, 16)
    got, s, z = kernels.unpack_dots(w, sz, 48, 96, bits)
    assert torch.equal(got, u)
    assert torch.equal(s, scale.bfloat16().float()) and torch.equal(z, zero.bfloat16().float())


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_dots_ref_is_the_weights_times_the_quantized_activations(bits):
    """The reference's block arithmetic (integer dots scaled after, the offset through each block's activation sum)
    equals the dense weights times x quantized per block of 32 to int8 (d = max |x| / 127), an all-zero block
    included, to fp32 rounding; and that stays within int8's rounding of the unquantized x @ w.T."""
    w, sz, *_ = packed(bits, 32, 128)
    x = torch.randn(5, 128)
    x[1, 32:64] = 0  # a block with nothing in it: d = 0, no division by zero
    u, scale, zero = kernels.unpack_dots(w, sz, 32, 128, bits)
    wd = ((u.float().view(32, 4, 32) - kernels.DOT_CENTER[bits]) * scale[..., None] + zero[..., None]).view(32, 128)
    xb = x.view(5, 4, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xq = ((xb / d.clamp(min=1e-30)).round() * d).view(5, 128)  # what the int8 codes stand for
    got = kernels.int8_dots_ref(x, w, sz, 32, bits)
    torch.testing.assert_close(got, xq @ wd.T, atol=1e-4, rtol=1e-5)
    assert ((got - x @ wd.T).abs().max() / (x @ wd.T).abs().max()).item() < 0.02


@needs_dots
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M, N, K", [(1, 16, 32), (3, 48, 96), (17, 80, 320), (33, 16, 64)])
def test_int8_dots_kernel_matches_its_reference(bits, M, N, K):
    """The C++ kernel (VNNI) computes the reference's numbers on irregular sizes, in bf16 and fp32 activations: the
    same int8 codes and integer dot products, only fp32 rounding of the sums apart."""
    w, sz, *_ = packed(bits, N, K, seed=M)
    mod = kernels._dots_module()
    for x in (torch.randn(M, K), torch.randn(M, K).bfloat16()):
        got, ref = mod.int8_dots(x, w, sz, N, bits), kernels.int8_dots_ref(x, w, sz, N, bits)
        assert got.dtype == x.dtype and got.shape == (M, N)
        tol = 1e-5 if x.dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
        torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


def test_int4x8_runs_the_int4_and_int8_kernels_numbers(tmp_path):
    """--quant int4x8 multiplies by exactly the matrices --quant int4 does (bf16 scale and zero, int8 rows and their
    scales): only the activations are rounded anew; a shape off the kernel's tiles (the LM head's 101 rows) keeps
    torch's int8 kernel."""
    path = tiny_dir(str(tmp_path / "m"), intermediate_size=128)
    four, dots = (load_model(path, "cpu", torch.bfloat16, q) for q in ("int4", "int4x8"))
    kinds = []
    for (o4, a4, _), (o8, a8, _) in zip(four.matrices(), dots.matrices()):
        w4, w8 = getattr(o4, a4), getattr(o8, a8)
        kinds.append(w8.kind)
        assert torch.equal(kernels.dense(w8), kernels.dense(w4))
        x = torch.randn(3, w4.shape[1]).bfloat16()
        torch.testing.assert_close(kernels.linear(x, w8).float(), kernels.linear(x, w4).float(), atol=0.05, rtol=0.05)
    assert set(kinds) == {"dot4", "int8"} and kinds[-1] == "int8"  # 101 rows: torch's int8 kernel


def test_int8_rows_become_dot8_with_their_own_numbers():
    """An int8 matrix on the kernel's tiles runs as dot8: codes q + 128, its row scale in every group, the same
    matrix exactly."""
    m = quant.int8_rows(torch.randn(32, 64), torch.bfloat16)
    d = quant.int8_dots_of(m)
    assert d.kind == "dot8" and torch.equal(kernels.dense(d), kernels.dense(m))


def test_int4x8_greedy_decode_runs(tmp_path):
    """A batch of two rows of different lengths decodes under --quant int4x8 (every matrix on the kernel's tiles, the
    LM head included), each row as many tokens as asked."""
    path = tiny_dir(str(tmp_path / "m"), intermediate_size=128, vocab_size=112)
    model = load_model(path, "cpu", torch.bfloat16, "int4x8")
    assert {getattr(o, a).kind for o, a, _ in model.matrices()} == {"dot4"}
    run = G.make_run("full", None, 64, None, [5, 7])
    out = G.generate(model, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]], run, 8)[0]
    assert [len(o) for o in out] == [8, 8]


def test_int4x8_refusals(monkeypatch, capsys):
    """int4x8 where it cannot run is one line naming why and the fix, before any weights load: fp32 activations,
    a CPU without VNNI or without a compiler (dots_missing's reason)."""
    with pytest.raises(cli.UsageError, match="takes bf16 activations"):
        cli.resolve_device("cpu", "float32", "int4x8")
    monkeypatch.setattr(kernels, "dots_missing", lambda: "this CPU has no AVX-512 VNNI (avx512_vnni in /proc/cpuinfo)")
    with pytest.raises(cli.UsageError, match="no AVX-512 VNNI.*use --quant int4"):
        cli.resolve_device("cpu", None, "int4x8")
    msg = one_line_exit(G.main, ["--quant", "int4x8", "--max-new-tokens", "2"], capsys)
    assert "use --quant int4" in msg
    assert cli.resolve_device("cpu", None, "int4")[1] == torch.bfloat16  # int4 itself is untouched


def test_int4x8_rows_are_keyed_apart_and_take_no_bf16_copies(monkeypatch):
    """eval.py keys int4x8's rows by their own quant, and never gives them bf16 copies (their big steps are the
    kernel's), even at batch 16 on a CPU with bf16 units."""
    monkeypatch.setattr(kernels, "bf16_units", lambda: True)
    monkeypatch.setattr(kernels, "dots_missing", lambda: None)
    argv = ["accuracy", "--quant", "int4x8", "--batch-size", "16", "--data", str(ev.DATA / "gsm8k_test.jsonl")]
    args = ev.build_parser().parse_args(argv)
    args.thinking = getattr(args, "thinking", None)
    key = ev.model_settings(args)
    assert key["quant"] == "int4x8" and "bf16_rows" not in key
    assert not cli.bf16_matmul("cpu", torch.bfloat16, "int4x8", 32) and cli.bf16_matmul("cpu", torch.bfloat16,
                                                                                         "int4", 32)


def test_compare_modes_lists_int4x8_and_refuses_a_bad_reference(capsys):
    """tools/compare_modes.py knows int4x8 and int4-bf16 (int4 with bf16 copies for steps of DENSE_ROWS rows), and a
    --reference that is no mode is one line naming the choices."""
    sys.path.insert(0, str(Path(__file__).parent / "tools"))
    import compare_modes

    assert compare_modes.MODES["int4x8"] == (None, "int4x8", 1)
    assert compare_modes.MODES["int4-bf16"] == (None, "int4", kernels.DENSE_ROWS)
    msg = one_line_exit(compare_modes.main, ["fidelity", "--reference", "int5"], capsys)
    assert "--reference int5: choose from" in msg and "int4x8" in msg
