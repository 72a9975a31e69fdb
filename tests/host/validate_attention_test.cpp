// Each rule of validate_attention: a valid problem with exactly one thing broken must be
// rejected with a tileattn::Error of the right kind whose message names the argument and the rule.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <limits>

#include "cpu/reference.hpp"
#include "host/valid_problems.hpp"
#include "host/validate.hpp"
#include "support/host_problem.hpp"
#include "support/metrics.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

using host::Pass;
using host::validate_attention;

AttentionProblem validate_fwd(const AttentionProblem& p) { return validate_attention(p, Pass::forward, Backend::cpu); }
AttentionProblem validate_bwd(const AttentionProblem& p) { return validate_attention(p, Pass::backward, Backend::cpu); }

void expect_fwd_error(const AttentionProblem& p, ErrorKind kind, const std::vector<std::string>& fragments) {
  expect_error([&] { validate_fwd(p); }, kind, fragments);
}
void expect_bwd_error(const AttentionProblem& p, ErrorKind kind, const std::vector<std::string>& fragments) {
  expect_error([&] { validate_bwd(p); }, kind, fragments);
}

// ---- valid problems pass ---------------------------------------------------------------------

TEST(ValidateAttention, ValidForwardAndBackwardPass) {
  ValidAttention a;
  EXPECT_NO_THROW(validate_fwd(a.p));
  EXPECT_NO_THROW(validate_bwd(a.p));
}

TEST(ValidateAttention, ForwardDoesNotNeedBackwardTensors) {
  ValidAttention a;
  a.p.dout.data = a.p.dq.data = a.p.dk.data = a.p.dv.data = nullptr;
  EXPECT_NO_THROW(validate_fwd(a.p));
}

TEST(ValidateAttention, SdpaLayoutThroughStridesPasses) {
  // (batch, heads, seqlen, dim) memory described as (batch, seqlen, heads, dim) strides.
  ValidAttention a(2, 4, 4, 3, 3, 8, 8);
  for (TensorView* t : {&a.p.q, &a.p.k, &a.p.v, &a.p.o, &a.p.dout, &a.p.dq, &a.p.dk, &a.p.dv}) {
    t->seq_stride = 8;
    t->head_stride = 4 * 8;
  }
  EXPECT_NO_THROW(validate_bwd(a.p));
}

TEST(ValidateAttention, ZeroStrideOnExtentOneIsAllowed) {
  ValidAttention a(1, 4, 4, 1, 1, 8, 8);  // batch 1, one head: those strides are never used
  for (TensorView* t : {&a.p.q, &a.p.k, &a.p.v, &a.p.o, &a.p.dout, &a.p.dq, &a.p.dk, &a.p.dv}) {
    t->batch_stride = 0;
    t->head_stride = 0;
  }
  EXPECT_NO_THROW(validate_bwd(a.p));
}

TEST(ValidateAttention, InputsMayOverlapThemselves) {
  // Inputs whose rows share memory are readable, so only outputs are held to non-overlap.
  ValidAttention a;
  a.p.k.seq_stride = 4;  // rows of K overlap (headdim 8)
  EXPECT_NO_THROW(validate_fwd(a.p));
}

TEST(ValidateAttention, ExpandedInputsWithZeroStridesPass) {
  // k.expand(...) over batch or heads, as PyTorch SDPA accepts: every input of either pass, O
  // included where it is a backward input.
  ValidAttention a;  // batch 2, heads_q 4, heads_kv 2
  for (TensorView* t : {&a.p.q, &a.p.k, &a.p.v, &a.p.dout}) {
    t->batch_stride = 0;
    t->head_stride = 0;
  }
  EXPECT_NO_THROW(validate_fwd(a.p));
  a.p.o.batch_stride = 0;
  a.p.o.head_stride = 0;
  EXPECT_NO_THROW(validate_bwd(a.p));
  ValidAttention b;
  b.p.v.seq_stride = 0;  // every key row the same value row
  EXPECT_NO_THROW(validate_bwd(b.p));
}

