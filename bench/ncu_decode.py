"""One decode step for ncu (bench/gpu_suite.sh style): `ncu --kernel-name regex:decode ... python3 bench/ncu_decode.py B CACHE [PAGE]`."""
import sys

import torch

import portattn

batch, cache = int(sys.argv[1]), int(sys.argv[2])
page = int(sys.argv[3]) if len(sys.argv) > 3 else 0
q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(batch, cache, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
seqlens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
table = None
if page:
    table = torch.randperm(batch * cache // page, device="cuda").reshape(batch, -1).to(torch.int32)
    k, v = k.view(-1, page, 8, 128), v.view(-1, page, 8, 128)
for _ in range(3):
    portattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
torch.cuda.synchronize()
