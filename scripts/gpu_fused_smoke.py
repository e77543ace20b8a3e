"""Quick check on a GPU that the fused elementwise kernels agree with their torch path (the
composition they replace) at Llama-3-8B sizes; exits 1 on a mismatch or an error. The GPU run
scripts use it to decide whether the engine runs with them (PAGEDKV_FUSED_OPS)."""

import sys

import torch

import pagedattn_kernels as pk

TOLERANCE = 0.07  # bf16 values of magnitude ~4: a few ulps


def main(device: str) -> int:
    torch.manual_seed(0)
    dt = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dt)

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a.float() - b.float()).abs().max().item() <= TOLERANCE

    x, r, w = rand(300, 4096), rand(300, 4096), rand(4096)
    got = pk.fused_add_rms_norm(x, r, w, 1e-5)
    ref = pk.fused_add_rms_norm(x, r, w, 1e-5, backend="torch")
    ok = torch.equal(got[1], ref[1]) and close(got[0], ref[0])
    g = rand(300, 2 * 14336)
    ok &= close(pk.silu_and_mul(g), pk.silu_and_mul(g, backend="torch"))
    pos = torch.arange(300, device=device) * 7
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=device).float() / 128))
    q, k = rand(300, 32, 128), rand(300, 8, 128)
    q_ref, k_ref = q.clone(), k.clone()
    pk.rotary_embedding(pos, q, k, inv)
    pk.rotary_embedding(pos, q_ref, k_ref, inv, backend="torch")
    ok &= close(q, q_ref) and close(k, k_ref)
    print("fused ops agree with their torch path:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
