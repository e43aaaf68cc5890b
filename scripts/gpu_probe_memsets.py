"""Which CUDA events one large GEMM through our cuBLASLt layer launches (are memsets cuBLASLt's?),
and the same for torch's own matmul, in launch order."""

import fusible  # noqa: F401  (registers torch.ops.fusible)
import torch

F = torch.ops.fusible
x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(16384, device="cuda", dtype=torch.bfloat16)
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
for name, fn in [
    ("fusible linear_fwd", lambda: F.linear_fwd(x, w, b)),
    ("fusible linear_bias_act gelu", lambda: F.linear_bias_act(x, w, b, "gelu")),
    ("fusible linear_wgrad", lambda: F.linear_wgrad(x, x, 1.0)),
    ("torch F.linear", lambda: torch.nn.functional.linear(x, w, b)),
]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{name}: {ev}")
