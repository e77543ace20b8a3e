"""SiLU-and-multiply to fp8 in one kernel with a grid barrier
(``fused.triton_kernels.silu_and_mul_fp8_kernel``, launcher
``fused.triton_launch.silu_and_mul_fp8_barrier``).

The kernel makes each tile's products and row maxima, waits at a grid-wide barrier, then
quantizes its tile from registers with every row's maxima: the bits of the two-kernel path
(``silu_and_mul_kernel``'s AMAX, then ``quantize_fp8_tiles_kernel``), which these tests check
code for code and scale for scale:

- on the CPU, in Triton's interpreter, where the kernel runs as two launches of its two phases
  (a spin barrier would never return there: the interpreter runs programs one after
  another), at the tile shapes an H200 gets (``barrier_tiles`` with 132 SMs) and others:
  against the two-kernel path, and against the torch path's ``quantize_fp8_per_token`` of
  the same products (up to the sign of zero codes, which Triton's quantization drops:
  ``_assert_same_values_fp8``);
- the dispatch rule (``silu_barrier_tiles``): which sizes take the one kernel, the
  ``PAGEDATTN_SILU_BARRIER`` switch, never in the interpreter;
- (GPU) the compiled kernel with its spin barrier, launched cooperatively, with and without
  PDL, eagerly, back to back without a sync, and captured in CUDA graphs replayed many times,
  against the two-kernel path; the barrier's word keeps its low 31 bits zero after every
  call (each call flips its top bit: ``_grid_barrier``). A hang in a GPU test here is the
  barrier waiting for a program that never arrives.

Inputs are fresh random tensors each run (the seed is printed; ``PAGEDATTN_TEST_SEED``
replays one); with 3 rows or more, the last row is all zeros and the one before it tiny (its
scale is the floor, its codes subnormal), as in ``test_fused_fp8``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels.common import sm_count
from pagedattn_kernels.fused import triton_launch as fl

from .test_fused_fp8 import FP8, _assert_same_fp8, _inputs, _unfused

F16, BF16 = torch.float16, torch.bfloat16
H200_SMS = 132


def _source(device: str) -> SimpleNamespace:
    """What ``test_fused_fp8._inputs`` needs of a test target."""

    def generator(seed: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed)

    return SimpleNamespace(device=device, generator=generator)


def _empty_fp8(x: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    q = torch.full((rows, inter), 1.0, device=x.device).to(FP8)  # nonzero: a missed store shows
    return q, torch.full((rows, 1), float("nan"), device=x.device)


def _two_kernels(x: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _empty_fp8(x, inter)
    fl.silu_and_mul(x, x, inter, fp8_out=(q, scale), tiled=True, barrier=False)
    return q, scale


def _one_kernel(x: torch.Tensor, inter: int, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _empty_fp8(x, inter)
    if tiles is None:
        fl.silu_and_mul(x, x, inter, fp8_out=(q, scale), tiled=True, barrier=True)
    else:
        assert fl.silu_and_mul_fp8_barrier(x, inter, q, scale, tiles)
    return q, scale


def _assert_same_values_fp8(got, want, what: str) -> None:
    """``_assert_same_fp8`` but for the sign of zero: the Triton quantization (every kernel,
    this one's ``_quotient`` included) stores a product of -0 as the code of +0 (the FMA
    correction adds +0 to -0), torch's division keeps -0 (code 0x80). Same value, and the
    only difference: every other code and every scale bit for bit."""
    (q, s), (wq, ws) = got, want

    def plus_zero(codes: torch.Tensor) -> torch.Tensor:
        c = codes.view(torch.uint8)
        return torch.where(c == 0x80, torch.zeros_like(c), c).view(FP8)

    _assert_same_fp8((plus_zero(q), s), (plus_zero(wq), ws), what)


def _low_bits_clear(flag: torch.Tensor) -> bool:
    """The barrier's word between calls: 0 or 2^31 (the top bit flips each call), never a
    count left over."""
    return not bool((flag & 0x7FFFFFFF).any())


# --------------------------------------------------------------------------- CPU: interpreter


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("inter", [14336, 1000, 96])
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_interpreted_phases_give_the_two_kernel_bits(seed, rows, inter, dtype):
    """The kernel's two phases in the interpreter, at the tiles an H200 gets (1-8 rows of
    2,048 columns a program; 1,000 columns: one chunk of 1,024; 96: one of 128), equal the
    two-kernel path bit for bit, and the torch path's ``quantize_fp8_per_token`` of the same
    products but for the sign of zero codes."""
    x, _, _, _ = _inputs(_source("cpu"), seed, rows, inter, dtype, silu=True)
    tiles = fl.barrier_tiles(rows, inter, H200_SMS)
    assert tiles is not None
    what = f"{rows}x{inter} {dtype} tiles={tiles} seed={seed}"
    got = _one_kernel(x, inter, tiles)
    _assert_same_fp8(got, _two_kernels(x, inter), f"against two kernels, {what}")
    # The interpreter's products are not always torch's on the CPU (numpy's exp is not
    # torch's expf): the torch quantization of the interpreter's own products.
    y = pk.silu_and_mul(x, backend="triton")
    want = pk.quantize_fp8_per_token(y, backend="torch")
    _assert_same_values_fp8(got, want, f"against the torch quantization, {what}")
    if rows >= 3:  # the zero row's floor scale and +0 codes reached the outputs
        assert not got[0][-1].view(torch.uint8).any(), what


@pytest.mark.parametrize("tiles", [(2, 256), (4, 128), (1, 1024), (8, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_interpreted_phases_at_other_tiles(seed, tiles, dtype):
    """Other tile shapes: several chunks, the last one partial (1,000 columns), and row tiles
    whose last one is partial (5 rows); float32 products (no rounding to a 16-bit type). The
    launcher's default in the interpreter (``barrier=True``) too."""
    rows, inter = 5, 1000
    x, _, _, _ = _inputs(_source("cpu"), seed, rows, inter, dtype, silu=True)
    want = _two_kernels(x, inter)
    what = f"tiles={tiles} {dtype} seed={seed}"
    _assert_same_fp8(_one_kernel(x, inter, tiles), want, what)
    _assert_same_fp8(_one_kernel(x, inter), want, f"launcher's tiles, {what}")


