"""aqr.export: the three forms (per-batch, frozen, streaming with explicit state) on BatchNorm, GroupNorm and
LayerNorm models, run in ONNX Runtime and from torch.export against eager AQR in the same mode, and the
errors for what cannot be exported."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import aqr
from aqr.deploy import ExportError, export, stream_state
from aqr.core.layers import LayerError

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_ORT = importlib.util.find_spec("onnx") is not None and importlib.util.find_spec("onnxruntime") is not None
needs_ort = pytest.mark.skipif(not HAS_ORT, reason="needs onnx and onnxruntime (pip install 'aqr[export]')")
slow = pytest.mark.slow  # each traces and exports graphs: 15 to 90 s

# the logits' bound: the graph computes what eager AQR computes, in the same float32 operations but fused
# and ordered by another runtime
LOGIT_BOUND = 1e-3


class ConvNet(nn.Module):
    """Two convolutions, each with a norm layer (``norm``: BatchNorm or GroupNorm), and a linear head."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        make = (lambda c: nn.BatchNorm2d(c)) if norm == "bn" else (lambda c: nn.GroupNorm(2, c))
        self.conv1, self.norm1 = nn.Conv2d(3, 6, 3, padding=1), make(6)
        self.conv2, self.norm2 = nn.Conv2d(6, 8, 3, padding=1, stride=2), make(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm1(self.conv1(x)))
        x = torch.relu(self.norm2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class TokenNet(nn.Module):
    """Patches to tokens, a LayerNorm (channels last), an MLP and a LayerNorm, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 12, 4, stride=4)
        self.norm1, self.mlp, self.norm2 = nn.LayerNorm(12), nn.Linear(12, 12), nn.LayerNorm(12)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)  # (N, L, C)
        t = t + torch.relu(self.mlp(self.norm1(t)))
        return self.head(self.norm2(t).mean(dim=1))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = TokenNet() if kind == "ln" else ConvNet(kind)
    if kind == "bn":  # running statistics of a source domain
        model.train()
        with torch.no_grad():
            for _ in range(5):
                model(torch.rand(16, 3, 16, 16))
    return model.eval()


def _images(n: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 16, 16, generator=g) * (1 + shift) + shift).float()


@pytest.fixture(scope="module", params=["bn", "gn", "ln"])
def setup(request):
    model = _model(request.param)
    stats = aqr.calibrate(model, [_images(16, s) for s in range(4)], tail_repeats=20, tail_batch=8)
    return request.param, model, stats


def _ort(path, feeds):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session, names


@needs_ort
@slow
def test_batch_form_in_onnx_runtime_and_torch_export_matches_eager_exact(setup, tmp_path):
    kind, model, stats = setup
    adapted = aqr.AQR(model, stats, mode="exact")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = export(adapted, _images(4, 10), tmp_path / "batch.onnx")
    program = export(adapted, _images(4, 10), tmp_path / "batch.pt2", format="torch")
    session, _ = _ort(path, None)
    loaded = torch.export.load(str(program)).module()
    for n in (1, 3, 16):  # dynamic batch size, batch 1 included
        x = _images(n, 20 + n, shift=0.3)
        want = adapted(x)
        got = torch.from_numpy(session.run(None, {"input": x.numpy()})[0])
        assert (got - want).abs().max().item() < LOGIT_BOUND
        assert (loaded(x) - want).abs().max().item() < LOGIT_BOUND
    # the map changes the output (the test would pass for an unmapped graph otherwise)
    x = _images(16, 99, shift=0.3)
    assert (adapted(x) - model(x)).abs().max().item() > 10 * LOGIT_BOUND
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model unchanged


@needs_ort
@slow
def test_frozen_form_maps_as_forward_held(setup, tmp_path):
    kind, model, stats = setup
    adapted = aqr.AQR(model, stats, target="stream", rebuild_every=2, horizon=8)
    for s in range(6):
        adapted(_images(1, 40 + s, shift=0.3))
    path = export(adapted, _images(1, 10), tmp_path / "frozen.onnx", form="frozen")
    loaded = torch.export.load(str(export(adapted, _images(2, 10), tmp_path / "frozen.pt2", format="torch",
                                          form="frozen"))).module()
    session, _ = _ort(path, None)
    for n in (1, 5):
        x = _images(n, 60 + n, shift=0.3)
        want = adapted.forward_held(x)
        assert (torch.from_numpy(session.run(None, {"input": x.numpy()})[0]) - want).abs().max().item() < LOGIT_BOUND
        assert (loaded(x) - want).abs().max().item() < LOGIT_BOUND
    assert (adapted.forward_held(x) - model(x)).abs().max().item() > 10 * LOGIT_BOUND


@needs_ort
@slow
@pytest.mark.parametrize("native", [False, True])
def test_stream_graph_steps_with_eager_stream(setup, tmp_path, native):
    """The explicit-state graph, stepped 60 batch-1 batches (and a few larger ones) in ONNX Runtime with the
    state it returns, against eager target='stream': its torch kernels (the reference) to rounding; the C
    kernels (the default) on the same predictions."""
    kind, model, stats = setup
    options = dict(target="stream", rebuild_every=4, horizon=16, tail_window=8, native=native)
    adapted = aqr.AQR(model, stats, **options)
    path = export(adapted, _images(2, 10), tmp_path / "stream.onnx")
    session, names = _ort(path, None)
    state = {k: v.numpy() for k, v in stream_state(adapted).items()}
    assert list(state) == names[1:]
    worst, same = 0.0, 0
    steps = 64
    for step in range(steps):
        n = 5 if step in (20, 41) else 1  # a batch of rebuild_every or more images merges first
        x = _images(n, 100 + step, shift=0.3 + 0.01 * step)
        want = adapted(x)
        out = session.run(None, {"input": x.numpy(), **state})
        state = dict(zip(names[1:], out[1:]))
        got = torch.from_numpy(out[0])
        worst = max(worst, (got - want).abs().max().item())
        same += int(torch.equal(got.argmax(1), want.argmax(1)))
    if not native:
        assert worst < LOGIT_BOUND
    assert same >= steps - (0 if not native else 2)
    # the state counted every image: those merged into the knots and those pending
    counters = state[f"state.{adapted.layer_names[0]}.counters"]
    assert int(counters[1]) + int(counters[2]) == steps + 8


@needs_ort
@slow
def test_stream_state_continues_an_eager_stream(setup, tmp_path):
    """stream_state of a wrapper that already ran: the graph continues where eager stopped."""
    kind, model, stats = setup
    adapted = aqr.AQR(model, stats, target="stream", rebuild_every=2, horizon=8, native=False)
    for s in range(5):
        adapted(_images(1, 200 + s, shift=0.2))
    path = export(adapted, _images(2, 10), tmp_path / "stream.onnx")
    session, names = _ort(path, None)
    state = {k: v.numpy() for k, v in stream_state(adapted).items()}
    for s in range(6):
        x = _images(1, 300 + s, shift=0.2)
        want = adapted(x)
        out = session.run(None, {"input": x.numpy(), **state})
        state = dict(zip(names[1:], out[1:]))
        assert (torch.from_numpy(out[0]) - want).abs().max().item() < LOGIT_BOUND


# ------------------------------------------------------------------------------------------- errors


def test_gradient_method_is_refused_in_one_line(tmp_path):
    model = _model("bn")
    tent = aqr.methods.create("tent", model)
    with pytest.raises(ExportError) as err:
        export(tent, _images(2, 0), tmp_path / "x.pt2", format="torch")
    text = str(err.value)
    assert "'tent'" in text and "gradient" in text and "\n" not in text


def test_other_objects_and_options_are_refused(tmp_path):
    model = _model("gn")
    stats = aqr.calibrate(model, [_images(16, 0)], tail_repeats=20, tail_batch=8)
    with pytest.raises(ExportError, match="takes an aqr.AQR"):
        export(model, _images(2, 0), tmp_path / "x.pt2", format="torch")
    batch = aqr.AQR(model, stats)
    with pytest.raises(ExportError, match="format must be one of"):
        export(batch, _images(2, 0), tmp_path / "x", format="tflite")
    with pytest.raises(ExportError, match="target='batch' does not keep"):
        export(batch, _images(2, 0), tmp_path / "x.pt2", format="torch", form="stream")
    with pytest.raises(ExportError, match="example_input must be a float batch"):
        export(batch, torch.zeros(2, 3, 16, 16, dtype=torch.uint8), tmp_path / "x.pt2", format="torch")
    stream = aqr.AQR(model, stats, target="stream")
    with pytest.raises(ExportError, match="has seen no batch"):
        export(stream, _images(2, 0), tmp_path / "x.pt2", format="torch", form="frozen")
    robust = aqr.AQR(model, stats, target="robust")
    with pytest.raises(ExportError, match="not target='robust'"):
        export(robust, _images(2, 0), tmp_path / "x.pt2", format="torch", form="stream")
    described = aqr.calibrate(model, [_images(16, 0)], tail_repeats=20, tail_batch=8, descriptors=True)
    mixed = aqr.AQR(model, described, target="mixed")
    mixed(_images(8, 1))
    with pytest.raises(ExportError, match="target='mixed' has no exported form"):
        export(mixed, _images(2, 0), tmp_path / "x.pt2", format="torch")


class Hidden(nn.Module):
    """A model that calls its norm layer through a plain list, outside its module tree."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.direct = [self.norm]
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.direct[0](self.conv(x)).mean(dim=(2, 3)))


