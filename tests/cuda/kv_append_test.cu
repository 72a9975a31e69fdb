// Appending to a key/value cache with the rotary embedding on the GPU equals the CPU backend,
// which tests/cpu/kv_cache_test.cpp pins against the float64 oracle: the same random call (cache
// contiguous with a batch index and left padding, or paged with shuffled pages) runs on both, and
// the cache bytes, O and L must agree. The rotated keys are one fp32 rotation rounded once on
// either side, so they may differ by the last place where the GPU contracts the products into fused
// multiply-adds; everything else in the cache is bitwise equal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpu/convert.hpp"
#include "gpu_test_util.cuh"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

struct AppendCase {
  std::string name;
  DType dtype;
  int64_t seqlen_q, seqlen_new, heads_q, heads_kv, headdim, rotary_dim;
  int64_t page_size;  // 0: contiguous rows with a batch index and left padding
  bool interleaved, causal;
  int num_splits = 0;
};

// A host buffer of `elements` values of the dtype, N(0, 1) rounded, and its device copy.
struct Buffer {
  std::vector<std::byte> host;
  DeviceBuffer device;
  Buffer(int64_t elements, DType dtype, std::mt19937_64& rng) : host(size_t(elements * cpu::dtype_size(dtype))) {
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < elements; ++i) cpu::store_element(host.data(), i, dtype, normal(rng));
    device = DeviceBuffer(host.data(), host.size());
  }
  std::vector<std::byte> downloaded() const {
    std::vector<std::byte> out(host.size());
    device.download(out.data());
    return out;
  }
};

std::vector<double> values(const std::vector<std::byte>& bytes, DType dtype) {
  std::vector<double> out(bytes.size() / size_t(cpu::dtype_size(dtype)));
  for (size_t i = 0; i < out.size(); ++i) out[i] = cpu::load_element(bytes.data(), int64_t(i), dtype);
  return out;
}

