"""The float64 eager-attention oracle of the transformers tests, made finite.

transformers' eager mask adds finfo(dtype).min; in float64 that plus a negative score
overflows to -inf, rows of padding tokens become NaN, and the NaN reaches real rows
through V (0 * NaN). float32's min is finite in float64 and still masks exactly.
"""
import torch


def use_finite_float64_eager_mask(monkeypatch) -> None:
    """Make transformers' "eager" mask use float32's min when the model runs in float64."""
    from transformers.masking_utils import AttentionMaskInterface

    eager_mask = AttentionMaskInterface._global_mapping["eager"]

    def finite_eager_mask(*args, dtype=torch.float32, **kwargs):
        if dtype != torch.float64:
            return eager_mask(*args, dtype=dtype, **kwargs)
        mask = eager_mask(*args, dtype=torch.float32, **kwargs)
        return None if mask is None else mask.to(torch.float64)

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "eager", finite_eager_mask)