def test_a_norm_layer_the_map_cannot_reach_is_refused(tmp_path):
    model = Hidden().eval()
    stats = aqr.calibrate(model, [_images(8, 0)], tail_repeats=20, tail_batch=8)
    with pytest.warns(UserWarning, match="outside the model's module tree"):
        adapted = aqr.AQR(model, stats, mode="exact")
    with pytest.raises(LayerError, match="'norm' is not called through the model's module tree") as err:
        export(adapted, _images(2, 0), tmp_path / "x.pt2", format="torch")
    assert "\n" not in str(err.value)


def test_torch_jit_trace_of_the_wrapper_is_still_refused():
    model = _model("gn")
    stats = aqr.calibrate(model, [_images(16, 0)], tail_repeats=20, tail_batch=8)
    with pytest.raises(RuntimeError, match="cannot be recorded by torch.jit.trace"):
        torch.jit.trace(aqr.AQR(model, stats), _images(2, 0))


def test_onnx_missing_names_the_extra(monkeypatch, tmp_path):
    import aqr.deploy.writer as module
    real = module.importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name, *rest: None if name == "onnx" else real(name, *rest))
    model = _model("gn")
    stats = aqr.calibrate(model, [_images(16, 0)], tail_repeats=20, tail_batch=8)
    with pytest.raises(ImportError, match=r"pip install 'aqr\[export\]'"):
        export(aqr.AQR(model, stats), _images(2, 0), tmp_path / "x.onnx")


