// Trains a residual MLP block built from fusible ops with torch::optim::AdamW on synthetic data:
//   y = x + fc2(gelu(fc1(layernorm(x))))
// MakeExtraOutput hands the residual out of the first fuser; AddExtraInput adds it back.
// Runs on CUDA when present, else CPU. Usage: train_mlp [steps]
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  using namespace fusible;
  // One optional argument: optimizer steps (default 200).
  if (argc > 2 || (argc == 2 && std::atoi(argv[1]) <= 0)) {
    const bool help =
        argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0);
    std::fprintf(help ? stdout : stderr,
                 "usage: train_mlp [N]\n  N: optimizer steps, a positive integer (default 200)\n");
    return help ? 0 : 2;
  }
  const int steps = argc > 1 ? std::atoi(argv[1]) : 200;
  const int64_t tokens = 256, hidden = 64, ffn = 256;
  const auto device = at::hasCUDA() ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  at::manual_seed(0);

  fuser::Sequential block({
      std::make_shared<ops::MakeExtraOutput>(),
      std::make_shared<ops::LayerNorm>(std::vector<int64_t>{hidden}, 1e-5, device),
      std::make_shared<ops::Linear>(hidden, ffn, true, device),
      std::make_shared<ops::GELU>(),
      std::make_shared<ops::Linear>(ffn, hidden, true, device),
  });
  fuser::Sequential residual_add({std::make_shared<ops::AddExtraInput>()});
  torch::optim::AdamW optimizer(block.parameters(), torch::optim::AdamWOptions(3e-3));

  // Target: a fixed smooth function of the input, learnable by the block.
  const auto mix = at::randn({hidden, hidden}, at::device(device)) / 8;
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, loss_value = 0;
  for (int step = 0; step < steps; ++step) {
    const auto x = at::randn({tokens, hidden}, at::device(device));
    const auto target = x + 0.5 * at::sin(at::matmul(x, mix));
    const auto outs = block.forward(x);  // [mlp(x), residual]
    const auto y = residual_add.forward(outs[0], {outs[1]})[0];
    optimizer.zero_grad();
    auto loss = (y - target).pow(2).mean();
    loss.backward();
    optimizer.step();
    loss_value = loss.item<double>();
    if (step == 0) first_loss = loss_value;
    if (step % 50 == 0 || step == steps - 1) std::printf("step %4d  loss %.5f\n", step, loss_value);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("device %s: loss %.5f -> %.5f, %.0f tokens/s\n", device.str().c_str(), first_loss,
              loss_value, steps * tokens / secs);
  return loss_value < first_loss ? 0 : 1;
}
