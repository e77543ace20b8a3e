"""``argmax_rows``: each row's first largest value, exactly ``torch.argmax(dim=-1)``.

- random logits on every target (the torch path, the Triton kernels in the interpreter and
  compiled) equal ``torch.argmax`` and the reference; on the GPU at Llama-3's vocabulary
  (128,256 columns) and 1-1,024 rows;
- values that stress the order: many equal maxima (ties go to the lowest index, also across
  the programs a row is split over), NaN of either sign and any payload (the first NaN wins,
  also when it lies in a later chunk than the largest number), +-inf, rows of -inf, -0.0
  against 0.0, subnormals, single columns; bfloat16, float16 and float32;
- rows split over many programs (a small forced chunk in the interpreter);
- a Hypothesis property over arbitrary bit patterns;
- strided logits and outputs; a captured CUDA graph, with and without PDL, replays like
  eager calls;
- bad calls: a clear ``ValueError`` and nothing written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.sampling import triton_launch
from pagedattn_kernels.testing import rejected_unchanged

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [BF16, F16, F32]
INF = float("inf")
VOCAB = 128256  # Llama-3

# The integers of each dtype's width, and NaN bit patterns in them: quiet, the largest
# payload, the smallest (signaling), then the same three with the sign bit set.
_INT = {BF16: torch.int16, F16: torch.int16, F32: torch.int32}
_NAN_BITS = {
    BF16: [0x7FC0, 0x7FFF, 0x7F81, 0xFFC0, 0xFFFF, 0xFF81],
    F16: [0x7E00, 0x7FFF, 0x7C01, 0xFE00, 0xFFFF, 0xFC01],
    F32: [0x7FC00000, 0x7FFFFFFF, 0x7F800001, 0xFFC00000, 0xFFFFFFFF, 0xFF800001],
}


def _signed(bits: int, dtype: torch.dtype) -> int:
    width = torch.iinfo(_INT[dtype]).bits
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def _set_nan(x: torch.Tensor, row: int, col: int, which: int) -> None:
    """Write the NaN ``_NAN_BITS[dtype][which]`` (bits, not a cast that may change them)."""
    x.view(_INT[x.dtype])[row, col] = _signed(_NAN_BITS[x.dtype][which], x.dtype)


def _check(got: torch.Tensor, x: torch.Tensor, what: str, with_reference: bool = True) -> None:
    """``got`` is torch.argmax's answer (on x's own device) and, for small x, the
    reference's."""
    want = torch.argmax(x, dim=-1)
    assert got.dtype == torch.int64 and tuple(got.shape) == (x.shape[0],), what
    wrong = (got != want).nonzero().flatten().tolist()
    assert not wrong, f"{what}: rows {wrong[:8]} got {got[wrong[:8]].tolist()}, " \
                      f"torch {want[wrong[:8]].tolist()}"  # fmt: skip
    if with_reference:
        assert torch.equal(reference.argmax_rows(x).cpu(), want.cpu()), f"{what}: reference"


def _tricky(gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype,
            device: str) -> torch.Tensor:  # fmt: skip
    """Values from a small palette (-inf, -2, -1, -0.0, 0.0, 1, 2, inf), each row capped at
    its own top palette value, so most rows hold their maximum many times (all -inf when the
    cap is -inf; both zeros when it is 0.0); in about half the rows three NaN of random bit
    patterns, either sign."""
    palette = torch.tensor([-INF, -2.0, -1.0, -0.0, 0.0, 1.0, 2.0, INF], device=device)
    pick = torch.randint(0, len(palette), (rows, cols), generator=gen, device=device)
    top = torch.randint(0, len(palette), (rows, 1), generator=gen, device=device)
    x = palette[torch.minimum(pick, top)].to(dtype)
    nan_rows = torch.rand(rows, generator=gen, device=device) < 0.5
    for r in nan_rows.nonzero().flatten().tolist():
        cols_ = torch.randint(0, cols, (3,), generator=gen, device=device).tolist()
        kinds = torch.randint(0, 6, (3,), generator=gen, device=device).tolist()
        for c, k in zip(cols_, kinds, strict=True):
            _set_nan(x, r, c, k)
    return x