def test_interpreted_phases_on_strided_rows(seed):
    """Rows of a wider buffer (a fused projection's output: row stride 4 * inter): the same
    bits as the contiguous rows."""
    rows, inter = 6, 160
    x, _, _, _ = _inputs(_source("cpu"), seed, rows, inter, BF16, silu=True)
    wide = torch.zeros(rows, 4 * inter, dtype=BF16)
    wide[:, : 2 * inter] = x
    _assert_same_fp8(_one_kernel(wide[:, : 2 * inter], inter, (2, 64)),
                     _two_kernels(x, inter), f"seed={seed}")  # fmt: skip


# --------------------------------------------------------------------------- dispatch rule


def test_barrier_tiles():
    """BLOCK 2,048 columns (the row when narrower), ROWS the fewest (a power of two) that keep
    the grid within the SMs, up to 16,384 elements a tile; None beyond."""
    assert fl.barrier_tiles(1, 14336, H200_SMS) == (1, 2048)  # 7 programs
    assert fl.barrier_tiles(16, 14336, H200_SMS) == (1, 2048)  # 112
    assert fl.barrier_tiles(18, 14336, H200_SMS) == (1, 2048)  # 126
    assert fl.barrier_tiles(19, 14336, H200_SMS) == (2, 2048)  # 70
    assert fl.barrier_tiles(64, 14336, H200_SMS) == (4, 2048)  # 112
    assert fl.barrier_tiles(128, 14336, H200_SMS) == (8, 2048)  # 112
    assert fl.barrier_tiles(144, 14336, H200_SMS) == (8, 2048)  # 126
    assert fl.barrier_tiles(145, 14336, H200_SMS) is None
    assert fl.barrier_tiles(512, 14336, H200_SMS) is None
    assert fl.barrier_tiles(64, 14336, 114) == (4, 2048)  # an H100 PCIe: 112 programs
    assert fl.barrier_tiles(64, 14336, 78) == (8, 2048)  # fewer SMs: 56 programs
    assert fl.barrier_tiles(3, 1000, H200_SMS) == (1, 1024)
    assert fl.barrier_tiles(3, 96, H200_SMS) == (1, 128)
    assert fl.barrier_tiles(16896, 96, H200_SMS) == (128, 128)  # 132 programs
    assert fl.barrier_tiles(16897, 96, H200_SMS) is None
    for sms in (4, 78, 114, 132):
        for inter in (96, 1000, 4096, 11008, 14336, 28672):
            for rows in range(1, 300, 7):
                tiles = fl.barrier_tiles(rows, inter, sms)
                if tiles is None:
                    continue
                r, block = tiles
                assert r * block <= fl.BARRIER_TILE and block <= fl.BARRIER_BLOCK
                assert -(-rows // r) * -(-inter // block) <= sms, (rows, inter, sms)


def test_barrier_setting(monkeypatch):
    monkeypatch.delenv(fl.SILU_BARRIER_ENV, raising=False)
    assert fl.silu_barrier_setting() == "on"
    for raw, want in (("1", "on"), (" 0 ", "off"), ("nocoop", "nocoop"), ("NoCoop", "nocoop"),
                      ("yes", "on")):  # fmt: skip
        monkeypatch.setenv(fl.SILU_BARRIER_ENV, raw)
        assert fl.silu_barrier_setting() == want, raw


def test_dispatch_rule(monkeypatch):
    """Compiled on CUDA with the grid within the SMs: the one kernel, launched cooperatively
    unless the switch says nocoop; with ``PAGEDATTN_SILU_BARRIER=0``, the interpreter, CPU
    tensors or too many rows: the two kernels."""
    monkeypatch.setattr(fl, "sm_count", lambda device, interpreted=4: H200_SMS)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv(fl.SILU_BARRIER_ENV, raising=False)
    for rows, tiles in ((1, (1, 2048)), (16, (1, 2048)), (64, (4, 2048)), (128, (8, 2048)),
                        (256, None), (2048, None)):  # fmt: skip
        assert fl.silu_barrier_tiles(rows, 14336, cuda, interpreted=False) == tiles, rows
        assert fl.silu_barrier_tiles(rows, 14336, cuda, interpreted=True) is None, rows
        assert fl.silu_barrier_tiles(rows, 14336, cpu, interpreted=False) is None, rows
    monkeypatch.setenv(fl.SILU_BARRIER_ENV, "nocoop")
    assert fl.silu_barrier_tiles(16, 14336, cuda, interpreted=False) == (1, 2048)
    monkeypatch.setenv(fl.SILU_BARRIER_ENV, "0")
    assert fl.silu_barrier_tiles(16, 14336, cuda, interpreted=False) is None


def test_interpreter_never_takes_the_barrier_by_itself(monkeypatch, seed):
    """The public op and the launcher's default (``barrier=None``) keep the interpreter on the
    two kernels (or a program per row); ``barrier=True`` runs the phases; a grid over more
    programs than the SMs is refused, not launched."""
    calls = []
    real = fl.silu_and_mul_fp8_barrier

    def spy(*args, **kwargs):
        calls.append(args[3].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fl, "silu_and_mul_fp8_barrier", spy)
    monkeypatch.delenv(fl.SILU_BARRIER_ENV, raising=False)
    x, _, _, _ = _inputs(_source("cpu"), seed, 4, 256, BF16, silu=True)
    pk.silu_and_mul_fp8(x, backend="triton")
    q, scale = _empty_fp8(x, 256)
    fl.silu_and_mul(x, x, 256, fp8_out=(q, scale), tiled=True)
    assert calls == [], "the interpreter took the barrier path by itself"
    _one_kernel(x, 256)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="more programs than the GPU holds"):
        _one_kernel(torch.zeros(145, 2 * 14336, dtype=BF16), 14336)


