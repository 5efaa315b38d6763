"""What a method declares, once: its name, config and reference option sets, what a caller must supply, and how it
is built from options.

A method class is registered with :meth:`MethodRegistry.register` (``@method(...)`` in each method's
file); the registry holds a :class:`MethodDeclaration` per name. :func:`aqr.methods.plan` turns a name and
keyword options into a :class:`MethodPlan`, the checked configs plus what the method needs, which the
library (:func:`aqr.methods.create`), the CLI and the benchmark harness (the dry check, the cell build,
the cell keys, the statistics cache) all read; nothing else re-derives what a method needs.
"""

from __future__ import annotations

import difflib
import math
import numbers
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from aqr.core.points import POINTS

from .base import ProtocolConfig

if TYPE_CHECKING:
    from torch import nn

    from .base import TTAMethod

#: The options of :class:`ProtocolConfig`, which every method takes.
PROTOCOL_OPTIONS = tuple(f.name for f in fields(ProtocolConfig))
#: The option that picks one of a method's reference option sets (``defaults="imagenet"``).
DEFAULTS_OPTION = "defaults"
#: What a caller hands a method beside its options: the source statistics and the clean source images.
SUPPLIED = ("stats", "source")


@dataclass(frozen=True)
class Needs:
    """What a caller must supply to build a method, beside the model and its options.

    Attributes:
        stats: where the method reads its :class:`aqr.SourceStats` (:mod:`aqr.core.points`:
            ``"output"`` or ``"pre-affine"``, the ``point`` of :func:`aqr.calibrate`); ``None``: no statistics.
        batch_size: the method's defaults depend on the evaluation batch size, which only the caller
            knows (TENT's and SAR's ViT learning rate): a caller fills the ``batch_size`` option.
        source: clean images of the source distribution (EATA's Fisher regularizer), ``source=``.
    """

    stats: str | None = None
    batch_size: bool = False
    source: bool = False

    def __post_init__(self) -> None:
        if self.stats is not None and self.stats not in POINTS:
            raise ValueError(f"Needs.stats must be None or one of {POINTS}, got {self.stats!r}")


@dataclass(frozen=True)
class MethodDeclaration:
    """One method as registered: the class, its config and reference option sets, its needs.

    Attributes:
        name: the name :func:`aqr.methods.create` takes.
        cls: the :class:`~aqr.methods.base.TTAMethod` subclass.
        config: the method's frozen config dataclass.
        defaults: the reference's option sets by name (``"cifar10"``, ``"imagenet"``), the values that differ
            from the config's own defaults; the first is used when ``defaults=`` is not given. Empty: the method takes no ``defaults=``.
        needs: what a caller supplies (:class:`Needs`).
        maps_quantiles: the method maps with AQR's quantile map (its cell keys carry the fast path's version).
        stateless: the method carries nothing from one batch to the next whatever its options, so both
            protocols give the same outputs.
    """

    name: str
    cls: type
    config: type
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    needs: Needs = Needs()
    maps_quantiles: bool = False
    stateless: bool = False

    @property
    def first_defaults(self) -> str | None:
        """The option set used when ``defaults=`` is not given (``None`` for a method without any)."""
        return next(iter(self.defaults), None)

    @property
    def options(self) -> tuple[str, ...]:
        """Every keyword option :func:`plan` takes for this method, sorted."""
        names = {f.name for f in fields(self.config) if f.name != DEFAULTS_OPTION} | set(PROTOCOL_OPTIONS)
        if self.defaults:
            names.add(DEFAULTS_OPTION)
        return tuple(sorted(names))

    def build_config(self, options: Mapping[str, Any]) -> Any:
        """The config from the option set ``options["defaults"]`` (if the method has any) overridden by the
        other options. ``TypeError`` names an option the method does not take; ``ValueError`` a value or
        an option set it refuses, and any NaN or infinite number (no method takes one)."""
        options = dict(options)
        unknown = sorted(set(options) - set(self.options) - set(PROTOCOL_OPTIONS))
        if unknown:
            raise TypeError(unknown_options_message(self.name, unknown, self.options))
        for key, value in options.items():
            if not _finite(value):
                raise ValueError(f"method {self.name!r}: option {key}={value!r} must be a finite number")
        base: Mapping[str, Any] = {}
        if self.defaults:
            chosen = options.pop(DEFAULTS_OPTION, self.first_defaults)
            if chosen not in self.defaults:
                raise ValueError(f"{self.name}: defaults must be one of {sorted(self.defaults)}, got {chosen!r}")
            base = self.defaults[chosen]
            if any(f.name == DEFAULTS_OPTION for f in fields(self.config)):
                base = {**base, DEFAULTS_OPTION: chosen}  # the config records which set filled it
        return self.config(**{**base, **options})


def _finite(value: Any) -> bool:
    """False for a NaN or infinite real number, also inside a list, tuple or mapping of options."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, Mapping):
        return all(_finite(v) for v in value.values())
    return True


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A method in the bench's method syntax, ``"aqr:target=stream,K=11"``, as its name and options
    (``("aqr", {"target": "stream", "K": 11})``; integers, floats and ``true``/``false`` read as such, other
    values kept as text); a bare name has no options. ``ValueError`` for an option without ``=`` or one given twice."""
    name, _, rest = str(spec).partition(":")
    options: dict[str, Any] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"method option must be key=value, got {part!r} in {spec!r}")
        key = key.strip()
        if key in options:
            raise ValueError(f"method option {key!r} is given twice in {spec!r}")
        options[key] = _spec_value(value.strip())
    return name.strip(), options


