// cuBLASLt GEMM: descriptors (RAII), the row-major to column-major mapping, the cache of prepared
// descriptors and algorithms.
//
// Mapping: cuBLASLt is column-major, and a row-major [r, c] matrix is, in the same memory, the
// column-major [c, r] matrix (its transpose), leading dim c. So the row-major d = op(a) op(b) is
// the column-major d^T = op(b)^T op(a)^T: cuBLASLt's A is our b, its B is our a, its m is our n and
// its n is our m. The bias (one per row of cuBLASLt's D) is one per column of our d, as a linear's
// bias.
#include "kernels/gemm/cublaslt_gemm.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <unordered_map>

namespace fusible::kernels::gemm {
namespace {

#define FUSIBLE_CUBLASLT_CHECK(expr)                                                    \
  do {                                                                                  \
    const cublasStatus_t status_ = (expr);                                              \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt: ", #expr, " failed with ", \
                cublasLtGetStatusString(status_));                                      \
  } while (0)

// Descriptors freed by their destructor.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct Owned {
  T handle = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (handle) Destroy(handle);
  }
};
using MatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return CUDA_R_16BF;
    case at::kHalf:
      return CUDA_R_16F;
    case at::kFloat:
      return CUDA_R_32F;
    case at::kFloat8_e4m3fn:
      return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2:
      return CUDA_R_8F_E5M2;
    default:
      TORCH_CHECK(false, "cuBLASLt GEMM: expected bf16, fp16, fp32 or FP8, got ", t);
  }
}

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
  switch (e) {
    case Epilogue::kNone:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::kReluBias:
      return CUBLASLT_EPILOGUE_RELU_BIAS;
    case Epilogue::kGeluBias:
      return CUBLASLT_EPILOGUE_GELU_BIAS;
    case Epilogue::kGeluAuxBias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::kDGeluBGrad:
      return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case Epilogue::kReluAuxBias:
      return CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
    case Epilogue::kDReluBGrad:
      return CUBLASLT_EPILOGUE_DRELU_BGRAD;
    case Epilogue::kBGradB:
      return CUBLASLT_EPILOGUE_BGRADB;
  }
  TORCH_INTERNAL_ASSERT(false);
}

bool fp8_type(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

bool aligned16(const at::Tensor& t) {
  return !t.defined() || reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The largest power of two (up to 256) dividing the pointer: what the algorithm may assume.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<std::uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// What a cached algorithm depends on.
// The heuristic's pick depends on the GPU too: the device is part of the key.
struct Key {
  int device;
  int64_t m, n, k;
  bool trans_a, trans_b, has_c, c_is_d;
  at::ScalarType dtype;           // d's (and c's, bias's)
  at::ScalarType a_type, b_type;  // dtype, or FP8
  bool fast_accum;
  Epilogue epilogue;
  cublasComputeType_t compute;
  uint32_t align_a, align_b, align_c, align_d;
  int64_t a_block, b_block;  // FP8 scale modes (RowMajorGemm's)
  bool operator==(const Key& o) const {
    return std::tie(device, m, n, k, trans_a, trans_b, has_c, c_is_d, dtype, a_type, b_type,
                    fast_accum, epilogue, compute, align_a, align_b, align_c, align_d, a_block,
                    b_block) == std::tie(o.device, o.m, o.n, o.k, o.trans_a, o.trans_b, o.has_c,
                                         o.c_is_d, o.dtype, o.a_type, o.b_type, o.fast_accum,
                                         o.epilogue, o.compute, o.align_a, o.align_b, o.align_c,
                                         o.align_d, o.a_block, o.b_block);
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = std::hash<int64_t>()(k.m);
    for (int64_t v : {int64_t(k.device), k.n, k.k, int64_t(k.trans_a), int64_t(k.trans_b),
                      int64_t(k.has_c), int64_t(k.c_is_d), int64_t(k.dtype),
                      int64_t(k.a_type) << 16 | int64_t(k.b_type) << 8 | int64_t(k.fast_accum),
                      k.a_block << 4 | k.b_block, int64_t(k.epilogue), int64_t(k.compute),
                      int64_t(k.align_a) << 27 | int64_t(k.align_b) << 18 |
                          int64_t(k.align_c) << 9 | int64_t(k.align_d)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    }
    return h;
  }
};

bool uses_mask(Epilogue e) { return e == Epilogue::kReluAuxBias || e == Epilogue::kDReluBGrad; }
bool uses_aux(Epilogue e) {
  return uses_mask(e) || e == Epilogue::kGeluAuxBias || e == Epilogue::kDGeluBGrad;
}

int64_t rows_of_op(const at::Tensor& t, bool trans) { return trans ? t.size(1) : t.size(0); }
int64_t cols_of_op(const at::Tensor& t, bool trans) { return trans ? t.size(0) : t.size(1); }

// A row-major [rows, cols] tensor as a column-major layout [cols, rows].
void make_layout(Layout& layout, cudaDataType_t type, int64_t rows, int64_t cols) {
  FUSIBLE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(
      &layout.handle, type, static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), cols));
}

}  // namespace

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::kNone:
      return "none";
    case Epilogue::kBias:
      return "BIAS";
    case Epilogue::kReluBias:
      return "RELU_BIAS";
    case Epilogue::kGeluBias:
      return "GELU_BIAS";
    case Epilogue::kGeluAuxBias:
      return "GELU_AUX_BIAS";
    case Epilogue::kDGeluBGrad:
      return "DGELU_BGRAD";
    case Epilogue::kReluAuxBias:
      return "RELU_AUX_BIAS";
    case Epilogue::kDReluBGrad:
      return "DRELU_BGRAD";
    case Epilogue::kBGradB:
      return "BGRADB";
  }
  return "?";
}