TEST(ValidateAttention, VarlenPasses) {
  ValidAttention a;  // batch 2, seqlen_q 4, seqlen_k 6
  a.make_varlen({4, 0}, {3, 6});
  EXPECT_NO_THROW(validate_bwd(a.p));
}

TEST(ValidateAttention, MaxHeadDimPasses) {
  ValidAttention a(1, 2, 2, 1, 1, 256, 256);
  EXPECT_NO_THROW(validate_bwd(a.p));
}

// ---- enums -----------------------------------------------------------------------------------

TEST(ValidateAttention, UnknownDtypeIsInvalidType) {
  ValidAttention a;
  a.p.dtype = static_cast<DType>(7);
  expect_fwd_error(a.p, ErrorKind::invalid_type, {"dtype=7", "DType"});
}

TEST(ValidateAttention, UnknownFp32ModeIsRejected) {
  ValidAttention a;
  a.p.fp32_mode = static_cast<Fp32Mode>(3);
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"fp32_mode=3", "Fp32Mode"});
}

TEST(ValidateAttention, UnknownBackendIsRejected) {
  ValidAttention a;
  a.p.backend = static_cast<Backend>(9);
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"backend=9", "Backend"});
}

// Whether the backend exists is asked by the dispatcher (api.cpp), not by validation.
TEST(ValidateAttention, CudaBackendWithoutCudaIsADeviceError) {
  ValidAttention a;
  a.p.backend = Backend::cuda;
#ifdef TILEATTN_WITH_CUDA
  // A CUDA build: on a machine with a device the host buffers are the error instead.
  try {
    forward(a.p);
    ADD_FAILURE() << "host buffers were accepted for backend=cuda";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
#else
  expect_error([&] { forward(a.p); }, ErrorKind::device, {"backend=cuda", "no CUDA backend"});
#endif
}

TEST(ValidateAttention, NegativeNumThreadsIsRejected) {
  ValidAttention a;
  a.p.num_threads = -2;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"num_threads=-2", ">= 0"});
}

// ---- sizes -----------------------------------------------------------------------------------

struct SizeCase {
  const char* name;
  int64_t AttentionProblem::*field;
  int64_t value;
};

class NonPositiveSize : public ::testing::TestWithParam<SizeCase> {};

TEST_P(NonPositiveSize, IsRejectedByName) {
  const SizeCase c = GetParam();
  ValidAttention a;
  a.p.*c.field = c.value;
  expect_fwd_error(a.p, ErrorKind::invalid_argument,
                   {std::string(c.name) + "=" + std::to_string(c.value), "must be positive"});
}

INSTANTIATE_TEST_SUITE_P(Sizes, NonPositiveSize,
                         ::testing::Values(SizeCase{"batch", &AttentionProblem::batch, 0},
                                           SizeCase{"batch", &AttentionProblem::batch, -1},
                                           SizeCase{"seqlen_q", &AttentionProblem::seqlen_q, 0},
                                           SizeCase{"seqlen_k", &AttentionProblem::seqlen_k, -3},
                                           SizeCase{"heads_q", &AttentionProblem::heads_q, 0},
                                           SizeCase{"heads_kv", &AttentionProblem::heads_kv, 0},
                                           SizeCase{"headdim_qk", &AttentionProblem::headdim_qk, 0},
                                           SizeCase{"headdim_v", &AttentionProblem::headdim_v, -8}),
                         [](const auto& info) {
                           return std::string(info.param.name) + (info.param.value < 0 ? "_negative" : "_zero");
                         });

TEST(ValidateAttention, SeqlenAboveInt32MaxIsRejected) {
  ValidAttention a;
  a.p.seqlen_k = int64_t(INT32_MAX) + 1;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"seqlen_k=2147483648", "INT32_MAX"});
  ValidAttention b;
  b.p.seqlen_q = int64_t(1) << 40;
  expect_fwd_error(b.p, ErrorKind::invalid_argument, {"seqlen_q=", "INT32_MAX"});
}

