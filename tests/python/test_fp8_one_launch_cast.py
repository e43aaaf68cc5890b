"""The CUDA FP8 cast of a small tensor in one allocation and one cooperative launch (amax, scale
and cast; delayed scaling's history update too) writes the bytes the plain launches write, at
every shape class around its limits, and stays capturable in a CUDA graph."""

import fusible
import pytest
import torch
from conftest import cuda_only

# (rows, cols): one tile; several; partial tiles; 4-wide vectors for 16-bit data too (cols % 8
# != 0); more tiles than SMs (each block then casts several); the one-launch limit (2^22
# elements) exactly; just past it (the plain launches either way).
SHAPES = [(16, 64), (16, 1024), (136, 72), (132, 68), (262144, 16), (4096, 1024), (4100, 1024)]
SHAPE_IDS = [f"{r}x{c}" for r, c in SHAPES]


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
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
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
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
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
def test_outputs_keep_storages_of_their_own():
    fusible._C._set_fp8_cast_one_launch(True)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    data, data_t, scale_inv = torch.ops.fusible.fp8_cast(x, "e4m3", 0.0, True)
    assert data.is_contiguous() and data_t.is_contiguous() and scale_inv.is_contiguous()
    assert data.shape == (32, 64) and data_t.shape == (64, 32) and scale_inv.shape == (1,)
    assert scale_inv.data_ptr() % 16 == 0  # cuBLASLt's scale pointers
    # Outputs sharing a storage would alias in the op's schema (opcheck rejects that).
    storages = {t.untyped_storage().data_ptr() for t in (data, data_t, scale_inv)}
    assert len(storages) == 3
    torch.library.opcheck(torch.ops.fusible.fp8_cast.default, (x, "e4m3", 0.0, True, "none"))


@cuda_only
@pytest.mark.parametrize("delayed", [False, True])
def test_the_one_launch_kernel_is_what_runs(delayed):
    """The equality tests above would pass if the cooperative launch always fell back: the
    profiler shows which kernels ran."""
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    history, scale = torch.zeros(4, device="cuda"), torch.ones(1, device="cuda")

    def cast():
        if delayed:
            return torch.ops.fusible.fp8_cast_delayed(x, "e4m3", history, scale, 0.0, "max", True)
        return torch.ops.fusible.fp8_cast(x, "e4m3", 0.0, True)

    names = {}
    for on in (True, False):
        fusible._C._set_fp8_cast_one_launch(on)
        cast()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            cast()
            torch.cuda.synchronize()
        names[on] = [e.name for e in prof.events()]
    one = [n for n in names[True] if "one_launch" in n]
    assert len(one) == 1, names[True]
    assert not any("amax_kernel" in n or "delayed_update" in n for n in names[True])
    assert not any("one_launch" in n for n in names[False])
    assert any("cast_transpose_kernel" in n for n in names[False])


@cuda_only
@pytest.mark.parametrize("fmt, margin", [("e5m2", 0.0), ("e4m3", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("values", ["random", "zeros", "inf", "nan"])
def test_formats_margins_and_special_values(fmt, margin, dtype, values):
    torch.manual_seed(4)
    x = (torch.randn(136, 200, device="cuda") * 7).to(dtype)
    if values == "zeros":
        x.zero_()
    elif values != "random":
        x[77, 13] = float(values)
    for transpose in (True, False):
        one, plain = _casts(lambda: torch.ops.fusible.fp8_cast(x, fmt, margin, transpose))
        _assert_same(one, plain)


@cuda_only
@pytest.mark.parametrize("act", [None, "gelu"])
def test_delayed_long_history_without_transpose(act):
    # A history longer than the block (the shift runs in chunks), no transpose, with and without
    # an activation on load.
    torch.manual_seed(5)
    start = torch.rand(300, device="cuda") * 10
    states = {on: (start.clone(), torch.full((1,), 2.0, device="cuda")) for on in (True, False)}
    for step in range(3):
        x = torch.randn(48, 512, device="cuda", dtype=torch.bfloat16) * (step + 1)
        outs = {}
        for on, (history, scale) in states.items():
            fusible._C._set_fp8_cast_one_launch(on)
            args = (x, "e4m3", history, scale, 0.0, "max", False)
            outs[on] = torch.ops.fusible.fp8_cast_delayed(*args, *([act] if act else []))
        _assert_same(outs[True], outs[False])
        assert torch.equal(states[True][0], states[False][0])
        assert torch.equal(states[True][1], states[False][1])


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
