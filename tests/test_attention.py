"""grouped_attention (toolkit/models/families/base.py), the eager attention the step graphs use
without repeat_kv, against transformers' own eager attention: GQA groups, a shared or per-head
mask, no grouping (DeepSeek, vision towers), and GPT-OSS's sinks."""
from __future__ import annotations

import types

import pytest
import torch

from toolkit.models.families import family_by_name
from toolkit.models.families.base import grouped_attention


def _inputs(hq, hkv, t=3, s=11, d=16, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, t, d, generator=g)
    k = torch.randn(2, hkv, s, d, generator=g)
    v = torch.randn(2, hkv, s, dv, generator=g)
    mask = torch.zeros(2, 1, t, s)
    mask[..., -2:] = -1e4  # positions the queries may not see
    return q, k, v, mask


@pytest.mark.parametrize("hq, hkv, per_head_mask", [(8, 2, False), (8, 2, True), (4, 4, False), (6, 1, False)])
def test_same_as_transformers_eager(hq, hkv, per_head_mask):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import eager_attention_forward

    q, k, v, mask = _inputs(hq, hkv)
    if per_head_mask:
        mask = mask.expand(2, hq, *mask.shape[2:]).clone()
        mask[:, 1, :, 0] = -1e4  # one head masked differently
    module = types.SimpleNamespace(num_key_value_groups=hq // hkv, training=False)
    want, want_p = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, got_p = grouped_attention(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape and got_p.shape == want_p.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6)
    # and it is not trivially equal: a different mask changes the output
    assert not torch.allclose(grouped_attention(module, q, k, v, None, scaling=0.25)[0], want)


def test_sinks_same_as_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, mask = _inputs(8, 2)
    module = types.SimpleNamespace(num_key_value_groups=4, training=False, sinks=torch.randn(8))
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = grouped_attention(module, q, k, v, mask, scaling=0.25, sinks=module.sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_vl_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3",
                                    "gpt_oss"])
def test_every_family_patches_its_eager_attention(family):
    import importlib

    patches = family_by_name(family).export_patches()
    attn = [(m, a) for m, a, _ in patches if a == "eager_attention_forward"]
    assert len(attn) == 1
    assert hasattr(importlib.import_module(attn[0][0]), "eager_attention_forward")
