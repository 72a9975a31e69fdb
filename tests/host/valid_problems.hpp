#pragma once
// Small valid problems over host buffers, for tests that break one rule at a time. Values are
// never read by validation (only cu_seqlens are), so the buffers stay zero.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tileattn/error.hpp"
#include "tileattn/problem.hpp"

namespace tileattn::test {

// Contiguous (batch, seqlen, heads, dim) fp32 tensors, or (total, heads, dim) for varlen.
struct ValidAttention {
  std::vector<float> q, k, v, o, dout, dq, dk, dv, lse;
  std::vector<int32_t> cu_q, cu_k;
  AttentionProblem p;

  ValidAttention(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads_q, int64_t heads_kv,
                 int64_t headdim_qk, int64_t headdim_v) {
    p.batch = batch;
    p.seqlen_q = seqlen_q;
    p.seqlen_k = seqlen_k;
    p.heads_q = heads_q;
    p.heads_kv = heads_kv;
    p.headdim_qk = headdim_qk;
    p.headdim_v = headdim_v;
    p.dtype = DType::f32;
    p.backend = Backend::cpu;
    bind(q, p.q, batch, seqlen_q, heads_q, headdim_qk);
    bind(k, p.k, batch, seqlen_k, heads_kv, headdim_qk);
    bind(v, p.v, batch, seqlen_k, heads_kv, headdim_v);
    bind(o, p.o, batch, seqlen_q, heads_q, headdim_v);
    bind(dout, p.dout, batch, seqlen_q, heads_q, headdim_v);
    bind(dq, p.dq, batch, seqlen_q, heads_q, headdim_qk);
    bind(dk, p.dk, batch, seqlen_k, heads_kv, headdim_qk);
    bind(dv, p.dv, batch, seqlen_k, heads_kv, headdim_v);
    lse.assign(size_t(batch * heads_q * seqlen_q), 0.0f);
    p.lse = lse.data();
  }

  // Default: batch 2, seqlen_q 4, seqlen_k 6, heads 4 over 2 kv heads, head dims 8 and 16.
  ValidAttention() : ValidAttention(2, 4, 6, 4, 2, 8, 16) {}

  // Turns the (batch, seqlen) tensors into one varlen batch with these per-sequence lengths
  // (batch entries each); the buffers already hold batch * seqlen rows, enough for any lengths
  // up to seqlen.
  void make_varlen(const std::vector<int32_t>& len_q, const std::vector<int32_t>& len_k) {
    cu_q = offsets(len_q);
    cu_k = offsets(len_k);
    p.cu_seqlens_q = cu_q.data();
    p.cu_seqlens_k = cu_k.data();
    p.total_q = p.batch * p.seqlen_q;
    p.total_k = p.batch * p.seqlen_k;
  }

 private:
  static void bind(std::vector<float>& buf, TensorView& view, int64_t batch, int64_t seqlen, int64_t heads,
                   int64_t dim) {
    buf.assign(size_t(batch * seqlen * heads * dim), 0.0f);
    view.data = buf.data();
    view.head_stride = dim;
    view.seq_stride = heads * dim;
    view.batch_stride = seqlen * heads * dim;
  }
  static std::vector<int32_t> offsets(const std::vector<int32_t>& lengths) {
    std::vector<int32_t> cu(1, 0);
    for (int32_t n : lengths) cu.push_back(cu.back() + n);
    return cu;
  }
};

// softmax(X) @ V with contiguous fp32 X (batch, d1, d2), V (batch, d2, d3), out (batch, d1, d3).
struct ValidSoftmaxMatmul {
  std::vector<float> x, v, out;
  SoftmaxMatmulProblem p;

  ValidSoftmaxMatmul(int64_t batch = 2, int64_t d1 = 3, int64_t d2 = 5, int64_t d3 = 4) {
    p.batch = batch;
    p.d1 = d1;
    p.d2 = d2;
    p.d3 = d3;
    p.dtype = DType::f32;
    p.backend = Backend::cpu;
    x.assign(size_t(batch * d1 * d2), 0.0f);
    v.assign(size_t(batch * d2 * d3), 0.0f);
    out.assign(size_t(batch * d1 * d3), 0.0f);
    p.x = x.data();
    p.v = v.data();
    p.out = out.data();
    p.x_row_stride = d2;
    p.x_batch_stride = d1 * d2;
    p.v_row_stride = d3;
    p.v_batch_stride = d2 * d3;
    p.out_row_stride = d3;
    p.out_batch_stride = d1 * d3;
  }
};

// Runs `call`, which must throw tileattn::Error of `kind` whose message contains every fragment.
inline void expect_error(const std::function<void()>& call, ErrorKind kind, const std::vector<std::string>& fragments) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_EQ(int(e.kind()), int(kind)) << "message: " << e.what();
    const std::string message = e.what();
    for (const std::string& f : fragments) {
      EXPECT_NE(message.find(f), std::string::npos) << "message \"" << message << "\" lacks \"" << f << "\"";
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected tileattn::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected tileattn::Error, nothing was thrown";
}

}  // namespace tileattn::test
