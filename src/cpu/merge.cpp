// CPU merge of partial attention results: one task per block of (batch, row) pairs, each row's
// heads merged with the shared weights (src/common/merge_weights.hpp).
#include "cpu/merge.hpp"

#include <algorithm>

#include "common/merge_weights.hpp"
#include "cpu/convert.hpp"
#include "cpu/parallel.hpp"

namespace tileattn::cpu {

void merge_attention(const MergeProblem& p) {
  const int64_t rows = p.batch * p.seqlen;
  // An elementwise pass: about 6 operations per element (two loads, two products, a sum, a store).
  const int threads = threads_for(p.num_threads, 6.0 * double(rows) * double(p.heads * p.headdim));
  constexpr int64_t kRowsPerTask = 16;
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(tasks, threads, [&](int64_t task) {
    const int64_t r1 = std::min(rows, (task + 1) * kRowsPerTask);
    for (int64_t r = task * kRowsPerTask; r < r1; ++r) {
      const int64_t b = r / p.seqlen, i = r % p.seqlen;
      for (int64_t h = 0; h < p.heads; ++h) {
        float& lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + i];
        const float lse_b = p.lse_b[b * p.lse_b_batch_stride + h * p.lse_b_head_stride + i];
        const MergeWeights w = merge_weights(lse, lse_b);
        const int64_t oa = b * p.out.batch_stride + i * p.out.seq_stride + h * p.out.head_stride;
        const int64_t ob = b * p.out_b.batch_stride + i * p.out_b.seq_stride + h * p.out_b.head_stride;
        for (int64_t d = 0; d < p.headdim; ++d) {
          // A zero weight selects 0 rather than multiplying: the side's O may be anything there.
          const float xa = w.a > 0.0f ? w.a * load_element(p.out.data, oa + d, p.out_dtype) : 0.0f;
          const float xb = w.b > 0.0f ? w.b * load_element(p.out_b.data, ob + d, p.out_b_dtype) : 0.0f;
          store_element(p.out.data, oa + d, p.out_dtype, xa + xb);
        }
        lse = w.lse;
      }
    }
  });
}

}  // namespace tileattn::cpu