def _spec_value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def spec_options(spec: str, options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The name and options of ``spec`` (a method name or a spec, :func:`parse_spec`) with the keyword
    ``options`` added. ``TypeError`` naming an option set both in the spec and as a keyword."""
    name, from_spec = parse_spec(spec)
    options = dict(options or {})
    both = sorted(set(from_spec) & set(options))
    if both:
        raise TypeError(f"method {spec!r}: option {', '.join(map(repr, both))} is set both in the spec and as a "
                        "keyword argument; give it once")
    return name, {**from_spec, **options}


def unknown_options_message(name: str, unknown: list[str], taken: tuple[str, ...]) -> str:
    """``method 'aqr' takes no option 'horizn' (did you mean 'horizon'?); it takes: ...``."""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, taken, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"method {name!r} takes no option {', '.join(hints)}; it takes: {', '.join(taken)}")


@dataclass(frozen=True)
class MethodPlan:
    """A method with its options checked: the configs and what must be supplied to build it.

    Built by :func:`aqr.methods.plan`; :meth:`build` makes the method around a model.
    """

    declaration: MethodDeclaration
    config: Any
    protocol: ProtocolConfig

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def needs(self) -> Needs:
        return self.declaration.needs

    @property
    def stats_point(self) -> str | None:
        """Where the method's statistics are taken (``None``: it needs none)."""
        return self.declaration.needs.stats

    @property
    def stats_descriptors(self) -> bool:
        """Whether the statistics must hold the images' descriptors (``aqr.calibrate(..., descriptors=True)``): an
        AQR configuration whose target clusters images by them (``target="mixed"``)."""
        aqr_config = getattr(self.config, "aqr_config", None)  # the configs of AQR and its compositions
        return aqr_config is not None and aqr_config().target_kind.needs_descriptors

    def build(self, model: nn.Module, stats: Any = None, source: Any = None) -> TTAMethod:
        """The method around a private copy of ``model``; ``stats`` / ``source`` where it needs them."""
        return self.declaration.cls(model, self.config, self.protocol, stats=stats, source=source)


class MethodRegistry:
    """Method declarations by name, in registration order. Registration happens when a method's module is
    imported (``@register(...)``); a registered name is never replaced, and :meth:`registered` lets a
    caller (a test, a plug-in) add a method for a while."""

    def __init__(self) -> None:
        self._declarations: dict[str, MethodDeclaration] = {}
        self._lock = threading.Lock()
        self.view: Mapping[str, MethodDeclaration] = MappingProxyType(self._declarations)

    def register(self, name: str, config: type, *, defaults: Mapping[str, Mapping[str, Any]] | None = None,
                 needs: Needs = Needs(), maps_quantiles: bool = False,
                 stateless: bool = False) -> Callable[[type], type]:
        """Class decorator: declare the decorated :class:`TTAMethod` subclass as method ``name``.

        Sets the class's ``name``, ``Config`` and ``declaration`` from the one declaration."""

        def decorate(cls: type) -> type:
            frozen = MappingProxyType({k: MappingProxyType(dict(v)) for k, v in (defaults or {}).items()})
            declaration = MethodDeclaration(name, cls, config, frozen, needs, maps_quantiles, stateless)
            with self._lock:
                if name in self._declarations:
                    raise ValueError(f"a method named {name!r} is registered already "
                                     f"({self._declarations[name].cls.__qualname__})")
                cls.name, cls.Config, cls.declaration = name, config, declaration
                self._declarations[name] = declaration
            return cls

        return decorate

    def unregister(self, name: str) -> None:
        """Remove method ``name`` (``KeyError`` if it is not registered)."""
        with self._lock:
            del self._declarations[name]

    def __contains__(self, name: object) -> bool:
        return name in self._declarations

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._declarations))

    def get(self, name: str) -> MethodDeclaration | None:
        return self._declarations.get(name)

    def __getitem__(self, name: str) -> MethodDeclaration:
        try:
            return self._declarations[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self._declarations), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KeyError(f"unknown method {name!r}{hint}; available: {', '.join(self._declarations)}") from None

    def plan(self, name: str, options: Mapping[str, Any] | None = None, *,
             batch_size: int | None = None) -> MethodPlan:
        """Method ``name`` (or a spec, ``"aqr:target=stream"``: :func:`spec_options`) with ``options`` checked
        (the protocol's, ``defaults=`` and the config's).

        ``batch_size``: the evaluation batch size, filled in as the ``batch_size`` option for a method
        whose ``needs.batch_size`` (unless ``options`` set it). ``KeyError`` for an unknown method,
        ``TypeError`` for an option it does not take (naming the closest one), ``ValueError`` for a value.
        """
        name, options = spec_options(name, options)
        declaration = self[name]
        supplied = sorted(set(options) & set(SUPPLIED))
        if supplied:
            raise TypeError(f"method {name!r}: {', '.join(supplied)} is supplied to build the method "
                            "(create(..., stats=...) or MethodPlan.build), not an option of its plan")
        protocol = ProtocolConfig(**{k: options.pop(k) for k in list(options) if k in PROTOCOL_OPTIONS})
        if declaration.needs.batch_size and batch_size is not None:
            options.setdefault("batch_size", batch_size)
        return MethodPlan(declaration, declaration.build_config(options), protocol)


#: Every method of :mod:`aqr.methods`, registered by its module (``@method(...)``).
REGISTRY = MethodRegistry()
method = REGISTRY.register