# ------------------------------------------------------------------------------------------- the command


@slow
def test_cli_export_writes_a_graph_that_runs_without_aqr(tmp_path):
    from aqr.cli import main

    model = aqr.models.load("resnet20_gn")
    layers = ["model.layer1.0.bn1", "model.layer3.2.bn2"]
    stats = aqr.calibrate(model, [torch.rand(16, 3, 32, 32) for _ in range(2)], layers=layers, tail_repeats=20,
                          tail_batch=8)
    stats_file = stats.save(tmp_path / "gn.aqr.safetensors")
    out = tmp_path / "gn.pt2"
    assert main(["export", "resnet20_gn", "--stats", str(stats_file), "--out", str(out), "--format", "torch"]) == 0
    x = torch.rand(3, 3, 32, 32)
    want = aqr.AQR(model, stats, mode="exact")(x)
    assert (torch.export.load(str(out)).module()(x) - want).abs().max().item() < LOGIT_BOUND


def test_cli_export_refuses_a_bad_shape_in_one_line(tmp_path, capsys):
    from aqr.cli import main

    code = main(["export", "resnet20_gn", "--stats", str(tmp_path / "none.safetensors"), "--out",
                 str(tmp_path / "x.onnx"), "--input-shape", "3,x,32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--input-shape" in err and "\n" not in err
