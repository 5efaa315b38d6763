"""Datasets: clean CIFAR (npz or the official pickles), CIFAR-C folders, ImageNet-C, and the
CIFAR-10-C generator (:mod:`aqr.data.cifar_c`, :mod:`aqr.data.corruptions`)."""

from aqr.data.cifar import (ArrayImageDataset, ImageNetCFolder, load_cifar, load_cifar_c, load_cifar_pickle, load_npz,
                            load_npz_arrays, sha256_file)

__all__ = ["ArrayImageDataset", "ImageNetCFolder", "load_cifar", "load_cifar_c", "load_cifar_pickle", "load_npz",
           "load_npz_arrays", "sha256_file"]