def _crafted(dtype: torch.dtype, cols: int, boundary: int) -> tuple[torch.Tensor, list[int]]:
    """Rows built so that the answer is known, and the expected indices. ``boundary``: a
    column where a chunk starts (the rows put their decisive values on either side of it)."""
    b = boundary
    assert b > 2 and 2 * b + 3 < cols
    fin = torch.finfo(dtype)
    rows, want = [], []

    def row(fill: float, values: dict[int, float], expect: int) -> None:
        r = torch.full((cols,), fill, dtype=dtype)
        for c, v in values.items():
            r[c] = v
        rows.append(r)
        want.append(expect)

    row(0.0, {b - 1: 5.0, b: 5.0, 2 * b: 5.0, cols - 1: 5.0}, b - 1)  # a tie across chunks
    row(0.0, {b: 5.0, 2 * b: 5.0, 1: 4.0}, b)  # the tie starts in a later chunk
    row(0.0, {cols - 1: 1.0}, cols - 1)  # the last column
    row(-INF, {}, 0)  # all -inf
    row(-INF, {b + 2: fin.min}, b + 2)  # -inf but one finite value
    row(1.0, {b + 1: INF, b: INF, 2: INF}, 2)  # +inf ties
    row(-3.0, {2 * b + 1: -0.5, 3: -1.0, b: -0.75}, 2 * b + 1)  # all negative
    row(-1.0, {b + 1: -0.0, b + 2: 0.0}, b + 1)  # -0.0 equals 0.0: the first of them
    row(-1.0, {1: 0.0, b: -0.0}, 1)
    row(0.0, {2 * b: fin.smallest_normal / 4}, 2 * b)  # a subnormal beats zero
    row(-0.0, {0: -fin.smallest_normal / 4}, 1)  # ... and -0.0 a negative one
    row(fin.min, {b + 3: fin.max, 0: fin.max / 2}, b + 3)  # the extremes
    # NaN beats +inf in an earlier chunk; the first NaN wins whatever its sign and payload.
    row(0.0, {2: INF, 1: fin.max}, 2 * b + 2)
    row(0.0, {}, b)
    row(0.0, {0: INF}, 1)
    x = torch.stack(rows)
    _set_nan(x, -3, 2 * b + 2, 4)  # negative, the largest payload, in a later chunk
    _set_nan(x, -3, 2 * b + 3, 0)  # a positive quiet NaN after it
    _set_nan(x, -2, b, 1)  # positive, the largest payload, first ...
    _set_nan(x, -2, b + 1, 2)  # ... then a signaling one
    _set_nan(x, -1, 1, 5)  # negative signaling at 1, after +inf; another NaN later
    _set_nan(x, -1, 2 * b, 0)
    return x, want


# --------------------------------------------------------------------------- every target

