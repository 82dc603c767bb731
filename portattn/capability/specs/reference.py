"""The pure-PyTorch reference backend: every feature on every device.

It is the test oracle and the fallback, and CI runs its tests on CPU, so it is
"verified" everywhere (ANY_ARCH).
"""
from ..declare import ALL_FEATURES, ANY_ARCH, BackendSpec

SPEC = BackendSpec(
    name="reference",
    title="reference (pure PyTorch)",
    vendor=None,
    dtypes=("float16", "bfloat16", "float32"),
    head_dim_multiple=1,
    head_dim_max=None,
    head_dim_v_equal=False,
    supported=ALL_FEATURES,
    verified={ANY_ARCH: ALL_FEATURES},
    implementation="portattn.backends.reference:ReferenceBackend",
)
