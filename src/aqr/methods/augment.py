"""The test-time augmentation of CoTTA, RoTTA and ROID, in plain torch on NCHW float batches in [0, 1].

The test-time-adaptation benchmark repository (mariodoebler/test-time-adaptation,
``augmentations/transforms_cotta.py``, after KATANA) builds it from torchvision transforms; torchvision
is optional here, so :func:`tta_augment` writes the same pipeline with tensor operations, in the
reference's order and with its parameter ranges (:data:`STRONG`; ``soft=True`` there is :data:`SOFT`):

1. clip to [0, 1];
2. colour jitter: brightness, contrast, saturation, hue and gamma, each with a factor drawn uniformly
   from its range, applied in a random order (brightness scales; contrast and saturation blend with
   the grey image's mean or with the grey image; hue rotates in HSV; gamma raises the clamped image to
   a power; every step clips to [0, 1]);
3. pad by half the image size on each side, replicating the edge;
4. random affine about the centre: rotation, translation by a whole number of pixels up to
   ``translate`` times the padded size, scaling; bilinear, zeros outside the padded image;
5. Gaussian blur with a 5x5 kernel of random sigma (reflect padding);
6. centre crop back to the input size;
7. horizontal flip with probability 1/2;
8. additive Gaussian noise (std 0.005) and a final clip to [0, 1].

As in the reference, where the transforms are applied to a whole batch tensor, every random
*parameter* (factors, order, angle, shift, scale, sigma, flip) is drawn once per call and shared by
the batch's images; only the noise differs per pixel. Differences from the reference: random numbers
come from the caller's generators (never the global RNG), so the draws differ; non-square images are
padded and cropped per side (the reference pads both sides by half the height and crops a square); the
affine warp leaves zeros outside the padded image instead of torchvision's fill mask (those pixels are
cropped away at these ranges either way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: ITU-R 601-2 luma weights, as torchvision's grayscale conversion uses.
_LUMA = (0.2989, 0.587, 0.114)


@dataclass(frozen=True)
class AugmentParams:
    """Ranges of the random test-time augmentation (see the module docs); defaults are the reference's."""

    brightness: tuple[float, float] = (0.6, 1.4)
    contrast: tuple[float, float] = (0.7, 1.3)
    saturation: tuple[float, float] = (0.5, 1.5)
    hue: tuple[float, float] = (-0.06, 0.06)
    gamma: tuple[float, float] = (0.7, 1.3)
    degrees: tuple[float, float] = (-15.0, 15.0)
    translate: float = 1 / 16
    scale: tuple[float, float] = (0.9, 1.1)
    blur_kernel: int = 5  # 0: no blur
    blur_sigma: tuple[float, float] = (0.001, 0.5)
    flip_p: float = 0.5
    noise_std: float = 0.005
    padding: str = "replicate"  # how the image is padded before the affine warp (F.pad mode)


#: The reference's ``get_tta_transforms(soft=False)``: used by CoTTA and RoTTA.
STRONG = AugmentParams()
#: The reference's ``get_tta_transforms(padding_mode="reflect", cotta_augs=False)``, ROID's consistency
#: augmentation: the same colour jitter, padding, affine warp, crop and flip, without blur and noise.
ROID = AugmentParams(blur_kernel=0, noise_std=0.0, padding="reflect")
#: The reference's ``soft=True`` ranges.
SOFT = AugmentParams(brightness=(0.8, 1.2), contrast=(0.85, 1.15), saturation=(0.75, 1.25), hue=(-0.03, 0.03),
                     gamma=(0.85, 1.15), degrees=(-8.0, 8.0), scale=(0.95, 1.05), blur_sigma=(0.001, 0.25))