void check(const AppendCase& c) {
  SCOPED_TRACE(c.name);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (replay: TILEATTN_TEST_SEED=" + std::to_string(seed) + ")");
  std::mt19937_64 rng(seed);
  const DType dt = c.dtype;
  const int64_t batch = 3, cache_len = 96 + c.seqlen_new, hq = c.heads_q, hkv = c.heads_kv, d = c.headdim;
  const bool paged = c.page_size > 0;
  const int64_t pages_per_seq = paged ? (cache_len + c.page_size - 1) / c.page_size : 0;
  const int64_t num_pages = batch * pages_per_seq + 2;
  const int64_t rows = paged ? num_pages * c.page_size : (batch + 1) * cache_len;

  // Per sequence: cached keys before the append, left padding (contiguous only), cache row.
  const std::vector<int32_t> cached{37, 0, int32_t(cache_len - c.seqlen_new - 3)}, leftpad{5, 0, 2},
      batch_idx{2, 3, 0};
  std::vector<int32_t> seqused(batch);  // the keys after the append, counted from the cache row's start
  for (int64_t b = 0; b < batch; ++b)
    seqused[size_t(b)] = (paged ? 0 : leftpad[size_t(b)]) + cached[size_t(b)] + int32_t(c.seqlen_new);
  std::vector<int32_t> table(size_t(batch * pages_per_seq));
  std::iota(table.begin(), table.end(), 1);
  std::shuffle(table.begin(), table.end(), rng);

  Buffer q(batch * c.seqlen_q * hq * d, dt, rng), k(rows * hkv * d, dt, rng), v(rows * hkv * d, dt, rng);
  Buffer k_new(batch * c.seqlen_new * hkv * d, dt, rng), v_new(batch * c.seqlen_new * hkv * d, dt, rng);
  const int64_t seqlen_k = paged ? pages_per_seq * c.page_size : cache_len;  // the rows a sequence may reach
  const int64_t half = c.rotary_dim / 2, rotary_seqlen = seqlen_k + c.seqlen_q;
  Buffer cos(rotary_seqlen * half, dt, rng), sin(rotary_seqlen * half, dt, rng);
  for (int64_t i = 0; i < rotary_seqlen * half; ++i) {  // a unit circle per angle
    const double a = std::atan2(cpu::load_element(sin.host.data(), i, dt), cpu::load_element(cos.host.data(), i, dt));
    cpu::store_element(cos.host.data(), i, dt, float(std::cos(a)));
    cpu::store_element(sin.host.data(), i, dt, float(std::sin(a)));
  }
  cos.device.upload(cos.host.data());
  sin.device.upload(sin.host.data());
  std::vector<std::byte> o_cpu(size_t(batch * c.seqlen_q * hq * d * cpu::dtype_size(dt)));
  std::vector<float> lse_cpu(size_t(batch * hq * c.seqlen_q)), lse_gpu(lse_cpu.size());
  DeviceBuffer o_dev(o_cpu.size()), lse_dev(lse_cpu.size() * sizeof(float));
  DeviceBuffer seqused_dev(seqused.data(), seqused.size() * 4), leftpad_dev(leftpad.data(), leftpad.size() * 4),
      batch_idx_dev(batch_idx.data(), batch_idx.size() * 4), table_dev(table.data(), table.size() * 4);

  auto rows_of = [&](void* data, int64_t seqlen, int64_t heads) {
    return TensorView{data, seqlen * heads * d, heads * d, d};
  };
  auto problem = [&](bool on_gpu) {
    AttentionProblem p;
    p.batch = batch, p.seqlen_q = c.seqlen_q, p.seqlen_k = seqlen_k;
    p.heads_q = hq, p.heads_kv = hkv, p.headdim_qk = p.headdim_v = d, p.dtype = dt;
    p.q = rows_of(on_gpu ? q.device.get() : q.host.data(), c.seqlen_q, hq);
    p.k = rows_of(on_gpu ? k.device.get() : k.host.data(), paged ? c.page_size : cache_len, hkv);
    p.v = rows_of(on_gpu ? v.device.get() : v.host.data(), paged ? c.page_size : cache_len, hkv);
    p.o = rows_of(on_gpu ? o_dev.get() : o_cpu.data(), c.seqlen_q, hq);
    p.lse = on_gpu ? lse_dev.get<float>() : lse_cpu.data();
    p.seqused_k = on_gpu ? seqused_dev.get<int32_t>() : seqused.data();
    if (paged) {
      p.block_table = on_gpu ? table_dev.get<int32_t>() : table.data();
      p.block_table_stride = p.pages_per_seq = pages_per_seq;
      p.page_size = c.page_size, p.num_pages = num_pages;
    } else {
      p.leftpad_k = on_gpu ? leftpad_dev.get<int32_t>() : leftpad.data();
      p.kv_batch_idx = on_gpu ? batch_idx_dev.get<int32_t>() : batch_idx.data();
      p.kv_batch = batch + 1;
    }
    p.k_new = rows_of(on_gpu ? k_new.device.get() : k_new.host.data(), c.seqlen_new, hkv);
    p.v_new = rows_of(on_gpu ? v_new.device.get() : v_new.host.data(), c.seqlen_new, hkv);
    p.seqlen_new = c.seqlen_new;
    p.rotary_cos = on_gpu ? cos.device.get() : cos.host.data();
    p.rotary_sin = on_gpu ? sin.device.get() : sin.host.data();
    p.rotary_dim = c.rotary_dim, p.rotary_seqlen = rotary_seqlen, p.rotary_interleaved = c.interleaved;
    p.causal = c.causal;
    p.num_splits = c.num_splits;
    p.backend = on_gpu ? Backend::cuda : Backend::cpu;
    return p;
  };
  try {
    tileattn::forward(problem(true));
  } catch (const Error& e) {
    // A narrowed build (TILEATTN_HEADDIMS) lacks the bucket.
    if (e.kind() == ErrorKind::unsupported && std::string(e.what()).find("head-dim bucket") != std::string::npos) return;
    throw;
  }
  check_cuda(cudaDeviceSynchronize(), "forward");
  tileattn::forward(problem(false));

  std::vector<std::byte> o_gpu(o_cpu.size());
  o_dev.download(o_gpu.data());
  lse_dev.download(lse_gpu.data());
  const double tol = dt == DType::f32 ? 2e-5 : dt == DType::f16 ? 4e-3 : 3e-2;
  EXPECT_TRUE(within(values(o_gpu, dt), values(o_cpu, dt), tol, tol)) << "O";
  EXPECT_TRUE(within(std::vector<double>(lse_gpu.begin(), lse_gpu.end()),
                     std::vector<double>(lse_cpu.begin(), lse_cpu.end()), tol, tol))
      << "L";
  EXPECT_TRUE(within(values(k.downloaded(), dt), values(k.host, dt), 2 * unit_roundoff(dt), 1e-6)) << "k cache";
  EXPECT_TRUE(v.downloaded() == v.host) << "v cache (appended rows are copies: bitwise)";
  EXPECT_TRUE(q.downloaded() == q.host) << "q is an input: its rotated copy lives in the workspace";
}

TEST(KvAppendGpu, EqualsTheCpuBackend) {
  TA_SKIP_WITHOUT_GPU();
  const DType bf16 = DType::bf16, f16 = DType::f16, f32 = DType::f32;
  const std::vector<AppendCase> cases = {
      // name, dtype, seqlen_q, seqlen_new, heads q/kv, headdim, rotary_dim, page_size, interleaved, causal
      {"decode_gqa_bf16", bf16, 1, 1, 8, 2, 128, 128, 0, true, false},
      {"decode_gqa_paged16_half_f16", f16, 1, 1, 8, 2, 64, 32, 16, false, true},
      {"speculative_causal_paged3_bf16", bf16, 4, 4, 4, 1, 64, 64, 3, true, true},
      {"split_paged64_bf16", bf16, 2, 2, 4, 4, 128, 96, 64, false, true, 4},
      {"prefill_80_f16", f16, 80, 80, 2, 2, 64, 64, 0, true, true},
      {"queries_past_new_rows_bf16", bf16, 6, 2, 2, 2, 32, 16, 16, true, true},
      {"fp32_d40", f32, 3, 3, 2, 1, 40, 24, 0, false, true},
  };
  for (const AppendCase& c : cases) check(c);
}

}  // namespace
}  // namespace tileattn::test
