"""The 19 common corruptions of CIFAR-10-C / ImageNet-C, re-implemented with numpy, scipy and Pillow.

Semantics follow the public reference generators ``make_cifar_c.py`` / ``make_imagenet_c.py``
(hendrycks/robustness, Apache-2.0); the parameter tables are in :mod:`aqr.data.corruption_params`.
The pieces the reference took from ImageMagick (motion blur), OpenCV and scikit-image are
re-implemented here, so the only dependencies are numpy, scipy and Pillow. Known, deliberate
differences from the reference are listed in :data:`DEVIATIONS`.

Every corruption takes a uint8 HWC RGB image and a ``numpy.random.Generator`` and returns a
new uint8 HWC image of the same shape; given the same generator state the output is identical.
"""

from __future__ import annotations

import hashlib
import io
import zlib
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image
from scipy import ndimage

from aqr.data.corruption_params import CORRUPTIONS, ParamSet, get_param_set

DEVIATIONS: tuple[str, ...] = (
    "motion_blur/snow: ImageMagick's MotionBlurImage is re-implemented as its one-sided line kernel "
    "(2*ceil(radius)+1 taps, half-Gaussian weights, edge pixels repeated, Q16 then 8-bit quantisation); "
    "pixel-exact against ImageMagick 6.9.11 convert -motion-blur.",
    "impulse_noise: salt-and-pepper flips each element independently with probability `amount` "
    "(current scikit-image); older scikit-image drew coordinates with randint(0, n-1), never touching the last row, column or channel.",
    "spatter (water): Canny edges follow OpenCV's L1-gradient Canny, but the distance transform is exact Euclidean "
    "(OpenCV used its 5x5 chamfer approximation); an all-zero liquid layer yields no spatter instead of NaN.",
    "elastic_transform: the affine warp samples exactly (OpenCV quantises coordinates to 1/32 px).",
    "frost: overlays are decoded with Pillow (RGBA -> RGB drops alpha as cv2.imread did) and resized with an "
    "OpenCV-style bilinear without antialiasing; at scale 0.2 this picks pixel 5k+2, as cv2.resize does.",
    "random streams: numpy.random.Generator per image instead of the global legacy RNG, so pixels are not "
    "bit-identical to the released arrays, only equal in distribution.",
)

FROST_FILES: tuple[str, ...] = ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg")
# The reference draws np.random.randint(5): only the first five overlays are ever used.
_FROST_USED = 5


# ----------------------------------------------------------------------------- helpers


