"""The CUDA FP8 cast of a small tensor in one allocation and one cooperative launch (amax, scale
and cast; delayed scaling's history update too) writes the bytes the plain launches write, at
every shape class around its limits, and stays capturable in a CUDA graph."""

import fusible
import pytest
import torch
from conftest import cuda_only

# (rows, cols): one tile; several; 4-wide vectors (cols % 8 != 0); more tiles than the device
# keeps resident (each block then casts several); the one-allocation limit (2^22 elements)
# exactly; just past it (the plain path's separate outputs).
SHAPES = [(16, 64), (16, 1024), (136, 72), (262144, 16), (4096, 1024), (4100, 1024)]


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@pytest.fixture(autouse=True)
def restore_the_switch():
    before = fusible._C._fp8_cast_one_launch()
    yield
    fusible._C._set_fp8_cast_one_launch(before)


def _casts(fn):
    """fn() with the one-launch cast on, then off; the outputs of each (cloned)."""
    out = {}
    for on in (True, False):
        fusible._C._set_fp8_cast_one_launch(on)
        out[on] = [t.clone() for t in fn()]
    return out[True], out[False]


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(_bits(g), _bits(w))


def test_the_switch_reads_back():
    for on in (True, False, True):
        fusible._C._set_fp8_cast_one_launch(on)
        assert fusible._C._fp8_cast_one_launch() == on


@cuda_only
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transpose", [True, False])
def test_current_scaling_bytes_equal_the_plain_launches(shape, dtype, transpose):
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    x.view(-1)[-1] = 40.0  # the amax in the last element: every block's partial counts
    one, plain = _casts(lambda: torch.ops.fusible.fp8_cast(x, "e4m3", 0.0, transpose))
    _assert_same(one, plain)
    assert one[2].item() == pytest.approx(40.0 / 448.0, rel=1e-6)
    if transpose:
        assert torch.equal(_bits(one[1]), _bits(one[0]).t())
    else:
        assert one[1].numel() == 0
    # And the CPU reference's bytes, up to a rare rounding tie of x * scale in fp32.
    data, _, scale_inv = torch.ops.fusible.fp8_cast(x.cpu(), "e4m3", 0.0, False)
    assert (_bits(one[0]).cpu() != _bits(data)).float().mean().item() <= 1e-3
    assert one[2].item() == pytest.approx(scale_inv.item(), rel=1e-6)


@cuda_only
@pytest.mark.parametrize("shape", [(16, 1024), (262144, 16), (4100, 1024)])
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_activation_on_load_equals_the_plain_launches(shape, act):
    torch.manual_seed(1)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2
    one, plain = _casts(lambda: torch.ops.fusible.fp8_cast(x, "e4m3", 0.0, True, act))
    _assert_same(one, plain)
    y = torch.ops.fusible.activation_fwd(x, act)  # act(x) cast on its own: the same bytes
    _assert_same(one, torch.ops.fusible.fp8_cast(y, "e4m3", 0.0, True))


@cuda_only
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_casts_and_updates_as_the_plain_launches(shape, algo):
    torch.manual_seed(2)
    start = torch.rand(5, device="cuda") * 10
    states = {on: (start.clone(), torch.full((1,), 3.0, device="cuda")) for on in (True, False)}
    for step in range(3):
        x = (torch.randn(shape, device="cuda") * (step + 1)).to(torch.bfloat16)
        if step == 1:
            x.zero_()  # an amax of 0 leaves history and scale as they are
        outs = {}
        for on, (history, scale) in states.items():
            fusible._C._set_fp8_cast_one_launch(on)
            outs[on] = torch.ops.fusible.fp8_cast_delayed(
                x, "e4m3", history, scale, 0.0, algo, True
            )
        _assert_same(outs[True], outs[False])
        assert torch.equal(states[True][0], states[False][0])
        assert torch.equal(states[True][1], states[False][1])
    history, scale = states[True]
    want_newest = x.float().abs().max()
    assert history[0].item() == pytest.approx(want_newest.item(), rel=1e-6)
    used = history.max() if algo == "max" else history[0]
    assert scale.item() == pytest.approx(448.0 / used.item(), rel=1e-6)


@cuda_only
def test_outputs_are_separate_tensors_of_one_allocation():
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    data, data_t, scale_inv = torch.ops.fusible.fp8_cast(x, "e4m3", 0.0, True)
    assert data.is_contiguous() and data_t.is_contiguous() and scale_inv.is_contiguous()
    assert data.shape == (32, 64) and data_t.shape == (64, 32) and scale_inv.shape == (1,)
    assert scale_inv.data_ptr() % 16 == 0  # cuBLASLt's scale pointers
    before = (data_t.clone(), scale_inv.clone())
    data.fill_(0)  # writes only its own bytes
    assert torch.equal(_bits(data_t), _bits(before[0])) and torch.equal(scale_inv, before[1])


@cuda_only
@pytest.mark.parametrize("delayed", [False, True])
def test_graph_capture_replays_the_eager_cast(delayed):
    fusible._C._set_fp8_cast_one_launch(True)  # eager: one launch; captured: the plain launches
    torch.manual_seed(3)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    history = torch.zeros(4, device="cuda")
    scale = torch.ones(1, device="cuda")

    def cast():
        if delayed:
            return torch.ops.fusible.fp8_cast_delayed(x, "e4m3", history, scale, 0.0, "max", True)
        return torch.ops.fusible.fp8_cast(x, "e4m3", 0.0, True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cast()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cast()
    for step in range(2):
        x.copy_(torch.randn_like(x) * (step + 2))
        state = (history.clone(), scale.clone())
        graph.replay()
        got = [t.clone() for t in captured] + [history.clone(), scale.clone()]
        history.copy_(state[0])
        scale.copy_(state[1])
        want = list(cast()) + [history.clone(), scale.clone()]
        _assert_same(got, want)
