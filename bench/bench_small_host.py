"""Host time per call of the small MLP (T=16, H=1024, F=4096, bf16), where the GPU work is tiny
and the per-call overhead is what counts; CUDA only.

Measured as the eager baselines are: wall time per iteration of a back-to-back loop of 200 calls,
synchronized at the end, median of 5 repeats (fwd+bwd clears .grad inside the loop).
Rows (merged into BENCH_OUT/latest.json, replacing rows of the same workload):
  mlp_small_bf16_fwd, mlp_small_bf16_fwd_bwd   fusible / eager / torch.compile
  mlp_small_bf16_fwd_graphed    CUDA-graph replay of the forward: fusible / eager (the floor) /
                                torch.compile mode="reduce-overhead" of eager
  mlp_small_bf16_fwd_compiled   torch.compile(fullgraph=True) of fusible's Sequential / eager
                                uncompiled / torch.compile of eager
Then a stage table: the fusible forward with one layer of the call path peeled off at a time.

usage: BENCH_OUT=dir python bench/bench_small_host.py
"""

import json
import os
import statistics
import time

import torch
from bench_mlp import SHAPES, make_models, merge_latest
from fusible.ops._call import call_parameters

F = torch.ops.fusible


def wall_us(fn, setup=None, iters=200, repeats=5, stat=statistics.median):
    for _ in range(20):
        if setup:
            setup()
        fn()
    res = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            if setup:
                setup()
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) / iters * 1e6)
    return stat(res)


def graph_replay_us(fn):
    """Captures fn() (no grad) into a CUDA graph, then times back-to-back replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        fn()
    return wall_us(graph.replay)


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()

    return run


def main():
    s = SHAPES["small"]
    torch.manual_seed(0)
    models, params, seq = make_models(s["T"], s["H"], s["F"], "cuda")
    x = torch.randn(s["T"], s["H"], device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)

    def zero_grads():
        for p in params:
            p.grad = None
        xg.grad = None

    # Stages first, before torch.compile starts its worker threads.
    # Stages: each line drops one layer of the call path; differences are that layer's cost.
    cpp = seq._engine()
    call_params = call_parameters(seq._param_sources)
    _, ln, fc1, _, fc2, _ = list(seq)

    def kernels_only():  # the three fused ops the forward plan runs, called directly
        h = F.layernorm_fwd(x, ln.weight, ln.bias, 1e-5, False)[0]
        h = F.linear_bias_act(h, fc1.weight, fc1.bias, "gelu")
        return F.linear_add(h, fc2.weight, fc2.bias, x, 1.0)

    stages = [
        ("seq(x): nn.Module.__call__", no_grad(lambda: seq(x))),
        ("seq.forward(x): + checks, hooks, parameters", no_grad(lambda: seq.forward(x))),
        ("C++ engine call from Python", no_grad(lambda: cpp.run(x, [], [], call_params, None))),
        ("the plan's 3 fused ops from Python", no_grad(kernels_only)),
        ("forward with grad (saves for backward)", lambda: seq(xg)),
        ("forward+backward", lambda: seq(xg).backward(dy)),
        ("eager forward", no_grad(lambda: models["eager"](x))),
    ]
    # Each fused op alone, and the ATen ops eager runs, for the per-op host cost.
    h1 = F.layernorm_fwd(x, ln.weight, ln.bias, 1e-5, False)[0]
    h2 = F.linear_bias_act(h1, fc1.weight, fc1.bias, "gelu")
    tf = torch.nn.functional
    stages += [
        (
            "  fusible::layernorm_fwd",
            no_grad(lambda: F.layernorm_fwd(x, ln.weight, ln.bias, 1e-5, False)),
        ),
        (
            "  fusible::linear_bias_act",
            no_grad(lambda: F.linear_bias_act(h1, fc1.weight, fc1.bias, "gelu")),
        ),
        ("  fusible::linear_add", no_grad(lambda: F.linear_add(h2, fc2.weight, fc2.bias, x, 1.0))),
        (
            "  aten layer_norm",
            no_grad(lambda: tf.layer_norm(x, (s["H"],), ln.weight, ln.bias, 1e-5)),
        ),
        ("  aten linear", no_grad(lambda: tf.linear(h1, fc1.weight, fc1.bias))),
        ("  aten gelu", no_grad(lambda: tf.gelu(h2, approximate="tanh"))),
        ("  aten add", no_grad(lambda: h1 + h1)),
    ]
    # Min over repeats: the differences between lines are small, the noise of a busy host is not.
    stage_us = [(name, wall_us(fn, setup=zero_grads, stat=min)) for name, fn in stages]
    plan = seq.fusion_plan()  # of the last call: forward+backward's

    fused = torch.compile(seq, fullgraph=True)
    graphed_compile = torch.compile(models["eager"], mode="reduce-overhead")
    rows = {}
    rows["mlp_small_bf16_fwd"] = {k: wall_us(no_grad(lambda f=f: f(x))) for k, f in models.items()}
    rows["mlp_small_bf16_fwd_bwd"] = {
        k: wall_us(lambda f=f: f(xg).backward(dy), setup=zero_grads) for k, f in models.items()
    }
    rows["mlp_small_bf16_fwd_graphed"] = {
        "fusible": graph_replay_us(lambda: seq(x)),
        "eager": graph_replay_us(lambda: models["eager"](x)),
        "compile": wall_us(no_grad(lambda: graphed_compile(x))),
    }
    rows["mlp_small_bf16_fwd_compiled"] = {
        "fusible": wall_us(no_grad(lambda: fused(x))),
        "eager": rows["mlp_small_bf16_fwd"]["eager"],
        "compile": rows["mlp_small_bf16_fwd"]["compile"],
    }

    out_dir = os.environ.get("BENCH_OUT", "build/bench")
    os.makedirs(out_dir, exist_ok=True)
    new = [{"workload": w, "unit": "us", **v} for w, v in rows.items()]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    merge_latest(out_dir, new, meta | {"date": time.strftime("%Y-%m-%d")})
    with open(os.path.join(out_dir, "bench_small_host.json"), "w") as f:
        json.dump({"rows": new, "stages_us": stage_us, "plan": plan}, f, indent=1)

    print(f"small MLP bf16 on {torch.cuda.get_device_name()}: host us per call (median)")
    print(f"{'workload':30} {'fusible':>9} {'eager':>9} {'compile':>9} {'vs eager':>9}")
    for w, v in rows.items():
        print(
            f"{w:30} {v['fusible']:9.1f} {v['eager']:9.1f} {v['compile']:9.1f} "
            f"{v['eager'] / v['fusible']:8.2f}x"
        )
    print(f"stages of the fusible call (plan: {plan})")
    for name, us in stage_us:
        print(f"  {name:42} {us:8.1f} us")


if __name__ == "__main__":
    main()
