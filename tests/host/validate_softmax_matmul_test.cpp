// Each rule of validate_softmax_matmul, one broken argument at a time.
#include <gtest/gtest.h>

#include "host/valid_problems.hpp"
#include "host/validate.hpp"
#include "tileattn/attention.hpp"

namespace tileattn::test {
namespace {

using host::validate_softmax_matmul;

void expect_sm_error(const SoftmaxMatmulProblem& p, ErrorKind kind, const std::vector<std::string>& fragments) {
  expect_error([&] { validate_softmax_matmul(p, Backend::cpu); }, kind, fragments);
}

TEST(ValidateSoftmaxMatmul, ValidProblemPassesUnchanged) {
  ValidSoftmaxMatmul s;
  s.p.backend = Backend::automatic;
  const SoftmaxMatmulProblem n = validate_softmax_matmul(s.p, Backend::cpu);
  EXPECT_EQ(n.backend, Backend::cpu);
  EXPECT_EQ(n.x, s.p.x);
  EXPECT_EQ(n.out_row_stride, s.p.out_row_stride);
}

TEST(ValidateSoftmaxMatmul, PaddedRowsAndBatchesPass) {
  ValidSoftmaxMatmul s(2, 3, 5, 4);
  s.x.resize(100);
  s.out.resize(100);
  s.p.x = s.x.data();
  s.p.out = s.out.data();
  s.p.x_row_stride = 8;
  s.p.x_batch_stride = 32;
  s.p.out_row_stride = 8;
  s.p.out_batch_stride = 40;
  EXPECT_NO_THROW(validate_softmax_matmul(s.p, Backend::cpu));
}

TEST(ValidateSoftmaxMatmul, NonPositiveSizesAreRejectedByName) {
  for (auto [field, name] :
       {std::pair{&SoftmaxMatmulProblem::batch, "batch"}, std::pair{&SoftmaxMatmulProblem::d1, "d1"},
        std::pair{&SoftmaxMatmulProblem::d2, "d2"}, std::pair{&SoftmaxMatmulProblem::d3, "d3"}}) {
    ValidSoftmaxMatmul s;
    s.p.*field = 0;
    expect_sm_error(s.p, ErrorKind::invalid_argument, {std::string(name) + "=0 must be positive"});
    s.p.*field = -4;
    expect_sm_error(s.p, ErrorKind::invalid_argument, {std::string(name) + "=-4 must be positive"});
  }
}

TEST(ValidateSoftmaxMatmul, SizeAboveInt32MaxIsRejected) {
  ValidSoftmaxMatmul s;
  s.p.d2 = int64_t(1) << 31;
  expect_sm_error(s.p, ErrorKind::invalid_argument, {"d2=2147483648 exceeds INT32_MAX"});
}

TEST(ValidateSoftmaxMatmul, NullPointersAreRejectedByName) {
  ValidSoftmaxMatmul a;
  a.p.x = nullptr;
  expect_sm_error(a.p, ErrorKind::invalid_argument, {"x is null"});
  ValidSoftmaxMatmul b;
  b.p.v = nullptr;
  expect_sm_error(b.p, ErrorKind::invalid_argument, {"v is null"});
  ValidSoftmaxMatmul c;
  c.p.out = nullptr;
  expect_sm_error(c.p, ErrorKind::invalid_argument, {"out is null"});
}

TEST(ValidateSoftmaxMatmul, MisalignedPointersAreRejected) {
  ValidSoftmaxMatmul s;
  s.p.out = reinterpret_cast<char*>(s.out.data()) + 3;
  expect_sm_error(s.p, ErrorKind::invalid_argument, {"out is not aligned to 4 bytes"});
}

TEST(ValidateSoftmaxMatmul, UnknownDtypeIsInvalidType) {
  ValidSoftmaxMatmul s;
  s.p.dtype = static_cast<DType>(-1);
  expect_sm_error(s.p, ErrorKind::invalid_type, {"dtype=-1", "DType"});
}

TEST(ValidateSoftmaxMatmul, BadStridesAreRejected) {
  ValidSoftmaxMatmul a;
  a.p.x_row_stride = -5;
  expect_sm_error(a.p, ErrorKind::invalid_argument, {"x.row_stride=-5 must not be negative"});
  ValidSoftmaxMatmul b;  // d2 = 5 rows of V
  b.p.v_row_stride = 0;
  expect_sm_error(b.p, ErrorKind::invalid_argument, {"v.row_stride=0 must be positive", "d2=5 > 1"});
  ValidSoftmaxMatmul c;  // batch = 2
  c.p.out_batch_stride = 0;
  expect_sm_error(c.p, ErrorKind::invalid_argument, {"out.batch_stride=0 must be positive", "batch=2 > 1"});
}

TEST(ValidateSoftmaxMatmul, OutputMustNotOverlapItself) {
  ValidSoftmaxMatmul a;  // d3 = 4
  a.p.out_row_stride = 3;
  expect_sm_error(a.p, ErrorKind::invalid_argument, {"out.row_stride=3", "overlap", ">= 4"});
  ValidSoftmaxMatmul b;  // d1 = 3 rows of 4
  b.p.out_batch_stride = 11;
  expect_sm_error(b.p, ErrorKind::invalid_argument, {"out.batch_stride=11", "overlap", ">= 12"});
  ValidSoftmaxMatmul c;  // inputs may overlap themselves
  c.p.x_row_stride = 2;
  EXPECT_NO_THROW(validate_softmax_matmul(c.p, Backend::cpu));
}

TEST(ValidateSoftmaxMatmul, NegativeNumThreadsIsRejected) {
  ValidSoftmaxMatmul s;
  s.p.num_threads = -1;
  expect_sm_error(s.p, ErrorKind::invalid_argument, {"num_threads=-1"});
}

TEST(ValidateSoftmaxMatmul, UnknownFp32ModeIsRejected) {
  ValidSoftmaxMatmul s;
  s.p.fp32_mode = static_cast<Fp32Mode>(2);
  expect_sm_error(s.p, ErrorKind::invalid_argument, {"fp32_mode=2"});
}

#ifndef TILEATTN_WITH_CUDA
TEST(ValidateSoftmaxMatmul, CudaBackendWithoutCudaIsADeviceError) {
  ValidSoftmaxMatmul s;
  s.p.backend = Backend::cuda;
  expect_error([&] { softmax_matmul(s.p); }, ErrorKind::device, {"backend=cuda", "no CUDA backend"});
}
#endif

}  // namespace
}  // namespace tileattn::test
