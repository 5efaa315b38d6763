"""Where a classifier's features are: the layer whose input is "the features before the classifier".

:func:`feature_layer` finds the classification head of the models aqr builds or loads (the zoo's CIFAR
ResNets ``linear``, its ViT ``head``, timm models' ``get_classifier()``, torchvision's ``fc``,
``classifier`` or ``heads``, the last ``nn.Linear`` of an ``nn.Sequential``), looking through a
:class:`~aqr.models.normalize.NormalizedModel` and into the last stage of an ``nn.Sequential``; a forward
pre-hook on that layer then sees the features of every image.
"""

from __future__ import annotations

from torch import nn

#: Attribute names of classification heads, in the order they are tried.
HEAD_NAMES = ("fc", "linear", "head", "heads", "classifier")


def _named(model: nn.Module, module: nn.Module) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def _find_head(model: nn.Module) -> str | None:
    """The qualified name of ``model``'s classification head, or ``None``."""
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and list(model.children())[-1:] == [inner]:  # a wrapper such as NormalizedModel
        found = _find_head(inner)
        if found is not None:
            return f"model.{found}"
    get_classifier = getattr(model, "get_classifier", None)  # timm
    if callable(get_classifier):
        head = get_classifier()
        name = _named(model, head) if isinstance(head, nn.Module) else None
        if name and not isinstance(head, nn.Identity):
            return name
    for attr in HEAD_NAMES:
        head = getattr(model, attr, None)
        if isinstance(head, nn.Module) and not isinstance(head, nn.Identity):
            return attr
    if isinstance(model, nn.Sequential) and len(model):  # the head of a pipeline is its last stage's
        last_name = list(model._modules)[-1]
        if isinstance(model[-1], nn.Linear):
            return last_name
        found = _find_head(model[-1])
        if found is not None:
            return f"{last_name}.{found}"
    return None


def feature_layer_name(model: nn.Module, name: str | None = None) -> str:
    """The qualified name of the layer whose input are ``model``'s features: ``name`` itself when given
    (checked to exist), else the classification head found as the module docs say.

    Raises ``ValueError`` when there is no such layer.
    """
    if name is not None:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"feature_layer={name!r} names no module of {type(model).__name__}") from None
        return name
    found = _find_head(model)
    if found is None:
        raise ValueError(f"cannot find the classifier layer of {type(model).__name__} (tried get_classifier() and "
                         f"{', '.join(HEAD_NAMES)}): pass feature_layer='<the layer whose input are the features>'")
    return found


def feature_layer(model: nn.Module, name: str | None = None) -> nn.Module:
    """The layer whose input are ``model``'s features (see :func:`feature_layer_name`)."""
    return model.get_submodule(feature_layer_name(model, name))