int64_t relu_mask_row_bytes(int64_t n) { return (n + 127) / 128 * 128 / 8; }

namespace {

// FP8: a [m, k] and b [n, k] (trans_b), k contiguous, rows 16-byte aligned; d, c and bias bf16 or
// fp16, or fp32 d without bias; epilogues without aux but GELU's; scales given.
bool can_run_fp8(const RowMajorGemm& g) {
  const auto t = g.d.scalar_type();
  if (g.trans_a || !g.trans_b || !fp8_type(g.b.scalar_type())) return false;
  if (g.a.scalar_type() == at::kFloat8_e5m2 && g.b.scalar_type() == at::kFloat8_e5m2) return false;
  if (t != at::kBFloat16 && t != at::kHalf && !(t == at::kFloat && !g.bias.defined())) return false;
  if (!g.a_scale_inv.defined() || !g.b_scale_inv.defined()) return false;
  if (uses_mask(g.epilogue) || g.epilogue == Epilogue::kDGeluBGrad ||
      g.epilogue == Epilogue::kBGradB) {
    return false;
  }
  for (const auto* x : {&g.a, &g.b}) {
    if (!x->is_cuda() || !x->is_contiguous() || !aligned16(*x) || x->size(1) % 16 != 0) {
      return false;
    }
  }
  for (const auto* x : {&g.c, &g.d, &g.bias, &g.aux}) {
    if (!x->defined()) continue;
    if (!x->is_cuda() || x->scalar_type() != t || !x->is_contiguous() || !aligned16(*x)) {
      return false;
    }
    if (x->dim() == 2 && (x->size(1) * x->element_size()) % 16 != 0) return false;
  }
  // cuBLASLt refuses scale pointers that are not 16-byte aligned ("not supported" at the matmul):
  // such a scale (a view into a larger one) takes the fallback.
  for (const auto* s : {&g.a_scale_inv, &g.b_scale_inv}) {
    if (!s->is_cuda() || s->scalar_type() != at::kFloat || !s->is_contiguous() || !aligned16(*s)) {
      return false;
    }
  }
  if (g.a_block == 0 || g.b_block == 0) {
    if (g.a_block != g.b_block || g.a_scale_inv.numel() != 1 || g.b_scale_inv.numel() != 1) {
      return false;
    }
  } else {
    // Block scaling (cuBLASLt on Hopper): no 128x128 x 128x128, the plain or bias epilogue only,
    // no fast accumulation.
    if (g.a_block == 2 && g.b_block == 2) return false;
    if (g.epilogue != Epilogue::kNone && g.epilogue != Epilogue::kBias) return false;
    if (g.fast_accum) return false;
  }
  if (g.a.size(0) == 0 || g.a.size(1) == 0 || g.b.size(0) == 0) return false;
  return !uses_aux(g.epilogue) || g.d.size(1) % 8 == 0;
}

}  // namespace

bool can_run(const RowMajorGemm& g) {
  if (fp8_type(g.a.scalar_type())) return can_run_fp8(g);
  const auto t = g.d.scalar_type();
  if (t != at::kBFloat16 && t != at::kHalf && t != at::kFloat) return false;
  // 16-bit a and b into fp32 c and d (a wgrad accumulating into an fp32 main_grad): no epilogue.
  const auto in = g.a.scalar_type();
  const bool widening = in != t && t == at::kFloat && (in == at::kBFloat16 || in == at::kHalf);
  if (in != t && !(widening && g.epilogue == Epilogue::kNone)) return false;
  const bool mask = uses_mask(g.epilogue);
  for (const auto* x : {&g.a, &g.b, &g.c, &g.d, &g.bias, &g.aux}) {
    if (!x->defined()) continue;
    if (x == &g.aux && mask) {  // the bit mask: bytes, checked below
      if (!x->is_cuda() || x->scalar_type() != at::kByte || !x->is_contiguous() || !aligned16(*x)) {
        return false;
      }
      continue;
    }
    const auto want = x == &g.a || x == &g.b ? in : t;
    if (!x->is_cuda() || x->scalar_type() != want || !x->is_contiguous() || !aligned16(*x)) {
      return false;
    }
    // rows 16-byte aligned
    if (x->dim() == 2 && (x->size(1) * x->element_size()) % 16 != 0) return false;
  }
  if (g.a.size(0) == 0 || g.a.size(1) == 0 || g.b.size(0) == 0 || g.b.size(1) == 0) return false;
  return !uses_aux(g.epilogue) || mask || g.d.size(1) % 8 == 0;
}

