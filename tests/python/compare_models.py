"""Models for tests/python/test_compare_sweep.py's "callable" configs."""
import os

import torch
from torch import nn


class TinyLM(nn.Module):
    """Embedding, one hidden layer, head: tokens [B, T] -> logits [B, T, 256]."""

    def __init__(self, ctx, width=16):
        super().__init__()
        self.tok = nn.Embedding(256, width)
        self.fc = nn.Linear(width, 2 * width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, 256, bias=False)

    def forward(self, idx):
        return self.head(self.mix(torch.nn.functional.gelu(self.fc(self.tok(idx)))))


def tiny_lm(ctx, width=16):
    return TinyLM(ctx, width)


def crash_once_lm(ctx, width=16, marker=None):
    """tiny_lm, but the first build under seed 1 kills rank 1 (a hard crash: the
    worker process dies); the marker file remembers it happened."""
    if (torch.initial_seed() == 1 and os.environ.get("RANK") == "1" and marker
            and not os.path.exists(marker)):
        open(marker, "w").close()
        os._exit(3)
    return TinyLM(ctx, width)