class Generators:
    """One ``torch.Generator`` per device, all seeded from one seed; :meth:`reset` re-seeds them.

    Scalar parameters are drawn on the CPU generator (the same on every device); per-pixel noise and
    masks on the generator of the tensor's device. ``seed=None`` draws a fresh seed from the operating
    system (not from torch's global RNG).
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed if seed is not None else torch.Generator().seed()
        self._by_device: dict[str, torch.Generator] = {}

    def reset(self) -> None:
        self._by_device.clear()

    def on(self, device: torch.device | str) -> torch.Generator:
        """The generator for ``device``, created (seeded) on first use after a reset."""
        device = torch.device(device)
        key = str(device)
        if key not in self._by_device:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._by_device[key] = gen
        return self._by_device[key]

    def uniform(self, low: float, high: float) -> float:
        """One number drawn uniformly from ``[low, high)`` on the CPU generator."""
        return low + (high - low) * float(torch.rand((), generator=self.on("cpu"), dtype=torch.float64))


class GlobalGenerators(Generators):
    """The :class:`Generators` interface on torch's global random number generator, for a method that
    seeds it through its protocol (``fork_rng``) instead of keeping generators of its own."""

    def __init__(self) -> None:
        super().__init__(0)

    def on(self, device: torch.device | str) -> torch.Generator | None:  # type: ignore[override]
        return None  # torch's default generator of the device

    def uniform(self, low: float, high: float) -> float:
        return float(torch.empty((), dtype=torch.float64).uniform_(low, high))


def _gray(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(1)
    return (_LUMA[0] * r + _LUMA[1] * g + _LUMA[2] * b).unsqueeze(1)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: float) -> torch.Tensor:
    return (factor * x + (1.0 - factor) * other).clamp(0.0, 1.0)


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1] (N, 3, H, W) to HSV with hue in [0, 1)."""
    r, g, b = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    flat = maxc == minc
    spread = maxc - minc
    sat = spread / torch.where(flat, torch.ones_like(maxc), maxc)
    spread = torch.where(flat, torch.ones_like(spread), spread)
    rc, gc, bc = (maxc - r) / spread, (maxc - g) / spread, (maxc - b) / spread
    is_r = maxc == r
    is_g = (maxc == g) & ~is_r
    is_b = ~is_r & ~is_g
    hue = is_r * (bc - gc) + is_g * (2.0 + rc - bc) + is_b * (4.0 + gc - rc)
    hue = torch.remainder(hue / 6.0 + 1.0, 1.0)
    return torch.stack((hue, sat, maxc), 1)


def hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rgb_to_hsv`."""
    h, s, v = x.unbind(1)
    sector = torch.floor(h * 6.0)
    f = h * 6.0 - sector
    sector = sector.to(torch.int64) % 6
    p = (v * (1.0 - s)).clamp(0.0, 1.0)
    q = (v * (1.0 - s * f)).clamp(0.0, 1.0)
    t = (v * (1.0 - s * (1.0 - f))).clamp(0.0, 1.0)
    # per sector: (r, g, b) taken from (v, q, p, t)
    table = torch.stack((v, q, p, t))  # (4, N, H, W)
    order = torch.tensor([[0, 3, 2], [1, 0, 2], [2, 0, 3], [2, 1, 0], [3, 2, 0], [0, 2, 1]], device=x.device)
    pick = order[sector]  # (N, H, W, 3)
    return torch.gather(table, 0, pick.permute(3, 0, 1, 2)).transpose(0, 1)


def adjust_hue(x: torch.Tensor, shift: float) -> torch.Tensor:
    hsv = rgb_to_hsv(x)
    hsv = torch.cat((torch.remainder(hsv[:, :1] + shift, 1.0), hsv[:, 1:]), 1)
    return hsv_to_rgb(hsv)


def colour_jitter(x: torch.Tensor, params: AugmentParams, gens: Generators) -> torch.Tensor:
    """Brightness, contrast, saturation, hue and gamma in a random order (factors shared by the batch)."""
    order = torch.randperm(5, generator=gens.on("cpu")).tolist()
    for step in order:
        if step == 0:
            x = _blend(x, torch.zeros_like(x), gens.uniform(*params.brightness))
        elif step == 1:
            x = _blend(x, _gray(x).mean(dim=(1, 2, 3), keepdim=True), gens.uniform(*params.contrast))
        elif step == 2:
            x = _blend(x, _gray(x), gens.uniform(*params.saturation))
        elif step == 3:
            x = adjust_hue(x, gens.uniform(*params.hue))
        else:  # gamma; the clamp keeps the power's gradient finite, as in the reference
            x = x.clamp(1e-8, 1.0).pow(gens.uniform(*params.gamma)).clamp(0.0, 1.0)
    return x


def affine(x: torch.Tensor, angle: float, shift: tuple[float, float], scale: float) -> torch.Tensor:
    """Rotate by ``angle`` degrees (clockwise as seen on screen, as torchvision's tensor ``affine`` does), shift by
    ``shift`` pixels (x right, y down) and scale about the centre; bilinear, zeros outside. Output pixel ``p``
    (centred pixel coordinates) samples the input at ``R^-1 (p - shift) / scale``."""
    n, _, h, w = x.shape
    rad = math.radians(angle)
    cos, sin = math.cos(rad) / scale, math.sin(rad) / scale
    tx, ty = shift
    ys = torch.arange(h, device=x.device, dtype=x.dtype) - (h - 1) / 2.0 - ty
    xs = torch.arange(w, device=x.device, dtype=x.dtype) - (w - 1) / 2.0 - tx
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    src_x = cos * xx + sin * yy
    src_y = -sin * xx + cos * yy
    grid = torch.stack((src_x / (w / 2.0), src_y / (h / 2.0)), -1).unsqueeze(0).expand(n, h, w, 2)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def gaussian_blur(x: torch.Tensor, kernel: int, sigma: float) -> torch.Tensor:
    """Blur every channel with a ``kernel`` x ``kernel`` Gaussian of std ``sigma`` (reflect padding)."""
    half = (kernel - 1) * 0.5
    t = torch.linspace(-half, half, kernel, device=x.device, dtype=x.dtype)
    k1 = torch.exp(-0.5 * (t / sigma) ** 2)
    k1 = k1 / k1.sum()
    k2 = torch.outer(k1, k1).expand(x.shape[1], 1, kernel, kernel)
    pad = kernel // 2
    return F.conv2d(F.pad(x, (pad, pad, pad, pad), mode="reflect"), k2, groups=x.shape[1])


def tta_augment(x: torch.Tensor, gens: Generators, params: AugmentParams = STRONG) -> torch.Tensor:
    """One random augmentation of the batch ``x`` (N, 3, H, W) in [0, 1]; see the module docs."""
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"the test-time augmentation needs RGB images (N, 3, H, W), got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    x = colour_jitter(x.clamp(0.0, 1.0), params, gens)
    ph, pw = h // 2, w // 2
    padded = F.pad(x, (pw, pw, ph, ph), mode=params.padding)
    big_h, big_w = padded.shape[-2:]
    max_dx, max_dy = params.translate * big_w, params.translate * big_h
    angle = gens.uniform(*params.degrees)
    shift = (float(round(gens.uniform(-max_dx, max_dx))), float(round(gens.uniform(-max_dy, max_dy))))
    scale = gens.uniform(*params.scale)
    padded = affine(padded, angle, shift, scale)
    if params.blur_kernel > 0:
        padded = gaussian_blur(padded, params.blur_kernel, gens.uniform(*params.blur_sigma))
    top, left = int(round((big_h - h) / 2.0)), int(round((big_w - w) / 2.0))
    x = padded[..., top:top + h, left:left + w]
    if gens.uniform(0.0, 1.0) < params.flip_p:
        x = x.flip(-1)
    if params.noise_std > 0:
        x = x + params.noise_std * torch.randn(x.shape, generator=gens.on(x.device), device=x.device, dtype=x.dtype)
    return x.clamp(0.0, 1.0)


def roid_augment(x: torch.Tensor, gens: Generators | None = None) -> torch.Tensor:
    """ROID's consistency augmentation (:data:`ROID`) of the batch ``x``; its random numbers from ``gens``,
    or torch's global generator (which ROID's protocol seeds)."""
    return tta_augment(x, gens if gens is not None else GlobalGenerators(), ROID)
