// merge_attention: the rules of the merge problem (they live here, beside the problem's dispatch,
// as src/host/validate.cpp holds attention's), then the backend's elementwise pass.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/merge.hpp"
#include "host/dispatch.hpp"
#include "tileattn/error.hpp"
#include "tileattn/merge.hpp"

#ifdef TILEATTN_WITH_CUDA
#include "cuda/cuda_backend.hpp"
#include "cuda/merge/merge.hpp"
#endif

namespace tileattn {
namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

std::string str(int64_t v) { return std::to_string(v); }

const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

int64_t element_bytes(DType d) { return d == DType::f32 ? 4 : 2; }

void check_dtype(DType d, const char* name) {
  if (d != DType::f32 && d != DType::f16 && d != DType::bf16)
    throw Error(ErrorKind::invalid_type,
                std::string(name) + "=" + str(int64_t(d)) + " is not a supported DType (f32=0, f16=1, bf16=2)");
}

void check_pointer(const void* p, int64_t alignment, const std::string& name) {
  if (p == nullptr) invalid(name + " is null");
  if (reinterpret_cast<uintptr_t>(p) % uintptr_t(alignment) != 0)
    invalid(name + " is not aligned to " + str(alignment) + " bytes (the size of its element)");
}

struct Dim {
  std::string field;
  int64_t stride, extent;
  const char* extent_name;
};

int64_t checked_mul_add(int64_t acc, int64_t a, int64_t b, const std::string& tensor) {
  int64_t prod, sum;
  if (__builtin_mul_overflow(a, b, &prod) || __builtin_add_overflow(acc, prod, &sum))
    invalid(tensor + " addresses more than INT64_MAX elements");
  return sum;
}

// Strides in elements over a contiguous run of `inner` elements. Every stride is >= 0; an input
// may be expanded (a zero stride reads one index for all), an output's stride is > 0 where its
// dimension has more than one index and it must not overlap itself (two threads would write one
// element): sorted by stride, each dimension steps past the span of the smaller ones. Returns the
// span in elements (highest index + 1), for the aliasing check.
int64_t check_strides(const std::string& tensor, int64_t inner, std::vector<Dim> dims, bool is_output) {
  int64_t last = inner - 1;
  for (const Dim& d : dims) {
    if (d.stride < 0) invalid(tensor + "." + d.field + "=" + str(d.stride) + " must not be negative");
    if (is_output && d.stride == 0 && d.extent > 1)
      invalid(tensor + "." + d.field + "=0 must be positive (" + d.extent_name + "=" + str(d.extent) + " > 1)");
    last = checked_mul_add(last, d.extent - 1, d.stride, tensor);
  }
  if (is_output) {
    std::erase_if(dims, [](const Dim& d) { return d.extent <= 1; });
    std::stable_sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
    int64_t span = inner;
    for (const Dim& d : dims) {
      if (d.stride < span)
        invalid(tensor + "." + d.field + "=" + str(d.stride) + " makes output " + tensor + " overlap itself: it must be >= " +
                str(span));
      span = checked_mul_add(span, d.extent - 1, d.stride, tensor);
    }
  }
  return last + 1;
}

// The side that is read must not share memory with the accumulator being written: each element
// would be read after another thread overwrote it.
void check_disjoint(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes, const char* a_name,
                    const char* b_name) {
  const auto a0 = reinterpret_cast<uintptr_t>(a), b0 = reinterpret_cast<uintptr_t>(b);
  if (a0 < b0 + uintptr_t(b_bytes) && b0 < a0 + uintptr_t(a_bytes))
    invalid(std::string(b_name) + " overlaps " + a_name + " (the merge writes " + a_name + " in place)");
}

void check_backend_enum(Backend b) {
  if (b != Backend::automatic && b != Backend::cpu && b != Backend::cuda)
    invalid("backend=" + str(int64_t(b)) + " is not a Backend (automatic=0, cpu=1, cuda=2)");
}

using host::check_memory_space;

void validate(const MergeProblem& p, Backend backend) {
  check_dtype(p.out_dtype, "out_dtype");
  check_dtype(p.out_b_dtype, "out_b_dtype");
  if (p.out_dtype != DType::f32 && p.out_b_dtype != p.out_dtype)
    throw Error(ErrorKind::invalid_type, std::string("out_b_dtype=") + dtype_name(p.out_b_dtype) +
                                             " must equal out_dtype=" + dtype_name(p.out_dtype) +
                                             " (a 16-bit accumulator merges its own dtype; use an f32 out to mix)");
  if (p.num_threads < 0)
    invalid("num_threads=" + str(int64_t(p.num_threads)) + " must be >= 0 (0 = all hardware threads)");

  check_pointer(p.out.data, element_bytes(p.out_dtype), "out.data");
  check_pointer(p.out_b.data, element_bytes(p.out_b_dtype), "out_b.data");
  check_pointer(p.lse, sizeof(float), "lse");
  check_pointer(p.lse_b, sizeof(float), "lse_b");
  check_memory_space(p.out.data, "out.data", backend);
  check_memory_space(p.out_b.data, "out_b.data", backend);
  check_memory_space(p.lse, "lse", backend);
  check_memory_space(p.lse_b, "lse_b", backend);

  const auto o_dims = [&](const TensorView& t) {
    return std::vector<Dim>{{"head_stride", t.head_stride, p.heads, "heads"},
                            {"seq_stride", t.seq_stride, p.seqlen, "seqlen"},
                            {"batch_stride", t.batch_stride, p.batch, "batch"}};
  };
  const int64_t out_span = check_strides("out", p.headdim, o_dims(p.out), true);
  const int64_t out_b_span = check_strides("out_b", p.headdim, o_dims(p.out_b), false);
  const auto l_dims = [&](int64_t head_stride, int64_t batch_stride) {
    return std::vector<Dim>{{"head_stride", head_stride, p.heads, "heads"},
                            {"batch_stride", batch_stride, p.batch, "batch"}};
  };
  // L's rows are contiguous: lse_head_stride and lse_batch_stride name the fields.
  const int64_t lse_span = check_strides("lse", p.seqlen, l_dims(p.lse_head_stride, p.lse_batch_stride), true);
  const int64_t lse_b_span =
      check_strides("lse_b", p.seqlen, l_dims(p.lse_b_head_stride, p.lse_b_batch_stride), false);
  check_disjoint(p.out.data, out_span * element_bytes(p.out_dtype), p.out_b.data,
                 out_b_span * element_bytes(p.out_b_dtype), "out", "out_b");
  check_disjoint(p.lse, lse_span * 4, p.lse_b, lse_b_span * 4, "lse", "lse_b");
  check_disjoint(p.out.data, out_span * element_bytes(p.out_dtype), p.lse, lse_span * 4, "out", "lse");
  // Each written tensor against the other side's input too: a row's write must not change what a
  // later row reads.
  check_disjoint(p.out.data, out_span * element_bytes(p.out_dtype), p.lse_b, lse_b_span * 4, "out", "lse_b");
  check_disjoint(p.lse, lse_span * 4, p.out_b.data, out_b_span * element_bytes(p.out_b_dtype), "lse", "out_b");
}

}  // namespace

void merge_attention(const MergeProblem& problem) {
  const MergeProblem& p = problem;
  check_backend_enum(p.backend);
  for (auto [name, v] : {std::pair{"batch", p.batch}, {"seqlen", p.seqlen}, {"heads", p.heads}, {"headdim", p.headdim}})
    if (v < 0) invalid(std::string(name) + "=" + str(v) + " must be >= 0");
  if (p.batch == 0 || p.seqlen == 0 || p.heads == 0 || p.headdim == 0) return;

  const Backend backend = host::resolve(p.backend, p.out.data);
  host::check_backend_present(backend);
  validate(p, backend);
#ifdef TILEATTN_WITH_CUDA
  if (backend == Backend::cuda) return cuda::merge_attention(p);
#endif
  cpu::merge_attention(p);
}

}  // namespace tileattn
