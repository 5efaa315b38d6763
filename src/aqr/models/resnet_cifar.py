"""CIFAR ResNets.

``CifarResNet`` is the He et al. (2016) CIFAR family (depth 6n+2, 16-32-64 channels, BasicBlocks,
option-A shortcuts), with parameter names identical to the akamaster ``resnet20-12fca82f.th``
checkpoint (``conv1``, ``bn1``, ``layer{1,2,3}.{i}.{conv,bn}{1,2}``, ``linear``). The norm
layers keep the ``bn`` attribute names whatever their kind, so the checkpoint layout stays one.
``ResNet18`` is the common 4-stage CIFAR ResNet-18 (64-512 channels, 1x1-conv shortcuts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aqr.models.norms import norm2d


def option_a_shortcut(x: torch.Tensor, planes: int) -> torch.Tensor:
    """Parameter-free shortcut: stride-2 subsampling and zero channels, ``planes // 4`` on each side."""
    pad = planes // 4
    return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, pad, pad))


class OptionA(nn.Module):
    """Module form of :func:`option_a_shortcut` (no parameters, nothing in the state dict)."""

    def __init__(self, planes: int) -> None:
        super().__init__()
        self.planes = planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return option_a_shortcut(x, self.planes)


class BasicBlock(nn.Module):
    """Two 3x3 convs with norm and ReLU; shortcut "A" (zero pad) or "B" (1x1 conv + norm)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm: str = "bn",
                 groups: int = 8, shortcut: str = "A") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = norm2d(norm, planes, groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = norm2d(norm, planes, groups)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            if shortcut == "A":
                if stride != 2 or planes != 2 * in_planes:
                    raise ValueError("option-A shortcut needs stride 2 and doubled channels")
                self.shortcut = OptionA(planes)
            elif shortcut == "B":
                self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                              norm2d(norm, planes, groups))
            else:
                raise ValueError(f"unknown shortcut {shortcut!r}; choose 'A' or 'B'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 inputs: three stages of n BasicBlocks at width, 2*width, 4*width."""

    def __init__(self, depth: int = 20, num_classes: int = 10, norm: str = "bn", width: int = 16,
                 groups: int = 8, shortcut: str = "A") -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1, got {depth}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = norm2d(norm, width, groups)
        self.in_planes = width
        self.layer1 = self._stage(width, n, 1, norm, groups, shortcut)
        self.layer2 = self._stage(2 * width, n, 2, norm, groups, shortcut)
        self.layer3 = self._stage(4 * width, n, 2, norm, groups, shortcut)
        self.linear = nn.Linear(4 * width, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def _stage(self, planes: int, n: int, stride: int, norm: str, groups: int, shortcut: str) -> nn.Sequential:
        blocks = []
        for s in [stride] + [1] * (n - 1):
            blocks.append(BasicBlock(self.in_planes, planes, s, norm, groups, shortcut))
            self.in_planes = planes
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


class ResNet18(nn.Module):
    """CIFAR ResNet-18: 3x3 stem, four stages of two BasicBlocks (width, 2w, 4w, 8w), 1x1 shortcuts."""

    def __init__(self, num_classes: int = 10, norm: str = "bn", width: int = 64, groups: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = norm2d(norm, width, groups)
        self.in_planes = width
        layers = []
        for i, stride in enumerate((1, 2, 2, 2)):
            planes = width * 2 ** i
            blocks = []
            for s in (stride, 1):
                blocks.append(BasicBlock(self.in_planes, planes, s, norm, groups, shortcut="B"))
                self.in_planes = planes
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.linear = nn.Linear(8 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)