def test_barrier_word_is_kept_per_device():
    flag = fl.barrier_flag(torch.device("cpu"))
    assert flag.dtype == torch.int32 and flag.numel() == 32 and _low_bits_clear(flag)
    assert fl.barrier_flag(torch.device("cpu")) is flag


# --------------------------------------------------------------------------- GPU


def _needs_fp8_gpu() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 Triton kernels need compute capability 8.9 or newer")


def _gpu_input(gen: torch.Generator, rows: int, inter: int, dtype=BF16) -> torch.Tensor:
    spread = torch.exp(1.5 * torch.randn(rows, 1, generator=gen, device="cuda")).clamp(2**-6, 8)
    x = 3 * torch.randn(rows, 2 * inter, generator=gen, device="cuda") * spread
    if rows >= 3:
        x[-1] = 0
        x[-2] *= 2.0**-8
    return x.to(dtype)


GPU_ROWS = [1, 16, 64, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["1", "nocoop"])
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_gpu_barrier_equals_two_kernels(monkeypatch, seed, dtype, pdl, setting):
    """Compiled, eagerly, at 1 / 16 / 64 / 128 rows of Llama-3-8B's 14,336 (ROWS 1, 1, 4, 8 on
    an H200): the one kernel (cooperative launch, or not: ``nocoop``), with PDL and without,
    gives the two-kernel path's bits and the unfused composition's; the default dispatch
    takes it; the barrier's word keeps its low bits zero."""
    _needs_fp8_gpu()
    monkeypatch.setenv("PAGEDATTN_PDL", pdl)
    monkeypatch.setenv(fl.SILU_BARRIER_ENV, setting)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    inter = 14336
    for rows in GPU_ROWS:
        x = _gpu_input(gen, rows, inter, dtype)
        what = f"{rows} rows {dtype} PDL={pdl} setting={setting} seed={seed}"
        tiles = fl.silu_barrier_tiles(rows, inter, dev, interpreted=False)
        assert tiles == fl.barrier_tiles(rows, inter, sm_count(dev)), what
        if tiles is None:
            pytest.skip(f"{rows} rows do not fit this GPU's {sm_count(dev)} SMs")
        got = _one_kernel(x, inter)
        default = pk.silu_and_mul_fp8(x)  # the dispatch: the barrier path here
        want = _two_kernels(x, inter)
        torch.cuda.synchronize()
        _assert_same_fp8(got, want, f"against two kernels, {what}")
        _assert_same_fp8(default, want, f"default dispatch, {what}")
        _assert_same_fp8(got, _unfused("silu_and_mul_fp8", x, None, None, None, "triton"),
                         f"against the unfused composition, {what}")  # fmt: skip
        assert _low_bits_clear(fl.barrier_flag(dev)), f"barrier word left counting, {what}"


