"""Tiny models with each kind of normalization layer, for fast tests."""

import torch
from torch import nn


def bn_cnn(num_classes: int = 5, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def gn_cnn(num_classes: int = 5, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


class LayerNorm2d(nn.LayerNorm):
    """Channels-first LayerNorm as in timm: normalizes dim 1 of (N, C, H, W)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patch-4 ViT on 8x8 images: 4 tokens, pre-norm blocks, a final norm."""

    def __init__(self, dim: int = 16, depth: int = 2, num_classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.stem_norm = LayerNorm2d(dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.stem_norm(self.patch(x)).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(t)).mean(dim=1))


def tiny_vit(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return TinyViT(**kw)


def images(n: int, size: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g)


def tiny_checkpoint_and_images(root, n_images: int):
    """A width-4 ResNet-20 checkpoint ``root/tiny.pt`` and ``root/clean.npz`` of ``n_images`` random
    CIFAR-shaped images labelled 0..9 in turn (the CLI's hardening tests' files); returns both paths and
    the generator that drew the images, for more data from the same stream."""
    import numpy as np

    from aqr.models import create, save_checkpoint

    torch.manual_seed(0)
    model = create("resnet20", num_classes=10, width=4)
    ckpt = save_checkpoint(root / "tiny.pt", model, {"name": "resnet20", "num_classes": 10, "kwargs": {"width": 4}})
    rng = np.random.default_rng(0)
    npz = root / "clean.npz"
    np.savez(npz, x=rng.integers(0, 256, (n_images, 32, 32, 3), dtype=np.uint8), y=np.arange(n_images) % 10)
    return ckpt, npz, rng
