"""Tests of the 19 corruptions on tiny synthetic images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from aqr.data.corruption_params import CIFAR_PARAMS, CORRUPTIONS, IMAGENET_PARAMS, get_param_set
from aqr.data.corruptions import (
    _hsv_to_rgb,
    _motion_blur,
    _rgb_to_hsv,
    _zoom_linear,
    corrupt,
    image_rng,
    load_frost_overlays,
)

# Corruptions whose mean |corrupted - clean| grows with severity under the reference tables.
# Not monotone by construction: glass_blur (severities 1-3 shuffle alike), frost and elastic
# (the image weight / affine jitter shrink as severity grows), spatter (water at 1-3, mud at 4-5),
# saturate (desaturates at 1-2, saturates at 3-5).
MONOTONE = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "speckle_noise",
    "gaussian_blur",
    "defocus_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "fog",
    "brightness",
    "contrast",
    "pixelate",
    "jpeg_compression",
)


def synthetic_images(n: int, size: int = 32, seed: int = 0) -> np.ndarray:
    """Random colour fields at a coarse and a fine scale: textured enough for blurs to matter,
    without the regular stripes that make pixelation alias."""

    def field(sigma: float) -> np.ndarray:
        f = ndimage.gaussian_filter(rng.random((n, size, size, 3)), sigma=(0, sigma, sigma, 0))
        return (f - f.min()) / (f.max() - f.min())

    rng = np.random.default_rng(seed)
    img = 0.1 + 0.5 * field(size / 10) + 0.3 * field(size / 40)
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def frost_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fake frost overlays, large enough for 224 px crops at scale 1 and 32 px crops at scale 0.2."""
    folder = tmp_path_factory.mktemp("frost")
    rng = np.random.default_rng(1)
    for name in ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg"):
        Image.fromarray(rng.integers(0, 256, (260, 300, 3), dtype=np.uint8)).save(folder / name)
    return folder


@pytest.fixture(scope="module")
def overlays(frost_dir: Path) -> tuple[np.ndarray, ...]:
    return load_frost_overlays(frost_dir, CIFAR_PARAMS.frost_scale)


IMAGES = synthetic_images(6)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_shape_dtype_change_and_determinism(name: str, overlays: tuple[np.ndarray, ...]) -> None:
    img = IMAGES[0]
    before = img.copy()
    for severity in (1, 3, 5):
        out = corrupt(img, name, severity, np.random.default_rng(7), frost_overlays=overlays)
        assert out.shape == img.shape and out.dtype == np.uint8
        again = corrupt(img, name, severity, np.random.default_rng(7), frost_overlays=overlays)
        np.testing.assert_array_equal(out, again)
    assert not np.array_equal(corrupt(img, name, 3, np.random.default_rng(0), frost_overlays=overlays), img)
    np.testing.assert_array_equal(img, before)  # input untouched


@pytest.mark.parametrize("name", MONOTONE)
def test_severity_monotone(name: str) -> None:
    def mean_abs_diff(severity: int) -> float:
        diffs = [
            np.abs(corrupt(img, name, severity, image_rng(0, name, severity, i)).astype(float) - img).mean()
            for i, img in enumerate(IMAGES)
        ]
        return float(np.mean(diffs))

    d = [mean_abs_diff(s) for s in range(1, 6)]
    assert all(a < b for a, b in zip(d, d[1:])), f"{name}: mean |diff| by severity {np.round(d, 2)}"


@pytest.mark.parametrize("name", ["gaussian_noise", "glass_blur", "snow", "fog", "spatter", "elastic_transform"])
def test_seed_matters(name: str) -> None:
    img = IMAGES[1]
    a = corrupt(img, name, 5, np.random.default_rng(1))
    b = corrupt(img, name, 5, np.random.default_rng(2))
    assert not np.array_equal(a, b)


