// Variants of the GELU + bias backward pass (bias_kernels.cu's bias_grad_kernel, GELU, bf16) at
// the large MLP's shape, timed side by side with the kernel the library launches and with two
// memory-only ceilings moving the same bytes. Standalone (no torch), built on the GPU machine:
//
//   nvcc -I csrc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr \
//        --expt-extended-lambda -o /tmp/gelu_variants \
//        bench/kernel_variants/gelu_bias_bwd_variants.cu
//   /tmp/gelu_variants [rows cols]
//
// Each variant's dpre must equal the library kernel's bit for bit and its column sums agree to
// 1e-5; a variant that does not is reported as WRONG and not timed.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/bias/bias_kernels.cu"  // the library's kernel, launched as the library does
#include "variant_bench.cuh"

namespace fk = fusible::kernels;
namespace fc = fusible::kernels::cuda;
using bf16 = __nv_bfloat16;

namespace {

__device__ __forceinline__ uint4 ld(const void* p, bool cs) {
  return cs ? __ldcs(static_cast<const uint4*>(p)) : *static_cast<const uint4*>(p);
}
__device__ __forceinline__ void st(void* p, uint4 v, bool cs) {
  if (cs) {
    __stcs(static_cast<uint4*>(p), v);
  } else {
    *static_cast<uint4*>(p) = v;
  }
}

// One (dy, pre) pair of 8 bf16 each -> g (8 bf16), column sums and nothing else: the library's
// math (act_derivative<float, true>), with conversions packed two at a time where kPack.
template <bool kPack>
__device__ __forceinline__ uint4 gelu_grad8(uint4 d, uint4 p, float (&sum)[8]) {
  const auto* d2 = reinterpret_cast<const __nv_bfloat162*>(&d);
  const auto* p2 = reinterpret_cast<const __nv_bfloat162*>(&p);
  uint4 out;
  auto* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 df = __bfloat1622float2(d2[k]);
    const float2 pf = __bfloat1622float2(p2[k]);
    const float g0 = df.x * fc::act_derivative<float, true>(fk::ActKind::kGelu, pf.x);
    const float g1 = df.y * fc::act_derivative<float, true>(fk::ActKind::kGelu, pf.y);
    sum[2 * k] += g0;
    sum[2 * k + 1] += g1;
    if constexpr (kPack) {
      o2[k] = __floats2bfloat162_rn(g0, g1);
    } else {
      o2[k].x = __float2bfloat16_rn(g0);
      o2[k].y = __float2bfloat16_rn(g1);
    }
  }
  return out;
}

// The variant kernel: block of 32 x RT threads, each on 8 adjacent columns; ROWB rows' loads in
// flight per thread; kPrefetch loads the next ROWB rows before computing the current ones.
template <int ROWB, int MINB, int RT, bool kPrefetch, bool kCs, bool kPack>
__global__ void __launch_bounds__(32 * RT, MINB)
    variant(const bf16* dy, const bf16* __restrict__ pre, bf16* dpre, float* __restrict__ partial,
            int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  __shared__ float tile[RT][32 * 8];
  const int64_t col = (blockIdx.x * 32 + threadIdx.x) * 8;
  const int64_t row_begin = blockIdx.y * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  float sum[8] = {};
  constexpr int kStep = RT * ROWB;
  if (col < cols) {
    uint4 d[ROWB], p[ROWB];
    auto load = [&](int64_t r0) {
#pragma unroll
      for (int u = 0; u < ROWB; ++u) {
        const int64_t r = r0 + u * RT;
        if (r < row_end) {
          d[u] = ld(dy + r * cols + col, kCs);
          p[u] = ld(pre + r * cols + col, kCs);
        }
      }
    };
    int64_t r0 = row_begin + threadIdx.y;
    if constexpr (kPrefetch) load(r0);
    for (; r0 < row_end; r0 += kStep) {
      uint4 cd[ROWB], cp[ROWB];
      if constexpr (kPrefetch) {
#pragma unroll
        for (int u = 0; u < ROWB; ++u) cd[u] = d[u], cp[u] = p[u];
        if (r0 + kStep < row_end) load(r0 + kStep);
      } else {
        load(r0);
#pragma unroll
        for (int u = 0; u < ROWB; ++u) cd[u] = d[u], cp[u] = p[u];
      }
#pragma unroll
      for (int u = 0; u < ROWB; ++u) {
        const int64_t r = r0 + u * RT;
        if (r >= row_end) break;
        st(dpre + r * cols + col, gelu_grad8<kPack>(cd[u], cp[u], sum), kCs);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) tile[threadIdx.y][threadIdx.x * 8 + j] = sum[j];
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float total = tile[0][threadIdx.x * 8 + j];
      for (int i = 1; i < RT; ++i) total += tile[i][threadIdx.x * 8 + j];
      partial[blockIdx.y * cols + col + j] = total;
    }
  }
}

