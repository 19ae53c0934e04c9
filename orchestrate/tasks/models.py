"""Models shipped with orchestrate. Any `torch.nn.Module` whose forward takes one input tensor
and returns logits (or predictions) works the same way: set `model._target_` to it."""

import math
from typing import Annotated

import torch
from torch import nn
from torch.nn import functional as F

from orchestrate.schema import AT_LEAST_1, PROBABILITY


class MLP(nn.Module):
    """Fully connected classifier/regressor: in_features -> hidden... -> out_features."""

    def __init__(self, in_features: Annotated[int, AT_LEAST_1], out_features: Annotated[int, AT_LEAST_1],
                 hidden: Annotated[list[int], AT_LEAST_1] = (256, 256)):
        super().__init__()
        sizes = [in_features, *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """A small CNN on flat features viewed as square single-channel images (the digits' 64
    pixels as 8x8): [Conv2d -> BatchNorm2d -> ReLU -> MaxPool2d] per entry of `channels`, then
    AdaptiveAvgPool2d to one value per channel, Dropout and a Linear head.
    Input (batch, in_features); output (batch, out_features) logits."""

    def __init__(self, in_features: Annotated[int, AT_LEAST_1], out_features: Annotated[int, AT_LEAST_1],
                 channels: Annotated[list[int], AT_LEAST_1] = (16, 32), dropout: Annotated[float, PROBABILITY] = 0.1):
        super().__init__()
        self.side = math.isqrt(in_features)
        if self.side * self.side != in_features:
            raise ValueError(f"model.in_features={in_features} is not a square number: ConvNet views the features "
                             "as a square image (e.g. 64 = 8x8)")
        layers: list[nn.Module] = []
        for a, b in zip([1, *channels], channels):
            # No conv bias: the BatchNorm right after it subtracts the mean anyway.
            layers += [nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)  # any image size down to one value per channel
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear([1, *channels][-1], out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x.view(-1, 1, self.side, self.side))
        return self.head(self.dropout(self.pool(x).flatten(1)))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        # Written out (no scaled_dot_product_attention) so that every backend sees the same ops:
        # ORT's gradient builder knows MatMul/Softmax/Where, and the ONNX export stays plain.
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A small GPT: token and position embeddings, pre-LayerNorm blocks, a linear head.
    Input (batch, block_size) token ids; output (batch, block_size, vocab_size) logits."""

    def __init__(self, vocab_size: Annotated[int, AT_LEAST_1], block_size: Annotated[int, AT_LEAST_1],
                 n_layer: Annotated[int, AT_LEAST_1] = 2, n_head: Annotated[int, AT_LEAST_1] = 4,
                 n_embd: Annotated[int, AT_LEAST_1] = 128):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head})")
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)
        # Position ids as a buffer rather than torch.arange in forward: the exported graph then has
        # no shape-dependent ops in front of the embedding, which keeps ORT's gradient graph simple.
        self.register_buffer("positions", torch.arange(block_size), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(self.positions[: idx.shape[1]])
        return self.head(self.ln_f(self.blocks(x)))