namespace {

// What a GEMM of one key needs besides its pointers: the descriptors and the heuristic's algorithm,
// built once. Per call only the bias and aux pointers are set (a descriptor's other attributes are
// functions of the key).
struct Prepared {
  MatmulDesc desc;
  Layout a, b, c, d;  // cuBLASLt's (see the mapping above)
  cublasLtMatmulAlgo_t algo;
};

void set_attribute(const MatmulDesc& desc, cublasLtMatmulDescAttributes_t attr, const void* value,
                   size_t size) {
  FUSIBLE_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, attr, value, size));
}

// Null where the heuristic finds no algorithm (kept so: try_run's answer is cached too).
std::unique_ptr<Prepared> prepare(const Key& key, const RowMajorGemm& g, cublasLtHandle_t handle,
                                  size_t workspace_size) {
  auto p = std::make_unique<Prepared>();
  const auto type = cuda_type(key.dtype);
  FUSIBLE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p->desc.handle, key.compute, CUDA_R_32F));
  // cuBLASLt's A is our b, its B is our a (see the mapping above).
  const cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a));
  set_attribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b));
  const auto epilogue = lt_epilogue(key.epilogue);
  set_attribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
  if (uses_aux(key.epilogue)) {
    // The ReLU mask's leading dim counts bits (the mask is bytes); the GELU aux's, elements.
    const int64_t aux_ld = uses_mask(key.epilogue) ? relu_mask_row_bytes(key.n) * 8 : key.n;
    set_attribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld));
  }
  if (fp8_type(key.a_type)) {
    const int8_t fast = key.fast_accum ? 1 : 0;
    set_attribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
    if (key.a_block != 0) {
      // cuBLASLt's A is our b, its B our a.
      const auto mode = [](int64_t block) -> int32_t {
        return block == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                          : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      };
      const int32_t a_mode = mode(key.b_block), b_mode = mode(key.a_block);
      set_attribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode));
      set_attribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode));
    }
    // The heuristic wants the scale pointers of block scales (each call sets its own again).
    const void* a_scale = g.b_scale_inv.data_ptr();
    const void* b_scale = g.a_scale_inv.data_ptr();
    set_attribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale));
    set_attribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale));
    if (key.epilogue != Epilogue::kNone) {
      const int32_t bias_type = type;  // FP8 kernels do not assume it
      set_attribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
    }
  }
  make_layout(p->a, cuda_type(key.b_type), g.b.size(0), g.b.size(1));  // our b, as stored
  make_layout(p->b, cuda_type(key.a_type), g.a.size(0), g.a.size(1));  // our a, as stored
  make_layout(p->c, type, key.m, key.n);
  make_layout(p->d, type, key.m, key.n);

  Preference pref;
  FUSIBLE_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref.handle));
  FUSIBLE_CUBLASLT_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.handle, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_size, sizeof(workspace_size)));
  // The pointers' real alignment (the default assumes 256 bytes).
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d}};
  for (const auto& [attr, align] : aligns) {
    FUSIBLE_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref.handle, attr, &align, sizeof(align)));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const auto status =
      cublasLtMatmulAlgoGetHeuristic(handle, p->desc.handle, p->a.handle, p->b.handle, p->c.handle,
                                     p->d.handle, pref.handle, 1, &result, &found);
  // A block-scaled problem this cuBLASLt declines runs the reference (cached as declined too).
  if (key.a_block != 0 && status != CUBLAS_STATUS_SUCCESS) return nullptr;
  FUSIBLE_CUBLASLT_CHECK(status);
  if (found == 0) return nullptr;
  p->algo = result.algo;
  return p;
}

// Per thread: a descriptor's pointers are set per call, so threads must not share one (and no
// lock is taken on the per-call path). The autograd engine runs a device's backwards on one thread.
Prepared* prepared(const Key& key, const RowMajorGemm& g, cublasLtHandle_t handle,
                   size_t workspace_size) {
  thread_local std::unordered_map<Key, std::unique_ptr<Prepared>, KeyHash> cache;
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, prepare(key, g, handle, workspace_size)).first;
  return it->second.get();
}