// Ceilings: the same bytes (two reads, one write) with a multiply only, 2-D like the variants and
// as a flat grid-stride loop.
template <int ROWB>
__global__ void __launch_bounds__(256)
    ceiling_2d(const bf16* a, const bf16* __restrict__ b, bf16* out, int64_t rows, int64_t cols,
               int64_t rows_per_chunk) {
  const int64_t col = (blockIdx.x * 32 + threadIdx.x) * 8;
  const int64_t row_end = min(rows, (blockIdx.y + 1) * rows_per_chunk);
  if (col >= cols) return;
  for (int64_t r0 = blockIdx.y * rows_per_chunk + threadIdx.y; r0 < row_end; r0 += 8 * ROWB) {
    uint4 x[ROWB], y[ROWB];
#pragma unroll
    for (int u = 0; u < ROWB; ++u) {
      const int64_t r = r0 + u * 8;
      if (r < row_end) x[u] = ld(a + r * cols + col, false), y[u] = ld(b + r * cols + col, false);
    }
#pragma unroll
    for (int u = 0; u < ROWB; ++u) {
      const int64_t r = r0 + u * 8;
      if (r >= row_end) break;
      auto* x2 = reinterpret_cast<__nv_bfloat162*>(&x[u]);
      const auto* y2 = reinterpret_cast<const __nv_bfloat162*>(&y[u]);
#pragma unroll
      for (int k = 0; k < 4; ++k) x2[k] = __hmul2(x2[k], y2[k]);
      st(out + r * cols + col, x[u], false);
    }
  }
}

__global__ void ceiling_flat(const uint4* a, const uint4* __restrict__ b, uint4* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint4 x = a[i];
    const uint4 y = b[i];
    auto* x2 = reinterpret_cast<__nv_bfloat162*>(&x);
    const auto* y2 = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
    for (int k = 0; k < 4; ++k) x2[k] = __hmul2(x2[k], y2[k]);
    out[i] = x;
  }
}

__global__ void sum_chunks(const float* partial, double* out, int64_t chunks, int64_t cols) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  double s = 0;
  for (int64_t k = 0; k < chunks; ++k) s += partial[k * cols + c];
  out[c] = s;
}

struct Bufs {
  bf16 *dy, *pre, *dpre, *ref_dpre;
  float* partial;
  double *sum, *ref_sum;
  int64_t rows, cols;
  int sms;
};

template <typename Kernel>
int64_t chunks_for(Kernel k, int threads, const Bufs& b) {
  int blocks = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, threads, 0));
  return fk::column_sum_chunks(b.rows, b.cols, b.sms, blocks * 2);
}

void report(const char* name, float ms, const Bufs& b, int64_t chunks, int regs_blocks) {
  const double bytes = 3.0 * 2 * b.rows * b.cols;
  std::printf("%-44s %8.1f us %7.0f GB/s %5.1f%% of 4.8 TB/s  chunks %3lld  blocks/SM %d\n", name,
              ms * 1e3, bytes / ms / 1e6, bytes / ms / 1e6 / 48, (long long)chunks, regs_blocks);
}

