#include "cuda/arch/tma_map.hpp"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include "cuda/common/check.cuh"

namespace tileattn::cuda::sm90 {

namespace {

// The driver's encoder, looked up through the runtime so that the library does not link libcuda.
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    TA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p) : nullptr;
  }();
  return fn;
}

}  // namespace

bool make_tile_map(CUtensorMap* map, DType dtype, const void* base, const TileMapShape& s) {
  const auto fn = encoder();
  if (fn == nullptr) return false;
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  const int64_t kElement = dtype == DType::f32 ? 4 : 2;
  const cuuint64_t dims[4] = {cuuint64_t(s.dim), cuuint64_t(s.rows), cuuint64_t(s.heads), cuuint64_t(s.batch)};
  const int64_t strides[3] = {s.row_stride * kElement, s.head_stride * kElement, s.batch_stride * kElement};
  cuuint64_t byte_strides[3];
  for (int i = 0; i < 3; ++i) {
    // A size-1 dimension's stride is never used (and may be anything, 0 included).
    if (dims[i + 1] == 1) {
      byte_strides[i] = 16;
      continue;
    }
    if (strides[i] <= 0 || strides[i] % 16 != 0 || strides[i] >= (int64_t(1) << 40)) return false;
    byte_strides[i] = cuuint64_t(strides[i]);
  }
  // One 128-byte row per box row: the width of the swizzle pattern.
  const cuuint32_t box[4] = {cuuint32_t(128 / kElement), cuuint32_t(s.box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = dtype == DType::f32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = fn(map, type, 4, const_cast<void*>(base), dims, byte_strides, box, element_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

bool make_store_map(CUtensorMap* map, DType dtype, const void* base, const TileMapShape& s) {
  const int64_t kElement = dtype == DType::f32 ? 4 : 2;
  return s.dim * kElement % 16 == 0 && make_tile_map(map, dtype, base, s);
}

TileMapShape attention_map_shape(const AttentionProblem& problem, const TensorView& t, int64_t dim, int64_t seqlen,
                                 int64_t total, int64_t heads, int box_rows) {
  TileMapShape s;
  const bool varlen = problem.is_varlen();
  s.dim = dim, s.rows = varlen ? total : seqlen, s.heads = heads, s.batch = varlen ? 1 : problem.batch;
  s.row_stride = t.seq_stride, s.head_stride = t.head_stride, s.batch_stride = varlen ? 0 : t.batch_stride;
  s.box_rows = box_rows;
  return s;
}

}  // namespace tileattn::cuda::sm90
