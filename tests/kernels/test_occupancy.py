"""How many programs of a compiled kernel an SM holds (``common.programs_per_sm``), and the
decode configurations' ``per_sm`` against it.

The decode launcher sizes its flash-decoding split and its plans' lanes by
``DecodeConfig.per_sm``. Nothing ties that number to the compiled kernel: when a kernel change
or a new Triton moves its registers, the number can go stale, and the grid is then sized for
the wrong count of program slots. (It did: the 16-bit kernel went from 190 to 128 registers a
thread, three programs an SM where two had fit, while ``per_sm`` said two, and 64 sequences
decoded 10-15% slower.) The GPU test compiles every configuration the launcher picks for
Llama-3-8B's heads and checks that its occupancy is still the one ``per_sm`` was measured at.
"""

from __future__ import annotations

import pytest
import torch

from pagedattn_kernels.common import FP8_DTYPE, SmLimits, programs_per_sm


@pytest.mark.parametrize(
    "registers, shared, warps, expected",
    [
        (128, 73728, 4, 3),  # 16-bit decode, 128-token tiles: shared memory holds three
        (190, 73728, 4, 2),  # the same at 190 registers: registers hold two
        (212, 12416, 1, 9),  # fp8 one-warp tiles: 216 x 32 registers a warp, nine warps
        (255, 22784, 2, 4),  # fp8 narrow tiles
        (248, 41472, 4, 2),  # fp8 wide tiles
        (54, 0, 8, 4),  # the SiLU kernel's persistent programs: 56 x 32 x 8 registers each
        (16, 0, 1, 32),  # tiny programs: the 32-program limit
        (32, 0, 32, 2),  # 1,024 threads: the 64-warp limit
        (255, 0, 8, 1),  # 255 registers (256 allocated) in eight warps: one
    ],
)
def test_programs_per_sm(registers, shared, warps, expected):
    assert programs_per_sm(registers, shared, warps) == expected


def test_programs_per_sm_limits_and_bad_warps():
    small = SmLimits(registers=32768, shared_bytes=100 * 1024)
    assert programs_per_sm(128, 0, 4, small) == 2
    assert programs_per_sm(32, 48 * 1024, 1, small) == 2  # 49 KB a program with the reserve
    with pytest.raises(ValueError, match="num_warps must be positive"):
        programs_per_sm(128, 0, 0)


class _Recording:
    """The attention kernels, with every compiled ``decode_kernel`` kept (the launcher's
    ``kernels_for`` answers this instead of the module)."""

    def __init__(self, module):
        self._module = module
        self.compiled: list = []

    def __getattr__(self, name):
        kernel = getattr(self._module, name)
        return _Kept(kernel, self.compiled) if name == "decode_kernel" else kernel


class _Kept:
    """A Triton kernel whose launches keep what they compiled (``kernel[grid](...)`` returns
    the compiled kernel)."""

    def __init__(self, kernel, compiled: list):
        self.kernel, self.compiled = kernel, compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled.append(self.kernel[grid](*args, **kwargs))

        return launch


#: How many programs of each configuration the launcher picks an SM holds on sm_90 (Triton
#: 3.6, Llama-3-8B heads), as its ``per_sm`` was measured against: a kernel or compiler
#: change that moves this must re-measure ``per_sm``. Where ``per_sm`` is lower, measurement
#: chose it (``decode_config``'s docstring, ``FP8_ONE_WARP``'s comment).
FITS = {"16-bit": 3, "16-bit planned": 3, "fp8 wide": 2, "fp8 narrow": 4, "fp8 one warp": 9,
        "fp8 one warp planned": 9, "fp8 long": 8}  # fmt: skip


def _shipped_configs(launch, dtype, fp8):
    """(what, config, planned) for the configurations ``decode_config`` picks at Llama-3-8B's
    heads: 16-bit caches, and fp8 ones at each of their pair counts."""
    if not fp8:
        return [("16-bit", launch.decode_config(128, dtype), False),
                ("16-bit planned", launch.decode_config(128, dtype, planned=True), True)]  # fmt: skip
    pairs = {"fp8 wide": 8, "fp8 narrow": launch.FP8_NARROW_TILE_PAIRS,
             "fp8 one warp": launch.FP8_ONE_WARP_PAIRS}  # fmt: skip
    configs = [(what, launch.decode_config(128, dtype, kv_dtype=FP8_DTYPE, num_pairs=n), False)
               for what, n in pairs.items()]  # fmt: skip
    configs.append(("fp8 long", launch.decode_config(
        128, dtype, kv_dtype=FP8_DTYPE, num_pairs=512, context_bound=4096), False))  # fmt: skip
    configs.append(("fp8 one warp planned", launch.decode_config(
        128, dtype, kv_dtype=FP8_DTYPE, num_pairs=launch.FP8_PLANNED_ONE_WARP_PAIRS,
        planned=True), True))  # fmt: skip
    return configs


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["16bit", "fp8"])
def test_decode_configs_per_sm_against_the_compiled_kernel(fp8, monkeypatch):
    """Each configuration's compiled variants (split or not, by a plan) fit ``FITS`` programs
    an SM, and its ``per_sm`` is no more than that."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("per_sm is tuned for sm_90 (H100/H200)")
    from pagedattn_kernels.attention import plan as decode_plan
    from pagedattn_kernels.attention import triton_kernels
    from pagedattn_kernels.attention import triton_launch as launch

    recording = _Recording(triton_kernels)
    monkeypatch.setattr(launch, "kernels_for", lambda device, module: recording)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    kv_dtype = FP8_DTYPE if fp8 else dtype
    lens = [4000, 300, 17]
    blocks = -(-max(lens) // 16)
    kc = torch.randn(len(lens) * blocks, 16, 8, 128, device=dev).to(kv_dtype)
    tables = torch.arange(len(lens) * blocks, dtype=torch.int32, device=dev).view(len(lens), -1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), 32, 128, device=dev, dtype=dtype)
    scales = {"k_scale": torch.ones(1, device=dev), "v_scale": torch.ones(1, device=dev)}
    wrong = []
    for what, cfg, planned in _shipped_configs(launch, dtype, fp8):
        recording.compiled.clear()
        plan = None
        if planned:
            plan = decode_plan.build_plan(lens, 8, cfg.tile_n, min_chunk=cfg.tile_n).to(dev)
        for splits in (None,) if planned else (1, 4):
            launch.paged_decode_attention(q, kc, kc, tables, seq_lens, 0.1, max(lens),
                                          torch.empty_like(q), num_splits=splits, config=cfg,
                                          plan=plan, **(scales if fp8 else {}))  # fmt: skip
        assert recording.compiled, what
        for ck in recording.compiled:
            fits = programs_per_sm(ck.n_regs, ck.metadata.shared, cfg.num_warps)
            if fits != FITS[what] or cfg.per_sm > fits:
                wrong.append(f"{what} (per_sm {cfg.per_sm}, measured at {FITS[what]} an SM): "
                             f"{ck.n_regs} registers, {ck.metadata.shared} B of shared "
                             f"memory: {fits} programs an SM")  # fmt: skip
    assert not wrong, "\n".join(wrong)
