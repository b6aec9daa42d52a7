#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "moerail/dtype.h"
#include "moerail/reference/host.h"
#include "moerail/tensor.h"

namespace moerail {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits_to_float(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(round_to_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);
  EXPECT_EQ(round_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
}

TEST(DType, F16RoundTripsEveryHalfValue) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_bits_to_float(std::uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_f16_bits(f), h) << "half bits " << h;
  }
  EXPECT_EQ(f16_bits_to_float(float_to_f16_bits(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_bits_to_float(float_to_f16_bits(1e6f))));
}

TEST(TensorView, ChecksNameTheArgument) {
  ref::HostTensor t(DType::F32, {3, 4});
  check_shape("op", "x", t, {3, -1});
  try {
    check_shape("dispatch", "x", t, {3, 5});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch: x has shape [3, 4] but [3, 5] was expected");
  }
  try {
    check_dtype("dispatch", "topk_idx", t, {DType::I32});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "dispatch: topk_idx has dtype f32 but one of {i32} was expected");
  }
  TensorView null_data(static_cast<void*>(nullptr), DType::F32, {2, 2});
  EXPECT_THROW(check_shape("op", "x", null_data, {2, 2}), Error);
  EXPECT_THROW(TensorView(static_cast<void*>(nullptr), DType::F32, {-1}), Error);
}

TEST(HostTensor, StoresRoundToTheDtype) {
  ref::HostTensor t(DType::BF16, {2});
  t.set_f(0, 1.00001);
  EXPECT_EQ(t.f(0), 1.0);
  t.fill_nan();
  EXPECT_TRUE(std::isnan(t.f(1)));
}

}  // namespace
}  // namespace moerail