def _unit(image: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    return image.astype(dtype) / 255.0


def _to_uint8(x: np.ndarray) -> np.ndarray:
    # The reference returns np.clip(x, 0, 1) * 255 and the caller stores np.uint8(...), which
    # truncates; keep the truncation so intensities match the released arrays.
    return (np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)


def _skimage_gaussian(x: np.ndarray, sigma: float, mode: str = "nearest", truncate: float = 4.0) -> np.ndarray:
    """skimage.filters.gaussian(x, sigma, multichannel=True): blur rows and columns, never channels."""
    sigmas = (sigma, sigma) + (0.0,) * (x.ndim - 2)
    return ndimage.gaussian_filter(x, sigma=sigmas, mode=mode, truncate=truncate)


def _rgb_to_hsv(rgb: np.ndarray) -> np.ndarray:
    """HSV in [0,1]^3 with skimage.color.rgb2hsv conventions (hue 0 where max == min)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    v = rgb.max(axis=-1)
    delta = v - rgb.min(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(v > 0, delta / np.where(v > 0, v, 1), 0.0)
        safe = np.where(delta > 0, delta, 1)
        h = np.where(r == v, (g - b) / safe, 0.0)
        h = np.where(g == v, 2.0 + (b - r) / safe, h)
        h = np.where(b == v, 4.0 + (r - g) / safe, h)
    h = np.where(delta > 0, (h / 6.0) % 1.0, 0.0)
    return np.stack([h, s, v], axis=-1)


def _hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    sector = np.floor(h * 6.0)
    f = h * 6.0 - sector
    sector = sector.astype(int) % 6
    p = v * (1 - s)
    q = v * (1 - f * s)
    t = v * (1 - (1 - f) * s)
    choices_r = [v, q, p, p, t, v]
    choices_g = [t, v, v, q, p, p]
    choices_b = [p, p, t, v, v, q]
    return np.stack(
        [np.choose(sector, choices_r), np.choose(sector, choices_g), np.choose(sector, choices_b)], axis=-1
    )


def _zoom_linear(x: np.ndarray, factor: float) -> np.ndarray:
    """scipy.ndimage.zoom(x, (factor, factor, 1), order=1) for HWC arrays, about 3x faster.

    Output size round(n * factor); output i samples input i * (n_in - 1) / (n_out - 1) (grid_mode=False).
    """
    out = x
    for axis in (0, 1):
        n_in = x.shape[axis]
        n_out = int(round(n_in * factor))
        pos = np.arange(n_out) * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(1)
        lo = np.minimum(np.floor(pos).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        shape = [1] * out.ndim
        shape[axis] = n_out
        frac = (pos - lo).reshape(shape).astype(out.dtype)
        out = np.take(out, lo, axis=axis) * (1 - frac) + np.take(out, hi, axis=axis) * frac
    return out


def _clipped_zoom(x: np.ndarray, factor: float) -> np.ndarray:
    """Zoom into the centre by ``factor`` (bilinear, as scipy.ndimage.zoom) and crop back to x's size."""
    h, w = x.shape[:2]
    ch, cw = int(np.ceil(h / factor)), int(np.ceil(w / factor))
    top, left = (h - ch) // 2, (w - cw) // 2
    zoomed = _zoom_linear(x[top : top + ch, left : left + cw], factor)
    trim_top, trim_left = (zoomed.shape[0] - h) // 2, (zoomed.shape[1] - w) // 2
    return zoomed[trim_top : trim_top + h, trim_left : trim_left + w]


def _motion_blur(x: np.ndarray, radius: float, sigma: float, angle: float) -> np.ndarray:
    """ImageMagick-6 MotionBlurImage on an HWC array in [0, 255]; returns its 8-bit result (as float).

    The kernel is one-sided: tap i (0 <= i < 2*ceil(radius)+1) has weight exp(-i^2 / 2 sigma^2)
    and reads the pixel i steps along ``angle`` (degrees, 0 = +x, positive turns towards +y).
    """
    width = int(2 * np.ceil(radius) + 1)
    taps = np.arange(width, dtype=np.float64)
    sigma = max(abs(sigma), 1e-12)
    weights = np.exp(-(taps**2) / (2.0 * sigma * sigma))
    weights /= weights.sum()
    theta = np.deg2rad(angle)
    off_x = np.ceil(taps * np.cos(theta) - 0.5).astype(int)
    off_y = np.ceil(taps * np.sin(theta) - 0.5).astype(int)
    h, w = x.shape[:2]
    pad = int(max(np.abs(off_x).max(), np.abs(off_y).max()))
    padded = np.pad(x.astype(np.float64), ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    out = np.zeros((h, w, x.shape[2]), dtype=np.float64)
    for wt, dx, dy in zip(weights, off_x, off_y):
        out += wt * padded[pad + dy : pad + dy + h, pad + dx : pad + dx + w]
    # ImageMagick Q16 rounds to a 16-bit quantum, and its 8-bit PNG output then truncates
    # (checked pixel-exact against `convert-im6.q16 -motion-blur` 6.9.11)
    return np.clip(np.floor(np.rint(out * 257.0) / 257.0), 0, 255)


def _plasma_fractal(rng: np.random.Generator, mapsize: int, wibble_decay: float) -> np.ndarray:
    """Diamond-square height map of side ``mapsize`` (a power of two), normalised to [0, 1]."""
    hmap = np.zeros((mapsize, mapsize), dtype=np.float64)
    step = mapsize
    wibble = 100.0
    while step >= 2:
        half = step // 2

        def noisy_mean(total: np.ndarray) -> np.ndarray:
            # wibble appears twice on purpose: the reference scales U(-wibble, wibble) by wibble again
            return total / 4 + wibble * rng.uniform(-wibble, wibble, total.shape)

        corners = hmap[0::step, 0::step]
        square = corners + np.roll(corners, -1, axis=0)
        square = square + np.roll(square, -1, axis=1)
        hmap[half::step, half::step] = noisy_mean(square)
        centres = hmap[half::step, half::step]
        corners = hmap[0::step, 0::step]
        left = centres + np.roll(centres, 1, axis=0) + corners + np.roll(corners, -1, axis=1)
        hmap[0::step, half::step] = noisy_mean(left)
        top = centres + np.roll(centres, 1, axis=1) + corners + np.roll(corners, -1, axis=0)
        hmap[half::step, 0::step] = noisy_mean(top)
        step = half
        wibble /= wibble_decay
    hmap -= hmap.min()
    return hmap / hmap.max()


def _disk_kernel(radius: float, alias_blur: float) -> np.ndarray:
    """Normalised disk of ``radius`` smoothed by a small Gaussian (cv2.GaussianBlur, reflect-101)."""
    if radius <= 8:
        grid, ksize = np.arange(-8, 9), 3
    else:
        grid, ksize = np.arange(-radius, radius + 1), 5
    xx, yy = np.meshgrid(grid, grid)
    disk = ((xx**2 + yy**2) <= radius**2).astype(np.float32)
    disk /= disk.sum()
    g = np.exp(-((np.arange(ksize) - (ksize - 1) / 2) ** 2) / (2.0 * alias_blur**2))
    g /= g.sum()
    disk = ndimage.correlate1d(disk, g, axis=0, mode="mirror")
    disk = ndimage.correlate1d(disk, g, axis=1, mode="mirror")
    # crop to the (symmetric) support so the filter below is cheap; zeros contribute nothing
    nz = np.argwhere(disk > 0)
    r = int(max(np.abs(nz - disk.shape[0] // 2).max(), 0))
    c = disk.shape[0] // 2
    return disk[c - r : c + r + 1, c - r : c + r + 1]


def _resize_bilinear(img: np.ndarray, scale: float) -> np.ndarray:
    """cv2.resize(img, (0, 0), fx=scale, fy=scale) with INTER_LINEAR: half-pixel centres, no antialiasing."""
    if scale == 1:
        return img
    h, w = img.shape[:2]
    oh, ow = int(round(h * scale)), int(round(w * scale))

    def axis(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.maximum((np.arange(n_out) + 0.5) / scale - 0.5, 0.0)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, src - lo

    r0, r1, fr = axis(oh, h)
    c0, c1, fc = axis(ow, w)
    f = img.astype(np.float64)
    top = f[r0][:, c0] * (1 - fc)[None, :, None] + f[r0][:, c1] * fc[None, :, None]
    bottom = f[r1][:, c0] * (1 - fc)[None, :, None] + f[r1][:, c1] * fc[None, :, None]
    out = top * (1 - fr)[:, None, None] + bottom * fr[:, None, None]
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def frost_fingerprint(frost_dir: str | Path) -> str:
    """A key of the frost overlays the corruption reads from ``frost_dir``: each used file's name and sha256.
    ``FileNotFoundError`` (as :func:`load_frost_overlays`) where one is missing."""
    from aqr.util.files import sha256_cached

    folder = Path(frost_dir)
    listing = "\n".join(f"{path.name} {sha256_cached(path)}" for path in frost_overlay_paths(folder))
    return hashlib.sha256(listing.encode()).hexdigest()


def frost_overlay_paths(frost_dir: str | Path) -> list[Path]:
    """The paths of the frost overlays the corruption reads (frost1.png .. frost5.jpg) in ``frost_dir``;
    ``FileNotFoundError`` naming the folder and the missing files when any is absent."""
    folder = Path(frost_dir)
    needed = FROST_FILES[:_FROST_USED]
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"frost overlays missing in {folder}: {', '.join(missing)} (expected {', '.join(needed)}, "
            "the frost images of hendrycks/robustness ImageNet-C/create_c)"
        )
    return [folder / name for name in needed]


def load_frost_overlays(frost_dir: str | Path, scale: float) -> tuple[np.ndarray, ...]:
    """Read the frost overlays frost1.png .. frost5.jpg from ``frost_dir`` as uint8 RGB, resized by ``scale``.

    Raises FileNotFoundError naming the folder and the missing files when any is absent.
    """
    overlays = []
    for path in frost_overlay_paths(frost_dir):
        with Image.open(path) as im:
            overlays.append(_resize_bilinear(np.asarray(im.convert("RGB")), scale))
    return tuple(overlays)



def check_request(params: str | ParamSet, corruptions: Sequence[str], severities: Sequence[int],
                  frost_dir: str | Path | None) -> tuple[ParamSet, tuple[int, ...]]:
    """The parameter set and severities of a generation request; ValueError (before any work) on an
    unknown corruption, severities not distinct in 1..5, or frost without readable overlays."""
    pset = get_param_set(params)
    for name in corruptions:
        pset.get(name, 1)
    chosen = tuple(int(s) for s in severities)
    if not chosen or len(set(chosen)) != len(chosen) or not all(1 <= s <= 5 for s in chosen):
        raise ValueError(f"severities must be distinct integers in 1..5, got {chosen}")
    if "frost" in corruptions:
        if frost_dir is None:
            raise ValueError("the frost corruption needs --frost-dir (folder with frost1.png .. frost5.jpg)")
        load_frost_overlays(frost_dir, pset.frost_scale)
    return pset, chosen


# ----------------------------------------------------------------------------- corruptions
# Each takes (float or uint8 image, parameter(s), rng, ParamSet, overlays) and returns uint8.


def _gaussian_noise(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    x = _unit(img)
    return _to_uint8(x + rng.normal(size=x.shape, scale=c))


def _shot_noise(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    x = _unit(img)
    return _to_uint8(rng.poisson(x * c) / c)


def _impulse_noise(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    x = _unit(img)
    flipped = rng.random(x.shape) < c
    salted = rng.random(x.shape) < 0.5
    x[flipped & salted] = 1.0
    x[flipped & ~salted] = 0.0
    return _to_uint8(x)


def _speckle_noise(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    x = _unit(img)
    return _to_uint8(x + x * rng.normal(size=x.shape, scale=c))


def _gaussian_blur(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    return _to_uint8(_skimage_gaussian(_unit(img), c))


def _glass_blur(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    sigma, delta, iterations = c
    x = (_skimage_gaussian(_unit(img), sigma) * 255).astype(np.uint8)
    h, w = x.shape[:2]
    rows, cols = range(h - delta, delta, -1), range(w - delta, delta, -1)
    # rng.integers(-delta, delta) excludes +delta, as np.random.randint did in the reference
    shifts = rng.integers(-delta, delta, size=(iterations, len(rows), len(cols), 2)).tolist()
    # Track which source pixel sits where. The reference's "swap" is a tuple assignment of numpy
    # views, which copies x[h', w'] into x[h, w] and leaves x[h', w'] as is; reproduce that.
    source = list(range(h * w))
    for it in range(iterations):
        for a, row in enumerate(rows):
            shifts_row = shifts[it][a]
            base = row * w
            for b, col in enumerate(cols):
                dx, dy = shifts_row[b]
                source[base + col] = source[(row + dy) * w + col + dx]
    x = x.reshape(h * w, -1)[source].reshape(img.shape)
    return _to_uint8(_skimage_gaussian(x / 255.0, sigma))


def _defocus_blur(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    kernel = _disk_kernel(*c)
    x = _unit(img)
    out = np.stack([ndimage.correlate(x[..., d], kernel, mode="mirror") for d in range(x.shape[2])], axis=-1)
    return _to_uint8(out)


def _motion_blur_corruption(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    blurred = _motion_blur(img, c[0], c[1], rng.uniform(-45, 45))
    return blurred.astype(np.uint8)


def _zoom_blur(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    factors = np.arange(*c)  # float arange, like the reference (e.g. 1..1.06 gives 7 factors)
    x = _unit(img, np.float32)
    out = np.zeros_like(x)
    for factor in factors:
        out += _clipped_zoom(x, factor)
    return _to_uint8((x + out) / (len(factors) + 1))


def _snow(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    loc, scale, zoom, threshold, radius, sigma, blend = c
    x = _unit(img, np.float32)
    layer = rng.normal(size=x.shape[:2], loc=loc, scale=scale)
    layer = _clipped_zoom(layer[..., None], zoom)
    layer[layer < threshold] = 0
    layer_u8 = (np.clip(layer, 0, 1) * 255).astype(np.uint8)
    flakes = _motion_blur(layer_u8, radius, sigma, rng.uniform(-135, -45)) / 255.0
    gray = (0.299 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2])[..., None]
    x = blend * x + (1 - blend) * np.maximum(x, gray * 1.5 + 0.5)
    return _to_uint8(x + flakes + np.rot90(flakes, k=2))


def _frost(img: np.ndarray, c: tuple, rng: np.random.Generator, overlays: Sequence[np.ndarray]) -> np.ndarray:
    frost = overlays[int(rng.integers(_FROST_USED))]
    h, w = img.shape[:2]
    if frost.shape[0] <= h or frost.shape[1] <= w:
        raise ValueError(f"frost overlay of shape {frost.shape[:2]} is too small for a {h}x{w} crop")
    top, left = int(rng.integers(0, frost.shape[0] - h)), int(rng.integers(0, frost.shape[1] - w))
    crop = frost[top : top + h, left : left + w].astype(np.float64)
    return np.clip(c[0] * img.astype(np.float64) + c[1] * crop, 0, 255).astype(np.uint8)


def _fog(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    strength, decay = c
    x = _unit(img)
    h, w = x.shape[:2]
    mapsize = 1 << int(np.ceil(np.log2(max(h, w))))
    max_val = x.max()
    x = x + strength * _plasma_fractal(rng, mapsize, decay)[:h, :w, None]
    return _to_uint8(x * max_val / (max_val + strength))


def _brightness(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    hsv = _rgb_to_hsv(_unit(img))
    hsv[..., 2] = np.clip(hsv[..., 2] + c, 0, 1)
    return _to_uint8(_hsv_to_rgb(hsv))


def _contrast(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    x = _unit(img)
    means = x.mean(axis=(0, 1), keepdims=True)
    return _to_uint8((x - means) * c + means)


def _saturate(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    hsv = _rgb_to_hsv(_unit(img))
    hsv[..., 1] = np.clip(hsv[..., 1] * c[0] + c[1], 0, 1)
    return _to_uint8(_hsv_to_rgb(hsv))


def _elastic_transform(img: np.ndarray, c: tuple, rng: np.random.Generator, scale: float) -> np.ndarray:
    alpha, sigma, jitter = (v * scale for v in c)
    x = _unit(img, np.float32)
    h, w, channels = x.shape
    # random affine: three points around the centre moved by U(-jitter, jitter); points are (x, y)
    centre = np.float32([h, w]) // 2
    size = min(h, w) // 3
    src_pts = np.float32([centre + size, [centre[0] + size, centre[1] - size], centre - size])
    dst_pts = src_pts + rng.uniform(-jitter, jitter, size=src_pts.shape).astype(np.float32)
    forward = np.linalg.solve(
        np.hstack([src_pts, np.ones((3, 1), np.float32)]).astype(np.float64), dst_pts.astype(np.float64)
    ).T  # 2x3, maps source (x, y, 1) to destination
    inverse = np.linalg.inv(np.vstack([forward, [0, 0, 1]]))[:2]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    src_x = inverse[0, 0] * xx + inverse[0, 1] * yy + inverse[0, 2]
    src_y = inverse[1, 0] * xx + inverse[1, 1] * yy + inverse[1, 2]
    # cv2.BORDER_REFLECT_101 is scipy's "mirror"
    x = np.stack(
        [ndimage.map_coordinates(x[..., d], [src_y, src_x], order=1, mode="mirror") for d in range(channels)], axis=-1
    )
    dx = (_skimage_gaussian(rng.uniform(-1, 1, size=(h, w)), sigma, mode="reflect", truncate=3) * alpha).astype(np.float32)
    dy = (_skimage_gaussian(rng.uniform(-1, 1, size=(h, w)), sigma, mode="reflect", truncate=3) * alpha).astype(np.float32)
    out = np.stack(
        [ndimage.map_coordinates(x[..., d], [yy + dy, xx + dx], order=1, mode="reflect") for d in range(channels)],
        axis=-1,
    )
    return _to_uint8(out)


def _pixelate(img: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    h, w = img.shape[:2]
    small = Image.fromarray(img).resize((int(w * c), int(h * c)), Image.BOX)
    return np.asarray(small.resize((w, h), Image.BOX)).copy()


def _jpeg_compression(img: np.ndarray, c: int, rng: np.random.Generator) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(img).save(buffer, "JPEG", quality=int(c))
    buffer.seek(0)
    with Image.open(buffer) as decoded:
        return np.asarray(decoded.convert("RGB")).copy()


def _canny(gray: np.ndarray, low: int, high: int) -> np.ndarray:
    """OpenCV's Canny (3x3 Sobel, L1 magnitude, 4-direction NMS, 8-connected hysteresis); bool edges."""
    g = gray.astype(np.int32)
    sobel = np.array([[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]], dtype=np.int32)
    gx = ndimage.correlate(g, sobel, mode="nearest")
    gy = ndimage.correlate(g, sobel.T, mode="nearest")
    mag = np.abs(gx) + np.abs(gy)
    h, w = mag.shape
    m = np.pad(mag, 1)  # magnitudes outside the image count as 0

    def nb(dr: int | np.ndarray, dc: int | np.ndarray) -> np.ndarray:
        rr = np.arange(h)[:, None] + 1 + dr
        cc = np.arange(w)[None, :] + 1 + dc
        return m[rr, cc]

    ax, ay = np.abs(gx).astype(np.int64), np.abs(gy).astype(np.int64)
    tg22 = int(0.4142135623730950488016887242097 * (1 << 15) + 0.5)
    tg22x = ax * tg22
    ys = ay << 15
    horizontal = ys < tg22x
    vertical = ~horizontal & (ys > tg22x + (ax << 16))
    diagonal = ~horizontal & ~vertical
    s = np.where((gx ^ gy) < 0, -1, 1)
    keep_h = (mag > nb(0, -1)) & (mag >= nb(0, 1))
    keep_v = (mag > nb(-1, 0)) & (mag >= nb(1, 0))
    keep_d = (mag > nb(-1, -s)) & (mag > nb(1, s))
    local_max = (horizontal & keep_h) | (vertical & keep_v) | (diagonal & keep_d)
    candidate = local_max & (mag > low)
    labels, n = ndimage.label(candidate, structure=np.ones((3, 3), dtype=bool))
    if n == 0:
        return np.zeros_like(candidate)
    strong = np.unique(labels[candidate & (mag > high)])
    return np.isin(labels, strong[strong > 0])


def _equalize_hist(img: np.ndarray) -> np.ndarray:
    """cv2.equalizeHist on a uint8 image."""
    hist = np.bincount(img.ravel(), minlength=256)
    first = int(np.flatnonzero(hist)[0])
    total = img.size
    if hist[first] == total:
        return np.full_like(img, first)
    # OpenCV computes the scale and the products in float32; float64 flips some .5 roundings
    scale = np.float32(255.0) / np.float32(total - hist[first])
    lut = np.zeros(256, dtype=np.float32)
    lut[first + 1 :] = np.cumsum(hist[first + 1 :]).astype(np.float32) * scale
    lut = np.clip(np.rint(lut), 0, 255).astype(np.uint8)
    return lut[img]


def _spatter(img: np.ndarray, c: tuple, rng: np.random.Generator) -> np.ndarray:
    loc, scale, sigma, threshold, intensity, mud = c
    x = _unit(img, np.float32)
    liquid = rng.normal(size=x.shape[:2], loc=loc, scale=scale)
    liquid = _skimage_gaussian(liquid, sigma)
    liquid[liquid < threshold] = 0
    if mud == 0:
        # clip before the cast: the reference cast out-of-range floats, which wraps
        liquid_u8 = (np.clip(liquid, 0, 1) * 255).astype(np.uint8)
        not_edge = ~_canny(liquid_u8, 50, 150)
        if not_edge.all():
            dist = np.full(liquid.shape, 20.0, dtype=np.float32)
        else:
            dist = ndimage.distance_transform_edt(not_edge).astype(np.float32)
        dist = np.minimum(dist, 20.0)
        dist = ndimage.uniform_filter(dist, size=3, mode="mirror").astype(np.uint8)
        dist = _equalize_hist(dist)
        emboss = np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]], dtype=np.float64)
        dist = np.clip(np.rint(ndimage.correlate(dist.astype(np.float64), emboss, mode="mirror")), 0, 255)
        dist = np.rint(ndimage.uniform_filter(dist, size=3, mode="mirror")).astype(np.float32)
        m = liquid_u8.astype(np.float32) * dist
        peak = m.max()
        m = m / peak * intensity if peak > 0 else np.zeros_like(m)
        water = np.array([175, 238, 238], dtype=np.float32) / 255.0  # pale turquoise
        return _to_uint8(x + m[..., None] * water)
    m = (liquid > threshold).astype(np.float32)
    m = _skimage_gaussian(m, intensity)
    m[m < 0.8] = 0
    mud_color = np.array([63, 42, 20], dtype=np.float32) / 255.0
    return _to_uint8(x * (1 - m[..., None]) + mud_color * m[..., None])


_SIMPLE: dict[str, Callable[[np.ndarray, object, np.random.Generator], np.ndarray]] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "speckle_noise": _speckle_noise,
    "gaussian_blur": _gaussian_blur,
    "glass_blur": _glass_blur,
    "defocus_blur": _defocus_blur,
    "motion_blur": _motion_blur_corruption,
    "zoom_blur": _zoom_blur,
    "snow": _snow,
    "fog": _fog,
    "brightness": _brightness,
    "contrast": _contrast,
    "saturate": _saturate,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg_compression,
    "spatter": _spatter,
}
assert set(_SIMPLE) | {"frost", "elastic_transform"} == set(CORRUPTIONS)


def corrupt(
    image: np.ndarray,
    name: str,
    severity: int | float,
    rng: np.random.Generator,
    *,
    params: str | ParamSet = "cifar",
    frost_dir: str | Path | None = None,
    frost_overlays: Sequence[np.ndarray] | None = None,
) -> np.ndarray:
    """Apply corruption ``name`` at ``severity`` (1..5) to a uint8 HWC RGB image.

    A float severity may lie anywhere in ``[0, 5]`` (Continuously Changing Corruptions): from 1 up, the
    parameters are interpolated between the two levels around it (:meth:`ParamSet.interpolated`); below 1,
    the severity-1 image is mixed with the clean one, weight ``severity`` on the corrupted (0: the image
    unchanged). An integer severity gives exactly the table's level.

    Returns a new uint8 array of the same shape; ``image`` is not modified. All randomness comes
    from ``rng``, so equal generator states give equal outputs. ``params`` picks the severity table
    ('cifar' for 32 px images, 'imagenet' for 224 px). ``frost`` needs either pre-loaded
    ``frost_overlays`` (from :func:`load_frost_overlays`, faster in loops) or ``frost_dir``.
    """
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 HxWx3 RGB image, got dtype {image.dtype} and shape {image.shape}")
    pset = get_param_set(params)
    if isinstance(severity, (float, np.floating)):
        if not 0 <= severity <= 5:  # (NaN too)
            raise ValueError(f"severity must be in [0, 5], got {severity!r}")
        if severity < 1:
            if name not in pset.table:
                pset.get(name, 1)  # the unknown name's error
            if severity == 0:
                return image.copy()
            level_one = corrupt(image, name, 1, rng, params=pset, frost_dir=frost_dir, frost_overlays=frost_overlays)
            mixed = (1 - severity) * image.astype(np.float64) + severity * level_one.astype(np.float64)
            return np.clip(np.floor(mixed + 0.5), 0, 255).astype(np.uint8)
        c = pset.interpolated(name, float(severity))
    else:
        c = pset.get(name, severity)
    if name == "frost":
        if frost_overlays is None:
            if frost_dir is None:
                raise ValueError("the frost corruption needs frost_dir (folder with frost1.png .. frost5.jpg)")
            frost_overlays = load_frost_overlays(frost_dir, pset.frost_scale)
        out = _frost(image, c, rng, frost_overlays)
    elif name == "elastic_transform":
        out = _elastic_transform(image, c, rng, pset.elastic_scale)
    else:
        out = _SIMPLE[name](image, c, rng)
    return np.ascontiguousarray(out, dtype=np.uint8)


def image_rng(seed: int, corruption: str, severity: int, index: int) -> np.random.Generator:
    """The generator for one image: a function of (seed, corruption, severity, index) only.

    The corruption enters through a CRC-32 of its name, so the stream of one corruption does not
    depend on which other corruptions are generated or in which order.
    """
    key = [int(seed), zlib.crc32(corruption.encode("utf-8")), int(severity), int(index)]
    return np.random.default_rng(np.random.SeedSequence(key))
