"""The parameter-efficient prefetch adapter (SpecPrefetch): low-rank corrections of future routers.

    lowrank.py     the module: logits(l+h) = h_l · (W_gate[l+h] + B·A)^T
    checkpoint.py  safetensors + JSON, tied to the model's config hash
    train.py       KL training on routing traces, streamed, early-stopped, seeded
"""
