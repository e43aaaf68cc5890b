// Tensor parallelism from a pure C++ caller: a c10d::ProcessGroup built in LibTorch and registered
// with c10d::register_process_group, its backend an in-process group whose ranks are threads (the
// wheel ships no gloo headers, so no real backend can be constructed here). The collective ops and
// a column + row sequence-parallel MLP on 2 and 4 ranks against the single-process float64 model.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "test_utils.h"

namespace fusible::test {
namespace {

using namespace std::chrono_literals;

// Where the ranks of one in-process group meet: each collective posts every rank's input, lets
// each rank compute its result from all of them, and only then lets any rank go on.
class Rendezvous {
 public:
  explicit Rendezvous(int size) : size_(size), inputs_(size) {}

  at::Tensor exchange(int rank, const at::Tensor& input,
                      const std::function<at::Tensor(const std::vector<at::Tensor>&)>& result) {
    {
      std::lock_guard lock(mutex_);
      inputs_[rank] = input;
    }
    barrier();
    auto out = result(inputs_);
    barrier();  // nobody posts the next collective's input while another rank still reads
    return out;
  }

 private:
  // Times out rather than hangs, so a rank that failed before communicating fails the test.
  void barrier() {
    std::unique_lock lock(mutex_);
    const auto generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool met = cv_.wait_for(lock, 30s, [&] { return generation_ != generation; });
    TORCH_CHECK(met, "test process group: a rank did not reach the collective within 30 s");
  }

  int size_;
  std::vector<at::Tensor> inputs_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

class DoneWork : public c10d::Work {
 public:
  bool wait(std::chrono::milliseconds) override { return true; }
};

// The collectives c10d's functional ops call (the coalesced gather and scatter, allreduce), one
// tensor at a time, summing in the order of the ranks.
class ThreadBackend : public c10d::Backend {
 public:
  ThreadBackend(int rank, int size, std::shared_ptr<Rendezvous> rendezvous)
      : Backend(rank, size), rendezvous_(std::move(rendezvous)) {}
  const std::string getBackendName() const override { return "fusible_test_threads"; }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::AllgatherOptions&) override {
    for (size_t i = 0; i < ins.size(); ++i) {
      outs[i].copy_(
          rendezvous_->exchange(getRank(), ins[i], [](const auto& all) { return at::cat(all); }));
    }
    return c10::make_intrusive<DoneWork>();
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "test process group: sum only");
    const auto rank = getRank(), size = getSize();
    for (size_t i = 0; i < ins.size(); ++i) {
      outs[i].copy_(rendezvous_->exchange(
          rank, ins[i], [&](const auto& all) { return sum(all).chunk(size)[rank]; }));
    }
    return c10::make_intrusive<DoneWork>();
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "test process group: sum only");
    for (auto& t : tensors) t.copy_(rendezvous_->exchange(getRank(), t, sum));
    return c10::make_intrusive<DoneWork>();
  }

 private:
  static at::Tensor sum(const std::vector<at::Tensor>& all) {
    auto total = all[0].clone();
    for (size_t i = 1; i < all.size(); ++i) total += all[i];
    return total;
  }

  std::shared_ptr<Rendezvous> rendezvous_;
};

