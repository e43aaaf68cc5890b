"""Long run: many training steps of a model that exercises the fuser's caches (two batch shapes, an
eval call without grad every so often, channels between fusers, a Python step between groups)
leave the memory held and the number of live Python objects where they were after warm-up. CUDA:
10^4 steps, torch.cuda.memory_allocated() exactly as after warm-up; CPU (CI): fewer steps, the
live objects only (the process's resident memory is the allocator's business)."""

import gc

import pytest
import torch
from conftest import DEVICES
from fusible import ops

STEPS = {"cpu": 300, "cuda": 10_000}
WARMUP = 100


def _model(device):
    torch.manual_seed(0)
    residual_out, residual_in = ops.MakeExtraOutput(), ops.AddExtraInput()
    residual_out.set_extra_output_channel(0, "residual", output_to_caller=False)
    residual_in.set_extra_input_channel(0, "residual")
    return ops.Sequential(
        residual_out,
        ops.LayerNorm(64, device=device),
        ops.Linear(64, 128, device=device),
        ops.GELU(),
        ops.Dropout(0.1),
        ops.Linear(128, 64, device=device),
        torch.nn.Tanh(),  # a plain module: the Sequential splits into two fusers around it
        residual_in,
        ops.RMSNorm(64, device=device),
    )


def _step(model, optimizer, step, device):
    tokens = 96 if step % 3 else 64  # two shapes, so the plan cache holds more than one entry
    x = torch.randn(tokens, 64, device=device)
    if step % 25 == 0:
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
    loss = model(x).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _live_objects():
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("device", DEVICES)
def test_memory_and_live_objects_stay_flat_over_a_long_run(device):
    model = _model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cuda = device == "cuda"
    for step in range(WARMUP):
        _step(model, optimizer, step, device)
    if cuda:
        torch.cuda.synchronize()
    objects_before = _live_objects()
    allocated_before = torch.cuda.memory_allocated() if cuda else 0
    first_loss = None
    for step in range(WARMUP, WARMUP + STEPS[device]):
        loss = _step(model, optimizer, step, device)
        first_loss = loss if first_loss is None else first_loss
    if cuda:
        torch.cuda.synchronize()
    del loss, first_loss
    objects_after = _live_objects()
    allocated_after = torch.cuda.memory_allocated() if cuda else 0
    # The figures (shown with pytest -s; the GPU check records them).
    memory = f"torch.cuda.memory_allocated {allocated_before} -> {allocated_after} bytes; "
    print(
        f"\nlong run on {device}: {STEPS[device]} steps after {WARMUP} warm-up steps; "
        f"{memory if cuda else ''}live Python objects {objects_before} -> {objects_after}"
    )
    # A handful of objects may come and go (interpreter caches); a leak per step would show as
    # hundreds or thousands.
    assert objects_after - objects_before < 50, (objects_before, objects_after)
    if cuda:
        # The losses held above are freed: what is left is parameters, grads and optimizer state.
        assert allocated_after <= allocated_before, (allocated_before, allocated_after)
