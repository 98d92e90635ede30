"""The main job's model and data: a byte-level GPT on real English text (Debian's
fortunes, or any text file), and the batches every comparison draws."""
import glob
import math
import os

import torch
from torch import nn

FORTUNES = "/usr/share/games/fortunes"
VOCAB = 256  # bytes


def load_text(path=None):
    """Debian's fortunes (all files), or the file at path, as int64 byte tokens."""
    if path in (None, "fortunes"):
        files = sorted(f for f in glob.glob(os.path.join(FORTUNES, "*"))
                       if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
        if not files:
            raise SystemExit("no text under %s: install the Debian package 'fortunes'" % FORTUNES)
    else:
        files = [path]
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split_text(text, train_fraction=0.95):
    """(train, validation): the first 95 % and the last 5 %."""
    cut = int(train_fraction * text.numel())
    return text[:cut], text[cut:]


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d, layers, heads, ctx):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batches(data, batch, ctx, gen, device="cpu"):
    """Endless (x, y) batches of `batch` windows of ctx tokens at random offsets
    drawn from gen (y: x shifted by one)."""
    while True:
        i = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
        x = torch.stack([data[j:j + ctx] for j in i])
        y = torch.stack([data[j + 1:j + ctx + 1] for j in i])
        yield x.to(device), y.to(device)