// Runs body(spec) on `size` threads, one per rank, each with its own registered ProcessGroup
// (the registry is process-wide, so every rank's view gets its own name). Rethrows the first
// failure after every thread has ended.
void run_ranks(int size, const std::function<void(const ops::ProcessGroupSpec&)>& body) {
  auto rendezvous = std::make_shared<Rendezvous>(size);
  std::vector<std::exception_ptr> errors(size);
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;  // the registry holds weak refs
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    const std::string name =
        "fusible_test_tp" + std::to_string(size) + "_rank" + std::to_string(rank);
    auto group = c10::make_intrusive<c10d::ProcessGroup>(rank, size);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                      c10::make_intrusive<ThreadBackend>(rank, size, rendezvous));
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
    group->setGroupName(name);
    c10d::register_process_group(name, group);
    groups.push_back(group);
    threads.emplace_back([&, rank, name] {
      try {
        body({name, size, rank});
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < size; ++rank) {
    c10d::unregister_process_group("fusible_test_tp" + std::to_string(size) + "_rank" +
                                   std::to_string(rank));
  }
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Each rank's input differs by rank and row, so a wrong order or a missing sum shows.
at::Tensor rank_input(int64_t rank, int64_t rows, int64_t cols) {
  return at::arange(rows * cols, at::kDouble).reshape({rows, cols}) * 0.5 + 100.0 * rank;
}

// The ranks' tensors summed, then rank's slice of `size` along dim 0.
at::Tensor summed_rows(const std::vector<at::Tensor>& all, int64_t size, int64_t rank) {
  return at::stack(all).sum(0).chunk(size)[rank];
}

class TensorParallelCpp : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelCpp, CollectivesForwardAndBackward) {
  const int size = GetParam();
  constexpr int64_t rows = 4, cols = 3;
  std::vector<at::Tensor> inputs, grads;
  for (int r = 0; r < size; ++r) {
    inputs.push_back(rank_input(r, rows, cols));
    grads.push_back(rank_input(r, rows * size, cols) + 7.0);
  }
  const auto gathered = at::cat(inputs);
  run_ranks(size, [&](const ops::ProcessGroupSpec& spec) {
    const auto r = spec.rank;
    {  // AllGather: the ranks' rows in rank order; its backward sums dy and keeps this rank's rows
      fuser::Sequential seq({std::make_shared<ops::AllGather>(spec)});
      const auto x = inputs[r].clone().requires_grad_(true);
      const auto y = seq.forward(x)[0];
      EXPECT_TRUE(at::equal(y, gathered));
      const auto dx = torch::autograd::grad({y}, {x}, {grads[r]})[0];
      EXPECT_TRUE(at::allclose(dx, summed_rows(grads, size, r), 0, 1e-12));
    }
    {  // ReduceScatter: the sum's rows of this rank; its backward all-gathers dy
      fuser::Sequential seq({std::make_shared<ops::ReduceScatter>(spec)});
      const auto x = grads[r].clone().requires_grad_(true);
      const auto y = seq.forward(x)[0];
      EXPECT_TRUE(at::allclose(y, summed_rows(grads, size, r), 0, 1e-12));
      const auto dx = torch::autograd::grad({y}, {x}, {inputs[r]})[0];
      EXPECT_TRUE(at::equal(dx, gathered));
    }
    {  // AllReduce: the sum on every rank; backward: the identity
      fuser::Sequential seq({std::make_shared<ops::AllReduce>(spec)});
      const auto x = inputs[r].clone().requires_grad_(true);
      const auto y = seq.forward(x)[0];
      EXPECT_TRUE(at::allclose(y, summed_rows(inputs, 1, 0), 0, 1e-12));
      EXPECT_TRUE(at::equal(torch::autograd::grad({y}, {x}, {inputs[r]})[0], inputs[r]));
    }
  });
}

// The column (sequence-parallel) -> GELU -> row (sequence-parallel) MLP of te.ops' layout: each
// rank holds a slice of the tokens and a shard of each weight.
TEST_P(TensorParallelCpp, SequenceParallelMlpMatchesOneProcess) {
  const int size = GetParam();
  constexpr int64_t tokens = 8, hidden = 6, ffn = 8;
  const auto x = at::randn({tokens, hidden}, at::kDouble);
  const auto w1 = at::randn({ffn, hidden}, at::kDouble) * 0.4;
  const auto w2 = at::randn({hidden, ffn}, at::kDouble) * 0.4;
  const auto dy = at::randn({tokens, hidden}, at::kDouble);
  std::vector<at::Tensor> ref_inputs{x.clone().requires_grad_(true),
                                     w1.clone().requires_grad_(true),
                                     w2.clone().requires_grad_(true)};
  const auto ref_y =
      at::linear(at::gelu(at::linear(ref_inputs[0], ref_inputs[1]), "tanh"), ref_inputs[2]);
  const auto ref_grads = torch::autograd::grad({ref_y}, ref_inputs, {dy});

  run_ranks(size, [&](const ops::ProcessGroupSpec& spec) {
    const auto r = spec.rank;
    auto fc1 = std::make_shared<ops::BasicLinear>(hidden, ffn, at::Device(at::kCPU), at::kDouble,
                                                  ops::TensorParallel{"column", spec, true});
    auto fc2 = std::make_shared<ops::BasicLinear>(ffn, hidden, at::Device(at::kCPU), at::kDouble,
                                                  ops::TensorParallel{"row", spec, true});
    {
      at::NoGradGuard no_grad;
      fc1->weight().copy_(w1.chunk(size, 0)[r]);
      fc2->weight().copy_(w2.chunk(size, 1)[r]);
    }
    fuser::Sequential seq({fc1, std::make_shared<ops::GELU>(), fc2});
    const auto x_local = x.chunk(size)[r].clone().requires_grad_(true);
    const auto y = seq.forward(x_local)[0];
    expect_close(y, ref_y.detach().chunk(size)[r], at::kDouble, true);
    const auto grads =
        torch::autograd::grad({y}, {x_local, fc1->weight(), fc2->weight()}, {dy.chunk(size)[r]});
    expect_close(grads[0], ref_grads[0].chunk(size)[r], at::kDouble, true);
    expect_close(grads[1], ref_grads[1].chunk(size, 0)[r], at::kDouble, true);
    expect_close(grads[2], ref_grads[2].chunk(size, 1)[r], at::kDouble, true);
    const auto plan = seq.fusion_plan();
    ASSERT_EQ(plan.size(), 1u);
    EXPECT_EQ(plan[0].forward.front(), "BasicLinear[all-gather input]");
    EXPECT_EQ(plan[0].forward.back(), "BasicLinear[reduce-scatter output]");
  });
}

// The single-process float64 LayerNorm -> Linear -> GELU -> Linear, every parameter random.
struct FullMlp {
  static constexpr int64_t tokens = 8, hidden = 6, ffn = 8, steps = 3;
  // ln_w, ln_b, w1, b1, w2, b2: the parallel model's parameters() order.
  std::vector<at::Tensor> params{
      1 + 0.2 * at::randn({hidden}, at::kDouble),  0.3 * at::randn({hidden}, at::kDouble),
      0.4 * at::randn({ffn, hidden}, at::kDouble), at::randn({ffn}, at::kDouble),
      0.4 * at::randn({hidden, ffn}, at::kDouble), at::randn({hidden}, at::kDouble)};
  at::Tensor x = at::randn({tokens, hidden}, at::kDouble);
  std::vector<at::Tensor> dys{at::randn({tokens, hidden}, at::kDouble),
                              at::randn({tokens, hidden}, at::kDouble),
                              at::randn({tokens, hidden}, at::kDouble)};

  static at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& p) {
    const auto h = at::layer_norm(x, {hidden}, p[0], p[1]);
    return at::linear(at::gelu(at::linear(h, p[2], p[3]), "tanh"), p[4], p[5]);
  }
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(bool adamw, std::vector<at::Tensor> p) {
  if (adamw) {
    return std::make_unique<torch::optim::AdamW>(
        std::move(p), torch::optim::AdamWOptions(0.05).weight_decay(0.1));
  }
  return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.1));
}

