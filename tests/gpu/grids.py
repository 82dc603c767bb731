"""The GPU test grids and feature coverage, derived from the declarations (no GPU needed to read).

Head dims and dtypes come from the backends' specs (`portattn/capability/specs/`) and the
CUDA variant table (`portattn/backends/cuda/variants.py`), so a head dim or dtype added
there is tested without editing a test. COVERAGE names, for every feature a CUDA spec
declares in `supported`, the GPU tests that exercise it; tests/test_gpu_coverage.py (CPU)
fails when a declared feature has no entry or an entry names a test that does not exist.
"""
from portattn.backends.cuda import variants
from portattn.capability.specs import cuda, cuda_sm90


def _head_dims(spec):
    """Every head dim a spec admits in a forward call (its head_dims, else the multiples of its
    step up to its maximum)."""
    return list(spec.admitted_head_dims())


# sm80+ path: the instantiated head dims, plus head dims served by the next larger
# instantiated variant with a masked tail (40 -> 64, 80 -> 96, 200 -> 224).
PADDED_HEAD_DIMS = (40, 80, 200)
CUDA_HEAD_DIMS = sorted(set(variants.HEAD_DIMS) | set(PADDED_HEAD_DIMS))
CUDA_DTYPES = list(cuda.SPEC.dtypes)  # torch dtype names

# Hopper path (variants.HOPPER_FWD_HEAD_DIMS / HOPPER_BWD_HEAD_DIMS; tests/test_cuda_hopper_build.py
# checks they agree with the spec): the forward grid is every head dim the spec admits (96
# included, served padded by the hd128 kernel: variants.HOPPER_FWD_PADDED); the
# backward grid (HOPPER_HEAD_DIMS, served by both passes: 96 included, on the hd128 backward
# kernel, variants.HOPPER_BWD_PADDED) leaves out its forward-only head dims.
HOPPER_FWD_HEAD_DIMS = _head_dims(cuda_sm90.SPEC)
HOPPER_HEAD_DIMS = [d for d in HOPPER_FWD_HEAD_DIMS if d not in cuda_sm90.SPEC.forward_only_head_dims]
HOPPER_DTYPES = list(cuda_sm90.SPEC.dtypes)

_FWD, _BWD, _DEC = "test_cuda_forward.py", "test_cuda_backward.py", "test_cuda_decode.py"
_FP8 = "test_cuda_decode_fp8.py"
_SRV = "test_serving_surface_gpu.py"
_HFWD, _HBWD = "test_cuda_hopper_forward.py", "test_cuda_hopper_backward.py"

# spec name -> feature -> "file::test" entries under tests/gpu/.
COVERAGE = {
    "cuda": {
        "forward": [f"{_FWD}::test_forward_grid"],
        "backward": [f"{_BWD}::test_backward_grid"],
        "causal": [f"{_FWD}::test_forward_grid", f"{_BWD}::test_backward_grid"],
        "window": [f"{_FWD}::test_forward_features", f"{_BWD}::test_backward_features", f"{_DEC}::test_decode_features"],
        "softcap": [f"{_FWD}::test_forward_features", f"{_BWD}::test_backward_features", f"{_DEC}::test_decode_features"],
        "alibi": [f"{_FWD}::test_forward_features", f"{_BWD}::test_backward_features", f"{_DEC}::test_decode_features"],
        "dropout": [f"{_FWD}::test_dropout_matches_reference_mask", f"{_BWD}::test_backward_dropout_matches_reference_mask"],
        "gqa": [f"{_FWD}::test_forward_features", f"{_BWD}::test_backward_features", f"{_DEC}::test_decode_layouts_and_splits"],
        "varlen": [f"{_FWD}::test_forward_varlen", f"{_BWD}::test_backward_varlen", f"{_DEC}::test_short_query_varlen"],
        "paged_kv": [f"{_DEC}::test_decode_layouts_and_splits", f"{_DEC}::test_append_rotary_leftpad"],
        "decode": [f"{_DEC}::test_decode_layouts_and_splits", f"{_DEC}::test_append_rotary_leftpad",
                   f"{_DEC}::test_cuda_graph_decode_steps_replay_with_changing_lengths"],
        "deterministic_backward": [f"{_BWD}::test_backward_features", f"{_BWD}::test_deterministic_is_bitwise_reproducible"],
        "fp8_kv": [f"{_FP8}::test_fp8_decode_layouts_and_splits", f"{_FP8}::test_fp8_append_quantises_like_the_reference",
                   f"{_FP8}::test_fp8_cuda_graph_replay_with_changing_lengths"],
        "seqused_k": [f"{_SRV}::test_seqused_k_forward_and_backward",
                      f"{_SRV}::test_paged_varlen_seqused_k_mixed_rows_strided_views_and_out",
                      f"{_SRV}::test_paged_varlen_step_replays_in_a_cuda_graph_with_new_lengths"],
    },
    "cuda-sm90": {
        "forward": [f"{_HFWD}::test_hopper_forward_grid", f"{_HFWD}::test_hopper_forward_every_launched_schedule",
                    f"{_HFWD}::test_hopper_forward_padded_head_dims_read_and_write_only_their_columns"],
        "backward": [f"{_HBWD}::test_hopper_backward_grid",
                     f"{_HBWD}::test_hopper_backward_padded_head_dims_read_and_write_only_their_columns"],
        "causal": [f"{_HFWD}::test_hopper_forward_grid", f"{_HBWD}::test_hopper_backward_grid"],
        "window": [f"{_HFWD}::test_hopper_forward_windows_and_softcap", f"{_HFWD}::test_hopper_forward_every_launched_schedule",
                   f"{_HBWD}::test_hopper_backward_windows_and_softcap"],
        "softcap": [f"{_HFWD}::test_hopper_forward_windows_and_softcap", f"{_HFWD}::test_hopper_forward_softcap_fp16",
                    f"{_HFWD}::test_hopper_forward_every_launched_schedule",
                    f"{_HBWD}::test_hopper_backward_windows_and_softcap", f"{_HBWD}::test_hopper_backward_softcap_fp16"],
        "gqa": [f"{_HFWD}::test_hopper_forward_gqa_and_strided_views", f"{_HBWD}::test_hopper_backward_grid"],
        "varlen": [f"{_HFWD}::test_hopper_forward_varlen", f"{_HBWD}::test_hopper_backward_varlen"],
        "deterministic_backward": [f"{_HBWD}::test_hopper_backward_grid", f"{_HBWD}::test_hopper_deterministic_is_bitwise_reproducible"],
    },
}