# (2 x VOCAB and 3 x 5000 split into chunks by the launcher's own rule: 8 and 5 a row with
# the interpreter's 4 "SMs")
SMALL_SHAPES = [(r, c) for r in (1, 3, 17) for c in (1, 7, 1000)] + [(2, VOCAB), (3, 5000)]
FULL_SHAPES = [(1, VOCAB), (16, VOCAB), (64, VOCAB), (512, VOCAB), (1024, VOCAB), (17, 7),
               (3, 1000)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_logits(target, seed, dtype):
    gen = target.generator(seed)
    for rows, cols in FULL_SHAPES if target.full else SMALL_SHAPES:
        x = (3 * torch.randn(rows, cols, generator=gen, device=target.device)).to(dtype)
        got = pk.argmax_rows(x, backend=target.backend)
        _check(got, x, f"{rows}x{cols} {dtype} seed={seed}", with_reference=not target.full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nan_and_infinities(target, seed, dtype):
    """The palette rows of ``_tricky``: ties everywhere, NaN in half the rows."""
    gen = target.generator(seed)
    shapes = FULL_SHAPES[:5] if target.full else [(17, 1000), (5, 7), (9, 1)]
    for rows, cols in shapes:
        x = _tricky(gen, rows, cols, dtype, target.device)
        got = pk.argmax_rows(x, backend=target.backend)
        _check(got, x, f"{rows}x{cols} {dtype} seed={seed}", with_reference=not target.full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [None, 16, 64])
def test_crafted_rows(target, dtype, chunk):
    """Rows whose answers are written down: ties, NaN, infinities, zeros and subnormals on
    either side of a chunk boundary. ``chunk`` None: the op as called; else the Triton
    launcher with that many columns a program (on the GPU: 1,024 and 16,384 instead)."""
    if chunk is not None and target.backend != "triton":
        pytest.skip("chunks are the Triton kernels'")
    if target.full and chunk is not None:
        chunk = {16: 1024, 64: 16384}[chunk]
    cols = VOCAB if target.full else 300
    # the decisive values on either side of a boundary of the chunks the call will use
    boundary = chunk or (triton_launch.pick_chunk(cols) if target.full else 64)
    x, want = _crafted(dtype, cols, boundary)
    x = x.to(target.device)
    if chunk is None:
        got = pk.argmax_rows(x, backend=target.backend)
    else:
        got = triton_launch.argmax_rows(x, torch.empty(x.shape[0], dtype=torch.int64,
                                                       device=x.device), chunk=chunk)  # fmt: skip
    assert torch.argmax(x, dim=-1).tolist() == want  # the expectations are torch's
    assert got.tolist() == want, f"{dtype} chunk={chunk}"
    if not target.full:
        assert reference.argmax_rows(x).tolist() == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_over_many_programs(target, seed, dtype):
    """Forced chunks of 16-256 columns (in the interpreter; 1,024 on the GPU) over rows whose
    length is not a multiple of them: each row's programs and their merge."""
    if target.backend != "triton":
        pytest.skip("chunks are the Triton kernels'")
    gen = target.generator(seed)
    cases = ([(7, VOCAB, 1024), (64, VOCAB, 2048), (3, 5000, 16)] if target.full
             else [(3, 1000, 16), (5, 130, 64), (2, 513, 256)])  # fmt: skip
    for rows, cols, chunk in cases:
        for x in (
            _tricky(gen, rows, cols, dtype, target.device),
            (3 * torch.randn(rows, cols, generator=gen, device=target.device)).to(dtype),
        ):
            out = torch.full((rows,), -7, dtype=torch.int64, device=target.device)
            got = triton_launch.argmax_rows(x, out, chunk=chunk)
            assert got is out
            _check(out, x, f"{rows}x{cols} chunk={chunk} {dtype} seed={seed}",
                   with_reference=not target.full)  # fmt: skip


def test_strided_logits_and_out(target, seed):
    """A row stride past the row (logits sliced from a wider buffer), a column stride of 2
    (the Triton path copies it first), an output that is a strided view, and no rows."""
    gen = target.generator(seed)
    dev = target.device
    rows, cols = (64, VOCAB) if target.full else (5, 300)
    wide = _tricky(gen, rows, cols + 40, BF16, dev)
    buf = torch.full((2 * rows,), -7, dtype=torch.int64, device=dev)
    for x in (wide[:, 8 : 8 + cols], wide[:, ::2]):
        got = pk.argmax_rows(x, out=buf[::2], backend=target.backend)
        assert got.data_ptr() == buf.data_ptr() and got.stride() == (2,)
        _check(got, x, f"strides {x.stride()} seed={seed}", with_reference=not target.full)
        assert bool((buf[1::2] == -7).all()), "wrote between the output's elements"
    empty = pk.argmax_rows(torch.zeros(0, cols, dtype=BF16, device=dev), backend=target.backend)
    assert empty.shape == (0,) and empty.dtype == torch.int64


# --------------------------------------------------------------------------- any bits

_SPECIAL = {dtype: [_signed(b, dtype) for b in bits] for dtype, bits in _NAN_BITS.items()}


@st.composite
def _bit_rows(draw):
    """A float dtype and a [rows, cols] array of its bits: any pattern (NaN of any payload,
    subnormals, both zeros, infinities), often from a few values, so that ties are common."""
    dtype = draw(st.sampled_from(DTYPES))
    width = torch.iinfo(_INT[dtype]).bits
    inf = 0x7F80 if dtype == BF16 else 0x7C00 if dtype == F16 else 0x7F800000
    sign = -(1 << (width - 1))
    few = st.sampled_from([0, sign, inf, sign + inf, 1, sign + 1, inf - 1, 0x3C00 if width == 16
                           else 0x3F800000, *_SPECIAL[dtype]])  # fmt: skip
    anything = st.integers(sign, -sign - 1)
    shape = st.tuples(st.integers(1, 4), st.integers(1, 40))
    bits = draw(arrays(np.int16 if width == 16 else np.int32, shape,
                       elements=st.one_of(few, anything)))  # fmt: skip
    return torch.from_numpy(bits).view(dtype)


@settings(max_examples=100)
@given(_bit_rows())
def test_any_bits_in_the_interpreter(x):
    """Every float of every dtype, split in chunks of 16 columns and whole: torch's answer."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _check(triton_launch.argmax_rows(x, out, chunk=16), x, "chunk=16")
    _check(pk.argmax_rows(x, backend="triton"), x, "whole rows")


# --------------------------------------------------------------------------- launch rule


def test_pick_chunk():
    """8,192 columns a program whatever the row count (the kernels' variants follow the
    vocabulary alone), at most the row rounded up to a power of two."""
    pick = triton_launch.pick_chunk
    assert pick(VOCAB) == 8192 and -(-VOCAB // pick(VOCAB)) == 16
    assert pick(1000) == 1024 and pick(7) == 8 and pick(1) == 1 and pick(8192) == 8192


# --------------------------------------------------------------------------- bad calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_calls_change_nothing(backend):
    x = torch.randn(3, 10)
    out = torch.full((3,), -7, dtype=torch.int64)

    def call(logits=x, out_=out, **kw):
        return lambda: pk.argmax_rows(logits, out=out_, backend=backend, **kw)

    cases = [
        (call(x.to(torch.int32)), "logits must be one of float32, float16, bfloat16"),
        (call(x.double()), "logits must be one of"),
        (call(x[0]), "logits must have 2 dims"),
        (call(x[None]), "logits must have 2 dims"),
        (call(torch.zeros(3, 0)), "has no columns"),
        (call(out_=torch.zeros(3, dtype=torch.int32)), "out must be an int64 tensor"),
        (call(out_=torch.zeros(4, dtype=torch.int64)), "of shape (3,)"),
        (call(out_=torch.zeros(3, 1, dtype=torch.int64)), "of shape (3,)"),
        (call(out_=torch.zeros(3, dtype=torch.int64, device="meta")), "on cpu"),
        (call(out_=[0, 0, 0]), "got list"),
        (call([[1.0, 2.0]]), "logits must be a torch.Tensor"),
    ]
    for fn, message in cases:
        got = rejected_unchanged(fn, out)
        assert message in got, got
    with pytest.raises(ValueError, match="backend="):
        pk.argmax_rows(x, backend="cuda")
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        triton_launch.argmax_rows(x, out, chunk=24)
    assert bool((out == -7).all())


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("rows", [1, 16, 64, 512])
def test_replays_in_a_cuda_graph(seed, rows, pdl, monkeypatch):
    """Captured once (the partials allocated inside the capture), replayed on new logits:
    torch's answers. The logits come from one of this package's kernels (``silu_and_mul``),
    so with PDL the argmax kernels follow a kernel that lets them launch early: they must
    still wait for its writes."""
    monkeypatch.setenv("PAGEDATTN_PDL", pdl)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.empty(rows, 2 * VOCAB, dtype=BF16, device="cuda")
    logits = torch.empty(rows, VOCAB, dtype=BF16, device="cuda")

    def fresh():
        g = 3 * torch.randn(rows, 2 * VOCAB, generator=gen, device="cuda")
        g[:, VOCAB:] = 1.0  # silu(gate) * 1: ties wherever gates round alike
        g = g.to(BF16)
        if rows > 1:  # a NaN in a later chunk than row 1's largest value, most likely
            g[1, VOCAB - 5] = float("nan")
        return g

    def step():
        pk.silu_and_mul(gate_up, out=logits)
        return pk.argmax_rows(logits)

    gate_up.copy_(fresh())
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for _ in range(3):
        gate_up.copy_(fresh())
        graph.replay()
        torch.cuda.synchronize()
        _check(got, logits, f"graph rows={rows} pdl={pdl} seed={seed}", with_reference=False)
        if rows > 1:
            assert int(got[1]) == VOCAB - 5
