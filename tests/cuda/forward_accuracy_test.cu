// The fp16/bf16 CUDA forward against the float64 oracle over the feature space: lengths, head
// dims (padded buckets, dims that are not multiples of 8), headdim_v != headdim_qk, GQA/MQA,
// causal and windows with seqlen_q != seqlen_k, soft-capping, varlen batches with empty
// sequences, split-KV and strided layouts, all through the public tileattn::forward.
//
// Rule (flash-attn's): max |O - O_ref| <= 2 max |O_naive - O_ref| + one rounding of max |O_ref|,
// O_naive from the naive same-precision kernel in gpu_test_util.cuh; the same for L with an
// fp32-sized floor. Outputs and every gap around them are poisoned: unwritten elements show as
// NaN, stray writes as touched poison.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/reference.hpp"
#include "cuda/gpu_test_util.cuh"
#include "host/validate.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

struct ForwardCase {
  std::string name;
  ProblemShape shape;
  bool expect_split = false;  // split-KV must be chosen (checked through forward_workspace_size)
  bool expect_sm90 = false;   // a Hopper device must run it on the TMA + wgmma kernel
  // Key row j of a sequence of n scaled by 1 + |ramp| * t, t = j / (n - 1) (ramp > 0) or
  // 1 - j / (n - 1) (ramp < 0): each row's max keeps rising along the keys or against them.
  double key_ramp = 0.0;
};

// Scales K's rows by the case's ramp (in place, before the upload).
void apply_key_ramp(HostProblem& hp, double ramp) {
  if (ramp == 0.0) return;
  std::vector<double> k = hp.k.gather();  // (batch * seqlen, heads, dim)
  const int64_t n = hp.k.seqlen, per_row = hp.k.heads * hp.k.dim;
  for (int64_t r = 0; r < hp.k.batch * n; ++r) {
    const double t = n > 1 ? double(r % n) / double(n - 1) : 0.0;
    const double f = 1.0 + (ramp > 0 ? ramp * t : -ramp * (1.0 - t));
    for (int64_t i = 0; i < per_row; ++i) k[r * per_row + i] *= f;
  }
  hp.k.scatter(k);
}

ProblemShape shape(int64_t sq, int64_t sk, int64_t d, int64_t hq = 2, int64_t hkv = 2) {
  ProblemShape s;
  s.seqlen_q = sq;
  s.seqlen_k = sk;
  s.headdim_qk = d;
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.with_backward = false;
  return s;
}