TEST(ValidateAttention, HeadDimAbove256IsUnsupported) {
  ValidAttention a;
  a.p.headdim_qk = 257;
  expect_fwd_error(a.p, ErrorKind::unsupported, {"headdim_qk=257", "256"});
  ValidAttention b;
  b.p.headdim_v = 512;
  expect_fwd_error(b.p, ErrorKind::unsupported, {"headdim_v=512", "256"});
}

TEST(ValidateAttention, HeadsKvMustDivideHeadsQ) {
  ValidAttention a(1, 4, 4, 8, 3, 8, 8);
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"heads_kv=3 must divide heads_q=8 (GQA)"});
  ValidAttention b(1, 4, 4, 2, 4, 8, 8);  // more kv heads than query heads
  expect_fwd_error(b.p, ErrorKind::invalid_argument, {"heads_kv=4 must divide heads_q=2"});
}

// ---- pointers --------------------------------------------------------------------------------

struct PointerCase {
  const char* name;
  TensorView AttentionProblem::*view;
};

class NullTensor : public ::testing::TestWithParam<PointerCase> {};

TEST_P(NullTensor, BackwardRejectsByName) {
  ValidAttention a;
  (a.p.*GetParam().view).data = nullptr;
  expect_bwd_error(a.p, ErrorKind::invalid_argument, {std::string(GetParam().name) + ".data is null"});
}

INSTANTIATE_TEST_SUITE_P(
    Pointers, NullTensor,
    ::testing::Values(PointerCase{"q", &AttentionProblem::q}, PointerCase{"k", &AttentionProblem::k},
                      PointerCase{"v", &AttentionProblem::v}, PointerCase{"o", &AttentionProblem::o},
                      PointerCase{"dout", &AttentionProblem::dout}, PointerCase{"dq", &AttentionProblem::dq},
                      PointerCase{"dk", &AttentionProblem::dk}, PointerCase{"dv", &AttentionProblem::dv}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ValidateAttention, ForwardRejectsEachNullInputAndOutput) {
  for (auto view : {&AttentionProblem::q, &AttentionProblem::k, &AttentionProblem::v, &AttentionProblem::o}) {
    ValidAttention a;
    (a.p.*view).data = nullptr;
    EXPECT_THROW(validate_fwd(a.p), Error);
  }
  ValidAttention a;
  a.p.o.data = nullptr;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"o.data is null"});
}

TEST(ValidateAttention, NullLseIsRejectedInBothPasses) {
  ValidAttention a;
  a.p.lse = nullptr;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"lse is null"});
  expect_bwd_error(a.p, ErrorKind::invalid_argument, {"lse is null"});
}

// The forward's row statistics for the backward: only the CUDA fp32 kernels write and read them.
TEST(ValidateAttention, SoftmaxStatsAreRejectedOffCudaFp32) {
  ValidAttention a;
  std::vector<float> stats(2 * a.lse.size());
  a.p.softmax_stats = stats.data();
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"softmax_stats", "fp32 problems on the CUDA backend"});
  expect_bwd_error(a.p, ErrorKind::invalid_argument, {"softmax_stats", "fp32 problems on the CUDA backend"});
  a.p.softmax_stats = nullptr;
  EXPECT_NO_THROW(validate_bwd(a.p));
}

