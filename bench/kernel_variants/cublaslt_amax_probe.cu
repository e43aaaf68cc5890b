// Which FP8 GEMM epilogue outputs cuBLASLt takes on this GPU: the amax of D (AMAX_D_POINTER) and
// of the GELU aux (EPILOGUE_AUX_AMAX_POINTER) with a bf16 or an FP8 D. Each case prints how many
// algorithms the heuristic offers, the matmul's status, and the amax it wrote beside max |D| read
// back (for an FP8 D, max |D| / d_scale: the unscaled value). Both amax buffers start at 12345, so
// an amax left at 12345 was not written.
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -std=c++17 -o /tmp/probe \
//     bench/kernel_variants/cublaslt_amax_probe.cu -lcublasLt && /tmp/probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    auto s_ = (x);                                                             \
    if (s_ != 0) std::printf("  %s -> %d (line %d)\n", #x, int(s_), __LINE__); \
  } while (0)

namespace {

struct Case {
  const char* name;
  bool fp8_d;
  cublasLtEpilogue_t epilogue;
  bool amax_d;
  bool aux_amax;
};

float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
float to_float(__nv_fp8_e4m3 v) { return float(v); }

void run_case(cublasLtHandle_t lt, const Case& c, int m, int n, int k) {
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  std::vector<__nv_fp8_e4m3> ha(size_t(m) * k), hb(size_t(n) * k);
  for (auto& v : ha) v = __nv_fp8_e4m3(dist(gen));
  for (auto& v : hb) v = __nv_fp8_e4m3(dist(gen));
  std::vector<__nv_bfloat16> hbias(m);
  for (auto& v : hbias) v = __float2bfloat16(dist(gen));
  void *a, *b, *cm, *d, *bias, *aux, *ws;  // cm: C, bf16, apart from d (an FP8 d may not alias it)
  float *amax, *aux_amax, *scale;
  const size_t d_bytes = size_t(m) * n * (c.fp8_d ? 1 : 2);
  cudaMalloc(&a, ha.size());
  cudaMalloc(&b, hb.size());
  cudaMalloc(&d, d_bytes);
  cudaMalloc(&cm, size_t(m) * n * 2);
  cudaMalloc(&aux, size_t(m) * n * 2);
  cudaMalloc(&bias, m * 2);
  cudaMalloc(&ws, 32 << 20);
  cudaMalloc(&amax, 4);
  cudaMalloc(&aux_amax, 4);
  cudaMalloc(&scale, 4);
  const float d_scale = 0.5f, one = 1.f, zero = 0.f;
  cudaMemcpy(a, ha.data(), ha.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(b, hb.data(), hb.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(bias, hbias.data(), m * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(scale, &d_scale, 4, cudaMemcpyHostToDevice);
  // Not zero: shows whether cuBLASLt sets the amax or takes the max with what is there.
  const float stale = 12345.f;
  cudaMemcpy(amax, &stale, 4, cudaMemcpyHostToDevice);
  cudaMemcpy(aux_amax, &stale, 4, cudaMemcpyHostToDevice);

  // Column-major D[m, n] = A^T B with A [k, m] and B [k, n]: k contiguous in both (TN).
  cublasLtMatmulDesc_t desc;
  CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epilogue,
                                    sizeof(c.epilogue)));
  if (c.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                      sizeof(bias)));
    cudaDataType_t bt = CUDA_R_16BF;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  if (c.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                      sizeof(aux)));
    int64_t ld = m;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    cudaDataType_t at = CUDA_R_16BF;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &at,
                                      sizeof(at)));
  }
  if (c.fp8_d) {
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &scale,
                                      sizeof(scale)));
  }
  if (c.amax_d) {
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amax,
                                      sizeof(amax)));
  }
  if (c.aux_amax) {
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_AMAX_POINTER,
                                      &aux_amax, sizeof(aux_amax)));
  }
  const cudaDataType_t dt = c.fp8_d ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatrixLayout_t la, lb, lc, ld;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k));
  CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, n, k));
  CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, m));  // C: bf16 (Hopper's FP8 rule)
  CK(cublasLtMatrixLayoutCreate(&ld, dt, m, n, m));
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  size_t wsz = 32 << 20;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz,
                                          sizeof(wsz)));
  cublasLtMatmulHeuristicResult_t res[4];
  int found = 0;
  auto hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, ld, pref, 4, res, &found);
  int status = -1;
  if (hs == CUBLAS_STATUS_SUCCESS && found > 0) {
    status = cublasLtMatmul(lt, desc, &one, a, la, b, lb, &zero, cm, lc, d, ld, &res[0].algo, ws,
                            wsz, 0);
  }
  cudaError_t ce = cudaDeviceSynchronize();
  float got = 0, got_aux = 0, max_d = 0, max_aux = 0;
  cudaMemcpy(&got, amax, 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(&got_aux, aux_amax, 4, cudaMemcpyDeviceToHost);
  if (status == 0) {
    if (c.fp8_d) {
      std::vector<__nv_fp8_e4m3> hd(size_t(m) * n);
      cudaMemcpy(hd.data(), d, hd.size(), cudaMemcpyDeviceToHost);
      for (auto v : hd) max_d = std::fmax(max_d, std::fabs(to_float(v)) / d_scale);
    } else {
      std::vector<__nv_bfloat16> hd(size_t(m) * n);
      cudaMemcpy(hd.data(), d, hd.size() * 2, cudaMemcpyDeviceToHost);
      for (auto v : hd) max_d = std::fmax(max_d, std::fabs(to_float(v)));
    }
    if (c.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
      std::vector<__nv_bfloat16> hx(size_t(m) * n);
      cudaMemcpy(hx.data(), aux, hx.size() * 2, cudaMemcpyDeviceToHost);
      for (auto v : hx) max_aux = std::fmax(max_aux, std::fabs(to_float(v)));
    }
  }
  std::printf(
      "%-44s heuristic %d (found %d) matmul %d cuda %d | amax_d %.4f max|D| %.4f | "
      "aux_amax %.4f max|aux| %.4f\n",
      c.name, int(hs), found, status, int(ce), got, max_d, got_aux, max_aux);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  for (void* p : {a, b, cm, d, bias, aux, ws}) cudaFree(p);
  for (float* p : {amax, aux_amax, scale}) cudaFree(p);
}

}  // namespace

int main() {
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  const Case cases[] = {
      {"bf16 D, no epilogue, amax_d", false, CUBLASLT_EPILOGUE_DEFAULT, true, false},
      {"bf16 D, bias, amax_d", false, CUBLASLT_EPILOGUE_BIAS, true, false},
      {"bf16 D, gelu_aux_bias, amax_d", false, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, false},
      {"bf16 D, gelu_aux_bias, aux_amax", false, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false, true},
      {"fp8 D, no epilogue, amax_d", true, CUBLASLT_EPILOGUE_DEFAULT, true, false},
      {"fp8 D, bias, amax_d", true, CUBLASLT_EPILOGUE_BIAS, true, false},
      {"fp8 D, gelu_aux_bias (bf16 aux), amax_d", true, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true,
       false},
      {"fp8 D, gelu_aux_bias (bf16 aux), no amax", true, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false,
       false},
  };
  for (const auto& c : cases) run_case(lt, c, 256, 128, 64);
  cublasLtDestroy(lt);
  return 0;
}
