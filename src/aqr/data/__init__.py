"""Datasets: image arrays and npz files (:mod:`~aqr.data.arrays`), CIFAR and CIFAR-C
(:mod:`~aqr.data.cifar`), ImageNet-C (:mod:`~aqr.data.imagenet_c`), and the CIFAR-10-C generator
(:mod:`~aqr.data.cifar_c` with :mod:`~aqr.data.corruptions` and :mod:`~aqr.data.corruption_params`,
which need scipy and Pillow and load only when used). :func:`resolve_data_dir` finds the
benchmark's data folder (``$AQR_DATA_DIR``).
"""

from aqr.data.arrays import ArrayImageDataset, load_npz, load_npz_arrays, to_float
from aqr.data.cifar import load_cifar, load_cifar_c, load_cifar_pickle
from aqr.data.imagenet_c import ImageNetCFolder
from aqr.data.location import DATA_DIR_ENV, DataDirError, resolve_data_dir

__all__ = ["DATA_DIR_ENV", "ArrayImageDataset", "DataDirError", "ImageNetCFolder", "load_cifar", "load_cifar_c",
           "load_cifar_pickle", "load_npz", "load_npz_arrays", "resolve_data_dir", "to_float"]