TEST(ValidateAttention, MisalignedPointersAreRejected) {
  ValidAttention a;
  a.p.v.data = reinterpret_cast<char*>(a.v.data()) + 2;  // fp32 needs 4-byte alignment
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"v.data is not aligned to 4 bytes"});
  ValidAttention b;
  b.p.dtype = DType::f16;  // 2-byte elements: an offset of 2 bytes is fine, 1 is not
  b.p.q.data = reinterpret_cast<char*>(b.q.data()) + 2;
  EXPECT_NO_THROW(validate_fwd(b.p));
  b.p.dq.data = reinterpret_cast<char*>(b.dq.data()) + 1;
  expect_bwd_error(b.p, ErrorKind::invalid_argument, {"dq.data is not aligned to 2 bytes"});
  ValidAttention c;
  c.p.lse = reinterpret_cast<float*>(reinterpret_cast<char*>(c.lse.data()) + 1);
  expect_fwd_error(c.p, ErrorKind::invalid_argument, {"lse is not aligned to 4 bytes"});
  ValidAttention d;
  d.p.dlse = reinterpret_cast<const float*>(reinterpret_cast<const char*>(d.lse.data()) + 2);
  expect_bwd_error(d.p, ErrorKind::invalid_argument, {"dlse is not aligned to 4 bytes"});
  d.p.dlse = d.lse.data();
  EXPECT_NO_THROW(validate_bwd(d.p));
}

TEST(ValidateAttention, LseElementCountMustFitInt64) {
  ValidAttention a;
  a.p.batch = a.p.heads_q = a.p.seqlen_q = INT32_MAX;
  a.p.heads_kv = 1;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"lse addresses more than INT64_MAX elements"});
}

// ---- strides ---------------------------------------------------------------------------------

TEST(ValidateAttention, NegativeStrideIsRejected) {
  ValidAttention a;
  a.p.q.seq_stride = -32;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"q.seq_stride=-32", "must not be negative"});
  ValidAttention b;
  b.p.dv.batch_stride = -1;
  expect_bwd_error(b.p, ErrorKind::invalid_argument, {"dv.batch_stride=-1", "must not be negative"});
}

TEST(ValidateAttention, ZeroStrideOnAnOutputExtentAboveOneIsRejected) {
  ValidAttention a;  // heads_kv = 2
  a.p.dk.head_stride = 0;
  expect_bwd_error(a.p, ErrorKind::invalid_argument, {"dk.head_stride=0 must be positive", "heads_kv=2 > 1"});
  ValidAttention b;  // seqlen_q = 4
  b.p.o.seq_stride = 0;
  expect_fwd_error(b.p, ErrorKind::invalid_argument, {"o.seq_stride=0 must be positive", "seqlen_q=4 > 1"});
  ValidAttention c;  // batch = 2
  c.p.dv.batch_stride = 0;
  expect_bwd_error(c.p, ErrorKind::invalid_argument, {"dv.batch_stride=0 must be positive", "batch=2 > 1"});
  ValidAttention d;  // heads_q = 4
  d.p.o.head_stride = 0;
  expect_fwd_error(d.p, ErrorKind::invalid_argument, {"o.head_stride=0 must be positive", "heads_q=4 > 1"});
}

TEST(ValidateAttention, ForwardOutputMustNotOverlapItself) {
  ValidAttention a;  // o: heads 4 x headdim_v 16 = 64 elements a row
  a.p.o.seq_stride = 32;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"o.seq_stride=32", "overlap", ">= 64"});
  ValidAttention b;
  b.p.o.head_stride = 8;  // < headdim_v = 16
  expect_fwd_error(b.p, ErrorKind::invalid_argument, {"o.head_stride=8", "overlap", ">= 16"});
  ValidAttention c;
  c.p.o.batch_stride = 4 * 64 - 1;  // batch 1 would start inside the last row of batch 0
  expect_fwd_error(c.p, ErrorKind::invalid_argument, {"o.batch_stride=255", "overlap", ">= 256"});
}

TEST(ValidateAttention, BackwardOutputsMustNotOverlapThemselves) {
  ValidAttention a;  // dk: heads_kv 2 x headdim_qk 8
  a.p.dk.seq_stride = 8;
  expect_bwd_error(a.p, ErrorKind::invalid_argument, {"dk.seq_stride=8", "overlap", ">= 16"});
  ValidAttention b;
  b.p.dq.head_stride = 4;
  expect_bwd_error(b.p, ErrorKind::invalid_argument, {"dq.head_stride=4", "overlap"});
  ValidAttention c;
  c.p.dv.seq_stride = 16;  // dv: 2 x 16 = 32 a row
  expect_bwd_error(c.p, ErrorKind::invalid_argument, {"dv.seq_stride=16", "overlap", ">= 32"});
  // In the backward O is an input and may overlap.
  ValidAttention d;
  d.p.o.seq_stride = 16;
  EXPECT_NO_THROW(validate_bwd(d.p));
}

