#include <gtest/gtest.h>

#include "tessera/tessera.h"

using namespace tessera;

TEST(Tensor, ViewsShareStorage) {
  Tensor a = arange(0, 12, 1, DType::Float32);
  Tensor m = kernels::view(a, {3, 4});
  Tensor t = kernels::transpose(m, 0, 1);
  EXPECT_TRUE(t.storage().is_same(a.storage()));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.shape(), (Shape{4, 3}));
  EXPECT_EQ(t.contiguous().to_vector<float>(),
            (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
}