// ops::Linear's own tensor-parallel decomposition (column, then row with its bias replicated and
// added after the reduction), with and without sequence parallelism, trained for three SGD and
// AdamW steps: every rank's output, gradients and parameters equal the single-process model's.
class TensorParallelLinearCpp : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(TensorParallelLinearCpp, TrainsAsOneProcess) {
  const auto [size, sp, adamw] = GetParam();
  using M = FullMlp;
  const M full;
  // The reference: per step the output, x's and every parameter's gradient; then the parameters.
  std::vector<at::Tensor> ref_p;
  for (const auto& p : full.params) ref_p.push_back(p.clone().requires_grad_(true));
  const auto ref_x = full.x.clone().requires_grad_(true);
  auto ref_opt = make_optimizer(adamw, ref_p);
  std::vector<std::vector<at::Tensor>> ref_steps;  // y, dx, d(params)...
  for (const auto& dy : full.dys) {
    ref_opt->zero_grad();
    const auto y = M::forward(ref_x, ref_p);
    std::vector<at::Tensor> inputs{ref_x};
    inputs.insert(inputs.end(), ref_p.begin(), ref_p.end());
    auto grads = torch::autograd::grad({y}, inputs, {dy});
    for (size_t i = 0; i < ref_p.size(); ++i) ref_p[i].mutable_grad() = grads[1 + i].clone();
    grads.insert(grads.begin(), y.detach());
    ref_steps.push_back(grads);
    ref_opt->step();
  }