def test_image_rng_is_keyed() -> None:
    draw = lambda *key: image_rng(*key).random(4)  # noqa: E731
    np.testing.assert_array_equal(draw(0, "fog", 3, 10), draw(0, "fog", 3, 10))
    for other in [(1, "fog", 3, 10), (0, "snow", 3, 10), (0, "fog", 4, 10), (0, "fog", 3, 11)]:
        assert not np.array_equal(draw(0, "fog", 3, 10), draw(*other))


def test_imagenet_params_at_224(frost_dir: Path) -> None:
    img = synthetic_images(1, size=224, seed=3)[0]
    ov = load_frost_overlays(frost_dir, IMAGENET_PARAMS.frost_scale)
    for name in CORRUPTIONS:
        out = corrupt(img, name, 2, np.random.default_rng(0), params="imagenet", frost_overlays=ov)
        assert out.shape == img.shape and out.dtype == np.uint8
        assert not np.array_equal(out, img), name
    # the ImageNet table is harsher than the CIFAR one for the same corruption
    small = synthetic_images(1, size=224, seed=3)[0]
    cifar = corrupt(small, "gaussian_noise", 5, np.random.default_rng(0), params="cifar")
    imnet = corrupt(small, "gaussian_noise", 5, np.random.default_rng(0), params="imagenet")
    assert np.abs(imnet.astype(float) - small).mean() > np.abs(cifar.astype(float) - small).mean()


def test_param_tables_complete() -> None:
    for pset in (CIFAR_PARAMS, IMAGENET_PARAMS):
        assert set(pset.table) == set(CORRUPTIONS)
        assert all(len(v) == 5 for v in pset.table.values())
    assert CIFAR_PARAMS.get("gaussian_noise", 5) == 0.10  # cifar_c_parameters.md
    assert CIFAR_PARAMS.get("snow", 3) == (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9)
    assert get_param_set("imagenet") is IMAGENET_PARAMS


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda img: corrupt(img, "nope", 1, np.random.default_rng()), "unknown corruption"),
        (lambda img: corrupt(img, "fog", 6, np.random.default_rng()), "severity"),
        (lambda img: corrupt(img, "fog", 1, np.random.default_rng(), params="svhn"), "parameter set"),
        (lambda img: corrupt(img.astype(float), "fog", 1, np.random.default_rng()), "uint8"),
        (lambda img: corrupt(img, "frost", 1, np.random.default_rng()), "frost_dir"),
    ],
)
def test_bad_arguments(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(IMAGES[0])


def test_missing_frost_dir_names_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="frost1.png"):
        corrupt(IMAGES[0], "frost", 1, np.random.default_rng(), frost_dir=tmp_path / "none")


@pytest.mark.data
def test_real_frost_overlays(data_dir: Path) -> None:
    folder = data_dir / "frost"
    if not folder.is_dir():
        pytest.skip(f"no frost images at {folder}")
    ov = load_frost_overlays(folder, 0.2)
    assert [o.shape for o in ov] == [(120, 180, 3), (63, 112, 3), (63, 112, 3), (70, 105, 3), (99, 132, 3)]
    out = corrupt(IMAGES[0], "frost", 5, np.random.default_rng(0), frost_dir=folder)
    assert out.shape == (32, 32, 3)


def test_motion_blur_is_one_sided_line() -> None:
    x = np.zeros((21, 21, 1))
    x[10, 10] = 255.0
    out = _motion_blur(x, radius=3, sigma=10, angle=0)
    # output(x) averages src(x + i), so a point spreads to its left along the row, nowhere else
    assert out[10, 4:11, 0].min() > 0 and out[10, 11:, 0].max() == 0
    assert out[:10].max() == 0 and out[11:].max() == 0
    vertical = _motion_blur(x, radius=3, sigma=10, angle=90)
    np.testing.assert_array_equal(vertical[:, 10, 0], out[10, :, 0])