TEST(ValidateAttention, AddressedExtentMustFitInt64) {
  ValidAttention a;
  a.p.q.seq_stride = std::numeric_limits<int64_t>::max() / 2;  // (seqlen_q - 1) * stride overflows
  a.p.q.batch_stride = 1;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"q addresses more than INT64_MAX elements"});
}

// ---- variable length -------------------------------------------------------------------------

TEST(ValidateAttention, CuSeqlensBothOrNeither) {
  ValidAttention a;
  a.make_varlen({4, 4}, {6, 6});
  a.p.cu_seqlens_k = nullptr;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"cu_seqlens_k is null", "needs both"});
  ValidAttention b;
  b.make_varlen({4, 4}, {6, 6});
  b.p.cu_seqlens_q = nullptr;
  expect_fwd_error(b.p, ErrorKind::invalid_argument, {"cu_seqlens_q is null", "needs both"});
}

// Offsets may start past row 0 (flash-attn's kernels start sequence b at cu_seqlens[b]), not before it.
TEST(ValidateAttention, CuSeqlensStartAtOrPastRowZero) {
  ValidAttention a;
  a.make_varlen({4, 4}, {6, 6});
  a.cu_q[0] = 1;
  EXPECT_NO_THROW(validate_fwd(a.p));
  a.cu_q[0] = -1;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"cu_seqlens_q[0]=-1 must be >= 0"});
}

TEST(ValidateAttention, CuSeqlensMustBeNonDecreasing) {
  ValidAttention a;
  a.make_varlen({4, 4}, {6, 6});
  a.cu_k = {0, 6, 5};
  a.p.cu_seqlens_k = a.cu_k.data();
  expect_fwd_error(a.p, ErrorKind::invalid_argument,
                   {"cu_seqlens_k[2]=5 is less than cu_seqlens_k[1]=6", "non-decreasing"});
}

TEST(ValidateAttention, CuSeqlensMustStayInsideTheBuffer) {
  ValidAttention a;
  a.make_varlen({4, 4}, {6, 6});
  a.p.total_q = 7;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"cu_seqlens_q[2]=8 exceeds total_q=7"});
}

TEST(ValidateAttention, VarlenSequenceLongerThanMaxIsRejected) {
  ValidAttention a;  // seqlen_k = 6 is the max length
  a.make_varlen({4, 4}, {2, 7});
  a.p.total_k = 16;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"cu_seqlens_k", "sequence 1 has length 7 > seqlen_k=6"});
}

TEST(ValidateAttention, VarlenTotalsMustBePositive) {
  ValidAttention a;
  a.make_varlen({0, 0}, {6, 6});
  a.p.total_q = 0;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"total_q=0 must be positive"});
}

TEST(ValidateAttention, VarlenIgnoresBatchStrideButChecksRowsOfTheTotal) {
  ValidAttention a;
  a.make_varlen({4, 4}, {6, 6});
  a.p.q.batch_stride = -5;  // unused for varlen
  EXPECT_NO_THROW(validate_fwd(a.p));
  a.p.o.seq_stride = 0;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"o.seq_stride=0 must be positive", "total_q=8 > 1"});
}

// ---- options ---------------------------------------------------------------------------------

TEST(ValidateAttention, WindowBelowMinusOneIsRejected) {
  ValidAttention a;
  a.p.window_left = -2;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"window_left=-2 must be >= -1"});
  ValidAttention b;
  b.p.window_right = -7;
  expect_fwd_error(b.p, ErrorKind::invalid_argument, {"window_right=-7 must be >= -1"});
}