  run_ranks(size, [&](const ops::ProcessGroupSpec& spec) {
    const auto r = spec.rank;
    const auto cpu = at::Device(at::kCPU);
    auto norm =
        std::make_shared<ops::LayerNorm>(std::vector<int64_t>{M::hidden}, 1e-5, cpu, at::kDouble);
    if (sp) norm->set_param_grad_reduction(spec);  // rows sharded, parameters replicated
    auto fc1 = std::make_shared<ops::Linear>(M::hidden, M::ffn, true, cpu, at::kDouble,
                                             ops::TensorParallel{"column", spec, sp});
    auto fc2 = std::make_shared<ops::Linear>(M::ffn, M::hidden, true, cpu, at::kDouble,
                                             ops::TensorParallel{"row", spec, sp});
    ASSERT_EQ(fc2->bias_op()->size(), M::hidden);  // replicated, not a summand
    ASSERT_EQ(fc2->collective_op(), nullptr);
    // This rank's shard of each full parameter (column: dim 0 of w1, b1; row: dim 1 of w2).
    const std::vector<std::function<at::Tensor(const at::Tensor&)>> shard{
        [](const at::Tensor& t) { return t; },
        [](const at::Tensor& t) { return t; },
        [&](const at::Tensor& t) { return t.chunk(size, 0)[r]; },
        [&](const at::Tensor& t) { return t.chunk(size, 0)[r]; },
        [&](const at::Tensor& t) { return t.chunk(size, 1)[r]; },
        [](const at::Tensor& t) { return t; }};
    fuser::Sequential seq({norm, fc1, std::make_shared<ops::GELU>(), fc2});
    std::vector<at::Tensor> params{norm->weight(),         norm->bias(),  fc1->weight(),
                                   fc1->bias_op()->bias(), fc2->weight(), fc2->bias_op()->bias()};
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(shard[i](full.params[i]));
    }
    auto opt = make_optimizer(adamw, params);
    const auto rows = [&](const at::Tensor& t) { return sp ? t.chunk(size)[r] : t; };
    for (size_t step = 0; step < full.dys.size(); ++step) {
      const auto& ref = ref_steps[step];
      opt->zero_grad();
      const auto x = rows(full.x).clone().requires_grad_(true);
      const auto y = seq.forward(x)[0];
      expect_close(y, rows(ref[0]), at::kDouble, true);
      std::vector<at::Tensor> inputs{x};
      inputs.insert(inputs.end(), params.begin(), params.end());
      const auto grads = torch::autograd::grad({y}, inputs, {rows(full.dys[step])});
      expect_close(grads[0], rows(ref[1]), at::kDouble, true);
      for (size_t i = 0; i < params.size(); ++i) {
        expect_close(grads[1 + i], shard[i](ref[2 + i]), at::kDouble, true);
        params[i].mutable_grad() = grads[1 + i].clone();
      }
      opt->step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      expect_close(params[i], shard[i](ref_p[i].detach()), at::kDouble, true);
    }
    const auto plan = seq.fusion_plan();
    ASSERT_EQ(plan.size(), 1u);
    const auto& fwd = plan[0].forward;
    ASSERT_GE(fwd.size(), 2u);
    EXPECT_EQ(fwd[fwd.size() - 2],
              sp ? "BasicLinear[reduce-scatter output]" : "BasicLinear[all-reduce output]");
    EXPECT_EQ(fwd.back(), "Bias");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelLinearCpp,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool(),
                                            ::testing::Bool()));

