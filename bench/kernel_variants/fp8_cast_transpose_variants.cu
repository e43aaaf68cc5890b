// Variants of the FP8 cast + transpose (fp8_kernels.cu's cast_transpose_kernel, bf16 in, E4M3
// data and its transpose out, delayed scaling's held scale) at the large MLP's shapes, timed side
// by side with the kernel the library launches and with a copy moving the same bytes. Standalone
// (no torch), built on the GPU machine:
//
//   nvcc -I csrc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr \
//        -o /tmp/cast_variants bench/kernel_variants/fp8_cast_transpose_variants.cu
//   /tmp/cast_variants
//
// The library's tile goes through shared memory a byte at a time (two shared-memory instructions
// per element). The variants transpose in registers instead: each thread casts 4 rows x 8 columns
// and permutes the 32 bytes into 8 columns of 4 (__byte_perm). Each variant's data, transpose and
// amax must equal the library kernel's bit for bit; one that does not is reported as WRONG.
#include "kernels/fp8/fp8_kernels.cu"  // the library's kernels
#include "variant_bench.cuh"

namespace fk = fusible::kernels;
namespace fc = fusible::kernels::cuda;
using bf16 = __nv_bfloat16;

namespace {

// 8 bf16 as one 16-byte load, evict-first with kCs (the library's helpers).
template <bool kCs>
__device__ __forceinline__ fc::Vec<bf16, 8> load8(const bf16* p) {
  if constexpr (kCs) return fc::load_vec_streaming<bf16, 8>(p);
  return fc::load_vec<bf16, 8>(p);
}

// Rows i of four 4-byte words (byte c of word i: row i, column c) as four words of columns.
__device__ __forceinline__ void transpose4x4(const uint32_t (&w)[4], uint32_t (&out)[4]) {
  const uint32_t t01 = __byte_perm(w[0], w[1], 0x5140), t01b = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t t23 = __byte_perm(w[2], w[3], 0x5140), t23b = __byte_perm(w[2], w[3], 0x7362);
  out[0] = __byte_perm(t01, t23, 0x5410);
  out[1] = __byte_perm(t01, t23, 0x7632);
  out[2] = __byte_perm(t01b, t23b, 0x5410);
  out[3] = __byte_perm(t01b, t23b, 0x7632);
}

// The library's 128 x 64 tile and grid; each thread 4 rows x 8 columns, a warp 8 row groups x 4
// column groups (64-byte loads per row, full 32-byte sectors of the transpose per store).
template <bool kAct, bool kCs>
__global__ void __launch_bounds__(256)
    regs_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ data,
                uint8_t* __restrict__ data_t, int64_t rows, int64_t cols, int64_t col_tiles,
                float* __restrict__ amax, const float* __restrict__ scale,
                float* __restrict__ scale_inv) {
  const float s = *scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.f / s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t tile = blockIdx.x;
  const int64_t r0 = tile / col_tiles * 128 + 4 * (8 * (warp % 4) + lane % 8);
  const int64_t c0 = tile % col_tiles * 64 + 8 * (4 * (warp / 4) + lane / 8);
  float m = 0.f;
  if (c0 < cols) {
    fc::Vec<bf16, 8> raw[4] = {};  // rows past the end stay zero (no effect on the amax)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (r0 + i < rows) raw[i] = load8<kCs>(x + (r0 + i) * cols + c0);
    }
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto& v = raw[i];
      float f[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        f[j] = fk::cast_input<bf16, kAct>(v.v[j], fk::ActKind::kGelu);
        m = fc::amax_with(m, f[j]);
        f[j] *= s;
      }
      fc::Vec<uint8_t, 8> q;
      fc::fp8_pack(f, q.v, true);
      const uint2 w = reinterpret_cast<const uint2&>(q);
      lo[i] = w.x;
      hi[i] = w.y;
      if (r0 + i < rows) {
        if constexpr (kCs) {
          __stcs(reinterpret_cast<uint2*>(data + (r0 + i) * cols + c0), w);
        } else {
          *reinterpret_cast<uint2*>(data + (r0 + i) * cols + c0) = w;
        }
      }
    }
    if (data_t != nullptr && r0 < rows) {  // rows % 4 == 0 where transposing
      uint32_t out[8];
      transpose4x4(lo, reinterpret_cast<uint32_t(&)[4]>(out[0]));
      transpose4x4(hi, reinterpret_cast<uint32_t(&)[4]>(out[4]));
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        auto* p = reinterpret_cast<uint32_t*>(data_t + (c0 + c) * rows + r0);
        if constexpr (kCs) {
          __stcs(p, out[c]);
        } else {
          *p = out[c];
        }
      }
    }
  }
  fc::block_amax_into(m, amax);
}