TEST(ValidateAttention, SoftcapMustBeFiniteAndNonNegative) {
  for (float bad : {std::nanf(""), -1.0f, std::numeric_limits<float>::infinity()}) {
    ValidAttention a;
    a.p.softcap = bad;
    expect_fwd_error(a.p, ErrorKind::invalid_argument, {"softcap=", "must be finite and >= 0"});
  }
  ValidAttention a;
  a.p.softcap = -0.5f;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"softcap=-0.5 must be"});
}

TEST(ValidateAttention, AlibiSlopesAlignedWithANonNegativeBatchStride) {
  alignas(8) float slopes[8] = {};
  ValidAttention a;
  a.p.alibi_slopes = reinterpret_cast<const float*>(reinterpret_cast<const char*>(slopes) + 2);
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"alibi_slopes is not aligned to 4 bytes"});
  a.p.alibi_slopes = slopes;
  a.p.alibi_batch_stride = -1;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"alibi_batch_stride=-1 must be >= 0"});
  a.p.alibi_batch_stride = int64_t(1) << 62;
  a.p.batch = 3;
  expect_fwd_error(a.p, ErrorKind::invalid_argument, {"alibi_slopes addresses more than INT64_MAX"});
}

TEST(NormaliseAttention, AlibiSlopesPassThrough) {
  const float slopes[2] = {0.25f, -1.0f};  // any finite value, negative ones included
  ValidAttention a;
  a.p.alibi_slopes = slopes;
  a.p.alibi_batch_stride = 0;
  const AttentionProblem n = validate_fwd(a.p);
  EXPECT_EQ(n.alibi_slopes, slopes);
  EXPECT_EQ(n.alibi_batch_stride, 0);
}

TEST(ValidateAttention, SoftmaxScaleMustBeFiniteAndPositive) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<float, std::string>> cases = {{std::nanf(""), "softmax_scale=nan"},
                                                            {inf, "softmax_scale=inf"},
                                                            {-inf, "softmax_scale=-inf"},
                                                            {0.0f, "softmax_scale=0 "},
                                                            {-0.125f, "softmax_scale=-0.125"}};
  for (const auto& [bad, text] : cases) {
    ValidAttention a;
    a.p.softmax_scale = bad;
    expect_fwd_error(a.p, ErrorKind::invalid_argument, {text, "must be finite and > 0"});
  }
}

// ---- normalisation ---------------------------------------------------------------------------

TEST(NormaliseAttention, DefaultScaleIsInverseSqrtOfQkHeadDim) {
  ValidAttention a(1, 4, 4, 2, 2, 64, 16);  // headdim_v differs: the scale follows headdim_qk
  const AttentionProblem n = validate_fwd(a.p);
  ASSERT_TRUE(n.softmax_scale.has_value());
  EXPECT_FLOAT_EQ(*n.softmax_scale, 0.125f);
}

TEST(NormaliseAttention, GivenScaleIsKept) {
  ValidAttention a;
  a.p.softmax_scale = 0.3f;
  EXPECT_EQ(*validate_fwd(a.p).softmax_scale, 0.3f);
}

TEST(NormaliseAttention, CausalFoldsIntoWindowRightAndStaysAHint) {
  ValidAttention a;
  a.p.causal = true;
  a.p.window_left = 2;
  const AttentionProblem n = validate_bwd(a.p);
  EXPECT_TRUE(n.causal);
  EXPECT_EQ(n.window_right, 0);
  EXPECT_EQ(n.window_left, 2);

  ValidAttention b;
  b.p.causal = true;
  b.p.window_right = 0;  // consistent, accepted as is
  EXPECT_EQ(validate_fwd(b.p).window_right, 0);
}