// te.ops' layout behind RowParallelBias::kPerRankSummand: a local GEMM, the bias summand, then
// the reduction as its own op; with the bias on rank 0 and zeros elsewhere it computes the
// single-process output.
TEST_P(TensorParallelCpp, SummandLayoutOfARowParallelLinear) {
  const int size = GetParam();
  constexpr int64_t tokens = 4, in = 8, out = 6;
  const auto x = at::randn({tokens, in}, at::kDouble);
  const auto w = at::randn({out, in}, at::kDouble);
  const auto b = at::randn({out}, at::kDouble);
  const auto ref = at::linear(x, w, b);
  run_ranks(size, [&](const ops::ProcessGroupSpec& spec) {
    const auto r = spec.rank;
    auto lin = std::make_shared<ops::Linear>(in, out, true, at::Device(at::kCPU), at::kDouble,
                                             ops::TensorParallel{"row", spec, false},
                                             ops::RowParallelBias::kPerRankSummand);
    ASSERT_NE(lin->collective_op(), nullptr);
    EXPECT_EQ(lin->collective_op()->type_name(), "AllReduce");
    EXPECT_FALSE(lin->linear_op()->is_tensor_parallel());
    EXPECT_EQ(lin->linear_op()->in_features(), in / size);
    {
      at::NoGradGuard no_grad;
      lin->weight().copy_(w.chunk(size, 1)[r]);
      lin->bias_op()->bias().copy_(r == 0 ? b : at::zeros_like(b));
    }
    fuser::Sequential seq({lin});
    expect_close(seq.forward(x.chunk(size, 1)[r])[0], ref, at::kDouble, true);
  });
}

// A row count the group cannot scatter fails on every rank before any communication (no hang).
TEST_P(TensorParallelCpp, IndivisibleRowsFailBeforeCommunicating) {
  const int size = GetParam();
  std::atomic<int> failures{0};
  run_ranks(size, [&](const ops::ProcessGroupSpec& spec) {
    fuser::Sequential seq({std::make_shared<ops::ReduceScatter>(spec)});
    expect_error_contains(
        [&] {
          seq.forward(at::randn({size + 1, 2}, at::kDouble));
        },
        "divisible by the process group's size");
    ++failures;
  });
  EXPECT_EQ(failures.load(), size);
}

// A spec whose size or rank is not the registered group's (a size left at its default of 1 would
// turn the parallelism off without a word) is refused when the op is built.
TEST_P(TensorParallelCpp, ASpecThatMisdescribesItsGroupIsRefused) {
  const int size = GetParam();
  std::atomic<int> refused{0};
  run_ranks(size, [&](const ops::ProcessGroupSpec& spec) {
    const ops::ProcessGroupSpec defaulted{spec.name};  // size 1, rank 0
    expect_error_contains([&] { ops::AllReduce op(defaulted); },
                          "the ProcessGroupSpec says size 1");
    const ops::ProcessGroupSpec wrong_rank{spec.name, spec.size, (spec.rank + 1) % spec.size};
    expect_error_contains(
        [&] {
          ops::BasicLinear op(4 * size, 4, c10::Device(c10::kCPU), at::kDouble,
                              ops::TensorParallel{"column", wrong_rank, false});
        },
        "this process is its rank");
    ++refused;
  });
  EXPECT_EQ(refused.load(), size);
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelCpp, ::testing::Values(2, 4));

}  // namespace
}  // namespace fusible::test