bool same_as_reference(const Bufs& b, int64_t chunks, const char* name) {
  const int64_t n = b.rows * b.cols;
  std::vector<uint16_t> x(n), y(n);
  CHECK(cudaMemcpy(x.data(), b.dpre, n * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(y.data(), b.ref_dpre, n * 2, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += x[i] != y[i];
  sum_chunks<<<(b.cols + 255) / 256, 256>>>(b.partial, b.sum, chunks, b.cols);
  std::vector<double> s(b.cols), r(b.cols);
  CHECK(cudaMemcpy(s.data(), b.sum, b.cols * 8, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(r.data(), b.ref_sum, b.cols * 8, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int64_t c = 0; c < b.cols; ++c) {
    worst = std::max(worst, std::abs(s[c] - r[c]) / (1.0 + std::abs(r[c])));
  }
  if (bad != 0 || worst > 1e-5) {
    std::printf("%-44s WRONG: %lld elements differ, column sums off by %.3g\n", name,
                (long long)bad, worst);
    return false;
  }
  return true;
}

template <int ROWB, int MINB, int RT, bool kPrefetch, bool kCs, bool kPack>
void run_variant(const char* name, Bufs& b) {
  auto k = variant<ROWB, MINB, RT, kPrefetch, kCs, kPack>;
  const int threads = 32 * RT;
  int blocks = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, threads, 0));
  // The library's chunk rule, with this kernel's occupancy (its col blocks assume 256 columns).
  const int64_t chunks = fk::column_sum_chunks(b.rows, b.cols, b.sms, blocks * 2);
  const int64_t rpc = (b.rows + chunks - 1) / chunks;
  const dim3 grid(b.cols / 256, chunks), block(32, RT);
  auto launch = [&] { k<<<grid, block>>>(b.dy, b.pre, b.dpre, b.partial, b.rows, b.cols, rpc); };
  launch();
  CHECK(cudaDeviceSynchronize());
  if (!same_as_reference(b, chunks, name)) return;
  report(name, median_ms(launch), b, chunks, blocks);
}

}  // namespace

int main(int argc, char** argv) {
  Bufs b{};
  b.rows = argc > 2 ? std::atoll(argv[1]) : 8192;
  b.cols = argc > 2 ? std::atoll(argv[2]) : 16384;
  CHECK(cudaDeviceGetAttribute(&b.sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t n = b.rows * b.cols;
  CHECK(cudaMalloc(&b.dy, n * 2));
  CHECK(cudaMalloc(&b.pre, n * 2));
  CHECK(cudaMalloc(&b.dpre, n * 2));
  CHECK(cudaMalloc(&b.ref_dpre, n * 2));
  CHECK(cudaMalloc(&b.partial, 1024 * b.cols * 4));
  CHECK(cudaMalloc(&b.sum, b.cols * 8));
  CHECK(cudaMalloc(&b.ref_sum, b.cols * 8));
  fill_normalish<<<1024, 256>>>(b.dy, n, 1u);
  fill_normalish<<<1024, 256>>>(b.pre, n, 2u);
  std::printf("GELU + bias backward, bf16 [%lld, %lld], %d SMs; bytes = 3 x 2 x rows x cols\n",
              (long long)b.rows, (long long)b.cols, b.sms);

  // The library's kernel, as bias_grad launches it (GELU at compile time, no amax).
  {
    auto k = fk::bias_grad_kernel<bf16, 8, true, false, true>;
    const int blocks_per_sm = fk::bias_grad_blocks_per_sm(true, fk::KernelDType::kBFloat16);
    const int64_t chunks = fk::column_sum_chunks(b.rows, b.cols, b.sms, blocks_per_sm);
    const int64_t rpc = (b.rows + chunks - 1) / chunks;
    const dim3 grid(b.cols / 256, chunks), block(32, 8);
    auto launch = [&] {
      k<<<grid, block>>>(b.dy, b.pre, b.ref_dpre, b.partial, nullptr, nullptr, b.rows, b.cols, rpc,
                         fk::ActKind::kGelu);
    };
    launch();
    CHECK(cudaDeviceSynchronize());
    sum_chunks<<<(b.cols + 255) / 256, 256>>>(b.partial, b.ref_sum, chunks, b.cols);
    report("library bias_grad_kernel (out of place)", median_ms(launch), b, chunks,
           blocks_per_sm / 2);
    auto in_place = [&] {
      k<<<grid, block>>>(b.dpre, b.pre, b.dpre, b.partial, nullptr, nullptr, b.rows, b.cols, rpc,
                         fk::ActKind::kGelu);
    };
    CHECK(cudaMemcpy(b.dpre, b.dy, n * 2, cudaMemcpyDeviceToDevice));
    report("library bias_grad_kernel (in place)", median_ms(in_place), b, chunks,
           blocks_per_sm / 2);
  }
  {
    const int64_t chunks = fk::column_sum_chunks(b.rows, b.cols, b.sms, 16);
    const int64_t rpc = (b.rows + chunks - 1) / chunks;
    report("ceiling: 2-D multiply, 2 rows", median_ms([&] {
             ceiling_2d<2><<<dim3(b.cols / 256, chunks), dim3(32, 8)>>>(b.dy, b.pre, b.dpre, b.rows,
                                                                        b.cols, rpc);
           }),
           b, chunks, 8);
    report("ceiling: flat grid-stride multiply", median_ms([&] {
             ceiling_flat<<<b.sms * 8, 256>>>(reinterpret_cast<const uint4*>(b.dy),
                                              reinterpret_cast<const uint4*>(b.pre),
                                              reinterpret_cast<uint4*>(b.dpre), n / 8);
           }),
           b, 0, 8);
  }
  //          ROWB MINB RT prefetch cs pack
  run_variant<2, 4, 8, false, false, false>("v: rows 2, min 4 (library's shape)", b);
  run_variant<2, 4, 8, false, false, true>("v: rows 2, min 4, packed cvt", b);
  run_variant<2, 3, 8, false, false, true>("v: rows 2, min 3, packed", b);
  run_variant<2, 2, 8, false, false, true>("v: rows 2, min 2, packed", b);
  run_variant<1, 4, 8, true, false, true>("v: rows 1 + prefetch, min 4, packed", b);
  run_variant<1, 6, 8, true, false, true>("v: rows 1 + prefetch, min 6, packed", b);
  run_variant<2, 3, 8, true, false, true>("v: rows 2 + prefetch, min 3, packed", b);
  run_variant<2, 2, 8, true, false, true>("v: rows 2 + prefetch, min 2, packed", b);
  run_variant<4, 2, 8, false, false, true>("v: rows 4, min 2, packed", b);
  run_variant<2, 4, 8, false, true, true>("v: rows 2, min 4, packed, streaming", b);
  run_variant<2, 3, 8, true, true, true>("v: rows 2 + prefetch, min 3, packed, streaming", b);
  run_variant<2, 4, 4, false, false, true>("v: 128 threads, rows 2, min 4, packed", b);
  run_variant<2, 8, 4, false, false, true>("v: 128 threads, rows 2, min 8, packed", b);
  run_variant<1, 8, 4, true, false, true>("v: 128 threads, rows 1 + prefetch, min 8", b);
  return 0;
}
