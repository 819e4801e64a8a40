"""An image prompt as the runners take it (the bundle side is export/images.py).

Both runners do for an image prompt what the model's forward does:
- the image's rows of the prompt's embeddings are the vision method's `image_embeds`;
- after decoder layer i (i < the tower's DeepStack taps), its `deepstack[i]` rows are added to the
  image rows' hidden states;
- every position's rotary positions are M-RoPE's (t, h, w): text advances all three together; an image
  token at merged row r, column c of an image starting at position s has (s, s + r, s + c), and the text
  after the image starts at s + max(rows, columns); after the prompt, position p has p + delta on all
  three axes (delta = the last prompt position's + 1 - the prompt's length).
"""
from __future__ import annotations

import dataclasses

import torch

from toolkit.errors import SpecPrefetchError


def rope_rows(ids: list[int], starts: list[int], grids: list[tuple[int, int]]) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, len(ids)] of a prompt and its delta, as the model's get_rope_index gives them:
    image k's tokens start at `starts[k]` and form a grid `grids[k]` (merged rows, columns)."""
    n = len(ids)
    out = torch.empty(3, n, dtype=torch.long)
    cur = i = 0
    for s, (gh, gw) in zip(starts, grids):
        if s < i or s + gh * gw > n:
            raise SpecPrefetchError(f"prompt: image tokens at {s}..{s + gh * gw - 1} do not fit {n} positions")
        out[:, i:s] = torch.arange(cur, cur + s - i)  # the text before the image
        cur += s - i
        r = torch.arange(gh).repeat_interleave(gw)
        c = torch.arange(gw).repeat(gh)
        out[:, s:s + gh * gw] = torch.stack([torch.full((gh * gw,), cur), cur + r, cur + c])
        cur += max(gh, gw)
        i = s + gh * gw
    out[:, i:] = torch.arange(cur, cur + n - i)
    return out, int(out.max()) + 1 - n


@dataclasses.dataclass
class ImagePrompt:
    """An image prompt as the runners take it: every position's token, the image rows' embeddings and
    DeepStack features, and the M-RoPE positions."""
    ids: list[int]
    starts: list[int]                 # each image's first image-token position
    embeds: list[torch.Tensor]        # per image [tokens, hidden]
    deepstack: list[torch.Tensor]     # per image [taps, tokens, hidden]
    rope: torch.Tensor                # [3, len(ids)]
    delta: int

    def image_rows(self, p0: int, T: int):
        """(rows in p0..p0+T-1 relative to p0, image index, token offsets) of the image tokens there."""
        for k, s in enumerate(self.starts):
            n = self.embeds[k].shape[0]
            a, b = max(s, p0), min(s + n, p0 + T)
            if a < b:
                yield slice(a - p0, b - p0), k, slice(a - s, b - s)

    def embed(self, h: torch.Tensor, p0: int) -> torch.Tensor:
        """h [1, T, H] of positions p0.. with the image rows replaced by their embeddings."""
        for rows, k, src in self.image_rows(p0, h.shape[1]):
            h = h.clone()
            h[0, rows] = self.embeds[k][src].to(h.dtype)
        return h

    def add_deepstack(self, h: torch.Tensor, p0: int, layer: int) -> torch.Tensor:
        """h after decoder layer `layer` with that tap's features added to the image rows."""
        for rows, k, src in self.image_rows(p0, h.shape[1]):
            if layer < self.deepstack[k].shape[0]:
                h = h.clone()
                h[0, rows] = h[0, rows] + self.deepstack[k][layer, src].to(h.dtype)
        return h
