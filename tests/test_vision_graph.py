"""export/vision.py: Qwen3-VL-MoE's vision tower at a fixed grid, against transformers' own tower on the
tiny checkpoint (the processor's pixel_values for real PIL images), and through torch.export."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from export.vision import VisionGraph
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import load_model


@pytest.fixture(scope="module")
def vl(tiny_models):
    return load_model(tiny_models["qwen3_vl_moe"])  # float32, with the PIL image processor


def _pixels(lm, h, w, seed=0):
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))
    out = lm.image_processor(images=[img], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("h, w, grid", [(32, 64, (1, 2, 4)), (64, 32, (1, 4, 2)), (64, 64, (1, 4, 4))])
def test_same_as_the_towers_output(vl, h, w, grid):
    pix, grid_thw = _pixels(vl, h, w)
    assert grid_thw.tolist() == [list(grid)]
    with torch.no_grad():
        want = vl.model.model.get_image_features(pix, grid_thw)
        embeds, deepstack = VisionGraph(vl.model, grid).eval()(pix)
    (want_embeds,) = want.pooler_output
    n = grid[1] * grid[2] // 4
    assert embeds.shape == want_embeds.shape == (n, 64)
    assert deepstack.shape == (len(want.deepstack_features), n, 64) and deepstack.shape[0] == 1
    # measured ~8e-8 (outputs ~0.07); 1e-6, not 1e-5: on these tiny random weights dropping the rotary
    # moves the deepstack feature by only ~7e-6
    assert (embeds - want_embeds).abs().max() <= 1e-6
    for got, ref in zip(deepstack, want.deepstack_features):
        assert (got - ref).abs().max() <= 1e-6
    assert want_embeds.abs().max() > 1e-3  # not trivially equal


def test_wrong_shape_and_grid_refused(vl):
    g = VisionGraph(vl.model, (1, 4, 4))
    with pytest.raises(SpecPrefetchError, match=r"expected \[16, 1536\]") as e:
        g(torch.zeros(8, 1536))
    assert "\n" not in str(e.value)
    with pytest.raises(SpecPrefetchError, match="multiples"):
        VisionGraph(vl.model, (1, 3, 4))


def test_torch_export(vl):
    pix, _ = _pixels(vl, 32, 64, seed=1)
    g = VisionGraph(vl.model, (1, 2, 4)).eval()
    ep = torch.export.export(g, (pix,), strict=False)
    with torch.no_grad():
        want = g(pix)
    got = ep.module()(pix)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-6


def test_deepstack_taps_and_their_order(vl):
    """A deeper tower whose DeepStack taps are early blocks, listed out of order ([2, 0] of 4 blocks):
    each feature comes from its own block's hidden state through its own merger, in the listed order
    (the tiny checkpoint's one tap is its last block, which would hide a mixed-up tap)."""
    import copy

    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    cfg = copy.deepcopy(vl.model.config.vision_config)
    cfg.depth, cfg.deepstack_visual_indexes = 4, [2, 0]
    torch.manual_seed(0)
    tower = Qwen3VLMoeVisionModel(cfg).eval()
    for p in tower.parameters():  # random weights large enough that every block matters
        p.data.normal_(0, 0.2)
    pix, grid_thw = _pixels(vl, 64, 64, seed=2)
    with torch.no_grad():
        want = tower(pix, grid_thw=grid_thw)
        embeds, deepstack = VisionGraph(tower, (1, 4, 4)).eval()(pix)
    assert deepstack.shape[0] == 2 and (deepstack[0] - deepstack[1]).abs().max() > 1e-3
    assert (embeds - want.pooler_output).abs().max() <= 1e-5
    for got, ref in zip(deepstack, want.deepstack_features):
        assert (got - ref).abs().max() <= 1e-5
