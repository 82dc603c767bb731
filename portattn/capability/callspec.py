"""What one attention call asks of a backend, in torch-free terms.

Dispatch builds one of these per distinct call shape (it is cached on a small
key, so the per-call cost is a dict lookup) and asks each backend's support
declaration whether it can serve it. Keeping it free of torch lets setup.py,
the report CLI and the fake-device tests use the same checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Feature names are the vocabulary of the support matrix, the README table,
# explain() and the report CLI. Add a name here first, then declare it.
FEATURES = (
    "forward",
    "backward",
    "causal",
    "window",
    "softcap",
    "alibi",
    "dropout",
    "gqa",
    "varlen",
    "paged_kv",
    "decode",
    "deterministic_backward",
    "seqused_k",
    "fp8_kv",
)

FEATURE_TITLES = {
    "forward": "forward",
    "backward": "backward",
    "causal": "causal (bottom-right)",
    "window": "sliding window",
    "softcap": "softcap",
    "alibi": "ALiBi",
    "dropout": "dropout",
    "gqa": "GQA / MQA",
    "varlen": "varlen (cu_seqlens)",
    "paged_kv": "paged KV cache",
    "decode": "KV-cache decode (split-KV, in place)",
    "deterministic_backward": "deterministic backward",
    "seqused_k": "seqused_k (keys used per sequence)",
    "fp8_kv": "FP8 (e4m3) KV cache",
}


@dataclass(frozen=True)
class CallSpec:
    dtype: str  # "float16" | "bfloat16" | "float32"
    head_dim: int  # of q and k
    head_dim_v: int  # of v (equal to head_dim for every current API entry point)
    device_type: str  # "cuda" | "cpu" | ... (torch's name; ROCm tensors are "cuda" too)
    features: frozenset  # subset of FEATURES actually used by the call ("forward" always)
    # Which GPU of `device_type` the call's tensors are on; per-device decisions (arch,
    # shared memory) read this device, never the current one. None: the current device
    # (the report's typical call, which describes no particular tensors).
    device_index: Optional[int] = None

    def uses(self, feature: str) -> bool:
        return feature in self.features
