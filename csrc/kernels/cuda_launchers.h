// Host launchers for the raw CUDA kernels: pointers, sizes and a stream, no torch types, so the .cu
// files compile with nvcc alone and the torch wrappers stay in host C++.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace fusible::kernels {

/// Element types the raw kernels are instantiated for.
enum class KernelDType { kFloat32, kFloat64, kFloat16, kBFloat16 };

/// y[m, n] = x[m, n] + bias[n]; all contiguous, row-major.
void launch_bias_fwd(const void* x,     // [rows, cols]
                     const void* bias,  // [cols]
                     void* y,           // [rows, cols]
                     int64_t rows, int64_t cols, KernelDType dtype, cudaStream_t stream);

/// Partial column sums of dy over row chunks, then their total: dbias[n] = sum_m dy[m, n].
/// workspace holds num_chunks * cols accumulator values (float, or double for kFloat64).
void launch_bias_bwd(const void* dy,   // [rows, cols]
                     void* workspace,  // [num_chunks, cols], accumulator type
                     void* dbias,      // [cols]
                     int64_t rows, int64_t cols, int64_t num_chunks, KernelDType dtype,
                     cudaStream_t stream);

/// How many row chunks launch_bias_bwd splits rows into (enough blocks to fill the GPU).
int64_t bias_bwd_num_chunks(int64_t rows, int64_t cols);

}  // namespace fusible::kernels
