"""Quick check on a GPU that the fused elementwise kernels agree with the torch code they
replace (one Llama-3-8B-sized shape each); exits 1 on any mismatch or error. Used by the GPU
run scripts to decide whether to run the engine with them (PAGEDKV_FUSED_OPS)."""

import sys

import torch
import torch.nn.functional as F

import pagedattn_kernels as pk


def main() -> int:
    dev, dt = (sys.argv[1] if len(sys.argv) > 1 else "cuda"), torch.bfloat16
    torch.manual_seed(0)
    x, r = torch.randn(300, 4096, device=dev, dtype=dt), torch.randn(300, 4096, device=dev, dtype=dt)
    w = torch.randn(4096, device=dev, dtype=dt)
    s = x + r
    ref = w * (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt)
    out, res = pk.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    ok = torch.equal(res, s) and (out.float() - ref.float()).abs().max().item() <= 0.07
    g = torch.randn(300, 2 * 14336, device=dev, dtype=dt)
    ok &= (pk.silu_and_mul(g).float() - (F.silu(g[:, :14336]) * g[:, 14336:]).float()).abs().max().item() <= 0.07
    q = torch.randn(300, 32, 128, device=dev, dtype=dt)
    k = torch.randn(300, 8, 128, device=dev, dtype=dt)
    pos = torch.arange(300, device=dev) * 7
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=dev).float() / 128))
    ang = torch.cat([pos[:, None].float() * inv] * 2, -1)
    cos, sin = ang.cos().to(dt)[:, None], ang.sin().to(dt)[:, None]

    def rot(t):
        h = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., h:], t[..., :h]), -1) * sin

    qr, kr = rot(q), rot(k)
    pk.rotary_embedding(pos, q, k, inv)
    ok &= (q.float() - qr.float()).abs().max().item() <= 0.07 and (k.float() - kr.float()).abs().max().item() <= 0.07
    print("fused ops agree with torch:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
