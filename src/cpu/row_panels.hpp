#pragma once
// One input's rows as dense fp32 panels, one (sequence, head) after another, copied once per call
// where the rows cannot be read in place (strided rows, 16-bit, pages) and several tasks read each
// row: otherwise every task copies the rows it reads. In flash-attn's (B, N, H, D) layout each row
// of a head is on a 4 KiB page of its own; the forward's per-task copies of K and V were 5.4% of
// its samples, the backward's of Q and dO (once per key tile) 5.2%.
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu/parallel.hpp"
#include "cpu/tile_ops.hpp"

namespace tileattn::cpu {

class RowPanels {
 public:
  // Copies t's rows (query_side: Q-like, else K-like) when that pays, as above; `readers`: the
  // tasks that read each row.
  RowPanels(const AttentionProblem& p, const TensorView& t, bool query_side, int64_t heads, int64_t dim,
            int64_t readers, int threads)
      : t_(t), query_side_(query_side), dim_(dim) {
    if (rows_in_place(p, t, query_side, dim) || readers <= 1) return;
    first_.assign(size_t(p.batch + 1), 0);
    for (int64_t b = 0; b < p.batch; ++b) first_[size_t(b + 1)] = first_[size_t(b)] + heads * length(sequence(p, b));
    if (double(first_.back()) * double(dim) > kMaxFloats) {
      first_.clear();
      return;
    }
    data_.buffer = PanelBuffer::take(size_t(first_.back() * dim));  // not zeroed: every row is copied in
    if (!data_.buffer) {
      first_.clear();
      return;
    }
    parallel_for(p.batch * heads, threads, [&](int64_t task) {
      const int64_t b = task / heads, h = task % heads;
      const Sequence s = sequence(p, b);
      load_rows(p, t_, s, query_side_, h, 0, length(s), dim_, data_.buffer->data() + row(s, h, 0) * dim_, dim_);
    });
  }

  // Rows i0 .. i0 + n of head h: from the panels, else as view_rows (in place, or copied into
  // scratch).
  RowsView rows(const AttentionProblem& p, const Sequence& s, int64_t h, int64_t i0, int64_t n, float* scratch) const {
    if (data_.buffer) return {data_.buffer->data() + row(s, h, i0) * dim_, dim_};
    return view_rows(p, t_, s, query_side_, h, i0, n, dim_, scratch);
  }

 private:
  // Panel memory kept by the calling thread between calls, up to kKeepFloats a buffer (a call
  // holds two: K and V, or Q and dO): allocated per call, it went back to the system on free and
  // was faulted in again page by page (about a thousand minor faults a call at B=1, H=8,
  // N=1024, D=64, some 5% of the forward).
  class PanelBuffer {
   public:
    static PanelBuffer* take(size_t floats) {
      thread_local PanelBuffer buffers[kBuffers];
      PanelBuffer* free = nullptr;
      for (PanelBuffer& b : buffers)
        if (!b.in_use_ && (!free || b.capacity_ > free->capacity_)) free = &b;
      if (!free) return nullptr;  // (no call holds more than two)
      if (free->capacity_ < floats) {
        free->data_.reset(), free->capacity_ = 0;  // (empty, not stale, if the allocation throws)
        free->data_.reset(new float[floats]);
        free->capacity_ = floats;
      }
      free->in_use_ = true;
      return free;
    }
    float* data() const { return data_.get(); }
    void give_back() {
      in_use_ = false;
      if (capacity_ > kKeepFloats) data_.reset(), capacity_ = 0;
    }

   private:
    static constexpr int kBuffers = 4;
    static constexpr size_t kKeepFloats = size_t(1) << 22;  // 16 MiB
    std::unique_ptr<float[]> data_;
    size_t capacity_ = 0;
    bool in_use_ = false;
  };

  static constexpr double kMaxFloats = double(1 << 28);  // 1 GiB: past it, tasks copy their own rows
  int64_t length(const Sequence& s) const { return query_side_ ? s.len_q : s.len_k; }
  int64_t row(const Sequence& s, int64_t h, int64_t i) const { return first_[size_t(s.b)] + h * length(s) + i; }

  TensorView t_;
  bool query_side_;
  int64_t dim_;
  std::vector<int64_t> first_;  // per sequence: the first row of its head 0
  // The buffer this call holds, given back when the panels go (also when a copy throws).
  struct Lease {
    PanelBuffer* buffer = nullptr;
    Lease() = default;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (buffer) buffer->give_back();
    }
  };
  Lease data_;
};

}  // namespace tileattn::cpu
