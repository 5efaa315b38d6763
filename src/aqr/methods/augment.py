"""Random image augmentations of test-time adaptation methods, in plain torch (no torchvision).

:func:`roid_augment` is the augmentation of ROID's consistency loss: the benchmark code's
``get_tta_transforms(img_size, padding_mode="reflect", cotta_augs=False)``, i.e. clip to [0, 1],
colour jitter (brightness 0.6-1.4, contrast 0.7-1.3, saturation 0.5-1.5, hue +-0.06, gamma 0.7-1.3,
in a random order), reflect padding by half the image height, a random affine map (rotation
+-15 degrees, translation up to 1/16 of the padded size in whole pixels, scale 0.9-1.1; bilinear,
zeros outside), the centre crop back to the original size, a horizontal flip with probability 0.5
and a final clip. As with torchvision transforms applied to a batched tensor, one draw of the
random parameters serves the whole batch. Random numbers come from torch's global generator (the
method protocol seeds it). The colour operations follow torchvision's tensor definitions
(ITU-R 601 grey levels, HSV hue rotation, per-image mean grey for the contrast).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _uniform(low: float, high: float) -> float:
    return float(torch.empty(()).uniform_(low, high))


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """``(N, 1, H, W)`` grey levels of RGB images ``x`` (0.2989 R + 0.587 G + 0.114 B)."""
    r, g, b = x.unbind(1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: float) -> torch.Tensor:
    return (factor * x + (1 - factor) * other).clamp(0, 1)


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    """HSV (each in [0, 1]) of RGB images ``x`` in [0, 1], channel dim 1."""
    r, g, b = x.unbind(1)
    maxc, _ = x.max(1)
    minc, _ = x.min(1)
    span = maxc - minc
    flat = span == 0
    safe_span = torch.where(flat, torch.ones_like(span), span)
    sat = span / torch.where(maxc == 0, torch.ones_like(maxc), maxc)
    rc, gc, bc = (maxc - r) / safe_span, (maxc - g) / safe_span, (maxc - b) / safe_span
    hue = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    hue = torch.where(flat, torch.zeros_like(hue), hue)
    hue = torch.remainder(hue / 6.0, 1.0)
    return torch.stack([hue, sat, maxc], 1)


def hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    """RGB images from HSV ``x`` (each in [0, 1], channel dim 1)."""
    h, s, v = x.unbind(1)
    channels = []
    for n in (5.0, 3.0, 1.0):  # R, G, B
        k = torch.remainder(n + 6.0 * h, 6.0)
        channels.append(v - v * s * torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0))
    return torch.stack(channels, 1)


def adjust_hue(x: torch.Tensor, shift: float) -> torch.Tensor:
    """Rotate the hue of RGB images ``x`` by ``shift`` turns."""
    hsv = rgb_to_hsv(x)
    hsv = torch.stack([torch.remainder(hsv[:, 0] + shift, 1.0), hsv[:, 1], hsv[:, 2]], 1)
    return hsv_to_rgb(hsv)


def color_jitter(x: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast, saturation, hue and gamma with random factors, in a random order."""
    for op in torch.randperm(5).tolist():
        if op == 0:
            x = _blend(x, torch.zeros_like(x), _uniform(0.6, 1.4))
        elif op == 1:
            x = _blend(x, grayscale(x).mean(dim=(1, 2, 3), keepdim=True), _uniform(0.7, 1.3))
        elif op == 2:
            x = _blend(x, grayscale(x), _uniform(0.5, 1.5))
        elif op == 3:
            x = adjust_hue(x, _uniform(-0.06, 0.06))
        else:
            x = (x.clamp(1e-8, 1.0) ** _uniform(0.7, 1.3)).clamp(0, 1)
    return x


def affine(x: torch.Tensor, degrees: float, translate: tuple[float, float], scale: float) -> torch.Tensor:
    """``x`` rotated by ``degrees``, scaled by ``scale`` and shifted by ``translate`` pixels (x, y)
    about the image centre; bilinear, zeros outside."""
    n, _, height, width = x.shape
    a = math.radians(degrees)
    cos, sin = math.cos(a), math.sin(a)
    # output -> input in centred pixel coordinates: R(-a) (out - t) / s
    m00, m01, m10, m11 = cos / scale, -sin / scale, sin / scale, cos / scale
    tx, ty = translate
    m02, m12 = -(m00 * tx + m01 * ty), -(m10 * tx + m11 * ty)
    theta = torch.tensor([[m00, m01 * height / width, 2 * m02 / width],
                          [m10 * width / height, m11, 2 * m12 / height]], dtype=x.dtype, device=x.device)
    grid = F.affine_grid(theta.expand(n, 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def roid_augment(x: torch.Tensor) -> torch.Tensor:
    """ROID's consistency augmentation of RGB images ``x`` in [0, 1], shape ``(N, 3, H, W)`` (module docs)."""
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"the augmentation needs RGB images of shape (N, 3, H, W), got {tuple(x.shape)}")
    height, width = x.shape[-2:]
    x = color_jitter(x.clamp(0, 1))
    pad = height // 2
    x = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    padded_h, padded_w = x.shape[-2:]
    degrees = _uniform(-15.0, 15.0)
    tx = float(round(_uniform(-padded_w / 16, padded_w / 16)))
    ty = float(round(_uniform(-padded_h / 16, padded_h / 16)))
    x = affine(x, degrees, (tx, ty), _uniform(0.9, 1.1))
    x = x[..., pad:pad + height, pad:pad + width]
    if float(torch.rand(())) < 0.5:
        x = x.flip(-1)
    return x.clamp(0, 1)
