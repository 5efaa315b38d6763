"""Streaming and robust AQR off the CPU: no host read inside a forward pass, the same values as the CPU's path.

A GPU's kernels queue up behind the host; a read of a device value on the host (``.item()``, ``bool(t)``,
``.tolist()``, a data-dependent shape) makes the host wait for the queue to drain, at every layer it happens.
On the ``meta`` device every such read raises, so a forward on ``meta`` runs the path a GPU takes (the torch
kernels, every flag left on the device) and fails on any read. The one read a stream's forward pass makes,
after its last layer, is :func:`aqr.adapt.stream.batch.host_outcome` (whether the batch was finite, and
robust AQR's predicted classes, in one copy): it is counted here, once per forward. On CPU, with
``host_reads_are_cheap`` patched to say no, the same path runs on real values and must give the CPU's
outputs and state bit for bit. With CUDA, ``torch.cuda.set_sync_debug_mode("error")`` checks it on the GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import aqr
import aqr.adapt.model as model_module
from aqr.adapt.stream import base, mixed, stream_maps, torch_kernels
from aqr.adapt.stream import batch as batch_module
from aqr.adapt.stream.batch import HostOutcome, host_outcome
from aqr.adapt.stream.robust import RobustLayerStream
from tests import batch_reference
from tests.models_tiny import images

pytestmark = pytest.mark.usefixtures("one_thread")

# batch sizes that take every step: the first batch, small ones (mapped with the state), large ones (merged
# first), a rebuild at every 4 images, and, for robust AQR, more than 256 predicted classes (its own-batch share)
SIZES = [2, 1, 3, 16, 64, 64, 2, 64, 64, 64, 64, 64, 3, 64]
CASES = {
    "stream": {"target": "stream"},
    "knot-ema": {"target": "stream", "estimator": "knot-ema"},
    "robust": {"target": "robust"},
    "robust-skip-2-passes": {"target": "robust", "on_nonfinite": "skip", "passes": 2},
    "mixed": {"target": "mixed", "components": 3},
    "mixed-skip": {"target": "mixed", "components": 2, "on_nonfinite": "skip"},
}


def calibrated(name: str = "bn") -> tuple[torch.nn.Module, aqr.SourceStats]:
    model = batch_reference.BUILDERS[name]().eval()
    return model, aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False,
                                descriptors=True)


class NoBlockingCopies:
    """Fails a copy from the host to another device that would wait for the device's queue: ``torch.tensor`` or
    ``torch.as_tensor`` made on a device, a CPU tensor's ``.to`` a device without ``non_blocking``, or ``copy_``
    of a CPU tensor into a device's (on a GPU each waits; on ``meta`` none fails by itself)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False

        def off_cpu(device: object) -> bool:
            return device is not None and torch.device(device).type != "cpu"

        def made(real: object) -> object:
            def make(*args: object, **kwargs: object) -> torch.Tensor:
                if self.on and off_cpu(kwargs.get("device")):
                    raise AssertionError(f"a blocking copy to {kwargs['device']} inside a forward")
                return real(*args, **kwargs)  # type: ignore[operator]
            return make

        real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

        def to(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            out = real_to(t, *args, **kwargs)
            if (self.on and t.device.type == "cpu" and out.device.type != "cpu"
                    and not kwargs.get("non_blocking", False)):
                raise AssertionError(f"a blocking copy to {out.device} inside a forward")
            return out

        def copy_(t: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            if self.on and t.device.type != "cpu" and src.device.type == "cpu" and src.ndim and not non_blocking:
                raise AssertionError(f"a blocking copy to {t.device} inside a forward")
            return real_copy(t, src, non_blocking)

        monkeypatch.setattr(torch, "tensor", made(torch.tensor))
        monkeypatch.setattr(torch, "as_tensor", made(torch.as_tensor))
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


class CountedSteps:
    """Counts robust AQR's own-batch steps decided on the device (so a test knows that path ran)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = RobustLayerStream._step_own_on_device

        def counted(stream: RobustLayerStream, *args: object, **kwargs: object) -> object:
            self.calls += 1
            return original(stream, *args, **kwargs)

        monkeypatch.setattr(RobustLayerStream, "_step_own_on_device", counted)


@pytest.mark.parametrize("name", ["bn", "vit"])
@pytest.mark.parametrize("case", [case for case in CASES if case != "mixed-skip"])  # skip: robust's shows it
def test_a_stream_forward_on_the_device_path_reads_back_once(monkeypatch: pytest.MonkeyPatch, name: str,
                                                             case: str) -> None:
    model, stats = calibrated(name)
    monkeypatch.setattr(aqr.SourceStats, "check_model", lambda self, m: None)  # reads the weights: a constructor's
    reads: list[object] = []
    classes = torch.Generator().manual_seed(0)

    def outcome(flag: object, labels: torch.Tensor | None = None, extra: tuple[torch.Tensor, ...] = ()) -> HostOutcome:
        # the one read, which meta cannot give: finite, classes drawn i.i.d. (no runs: robust's own share), and
        # the mixed target's whitened descriptors and clusters (0 or 1: every case keeps 2 clusters or more)
        reads.append(flag)
        assert flag is not False and (flag is True or flag.device.type == "meta")
        assert all(t.device.type == "meta" for t in extra)
        host = tuple(torch.randn(t.shape, dtype=t.dtype, generator=classes) if t.is_floating_point()
                     else torch.randint(0, 2, t.shape, generator=classes) for t in extra)
        return HostOutcome(True, None if labels is None else torch.randint(0, 5, (labels.shape[0],), generator=classes),
                           host)

    monkeypatch.setattr(model_module, "host_outcome", outcome)
    steps = CountedSteps(monkeypatch)
    adapter = aqr.AQR(copy.deepcopy(model).to("meta"), stats, rebuild_every=4, compile=False, **CASES[case])
    blocking = NoBlockingCopies(monkeypatch)
    inputs = [torch.empty(n, 3, 8, 8, device="meta") for n in SIZES]
    for i, (n, x) in enumerate(zip(SIZES, inputs)):
        # any read of a meta tensor raises, and after the first batch (which moves the statistics to the device
        # once, as the GPU test lets it) so does a blocking copy to it
        blocking.on = i > 0
        out = adapter(x)
        assert out.device.type == "meta" and out.shape[0] == n
        assert len(reads) == i + 1, "one read per forward pass"
    adapter.forward_held(inputs[1][:1].expand(3, -1, -1, -1))
    blocking.on = False
    assert len(reads) == len(SIZES) + 1
    streams = [s for m in adapter._maps.values() for s in m.streams.values()]
    assert streams and all(s.started and s.knots.device.type == "meta" for s in streams)
    # every batch committed: a robust state counts its pending images as seen, a stream's group holds them
    shared = [getattr(s, "shared", s) for s in streams]  # a mixed layer's shared state is robust's
    assert all((s.seen if isinstance(s, RobustLayerStream) else s.seen + s.group.images) == sum(SIZES)
               for s in shared)
    if case.startswith(("robust", "mixed")):
        assert steps.calls > 0, "the own-batch step decided on the device ran"
    if case.startswith("mixed"):
        assert adapter._batch.router.seeded, "the centres were seeded: the clusters ran on the device"


def run_stream(options: dict[str, object], device_path: bool, monkeypatch: pytest.MonkeyPatch,
               batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, object], int]:
    """Outputs and final state of a torch-kernel stream over ``batches``, on the device path where asked."""
    with monkeypatch.context() as patch:
        if device_path:
            for module in (base, torch_kernels, stream_maps, mixed, batch_module):
                patch.setattr(module, "host_reads_are_cheap", lambda device: False)
        steps = CountedSteps(patch)
        model, stats = calibrated()
        adapter = aqr.AQR(model, stats, native=False, compile=False, **options)
        outs = [adapter(x) for x in batches]
        outs.append(adapter.forward_held(batches[0][:3]))
        return outs, adapter.state_dict()["_extra_state"], steps.calls


def same_values(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("case", list(CASES))
def test_the_device_path_gives_the_cpu_values_bit_for_bit(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    options = {"rebuild_every": 4, **CASES[case]}
    batches = [images(n, seed=100 + i) * (1 + 0.05 * i) for i, n in enumerate(SIZES)]
    if options.get("on_nonfinite") == "skip":
        batches[5] = batches[5].clone()
        batches[5][0, 0, 0, 0] = float("nan")  # skipped: its outputs as the CPU gives them, the state unchanged
    host_outs, host_state, host_steps = run_stream(options, False, monkeypatch, batches)
    device_outs, device_state, device_steps = run_stream(options, True, monkeypatch, batches)
    assert host_steps == 0
    if case.startswith(("robust", "mixed")):
        assert device_steps > 0
    for i, (a, b) in enumerate(zip(host_outs, device_outs)):
        assert same_values(a, b), f"batch {i}"
    assert same_values(host_state, device_state)


def test_host_outcome_reads_the_flag_and_the_classes_in_one_copy() -> None:
    labels = torch.tensor([3, 1, 4])
    assert host_outcome(torch.tensor(True)) == (True, None, ())
    assert host_outcome(torch.tensor(False), labels) == (False, None, ())
    assert host_outcome(False, labels) == (False, None, ())
    finite, host, extra = host_outcome(torch.tensor(True), labels)
    assert finite and host.tolist() == [3, 1, 4] and host.device.type == "cpu" and extra == ()


def test_one_copy_gives_back_every_tensor_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # off the CPU the tensors travel as one buffer of bytes: made to take that path here by saying that reads
    # on the CPU are not cheap; bool, int64, float64 and float32 side by side (misaligned offsets included)
    tensors = [torch.tensor([True]), torch.tensor([[3, -1], [7, 2]]), torch.randn(3, 5, dtype=torch.float64),
               torch.tensor([1.5], dtype=torch.float32), torch.arange(6.0)[::2]]
    copies: list[torch.Tensor] = []
    real_cat = torch.cat

    def counted_cat(parts: list[torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
        joined = real_cat(parts, *args, **kwargs)
        copies.append(joined)
        return joined

    monkeypatch.setattr(batch_module, "host_reads_are_cheap", lambda device: False)
    monkeypatch.setattr(batch_module.torch, "cat", counted_cat)
    out = batch_module.one_copy(tensors)
    monkeypatch.undo()
    assert len(copies) == 1 and copies[0].dtype == torch.uint8
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.data_ptr() != a.data_ptr()  # a copy, not the tensor itself


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sync debug mode of a GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_forward_on_a_gpu_synchronizes_once(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    model, stats = calibrated()
    cuda = copy.deepcopy(model).cuda()
    adapter = aqr.AQR(cuda, stats, rebuild_every=4, **CASES[case])
    reads = []

    def outcome(flag: object, labels: torch.Tensor | None = None, extra: tuple[torch.Tensor, ...] = ()) -> HostOutcome:
        reads.append(flag)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return host_outcome(flag, labels, extra)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(model_module, "host_outcome", outcome)
    batches = [images(n, seed=100 + i).cuda() for i, n in enumerate(SIZES)]
    adapter(batches[0])  # the first batch builds the per-batch backend (its subsets) once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in batches[1:]:
            adapter(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(reads) == len(SIZES)


def paramless_model() -> torch.nn.Module:
    """A model without parameters or buffers: ``AQR.to`` may move it to any device (it converts no tensor of
    the user's), so its stream's move can be seen on CPU (to ``meta``)."""
    return torch.nn.Sequential(torch.nn.GroupNorm(1, 3, affine=False), torch.nn.ReLU(),
                               torch.nn.GroupNorm(3, 3, affine=False), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten()).eval()


HOST_PARTS = ("seen", "started", "window.filled", "window.head", "group.images")


@pytest.mark.parametrize("target", ["stream", "robust", "mixed"])
def test_to_moves_a_streams_running_state_to_the_new_device(target: str) -> None:
    model = paramless_model()
    stats = aqr.calibrate(model, [images(32, seed=s) for s in range(2)], num_quantiles=21, compile=False,
                          descriptors=True)
    adapter = aqr.AQR(model, stats, target=target, rebuild_every=4, compile=False)
    prefix = "shared." if target == "mixed" else ""  # a mixed layer's own running state is its shared one
    for i, n in enumerate([4, 2, 16, 3]):
        adapter(images(n, seed=10 + i))
    cpu = torch.device("cpu")
    before = {name: m.streams[cpu].export_state() for name, m in adapter._maps.items()}
    assert adapter.to("cpu") is adapter and all(set(m.streams) == {cpu} for m in adapter._maps.values())
    assert all(same_values(before[name], m.streams[cpu].export_state()) for name, m in adapter._maps.items())
    adapter.to("meta")  # every state tensor moves; the counters come along
    meta = torch.device("meta")
    for name, layer_map in adapter._maps.items():
        assert set(layer_map.streams) == {meta}
        moved = layer_map.streams[meta]
        assert isinstance(moved.kernels, torch_kernels.TorchStreamKernels)
        values = moved.export_state()
        assert values.keys() == before[name].keys()
        for part, value in values.items():
            if part.endswith("group_recent") or part == "generations":  # host bookkeeping stays on the host
                assert value.device == cpu and torch.equal(value, before[name][part])
            elif isinstance(value, torch.Tensor):
                assert value.device == meta and value.shape == before[name][part].shape, part
            else:  # the counters (HOST_PARTS and robust's lists) come along
                assert value == before[name][part], part
        assert all(prefix + part in values for part in HOST_PARTS)
        assert moved.started and getattr(moved, "shared", moved).seen > 0


def test_a_conversion_that_moves_nothing_keeps_the_state_objects() -> None:
    model = paramless_model()
    stats = aqr.calibrate(model, [images(32, seed=s) for s in range(2)], num_quantiles=21, compile=False)
    adapter = aqr.AQR(model, stats, target="stream", compile=False)
    adapter(images(8, seed=1))
    streams = {name: dict(m.streams) for name, m in adapter._maps.items()}
    adapter.float().to(torch.device("cpu"))
    assert all(m.streams == streams[name] for name, m in adapter._maps.items())
    with pytest.raises(ValueError, match="never converts the user's model"):
        aqr.AQR(batch_reference.BUILDERS["bn"]().eval(), calibrated()[1], target="stream").double()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("target", ["stream", "robust", "mixed"])
def test_a_stream_moved_to_the_gpu_continues_as_on_the_cpu(target: str) -> None:
    model, stats = calibrated()
    batches = [images(n, seed=100 + i) for i, n in enumerate(SIZES)]
    reference = aqr.AQR(copy.deepcopy(model), stats, target=target, rebuild_every=4, native=False, compile=False)
    moved_model = copy.deepcopy(model)
    moved = aqr.AQR(moved_model, stats, target=target, rebuild_every=4, native=False, compile=False)
    for x in batches[:5]:
        torch.testing.assert_close(moved(x), reference(x), rtol=0, atol=0)
    moved_model.cuda()
    moved.cuda()
    assert all(set(m.streams) == {torch.device("cuda", torch.cuda.current_device())} for m in moved._maps.values())
    for x in batches[5:]:
        out, expected = moved(x.cuda()).cpu(), reference(x)
        if target == "mixed":  # an image near two centres may join the other on the GPU's rounding: its map moves
            agree = (out.argmax(1) == expected.argmax(1)).float().mean().item()
            assert agree >= 0.9 and (out - expected).abs().median().item() < 1e-3
        else:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