std::vector<ForwardCase> base_cases() {
  std::vector<ForwardCase> c;
  // Lengths, square, with and without the causal mask.
  for (int64_t n : {1, 17, 127, 1000}) {
    c.push_back({"len" + std::to_string(n), shape(n, n, 64)});
    ProblemShape s = shape(n, n, 64);
    s.causal = true;
    c.push_back({"len" + std::to_string(n) + "_causal", s});
  }
  {
    ProblemShape s = shape(4096, 4096, 128, 1, 1);
    c.push_back({"len4096", s});
    s.causal = true;
    c.push_back({"len4096_causal", s});
  }
  // At D = 128, key ranges from 8192 on take the 192-key instance on Hopper (not a multiple of
  // 192 here, so the last key tile is ragged).
  {
    ProblemShape s = shape(8300, 8300, 128, 1, 1);
    s.causal = true;
    c.push_back({"len8300_causal", s});
    c.push_back({"sq300_sk9000_gqa", shape(300, 9000, 128, 4, 2)});
  }
  // Rows whose max climbs across the key tiles (scores' spread 1 to 6 along the keys): with the
  // keys visited from the last, rising toward key 0 moves each row's reference max again and
  // again, by more than the kernels' slack (2^8) and by less; rising toward the end leaves it
  // stale for every tile after the first (P up to 2^8).
  for (double ramp : {5.0, -5.0}) {
    const std::string dir = ramp > 0 ? "key_ramp_up" : "key_ramp_down";
    ForwardCase a{dir, shape(200, 1000, 64)};
    a.key_ramp = ramp;
    c.push_back(a);
    ForwardCase b{dir + "_causal_d128", shape(1000, 1000, 128)};
    b.shape.causal = true;
    b.key_ramp = ramp;
    c.push_back(b);
    // Two queries of a 4:1 group: the decode kernel (8 packed rows), over key splits.
    ForwardCase d{dir + "_decode_gqa", shape(2, 3000, 64, 8, 2)};
    d.key_ramp = ramp;
    c.push_back(d);
  }
  // seqlen_q != seqlen_k both ways; causal is bottom-right aligned (rows that see no key: O = 0).
  for (auto [sq, sk] : {std::pair<int64_t, int64_t>{17, 1000}, {1000, 17}, {127, 300}, {300, 127}}) {
    const std::string n = "sq" + std::to_string(sq) + "_sk" + std::to_string(sk);
    c.push_back({n, shape(sq, sk, 64)});
    ProblemShape s = shape(sq, sk, 64);
    s.causal = true;
    c.push_back({n + "_causal", s});
  }
  // Head dims: every bucket, dims padded up to a bucket, and dims that are not multiples of 8
  // (element-wise loads instead of cp.async).
  for (int64_t d : {32, 40, 64, 80, 96, 112, 128, 160, 192, 224, 256, 20, 100}) {
    c.push_back({"d" + std::to_string(d), shape(200, 333, d)});
  }
  {
    ProblemShape s = shape(190, 190, 256);
    s.causal = true;
    c.push_back({"d256_causal", s});
  }
  // headdim_v != headdim_qk.
  for (auto [dqk, dv] : {std::pair<int64_t, int64_t>{128, 64}, {64, 128}, {192, 128}, {32, 256}}) {
    ProblemShape s = shape(150, 260, dqk);
    s.headdim_v = dv;
    s.causal = dqk == 192;
    c.push_back({"dqk" + std::to_string(dqk) + "_dv" + std::to_string(dv), s});
  }
  // GQA / MQA.
  {
    ProblemShape s = shape(257, 257, 64, 8, 2);
    c.push_back({"gqa8_2", s});
    s.causal = true;
    c.push_back({"gqa8_2_causal", s});
    ProblemShape m = shape(100, 513, 128, 4, 1);
    c.push_back({"mqa4", m});
  }
  // Sliding windows (flash-attn semantics), also with seqlen_q != seqlen_k.
  for (auto [l, r] : {std::pair<int64_t, int64_t>{64, 0}, {32, 16}, {-1, 10}, {0, 0}, {200, -1}}) {
    ProblemShape s = shape(300, 300, 64);
    s.window_left = l, s.window_right = r;
    c.push_back({"window_" + std::to_string(l + 1) + "_" + std::to_string(r + 1), s});
  }
  {
    ProblemShape s = shape(100, 700, 64);
    s.window_left = 150, s.window_right = 0;
    c.push_back({"window_sq100_sk700", s});
    ProblemShape t = shape(700, 100, 128);
    t.window_left = 40, t.window_right = 5;
    c.push_back({"window_sq700_sk100", t});
  }
  // The wide head dims step 112 keys (D = 192) and 80 (D = 256) on Hopper: key ranges that are no
  // multiple of either, a two-sided window, GQA, sq > sk with rows that see no key, varlen.
  {
    ProblemShape s = shape(333, 1000, 192, 8, 2);
    s.window_left = 170, s.window_right = 45;
    c.push_back({"wide_d192_window_gqa", s});
    ProblemShape t = shape(700, 250, 256, 4, 4);
    t.causal = true;
    t.softcap = 6.0f;
    c.push_back({"wide_d256_sq_gt_sk_causal_softcap", t});
    ProblemShape v = shape(0, 0, 256, 2, 1);
    v.seqlens_q = {81, 0, 500};
    v.seqlens_k = {161, 9, 479};
    v.causal = true;
    c.push_back({"wide_d256_varlen_causal_mqa", v});
    ProblemShape d = shape(1000, 1000, 192, 2, 2);
    d.headdim_v = 128;
    d.causal = true;
    c.push_back({"wide_dqk192_dv128_causal", d});
  }
  // Soft-capping, alone and under a causal mask; a large scale makes the cap bite.
  {
    ProblemShape s = shape(200, 300, 64);
    s.softcap = 2.0f;
    c.push_back({"softcap", s});
    s.causal = true;
    s.softmax_scale = 0.5f;
    c.push_back({"softcap_causal_scale", s});
  }
  // Varlen batches, with an empty query and an empty key sequence.
  {
    ProblemShape s = shape(0, 0, 64, 4, 2);
    s.seqlens_q = {5, 0, 130, 64, 200};
    s.seqlens_k = {7, 3, 130, 0, 260};
    c.push_back({"varlen", s});
    s.causal = true;
    c.push_back({"varlen_causal", s});
    ProblemShape w = shape(0, 0, 96, 2, 1);
    w.seqlens_q = {300, 1, 77};
    w.seqlens_k = {300, 900, 50};
    w.window_left = 33, w.window_right = 7;
    c.push_back({"varlen_window_d96", w});
  }
  // Split-KV: few query rows against many keys.
  {
    ProblemShape s = shape(1, 8192, 128, 4, 4);
    c.push_back({"split_decode", s, true});
    ProblemShape g = shape(16, 4096, 64, 8, 2);
    g.causal = true;
    c.push_back({"split_gqa_causal", g, true});
    ProblemShape w = shape(64, 20000, 128, 2, 1);
    w.window_left = 3000, w.window_right = 0;
    c.push_back({"split_window", w, true});
    ProblemShape v = shape(0, 0, 64, 2, 2);
    v.seqlens_q = {1, 0, 3};
    v.seqlens_k = {5000, 100, 9000};
    c.push_back({"split_varlen", v, true});
    ProblemShape d = shape(3, 5000, 80, 2, 2);
    d.softcap = 5.0f;
    c.push_back({"split_d80_softcap", d, true});
    // Value rows of 34 columns: the combine's column loop without 4-column vectors.
    ProblemShape o = shape(2, 6000, 40, 4, 2);
    o.headdim_v = 34;
    c.push_back({"split_dv34_gqa", o, true});
  }
  // More equal query tiles than SMs (no mask, one length): on Hopper one block per SM walks the
  // tiles, two Q buffers deep; blocks of one to four tiles, ragged last query tiles, GQA,
  // seqlen_q != seqlen_k.
  {
    ProblemShape a = shape(600, 600, 64, 32, 8);
    a.batch = 3;
    c.push_back({"persistent_gqa_d64", a, false, true});
    ProblemShape b = shape(400, 333, 128, 16, 16);
    b.batch = 4;
    c.push_back({"persistent_d128", b, false, true});
    ProblemShape d = shape(1100, 1000, 96, 12, 4);
    d.batch = 2;
    c.push_back({"persistent_d96", d, false, true});
    // Up to 4096 keys: 17 key tiles a unit, more keys than queries; and on three consumers (192-row
    // tiles, head dims up to 64), 24 key tiles, the last ragged.
    c.push_back({"persistent_long_keys_gqa_d128", shape(1100, 2100, 128, 16, 4), false, true});
    c.push_back({"persistent_three_consumers_long_keys_d64", shape(1100, 3000, 64, 24, 8), false, true});
  }
  // The same under the causal mask: a unit is a head's m-th heaviest query tile with its m-th
  // lightest; an odd tile count leaves the middle one alone; more keys than queries shift the
  // diagonal (bottom-right).
  {
    ProblemShape e = shape(1000, 1000, 64, 16, 4);
    e.batch = 3;
    e.causal = true;
    c.push_back({"persistent_causal_gqa_d64", e, false, true});
    ProblemShape o = shape(600, 900, 128, 16, 16);
    o.batch = 4;
    o.causal = true;
    c.push_back({"persistent_causal_odd_tiles_sk_gt_sq", o, false, true});
    ProblemShape s = shape(257, 257, 96, 24, 8);
    s.batch = 4;
    s.causal = true;
    c.push_back({"persistent_causal_d96", s, false, true});
  }
  // Causal walks of 192-row tiles (three consumers, head dims up to 64, from 4096 rows): the
  // heaviest tile ragged (64 rows) and paired with the lightest, GQA 2:1. And a causal walk of
  // 128-row tiles below that, with more keys than queries.
  {
    ProblemShape g = shape(4096, 4096, 32, 14, 7);
    g.causal = true;
    c.push_back({"persistent_three_consumers_causal_gqa_d32", g, false, true});
    ProblemShape k = shape(2048, 2200, 64, 12, 12);
    k.batch = 2;
    k.causal = true;
    c.push_back({"persistent_causal_sk_gt_sq_d64", k, false, true});
  }
  // Long unmasked problems up to head dim 64: three consumer warpgroups, 192-row query tiles on
  // Hopper; ragged last tiles, GQA, headdim_v != headdim_qk, varlen sequences that end
  // inside a tile.
  {
    c.push_back({"three_consumers_gqa", shape(2100, 1500, 64, 4, 2), false, true});
    ProblemShape s = shape(2048, 3000, 32, 2, 1);
    s.headdim_v = 48;
    c.push_back({"three_consumers_d32_dv48", s, false, true});
    ProblemShape v = shape(0, 0, 64, 2, 2);
    v.seqlens_q = {2500, 100, 0, 2200};
    v.seqlens_k = {2000, 3000, 5, 1100};
    c.push_back({"three_consumers_varlen", v, false, true});
    // From 1024 rows: walked where the tiles outnumber the SMs (GQA 4:1; the last 192-row tile's
    // second and third consumers hold rows past the sequence only), one block a tile where they
    // are fewer (the second consumer's rows ragged).
    ProblemShape w = shape(1024, 1000, 64, 16, 4);
    w.batch = 2;
    c.push_back({"three_consumers_walk_ragged_gqa", w, false, true});
    ProblemShape l = shape(1030, 2100, 32, 6, 6);
    l.headdim_v = 64;
    c.push_back({"three_consumers_rows_1030_d32_dv64", l, false, true});
  }
  // The same under the causal mask past the persistent walk's key limit: diagonal tiles of 192
  // rows, more keys than queries (the diagonal shifted), rows that see no key (sq > sk).
  {
    ProblemShape a = shape(2100, 4500, 64, 4, 2);
    a.causal = true;
    c.push_back({"three_consumers_causal_sk_gt_sq", a, false, true});
    ProblemShape s = shape(4200, 4200, 32, 2, 1);
    s.causal = true;
    c.push_back({"three_consumers_causal_d32", s, false, true});
    ProblemShape v = shape(0, 0, 64, 2, 2);
    v.seqlens_q = {4400, 100, 2500};
    v.seqlens_k = {4200, 5000, 4700};
    v.causal = true;
    c.push_back({"three_consumers_causal_varlen_rows_without_keys", v, false, true});
  }
  // Soft-capping: on Hopper an instance of its own (two consumers, 128-key steps, a block per
  // tile) whatever the shape would take without it: shapes of the walk and of three consumers
  // above with a cap, a long-key range (the 192-key instance's) and a long unmasked one.
  {
    struct Capped {
      const char* name;
      const char* shape_of;
      float cap;
    };
    for (const Capped& k : {Capped{"softcap_walk_shape_d128", "persistent_d128", 20.0f},
                            Capped{"softcap_causal_d96", "persistent_causal_d96", 10.0f},
                            Capped{"softcap_causal_sk_gt_sq_d64", "persistent_causal_sk_gt_sq_d64", 4.0f},
                            Capped{"softcap_unmasked_long_d32_dv48", "three_consumers_d32_dv48", 8.0f},
                            Capped{"softcap_causal_long_d32", "three_consumers_causal_d32", 6.0f}}) {
      const auto from = std::find_if(c.begin(), c.end(), [&](const ForwardCase& x) { return x.name == k.shape_of; });
      if (from == c.end()) throw std::logic_error(std::string("no forward case named ") + k.shape_of);
      ProblemShape s = from->shape;
      s.softcap = k.cap;
      c.push_back({k.name, s, false, true});
    }
    ProblemShape l = shape(64, 9000, 128, 4, 2);
    l.softcap = 30.0f;
    c.push_back({"softcap_long_keys_d128", l, false, true});
    ProblemShape u = shape(1500, 1500, 64, 8, 8);
    u.softcap = 15.0f;
    c.push_back({"softcap_unmasked_long_d64", u, false, true});
  }
  // GQA packing (decoding, seqlen_q <= 64): the query heads of a group share a tile; positions
  // and heads come from packed rows in the mask, the loads and the stores.
  {
    c.push_back({"pack_decode", shape(1, 5000, 128, 32, 8)});
    ProblemShape s = shape(5, 3000, 64, 16, 2);
    s.causal = true;
    c.push_back({"pack_speculative_causal", s});
    ProblemShape w = shape(64, 700, 40, 6, 2);
    w.window_left = 100, w.window_right = 3;
    w.softcap = 3.0f;
    c.push_back({"pack_window_softcap_d40", w});
    ProblemShape d = shape(16, 900, 256, 8, 1);
    d.causal = true;
    d.layout = Layout::bhsd;
    c.push_back({"pack_d256_bhsd_causal", d});
    ProblemShape v = shape(0, 0, 128, 8, 2);
    v.seqlens_q = {1, 0, 7, 3};
    v.seqlens_k = {4000, 9, 300, 0};
    v.causal = true;
    c.push_back({"pack_varlen_causal", v});
  }
  // The decode kernel (at most 16 packed rows): each warp's 16 keys of a tile, folded at the end.
  {
    c.push_back({"decode_d256_gqa", shape(1, 2000, 256, 8, 2)});
    c.push_back({"decode_d32_mha", shape(3, 1500, 32, 4, 4)});
    ProblemShape s = shape(4, 2500, 128, 16, 4);
    s.causal = true;
    c.push_back({"decode_speculative_16rows_causal", s});
    ProblemShape w = shape(2, 900, 40, 4, 2);
    w.window_left = 70, w.window_right = 0;
    w.softcap = 4.0f;
    c.push_back({"decode_window_softcap_d40", w});
    ProblemShape e = shape(8, 5, 64, 2, 1);
    e.causal = true;
    c.push_back({"decode_sq_gt_sk_causal", e});
    ProblemShape a = shape(2, 777, 96, 3, 3);
    a.alibi = ProblemShape::Alibi::per_head;
    c.push_back({"decode_alibi_d96", a});
  }
  // ALiBi: both LSE forms, sq != sk, GQA, softcap underneath, varlen per sequence, split-KV, both
  // slope shapes. All but the decode-sized split case run on the Hopper kernel there.
  {
    using A = ProblemShape::Alibi;
    ProblemShape s = shape(200, 300, 64, 4, 2);
    s.alibi = A::per_head;
    c.push_back({"alibi_gqa", s, false, true});
    s.causal = true;
    s.batch = 2;
    s.alibi = A::per_batch_head;
    c.push_back({"alibi_gqa_causal", s, false, true});
    ProblemShape t = shape(300, 120, 64);
    t.causal = true;
    t.softcap = 2.0f;
    t.alibi = A::per_head;
    c.push_back({"alibi_softcap_causal_sq_gt_sk", t, false, true});
    ProblemShape v = shape(0, 0, 64, 4, 2);
    v.seqlens_q = {5, 0, 130, 64, 200};
    v.seqlens_k = {7, 3, 130, 0, 260};
    v.alibi = A::per_batch_head;
    c.push_back({"alibi_varlen", v, false, true});
    v.causal = true;
    c.push_back({"alibi_varlen_causal", v, false, true});
    ProblemShape d = shape(16, 4096, 64, 8, 2);
    d.causal = true;
    d.alibi = A::per_head;
    c.push_back({"alibi_split_causal", d, true});
  }
  // ALiBi on the Hopper kernel, over several key tiles (the bias on interior tiles, which skip
  // the mask): head dims 64, 128, 256, GQA/MQA, soft-capping underneath, a window that is not the
  // causal form, a strided layout, varlen with L's offset per sequence, split-KV partials (stored
  // without TMA), and at D = 128 a key range that takes the 192-key instance without ALiBi.
  {
    using A = ProblemShape::Alibi;
    ProblemShape s = shape(1000, 1000, 128);
    s.batch = 2;
    s.causal = true;
    s.alibi = A::per_batch_head;
    c.push_back({"alibi_sm90_d128_causal", s, false, true});
    ProblemShape g = shape(700, 900, 128, 4, 2);
    g.alibi = A::per_head;
    c.push_back({"alibi_sm90_d128_gqa", g, false, true});
    ProblemShape m = shape(300, 333, 256, 4, 1);
    m.alibi = A::per_head;
    c.push_back({"alibi_sm90_d256_mqa", m, false, true});
    m.causal = true;
    m.softcap = 3.0f;
    m.softmax_scale = 0.5f;
    c.push_back({"alibi_sm90_d256_softcap_causal", m, false, true});
    ProblemShape f = shape(500, 400, 64, 4, 2);
    f.batch = 2;
    f.softcap = 2.0f;
    f.alibi = A::per_batch_head;
    c.push_back({"alibi_sm90_d64_softcap_gqa", f, false, true});
    ProblemShape w = shape(257, 300, 64);
    w.layout = Layout::bhsd;
    w.window_left = 100, w.window_right = 0;
    w.alibi = A::per_head;
    c.push_back({"alibi_sm90_window_bhsd", w, false, true});
    ProblemShape l = shape(300, 9000, 128, 4, 2);
    l.causal = true;
    l.alibi = A::per_head;
    c.push_back({"alibi_sm90_d128_long_keys_causal", l, false, true});
    ProblemShape v = shape(0, 0, 128, 4, 2);
    v.seqlens_q = {300, 0, 17, 200};
    v.seqlens_k = {300, 50, 900, 120};
    v.causal = true;
    v.alibi = A::per_batch_head;
    c.push_back({"alibi_sm90_varlen_d128_causal", v, false, true});
    ProblemShape p = shape(64, 20000, 128, 2, 1);
    p.causal = true;
    p.alibi = A::per_head;
    c.push_back({"alibi_sm90_split_causal", p, true, true});
  }
  // Strided layouts: SDPA's (batch, heads, seqlen, dim) and padded rows/heads/batches.
  {
    ProblemShape s = shape(129, 200, 64);
    s.batch = 2;
    s.layout = Layout::bhsd;
    s.causal = true;
    c.push_back({"bhsd_causal", s});
    ProblemShape p = shape(129, 200, 96, 4, 2);
    p.batch = 3;
    p.layout = Layout::padded;
    c.push_back({"padded_gqa", p});
    ProblemShape q = shape(1, 3000, 64, 2, 2);
    q.batch = 2;
    q.layout = Layout::padded;
    c.push_back({"padded_split", q, true});
    // Aligned strides with value dims of 17 (rows of 34 bytes: O is stored directly) and 24
    // (48 bytes: the Hopper kernel's TMA store writes a part of its 64-column box), both with
    // rows past the sequence in the last query tile. One key tile, so that no split-KV takes O
    // off that path; causal with fewer keys than queries leaves the first rows without a key.
    for (int64_t dv : {17, 24}) {
      ProblemShape o = shape(200, 120, 33, 4, 2);
      o.headdim_v = dv;
      o.layout = Layout::padded;
      o.causal = dv == 24;
      c.push_back({"padded_dv" + std::to_string(dv), o});
    }
  }
  return c;
}

