"""The package's layout convention, checked so that it keeps holding: every public op comes from
``pagedattn_kernels.ops``, lives in one folder with its checks, torch path, Triton code and
float64 reference, and CPU users need no triton. (The ops' numbers are tested elsewhere, against
those references.)"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import subprocess
import sys
import textwrap

import pytest

import pagedattn_kernels
from pagedattn_kernels import ops, reference

# What the engine imports (packages/engine: attention.py, models/layers.py,
# models/quantization.py, models/dense_linear.py, worker/model_runner.py).
ENGINE_NAMES = {
    "reshape_and_cache",
    "paged_attention",
    "paged_decode_attention",
    "DecodePlan",
    "decode_plan_capacity",
    "decode_plan_pays",
    "plan_decode",
    "warm_up_decode_attention",
    "copy_blocks",
    "swap_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rms_norm_fp8",
    "fused_add_rms_norm_fp8",
    "silu_and_mul_fp8",
    "fp8_matmul",
    "fp8_matmul_silu_and_mul",
    "matmul_16bit",
    "matmul_16bit_silu_and_mul",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "quantize_fp8_per_token",
    "resolve_backend",
    "MAX_HIDDEN",
    "FP8_DTYPE",
    "FP8_MAX",
    "argmax_rows",
}
FOLDERS = ("attention", "cache", "fused", "quant", "sampling")
FOLDER_MODULES = ("ops", "checks", "torch_impl", "triton_launch", "triton_kernels", "reference")
# Ops without a `backend=` choice, and why.
NO_BACKEND = {"swap_blocks": "a swap is the copy engine's work on every device"}


def _folder(op) -> str:
    return op.__module__.removesuffix(".ops")


def test_ops_is_the_public_face():
    assert set(ops.__all__) >= ENGINE_NAMES
    assert set(pagedattn_kernels.__all__) == {*ops.__all__, "__version__"}
    for name in ops.__all__:
        assert getattr(pagedattn_kernels, name) is getattr(ops, name), name
    # Every engine op is found as an operation (the rule `operations()` applies is not vacuous).
    not_ops = {
        "resolve_backend", "MAX_HIDDEN", "FP8_DTYPE", "FP8_MAX", "DecodePlan",
        "decode_plan_capacity", "decode_plan_pays", "plan_decode", "warm_up_decode_attention",
    }  # fmt: skip
    assert set(ops.operations()) == ENGINE_NAMES - not_ops


@pytest.mark.parametrize("name", sorted(ops.operations()))
def test_every_op_has_a_torch_path_and_a_reference(name):
    op = ops.operations()[name]
    folder = _folder(op)
    assert folder.rpartition(".")[2] in FOLDERS, f"{name} comes from {op.__module__}"
    torch_impl = importlib.import_module(f"{folder}.torch_impl")
    folder_reference = importlib.import_module(f"{folder}.reference")
    assert callable(getattr(torch_impl, name, None)), f"{folder}.torch_impl has no {name}"
    assert callable(getattr(folder_reference, name, None)), f"{folder}.reference has no {name}"
    assert name in folder_reference.__all__
    # The top-level reference module gathers it (tests and tutorials import it from there).
    assert getattr(reference, name) is getattr(folder_reference, name)
    assert name in reference.__all__
    backend = inspect.signature(op).parameters.get("backend")
    if name in NO_BACKEND:
        assert backend is None
    else:
        assert backend is not None and backend.kind is inspect.Parameter.KEYWORD_ONLY
        assert backend.default is None


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_folder_holds_the_same_files(folder):
    package = f"pagedattn_kernels.{folder}"
    for module in FOLDER_MODULES:
        assert importlib.util.find_spec(f"{package}.{module}") is not None, f"{package}.{module}"
    launch = importlib.import_module(f"{package}.triton_launch")
    # The launchers load their own folder's kernels (compiled or interpreted copy).
    assert f"{package}.triton_kernels" == launch.KERNELS
    assert set(importlib.import_module(f"{package}.ops").__all__) <= set(ops.__all__)


# Arguments that change from call to call (counts, partition sizes, the block-table width, and
# the per-batch metadata pointers that a mixed batch slices): a Triton specialisation on any
# of them compiles a new variant mid-serving (tests/kernels/test_specialization.py, on a GPU).
NOT_SPECIALIZED = {
    ("attention", "decode_kernel"): {
        "partition_size", "block_tables_ptr", "seq_lens_ptr", "order_ptr", "work_ptr",
        "stride_bt_seq", "k_scale_ptr", "v_scale_ptr",
    },
    ("attention", "decode_reduce_kernel"): {"partition_size", "num_splits", "seq_lens_ptr"},
    ("attention", "decode_merge_kernel"): {"merges_ptr"},
    ("attention", "prefill_kernel"): {
        "num_seqs", "cu_q_ptr", "block_tables_ptr", "seq_lens_ptr", "stride_bt_seq",
        "k_scale_ptr", "v_scale_ptr",
    },
    ("cache", "reshape_and_cache_kernel"): {"k_scale_ptr", "v_scale_ptr"},
    ("cache", "copy_blocks_kernel"): set(),
    ("fused", "rms_norm_kernel"): {"num_rows"},
    ("fused", "silu_and_mul_kernel"): {"num_rows"},
    ("fused", "rotary_kernel"): {"num_tokens"},
    # Row widths and strides are a model's constants: specialized, so that loads and stores
    # of widths that are multiples of 16 vectorize (unspecialized, each moved one element).
    ("quant", "quantize_fp8_per_token_kernel"): set(),
    ("quant", "row_chunk_amax_kernel"): {"rows"},
    ("quant", "quantize_fp8_tiles_kernel"): {"rows"},
    ("quant", "fp8_matmul_kernel"): {"M", "splits"},
    ("quant", "fp8_matmul_reduce_kernel"): {"numel", "splits"},
    # The vocabulary and the logits' row stride are a model's constants; the row count is the
    # grid, the chunk count follows it through few values (triton_launch.pick_chunk).
    ("sampling", "argmax_chunks_kernel"): set(),
    ("sampling", "argmax_merge_kernel"): set(),
}  # fmt: skip


@pytest.mark.parametrize("where", sorted(NOT_SPECIALIZED), ids="/".join)
def test_per_call_arguments_are_not_specialized(where):
    pytest.importorskip("triton")
    folder, kernel_name = where
    from pagedattn_kernels.common import load_kernels

    kernel = getattr(load_kernels(f"pagedattn_kernels.{folder}.triton_kernels", False), kernel_name)
    got = {p.name for p in kernel.params if p.do_not_specialize}
    assert got == NOT_SPECIALIZED[where]


def test_cpu_ops_need_no_triton():
    """In a fresh interpreter where ``import triton`` fails, every op runs on CPU tensors."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTriton())
        import torch
        import pagedattn_kernels as pk
        from pagedattn_kernels import reference

        kc, vc = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
        k = torch.randn(6, 1, 8)
        pk.reshape_and_cache(k, k, kc, vc, torch.arange(6) + 4)
        table = torch.tensor([[1, 2]], dtype=torch.int32)
        lens = torch.tensor([6], dtype=torch.int32)
        q = torch.randn(2, 2, 8)
        out = pk.paged_attention(q, kc, vc, table, lens, torch.tensor([0, 2], dtype=torch.int32))
        assert out.shape == q.shape
        pk.paged_decode_attention(q[:1], kc, vc, table, lens)
        pk.copy_blocks(torch.stack([kc, vc]), torch.tensor([[1, 3]]))
        pk.swap_blocks(kc, vc, torch.tensor([[0, 0]]))
        x, w = torch.randn(3, 16), torch.ones(16)
        pk.rms_norm(x, w, 1e-6)
        pk.fused_add_rms_norm(x, x.clone(), w, 1e-6)
        pk.silu_and_mul(x)
        pk.rotary_embedding(torch.arange(6), q.repeat(3, 1, 1), None, torch.ones(4))
        k8, v8 = kc.to(pk.FP8_DTYPE), vc.to(pk.FP8_DTYPE)
        scale = torch.tensor([0.5])
        pk.reshape_and_cache(k, k, k8, v8, torch.arange(6) + 4, k_scale=scale, v_scale=scale)
        pk.paged_decode_attention(q[:1], k8, v8, table, lens, k_scale=scale, v_scale=scale)
        pk.quantize_fp8_per_token(x)
        assert pk.argmax_rows(x).tolist() == x.argmax(-1).tolist()
        assert "triton" not in sys.modules
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
