// Host time per call of the small MLP block from C++ (the overhead the C++ path adds when the GPU
// work is tiny): y = x + fc2(gelu(fc1(layernorm(x)))), T=16, H=1024, F=4096, bf16 on CUDA (fp32 on
// CPU), the residual through a channel. Prints microseconds per forward (no grad) and per
// forward+backward, each the mean of a timed loop after a warm-up, synchronized at the end; then
// the same for each op the forward plan runs, called alone, and for the ATen ops eager runs.
// Usage: time_small_mlp [iterations]
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <fusible/fusible.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#ifdef FUSIBLE_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

void synchronize(const c10::Device& device) {
#ifdef FUSIBLE_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

double us_per_call(const std::function<void()>& call, int iterations, const c10::Device& device) {
  for (int i = 0; i < 10; ++i) call();  // warm-up: plans, cuBLASLt heuristics, the allocator
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) call();
  synchronize(device);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return secs / iterations * 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fusible;
  // One optional argument: timed calls per measurement (default 200).
  if (argc > 2 || (argc == 2 && std::atoi(argv[1]) <= 0)) {
    const bool help =
        argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0);
    std::fprintf(help ? stdout : stderr,
                 "usage: time_small_mlp [N]\n  N: timed calls per measurement, a positive integer "
                 "(default 200)\n");
    return help ? 0 : 2;
  }
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 200;
  const int64_t tokens = 16, hidden = 1024, ffn = 4096;
  const auto device = at::hasCUDA() ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  at::manual_seed(0);

  auto make = std::make_shared<ops::MakeExtraOutput>();
  make->set_extra_output_channel(0, "residual", /*output_to_caller=*/false);
  auto add = std::make_shared<ops::AddExtraInput>();
  add->set_extra_input_channel(0, "residual");
  auto ln = std::make_shared<ops::LayerNorm>(std::vector<int64_t>{hidden}, 1e-5, device, dtype);
  auto fc1 = std::make_shared<ops::Linear>(hidden, ffn, true, device, dtype);
  auto fc2 = std::make_shared<ops::Linear>(ffn, hidden, true, device, dtype);
  fuser::Sequential block({make, ln, fc1, std::make_shared<ops::GELU>(), fc2, add});
  const auto x = at::randn({tokens, hidden}, at::device(device).dtype(dtype));
  const auto xg = x.clone().requires_grad_();
  const auto dy = at::randn_like(x);

  const double forward = us_per_call(
      [&] {
        const at::NoGradGuard no_grad;
        block.forward(x);
      },
      iterations, device);
  const double forward_with_grad = us_per_call([&] { block.forward(xg); }, iterations, device);
  const double forward_backward =
      us_per_call([&] { block.forward(xg)[0].backward(dy); }, iterations, device);
  std::printf(
      "small MLP (T=%lld, H=%lld, F=%lld) on %s, host time per call: forward %.1f us, "
      "forward+backward %.1f us\n",
      static_cast<long long>(tokens), static_cast<long long>(hidden), static_cast<long long>(ffn),
      device.str().c_str(), forward, forward_backward);
  std::printf("  forward with grad (the autograd node, saved tensors)  %7.1f us\n",
              forward_with_grad);

  // Stages below the fuser: the forward and backward plans' ops called directly (through the
  // dispatcher, below autograd as the fuser calls them), the ATen ops eager runs, an allocation.
  const auto w1 = fc1->weight(), b1 = fc1->bias_op()->bias();
  const auto w2 = fc2->weight(), b2 = fc2->bias_op()->bias();
  const auto lw = ln->weight(), lb = ln->bias();
  const at::NoGradGuard no_grad;
  const at::AutoDispatchBelowAutograd below_autograd;
  const auto h1 = std::get<0>(kernels::layernorm_fwd(x, lw, lb, 1e-5, false));
  const auto [pre, lmean, lrstd] = kernels::layernorm_fwd(x, lw, lb, 1e-5, false);
  const auto [h2, a1] = kernels::linear_bias_act_fwd(h1, w1, b1, "gelu");
  const std::pair<const char*, std::function<void()>> stages[] = {
      {"fusible layernorm_fwd", [&] { kernels::layernorm_fwd(x, lw, lb, 1e-5, false); }},
      {"fusible linear_bias_act (gelu)", [&] { kernels::linear_bias_act(h1, w1, b1, "gelu"); }},
      {"fusible linear_add", [&] { kernels::linear_add(h2, w2, b2, x, 1.0); }},
      // The backward plan's ops, in the order it runs them.
      {"fusible bias_bwd (fc2)", [&] { kernels::bias_bwd(dy); }},
      {"fusible linear_wgrad (fc2)", [&] { kernels::linear_wgrad(dy, h2, 1.0); }},
      {"fusible linear_dgrad_act_bias (fc2)",
       [&] { kernels::linear_dgrad_act_bias(dy, w2, a1, "gelu"); }},
      {"fusible linear_wgrad (fc1)", [&] { kernels::linear_wgrad(h2, h1, 1.0); }},
      {"fusible linear_dgrad (fc1)", [&] { kernels::linear_dgrad(h2, w1, 1.0); }},
      {"fusible layernorm_bwd_add",
       [&] { kernels::layernorm_bwd_add(dy, x, lmean, lrstd, lw, false, dy); }},
      {"aten layer_norm", [&] { at::layer_norm(x, {hidden}, lw, lb, 1e-5); }},
      {"aten linear (bias)", [&] { at::linear(h1, w1, b1); }},
      {"aten gelu (tanh)", [&] { at::gelu(h2, "tanh"); }},
      {"aten add", [&] { at::add(h1, h1); }},
      {"at::empty [T, H]",
       [&] {
         at::empty({tokens, hidden}, x.options());
       }},
  };
  for (const auto& [name, call] : stages) {
    std::printf("  %-36s %7.1f us\n", name, us_per_call(call, iterations, device));
  }
  return forward > 0 && forward_backward > 0 ? 0 : 1;
}