struct Param {
  ForwardCase c;
  DType dtype;
};

std::vector<Param> params() {
  std::vector<Param> out;
  for (const ForwardCase& c : base_cases())
    for (DType dt : {DType::f16, DType::bf16}) {
      Param p{c, dt};
      p.c.shape.dtype = dt;
      out.push_back(p);
    }
  return out;
}

std::string param_name(const testing::TestParamInfo<Param>& info) {
  return info.param.c.name + (info.param.dtype == DType::f16 ? "_f16" : "_bf16");
}

class ForwardAccuracy : public testing::TestWithParam<Param> {};

TEST_P(ForwardAccuracy, WithinTwiceNaiveError) {
  TA_SKIP_WITHOUT_GPU();
  const Param& param = GetParam();
  HostProblem hp(param.c.shape);
  apply_key_ramp(hp, param.c.key_ramp);
  DeviceProblem dp(hp);

  try {
    const size_t workspace = tileattn::forward_workspace_size(dp.problem);
    if (param.c.expect_split) EXPECT_GT(workspace, 0u) << "split-KV expected for this shape";
    if (param.c.expect_sm90 && hopper_kernels_run())
      EXPECT_STREQ(tileattn::plan_forward(dp.problem).kernel_name(), "sm90");
    tileattn::forward(dp.problem);
  } catch (const Error& e) {
    // A narrowed build (TILEATTN_HEADDIMS) lacks the bucket; every other error is a failure.
    if (e.kind() == ErrorKind::unsupported) GTEST_SKIP() << e.what();
    throw;
  }
  dp.download();

  expect_forward_within_2x(hp, dp);
}

INSTANTIATE_TEST_SUITE_P(Sweep, ForwardAccuracy, testing::ValuesIn(params()), param_name);

}  // namespace
}  // namespace tileattn::test