// Runs g, or returns false (nothing run) where no algorithm fits.
bool run_if_possible(const RowMajorGemm& g) {
  const int64_t m = rows_of_op(g.a, g.trans_a);
  const int64_t k = cols_of_op(g.a, g.trans_a);
  const int64_t n = cols_of_op(g.b, g.trans_b);
  TORCH_CHECK(rows_of_op(g.b, g.trans_b) == k && g.d.size(0) == m && g.d.size(1) == n,
              "cuBLASLt GEMM: inconsistent shapes (m ", m, ", n ", n, ", k ", k, ")");
  if (g.epilogue != Epilogue::kNone) {
    const int64_t bias_size = g.epilogue == Epilogue::kBGradB ? m : n;
    TORCH_CHECK(g.bias.defined() && g.bias.numel() == bias_size, "cuBLASLt GEMM: epilogue ",
                epilogue_name(g.epilogue), " expects a bias of ", bias_size, " elements");
  }
  if (uses_aux(g.epilogue)) {
    const int64_t aux_cols = uses_mask(g.epilogue) ? relu_mask_row_bytes(n) : n;
    TORCH_CHECK(
        g.aux.defined() && g.aux.dim() == 2 && g.aux.size(0) == m && g.aux.size(1) == aux_cols,
        "cuBLASLt GEMM: epilogue ", epilogue_name(g.epilogue), " expects aux [", m, ", ", aux_cols,
        "]");
  }
  const bool has_c = g.c.defined() && g.beta != 0.0;
  if (has_c) {
    TORCH_CHECK(g.c.size(0) == m && g.c.size(1) == n, "cuBLASLt GEMM: expected c of shape [", m,
                ", ", n, "]");
  }
  const c10::cuda::CUDAGuard guard(g.d.device());
  const auto dtype = g.d.scalar_type();
  const bool tf32 = dtype == at::kFloat && g.a.scalar_type() == at::kFloat &&
                    at::globalContext().allowTF32CuBLAS();
  const void* c_ptr = has_c ? g.c.data_ptr() : g.d.data_ptr();
  const Key key{g.d.device().index(),
                m,
                n,
                k,
                g.trans_a,
                g.trans_b,
                has_c,
                has_c && g.c.is_same(g.d),
                dtype,
                g.a.scalar_type(),
                g.b.scalar_type(),
                g.fast_accum && fp8_type(g.a.scalar_type()),
                g.epilogue,
                tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                alignment(g.b.data_ptr()),
                alignment(g.a.data_ptr()),
                alignment(c_ptr),
                alignment(g.d.data_ptr()),
                g.a_block,
                g.b_block};
  auto handle = at::cuda::getCurrentCUDABlasLtHandle();
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  auto* found = prepared(key, g, handle, workspace_size);
  if (found == nullptr) return false;
  auto& p = *found;
  if (fp8_type(key.a_type)) {
    // cuBLASLt's A is our b (see the mapping above).
    const void* a_scale = g.b_scale_inv.data_ptr();
    const void* b_scale = g.a_scale_inv.data_ptr();
    set_attribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale));
    set_attribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale));
  }
  if (g.epilogue != Epilogue::kNone) {
    const void* bias = g.bias.data_ptr();
    set_attribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  }
  if (uses_aux(g.epilogue)) {
    const void* aux = g.aux.data_ptr();
    set_attribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux));
  }
  const float alpha = static_cast<float>(g.alpha);
  const float beta = has_c ? static_cast<float>(g.beta) : 0.0f;
  FUSIBLE_CUBLASLT_CHECK(cublasLtMatmul(
      handle, p.desc.handle, &alpha, g.b.data_ptr(), p.a.handle, g.a.data_ptr(), p.b.handle, &beta,
      c_ptr, p.c.handle, g.d.data_ptr(), p.d.handle, &p.algo, at::cuda::getCUDABlasLtWorkspace(),
      workspace_size, c10::cuda::getCurrentCUDAStream()));
  return true;
}

}  // namespace

bool try_run(const RowMajorGemm& g) { return run_if_possible(g); }

void run(const RowMajorGemm& g) {
  TORCH_CHECK(run_if_possible(g), "cuBLASLt GEMM: no algorithm for ", g.a.sizes(),
              g.trans_a ? "^T" : "", " x ", g.b.sizes(), g.trans_b ? "^T" : "", ", ",
              g.a.scalar_type(), " to ", g.d.scalar_type(), ", epilogue ",
              epilogue_name(g.epilogue));
}

}  // namespace fusible::kernels::gemm