@pytest.mark.gpu
def test_gpu_barrier_back_to_back(seed):
    """200 calls of several sizes queued without a sync (each starts from the word the one
    before left): all finish, each with the two-kernel path's bits."""
    _needs_fp8_gpu()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    inputs = [_gpu_input(gen, rows, 14336) for rows in (1, 7, 16, 33, 64, 128)]
    sizes = [x.shape[0] for x in inputs]
    assert all(fl.silu_barrier_tiles(r, 14336, dev, False) for r in sizes if r <= 64), sizes
    outs = [pk.silu_and_mul_fp8(inputs[i % len(inputs)]) for i in range(200)]
    torch.cuda.synchronize()
    wants = [_two_kernels(x, 14336) for x in inputs]
    for i, got in enumerate(outs):
        _assert_same_fp8(got, wants[i % len(inputs)], f"call {i}, seed={seed}")
    assert _low_bits_clear(fl.barrier_flag(dev))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_gpu_barrier_in_cuda_graphs(monkeypatch, seed, pdl):
    """A graph per row count (1 / 16 / 64 / 128), each capturing four calls (a layer's SiLU
    repeated), taken on the barrier path; replayed five times each on new inputs, all graphs
    in turn: every output is the two-kernel path's on those inputs, and the barrier's word
    keeps its low bits zero."""
    _needs_fp8_gpu()
    monkeypatch.setenv("PAGEDATTN_PDL", pdl)
    monkeypatch.delenv(fl.SILU_BARRIER_ENV, raising=False)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    inter, calls = 14336, 4
    taken = []
    real = fl.silu_and_mul_fp8_barrier

    def spy(*args, **kwargs):
        done = real(*args, **kwargs)
        taken.append(done)
        return done

    monkeypatch.setattr(fl, "silu_and_mul_fp8_barrier", spy)
    graphs = []
    for rows in GPU_ROWS:
        if fl.silu_barrier_tiles(rows, inter, dev, interpreted=False) is None:
            continue
        static = [_gpu_input(gen, rows, inter) for _ in range(calls)]
        for x in static:  # compile and make the barrier's word outside the capture
            pk.silu_and_mul_fp8(x)
        torch.cuda.synchronize()
        taken.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [pk.silu_and_mul_fp8(x) for x in static]
        assert taken == [True] * calls, f"{rows} rows: captured {taken}"
        graphs.append((rows, graph, static, outs))
    for replay in range(5):
        for rows, graph, static, outs in graphs:
            fresh = [_gpu_input(gen, rows, inter) for _ in range(calls)]
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            for i, (got, x) in enumerate(zip(outs, fresh)):
                what = f"{rows} rows, call {i}, replay {replay}, PDL={pdl}, seed={seed}"
                _assert_same_fp8(got, _two_kernels(x, inter), what)
            assert _low_bits_clear(fl.barrier_flag(dev)), f"replay {replay} of {rows} rows"


@pytest.mark.gpu
def test_gpu_capture_before_the_barrier_word_exists(monkeypatch, seed):
    """A capture that meets the barrier path before its word was made (no eager call first)
    takes the two kernels instead of allocating inside the graph, and replays correctly."""
    _needs_fp8_gpu()
    monkeypatch.setattr(fl, "_BARRIER_FLAGS", {})  # restored afterwards (the word lives on)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = _gpu_input(gen, 16, 14336)
    _two_kernels(x, 14336)  # compile the two kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pk.silu_and_mul_fp8(x)
    assert fl._BARRIER_FLAGS == {}
    fresh = _gpu_input(gen, 16, 14336)
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same_fp8(out, _two_kernels(fresh, 14336), f"seed={seed}")