def test_zoom_linear_matches_scipy() -> None:
    x = np.random.default_rng(0).random((29, 29, 3)).astype(np.float32)
    for factor in (1.0, 1.03, 1.17, 1.75, 2.25):
        ours, ref = _zoom_linear(x, factor), ndimage.zoom(x, (factor, factor, 1), order=1)
        assert ours.shape == ref.shape
        # scipy may read the last sample a hair past the edge and return its constant 0 there;
        # we clamp instead, so compare all but the last row and column
        np.testing.assert_allclose(ours[:-1, :-1], ref[:-1, :-1], atol=1e-5)


def test_hsv_round_trip() -> None:
    rgb = np.random.default_rng(0).random((16, 16, 3))
    rgb[0, 0] = 0.5  # grey: hue and saturation 0
    np.testing.assert_allclose(_hsv_to_rgb(_rgb_to_hsv(rgb)), rgb, atol=1e-12)
    assert _rgb_to_hsv(rgb)[0, 0, 1] == 0


def _imagemagick() -> str | None:
    """Path of a real ImageMagick 6 `convert` (some machines ship a stand-in that only converts PNG)."""
    import shutil
    import subprocess

    for name in ("convert-im6.q16", "convert"):
        path = shutil.which(name)
        if path:
            out = subprocess.run([path, "-version"], capture_output=True, text=True).stdout
            if "ImageMagick 6" in out and "Q16" in out:
                return path
    return None


def test_motion_blur_matches_imagemagick(tmp_path: Path) -> None:
    import subprocess

    convert = _imagemagick()
    if convert is None:
        pytest.skip("ImageMagick 6 (Q16) not installed; the reference generator used its -motion-blur")
    img = IMAGES[2]
    Image.fromarray(img).save(tmp_path / "in.png")
    for radius, sigma, angle in [(6, 1, 12.5), (9, 2.5, -40), (14, 12, -100)]:
        out = tmp_path / "out.png"
        subprocess.run([convert, str(tmp_path / "in.png"), "-motion-blur", f"{radius}x{sigma}{angle:+}", str(out)], check=True)
        reference = np.asarray(Image.open(out).convert("RGB"))
        np.testing.assert_array_equal(_motion_blur(img, radius, sigma, angle).astype(np.uint8), reference)


def test_opencv_pieces_match_opencv() -> None:
    """The OpenCV operations the reference used, re-implemented here, agree with OpenCV itself."""
    cv2 = pytest.importorskip("cv2", reason="opencv-python-headless not installed (only used as a test oracle)")
    from aqr.data.corruptions import _canny, _disk_kernel, _equalize_hist, _resize_bilinear, _skimage_gaussian

    rng = np.random.default_rng(0)
    for _ in range(50):  # liquid layers as in spatter severity 3
        liquid = _skimage_gaussian(rng.normal(size=(32, 32), loc=0.65, scale=0.3), 1.0)
        liquid[liquid < 0.69] = 0
        u8 = (np.clip(liquid, 0, 1) * 255).astype(np.uint8)
        np.testing.assert_array_equal(_canny(u8, 50, 150), cv2.Canny(u8, 50, 150) > 0)
        dist = rng.integers(0, 21, (32, 32)).astype(np.uint8)
        np.testing.assert_array_equal(_equalize_hist(dist), cv2.equalizeHist(dist))
    big = rng.integers(0, 256, (315, 560, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_resize_bilinear(big, 0.2), cv2.resize(big, (0, 0), fx=0.2, fy=0.2))
    x = rng.random((32, 32))
    for radius, alias in [(0.3, 0.4), (1, 0.2), (1.5, 0.1)]:
        grid = np.arange(-8, 9)
        xx, yy = np.meshgrid(grid, grid)
        disk = ((xx**2 + yy**2) <= radius**2).astype(np.float32)
        reference = cv2.GaussianBlur(disk / disk.sum(), ksize=(3, 3), sigmaX=alias)
        ours = ndimage.correlate(x, _disk_kernel(radius, alias), mode="mirror")
        np.testing.assert_allclose(ours, cv2.filter2D(x, -1, reference), atol=1e-7)
