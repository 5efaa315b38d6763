"""Deploying an adapted model outside eager PyTorch: :func:`export` writes an :class:`aqr.AQR` as an ONNX graph
or a ``torch.export`` program of pure torch operations (:mod:`aqr.deploy.writer`, :mod:`aqr.deploy.maps`)."""

from aqr.deploy.writer import FORMATS, FORMS, ExportError, export, export_module, input_names, stream_state

__all__ = ["FORMATS", "FORMS", "ExportError", "export", "export_module", "input_names", "stream_state"]