// The same bytes moved without casting: 16-byte loads, two 8-byte stores (row-major twice).
__global__ void ceiling_copy(const uint4* __restrict__ x, uint2* __restrict__ a,
                             uint2* __restrict__ b, int64_t n16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(x + i);
    __stcs(a + i, make_uint2(v.x ^ v.y, v.z));
    __stcs(b + i, make_uint2(v.w, v.x));
  }
}

// The same bytes with 16-byte stores: 32-byte loads, two 16-byte stores.
__global__ void ceiling_copy16(const uint4* __restrict__ x, uint4* __restrict__ a,
                               uint4* __restrict__ b, int64_t n32) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n32;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(x + 2 * i), w = __ldcs(x + 2 * i + 1);
    __stcs(a + i, make_uint4(v.x ^ w.y, v.z, w.x, v.w));
    __stcs(b + i, make_uint4(v.w, w.x ^ v.y, w.z, w.w));
  }
}

// The amax pass with kUnroll 16-byte loads in flight per thread (evict-first with kCs), over
// `waves` times the library's grid.
template <int kUnroll, bool kCs>
__global__ void amax_variant(const bf16* __restrict__ x, int64_t num_vecs,
                             float* __restrict__ amax) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  float m = 0.f;
  for (; v + (kUnroll - 1) * stride < num_vecs; v += kUnroll * stride) {
    fc::Vec<bf16, 8> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = load8<kCs>(x + (v + u * stride) * 8);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fc::amax_with(m, fc::to_acc(raw[u].v[j]));
    }
  }
  for (; v < num_vecs; v += stride) {
    const auto xv = load8<kCs>(x + v * 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fc::amax_with(m, fc::to_acc(xv.v[j]));
  }
  fc::block_amax_into(m, amax);
}

struct Bufs {
  int64_t rows, cols;
  int sms;
  bf16* x;
  uint8_t *data, *data_t, *ref_data, *ref_data_t;
  float *amax, *ref_amax, *scale, *scale_inv;
};

void report(const char* name, float ms, const Bufs& b) {
  const double bytes = 4.0 * b.rows * b.cols;  // 2 in, 1 + 1 out per element
  std::printf("  %-40s %8.1f us %7.0f GB/s %5.1f%% of 4.8 TB/s\n", name, ms * 1e3, bytes / ms / 1e6,
              bytes / ms / 1e6 / 48);
}