TEST(NormaliseAttention, CausalSetsAnyWindowRightToZeroAndKeepsTheLeft) {
  // flash-attn's rule: causal=true with a window (left, right) is the window (left, 0).
  for (int64_t right : {int64_t(1), int64_t(3), int64_t(5), int64_t(1) << 40}) {
    ValidAttention a;  // seqlen_q 4, seqlen_k 6
    a.p.causal = true;
    a.p.window_left = 2;
    a.p.window_right = right;
    const AttentionProblem f = validate_fwd(a.p);
    const AttentionProblem b = validate_bwd(a.p);
    for (const AttentionProblem& n : {f, b}) {
      EXPECT_TRUE(n.causal);
      EXPECT_EQ(n.window_right, 0) << "window_right=" << right;
      EXPECT_EQ(n.window_left, 2) << "window_right=" << right;
    }
  }
}

TEST(NormaliseAttention, CausalWithAWindowComputesTheWindowWithRightZero) {
  // End to end on the CPU backend: causal=true, window (3, 5) is what the float64 oracle computes
  // for the non-causal window (3, 0), forward and backward, bottom-right aligned with sk > sq.
  ProblemShape s;
  s.batch = 2;
  s.seqlen_q = 9;
  s.seqlen_k = 14;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.headdim_qk = 16;
  s.headdim_v = 8;
  s.causal = true;
  s.window_left = 3;
  s.window_right = 5;
  HostProblem hp(s);
  forward(hp.problem);
  backward(hp.problem);
  AttentionProblem e = hp.problem;
  e.causal = false;
  e.window_right = 0;
  const cpu::ReferenceBackward ref = cpu::reference_backward(e);
  const cpu::ReferenceForward ref_fwd = cpu::reference_forward(e);
  constexpr double kTol = 2e-5;  // fp32 over at most 4 visible keys
  EXPECT_TRUE(within(hp.o.gather(), ref_fwd.o, kTol, kTol)) << "O";
  EXPECT_TRUE(within(hp.gather_lse(), ref_fwd.lse, kTol, kTol)) << "L";
  EXPECT_TRUE(within(hp.dq.gather(), ref.dq, kTol, kTol)) << "dQ";
  EXPECT_TRUE(within(hp.dk.gather(), ref.dk, kTol, kTol)) << "dK";
  EXPECT_TRUE(within(hp.dv.gather(), ref.dv, kTol, kTol)) << "dV";
}

TEST(NormaliseAttention, NonCausalWindowIsKept) {
  ValidAttention a;  // seqlen_q 4, seqlen_k 6
  a.p.window_left = 3;
  a.p.window_right = 1;
  const AttentionProblem n = validate_fwd(a.p);
  EXPECT_FALSE(n.causal);
  EXPECT_EQ(n.window_left, 3);
  EXPECT_EQ(n.window_right, 1);
  a.p.window_left = a.p.window_right = -1;
  EXPECT_EQ(validate_fwd(a.p).window_left, -1);
  EXPECT_EQ(validate_fwd(a.p).window_right, -1);
}

TEST(NormaliseAttention, WindowBeyondTheSequenceIsClampedAndStillMasksNothing) {
  ValidAttention a;  // seqlen_q 4, seqlen_k 6
  a.p.window_left = int64_t(1) << 40;
  a.p.window_right = INT32_MAX;
  const AttentionProblem n = validate_fwd(a.p);
  EXPECT_EQ(n.window_left, 6);
  EXPECT_EQ(n.window_right, 4);
}

TEST(NormaliseAttention, BackendIsTheResolvedOneAndTheRestIsUnchanged) {
  ValidAttention a;
  a.p.backend = Backend::automatic;
  a.p.softcap = 30.0f;
  a.p.deterministic = true;
  a.p.num_threads = 3;
  const AttentionProblem n = validate_fwd(a.p);
  EXPECT_EQ(n.backend, Backend::cpu);
  EXPECT_EQ(n.softcap, 30.0f);
  EXPECT_TRUE(n.deterministic);
  EXPECT_EQ(n.num_threads, 3);
  EXPECT_EQ(n.q.data, a.p.q.data);
  EXPECT_EQ(n.o.seq_stride, a.p.o.seq_stride);
}

}  // namespace
}  // namespace tileattn::test
