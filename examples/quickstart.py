"""Run attention on the best available device, check it against the reference backend,
and print which backend ran, the error and the time per call."""
import time

import torch

import portattn
from portattn.backends.reference import ReferenceBackend


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch, seqlen, heads, head_dim = (4, 2048, 16, 128) if device.type == "cuda" else (2, 256, 8, 64)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype) for _ in range(3))

    explanation = portattn.explain(q, k, v, causal=True)
    out = portattn.flash_attn_func(q, k, v, causal=True)

    # The reference backend in float32 is the oracle every test uses.
    ref = torch.empty(q.shape, device=device, dtype=torch.float32)
    lse = torch.empty(batch, heads, seqlen, device=device, dtype=torch.float32)
    ReferenceBackend().forward(
        q.float(), k.float(), v.float(), ref, lse, cu_seqlens_q=None, cu_seqlens_k=None,
        max_seqlen_q=seqlen, max_seqlen_k=seqlen, softmax_scale=head_dim**-0.5, window_left=-1,
        window_right=0, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0,
    )
    error = (out.float() - ref).abs().max().item()

    repeats = 20 if device.type == "cuda" else 3
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        portattn.flash_attn_func(q, k, v, causal=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_call_ms = (time.perf_counter() - start) / repeats * 1e3

    print(f"device:   {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    print(f"backend:  {explanation.chosen}")
    print(f"shape:    q/k/v {tuple(q.shape)} {str(dtype).replace('torch.', '')}, causal")
    print(f"max |out - reference fp32|: {error:.3e}")
    print(f"time per call: {per_call_ms:.3f} ms")
    if not error < 2e-2:
        raise SystemExit("quickstart: error larger than expected")


if __name__ == "__main__":
    main()