bool same_as_reference(const Bufs& b, const char* name) {
  const int64_t n = b.rows * b.cols;
  std::vector<uint8_t> d(n), rd(n), t(n), rt(n);
  float a = 0, ra = 0;
  CHECK(cudaMemcpy(d.data(), b.data, n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(rd.data(), b.ref_data, n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(t.data(), b.data_t, n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(rt.data(), b.ref_data_t, n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&a, b.amax, 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&ra, b.ref_amax, 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0, bad_t = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad += d[i] != rd[i];
    bad_t += t[i] != rt[i];
  }
  if (bad != 0 || bad_t != 0 || a != ra) {
    std::printf("  %-40s WRONG: %lld data, %lld transpose bytes differ; amax %g vs %g\n", name,
                (long long)bad, (long long)bad_t, a, ra);
    return false;
  }
  return true;
}

template <bool kAct, bool kCs>
void run_variant(const char* name, Bufs& b) {
  const int64_t col_tiles = (b.cols + 63) / 64;
  const int64_t tiles = fk::fp8_cast_tiles(b.rows, b.cols);
  auto launch = [&] {
    regs_kernel<kAct, kCs><<<tiles, 256>>>(b.x, b.data, b.data_t, b.rows, b.cols, col_tiles, b.amax,
                                           b.scale, b.scale_inv);
  };
  CHECK(cudaMemset(b.amax, 0, 4));
  launch();
  CHECK(cudaDeviceSynchronize());
  if (!same_as_reference(b, name)) return;
  report(name, median_ms(launch), b);
}

template <bool kAct>
void run_shape(Bufs& b) {
  std::printf("bf16 [%lld, %lld]%s, %d SMs; bytes = 4 x rows x cols\n", (long long)b.rows,
              (long long)b.cols, kAct ? ", GELU on load" : "", b.sms);
  const int64_t col_tiles = (b.cols + 63) / 64;
  const int64_t tiles = fk::fp8_cast_tiles(b.rows, b.cols);
  auto lib = [&] {
    fk::cast_transpose_kernel<bf16, 8, kAct><<<tiles, fk::kThreads>>>(
        b.x, b.ref_data, b.ref_data_t, b.rows, b.cols, col_tiles, b.ref_amax, b.scale, b.scale_inv,
        448.f, 1.f, true, fk::ActKind::kGelu);
  };
  CHECK(cudaMemset(b.ref_amax, 0, 4));
  lib();
  CHECK(cudaDeviceSynchronize());
  report("library cast_transpose_kernel", median_ms(lib), b);
  const int64_t n = b.rows * b.cols;
  report("ceiling: copy of the same bytes", median_ms([&] {
           ceiling_copy<<<b.sms * 8, 256>>>(reinterpret_cast<const uint4*>(b.x),
                                            reinterpret_cast<uint2*>(b.data),
                                            reinterpret_cast<uint2*>(b.data_t), n / 8);
         }),
         b);
  if (!kAct) {
    report("ceiling: copy, 16-byte stores", median_ms([&] {
             ceiling_copy16<<<b.sms * 8, 256>>>(reinterpret_cast<const uint4*>(b.x),
                                                reinterpret_cast<uint4*>(b.data),
                                                reinterpret_cast<uint4*>(b.data_t), n / 16);
           }),
           b);
  }
  run_variant<kAct, false>("v: register transpose", b);
  run_variant<kAct, true>("v: register transpose, evict-first", b);
  if (kAct) return;
  // The amax pass (current scaling's first read of x), bytes = 2 x rows x cols.
  const auto amax_report = [&](const char* name, float ms) {
    const double bytes = 2.0 * n;
    std::printf("  %-40s %8.1f us %7.0f GB/s %5.1f%% of 4.8 TB/s\n", name, ms * 1e3,
                bytes / ms / 1e6, bytes / ms / 1e6 / 48);
  };
  float want = 0;
  CHECK(cudaMemset(b.ref_amax, 0, 4));
  fk::launch_amax(b.x, n, b.ref_amax, b.sms, 0, nullptr);
  CHECK(cudaMemcpy(&want, b.ref_amax, 4, cudaMemcpyDeviceToHost));
  amax_report("amax: library launch_amax",
              median_ms([&] { fk::launch_amax(b.x, n, b.ref_amax, b.sms, 0, nullptr); }));
  const int64_t vecs = n / 8, grid = fc::grid_for(vecs, 256, b.sms);
  const auto variant = [&](const char* name, auto kernel, int64_t blocks) {
    float got = 0;
    CHECK(cudaMemset(b.amax, 0, 4));
    kernel<<<blocks, 256>>>(b.x, vecs, b.amax);
    CHECK(cudaMemcpy(&got, b.amax, 4, cudaMemcpyDeviceToHost));
    if (got != want) {
      std::printf("  %-40s WRONG: amax %g vs %g\n", name, got, want);
      return;
    }
    amax_report(name, median_ms([&] { kernel<<<blocks, 256>>>(b.x, vecs, b.amax); }));
  };
  std::printf("  (library grid: %lld blocks)\n", (long long)grid);
  variant("amax v: unroll 4 (library's loop)", amax_variant<4, false>, grid);
  variant("amax v: unroll 8", amax_variant<8, false>, grid);
  variant("amax v: unroll 4, evict-first", amax_variant<4, true>, grid);
  variant("amax v: unroll 8, evict-first", amax_variant<8, true>, grid);
  variant("amax v: unroll 4, 2x grid", amax_variant<4, false>, 2 * grid);
  variant("amax v: unroll 8, 2x grid, evict-first", amax_variant<8, true>, 2 * grid);
}

}  // namespace

int main() {
  Bufs b{};
  CHECK(cudaDeviceGetAttribute(&b.sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t max_n = int64_t(8192) * 16384;
  CHECK(cudaMalloc(&b.x, max_n * 2));
  for (auto** p : {&b.data, &b.data_t, &b.ref_data, &b.ref_data_t}) CHECK(cudaMalloc(p, max_n));
  for (auto** p : {&b.amax, &b.ref_amax, &b.scale, &b.scale_inv}) CHECK(cudaMalloc(p, 16));
  const float scale = 64.f;
  CHECK(cudaMemcpy(b.scale, &scale, 4, cudaMemcpyHostToDevice));
  fill_normalish<<<1024, 256>>>(b.x, max_n, 3u);
  // h (fc2's input), x and dy (8192 x 4096), a weight (16384 x 4096).
  const int64_t shapes[][2] = {{8192, 16384}, {8192, 4096}, {16384, 4096}};
  for (const auto& s : shapes) {
    b.rows = s[0];
    b.cols = s[1];
    run_shape<false>(b);
  }
  b.rows = 8192;
  b.cols = 16384;
  run_shape<true>(b);  // delayed scaling's cast of h from fc1's pre-activation
  return 0;
}
