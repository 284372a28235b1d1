// Kernel dispatch by device (kernels/dispatch.h) and the stand-in device of the testing kit:
// mixed devices and missing kernels are errors that name the kernel and the tensors; with host
// fallback every kernel on a cuda:0 tensor gives the CPU's result bit for bit and leaves it on
// the device; and the stand-in's memory really is out of the CPU's reach.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <csignal>
#include <cstdlib>
#include <string>

#include "tessera/tessera.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "tessera/testing/stand_in_device.h"

using namespace tessera;
using tessera::testing::expect_error;
using tessera::testing::random_tensor;
using tessera::testing::StandInDevice;

namespace {

Tensor cuda(const Tensor& t) {
  return t.to(Device::cuda(0));
}
Tensor host(const Tensor& t) {
  EXPECT_TRUE(t.device().is_cuda()) << t.str();
  return t.to(Device::cpu());
}
void expect_bits(const Tensor& device_result, const Tensor& cpu_result, const char* what) {
  ASSERT_TRUE(device_result.device().is_cuda()) << what << ": " << device_result.str();
  EXPECT_EQ(device_result.shape(), cpu_result.shape()) << what;
  EXPECT_EQ(device_result.dtype(), cpu_result.dtype()) << what;
  EXPECT_EQ(host(device_result).to(DType::Float64).to_vector<double>(),
            cpu_result.to(DType::Float64).to_vector<double>())
      << what;
}

}  // namespace

TEST(DeviceDispatch, MixedDevicesNameTheKernelAndBothTensors) {
  StandInDevice device;
  Tensor a = random_tensor({2, 3}, 1, DType::Float32);
  Tensor b = cuda(random_tensor({2, 3}, 2, DType::Float32));
  expect_error([&] { kernels::binary(kernels::BinaryOp::Add, a, b); },
               {"binary", "one device", "cpu", "cuda:0", "tensor argument 1", "tensor argument 2"});
  expect_error([&] { kernels::cat({a, b}, 0); }, {"cat", "cpu", "cuda:0"});
}

TEST(DeviceDispatch, WithoutFallbackAMissingDeviceKernelIsAnErrorNamingIt) {
  // The device's own kernels (emulated) except vocab_ce_loss.
  StandInDevice device(tessera::testing::KernelsOn::Device, {"vocab_ce_loss"});
  const Tensor stats = cuda(full({3, 2}, 1.0)), row_max = cuda(full({3}, 0.0));
  const Tensor target = cuda(full({3}, 1.0, DType::Int64));
  kernels::set_host_fallback(DeviceType::CUDA, kernels::HostFallback::Off);
  const std::string err =
      tessera::testing::error_of([&] { kernels::vocab_ce_loss(stats, row_max, target, 3); });
  kernels::set_host_fallback(DeviceType::CUDA, kernels::HostFallback::Missing);
  EXPECT_NE(err.find("vocab_ce_loss"), std::string::npos) << err;
  EXPECT_NE(err.find("cuda:0"), std::string::npos) << err;
  EXPECT_NE(err.find("HostFallback::Missing"), std::string::npos) << err;
}

TEST(DeviceDispatch, FallbackGivesTheCpuResultOnTheDevice) {
  StandInDevice device;
  const int64_t calls = kernels::host_fallback_calls();
  Tensor a = random_tensor({3, 4}, 1, DType::Float32);
  Tensor b = random_tensor({4, 5}, 2, DType::Float32);
  Tensor w = random_tensor({4}, 3, DType::Float32);
  expect_bits(kernels::matmul(cuda(a), cuda(b), false, false), kernels::matmul(a, b), "matmul");
  expect_bits(kernels::unary(kernels::UnaryOp::Silu, cuda(a)),
              kernels::unary(kernels::UnaryOp::Silu, a), "silu");
  expect_bits(kernels::softmax(cuda(a), 1), kernels::softmax(a, 1), "softmax");
  expect_bits(kernels::sum(cuda(a), {0}, false), kernels::sum(a, {0}), "sum");
  expect_bits(kernels::rms_norm(cuda(a), cuda(w), 1e-6).out, kernels::rms_norm(a, w, 1e-6).out,
              "rms_norm");
  const auto dmax = kernels::max(cuda(a), 1, false);
  const auto cmax = kernels::max(a, 1);
  expect_bits(dmax.values, cmax.values, "max values");
  expect_bits(dmax.indices, cmax.indices, "max indices");
  expect_bits(kernels::cat({cuda(a), cuda(a)}, 0), kernels::cat({a, a}, 0), "cat");
  EXPECT_GT(kernels::host_fallback_calls(), calls);
}

TEST(DeviceDispatch, ViewsOfDeviceTensorsKeepTheirStrides) {
  StandInDevice device;
  Tensor a = random_tensor({4, 6}, 1, DType::Float32);
  Tensor d = cuda(a);
  // A transposed column window: not contiguous, not at offset 0.
  Tensor dv = kernels::transpose(kernels::narrow(d, 1, 2, 3), 0, 1);
  Tensor cv = kernels::transpose(kernels::narrow(a, 1, 2, 3), 0, 1);
  expect_bits(kernels::binary_scalar(kernels::BinaryOp::Mul, dv, 2.0),
              kernels::binary_scalar(kernels::BinaryOp::Mul, cv, 2.0), "strided mul");
  expect_bits(dv.contiguous(), cv.contiguous(), "contiguous of a device view");
  expect_bits(dv.to(DType::Float64), cv.to(DType::Float64), "dtype conversion on the device");
  EXPECT_EQ(dv.to(Device::cpu()).to_vector<float>(), cv.contiguous().to_vector<float>());
}

TEST(DeviceDispatch, InPlaceKernelsWriteOnlyTheirViewOnTheDevice) {
  StandInDevice device;
  Tensor a = random_tensor({4, 6}, 1, DType::Float32);
  Tensor b = random_tensor({4, 2}, 2, DType::Float32);
  Tensor d = cuda(a);
  Tensor dwin = kernels::narrow(d, 1, 1, 2);
  kernels::add_(dwin, cuda(b), 0.5);
  Tensor cwin = kernels::narrow(a, 1, 1, 2);
  kernels::add_(cwin, b, 0.5);
  expect_bits(d, a, "add_ into a column window");

  Tensor cpu_target = zeros({6, 4});
  Tensor dev_target = cuda(cpu_target);
  Tensor dev_t = kernels::transpose(dev_target, 0, 1);  // [4, 6] view with strides (1, 4)
  dev_t.copy_(d);
  kernels::transpose(cpu_target, 0, 1).copy_(a);
  expect_bits(dev_target, cpu_target, "copy_ into a transposed device view");
}

TEST(DeviceDispatch, RandomDrawsOnTheDeviceAreTheCpuDraws) {
  StandInDevice device;
  Tensor c = empty({5, 7});
  Tensor d = empty({5, 7}, TensorOptions(DType::Float32, Device::cuda(0)));
  Generator gc(42), gd(42);
  normal_(c, 0.0, 1.0, gc);
  normal_(d, 0.0, 1.0, gd);
  expect_bits(d, c, "normal_");
  Generator g1(7), g2(7);
  const auto dd = kernels::dropout(cuda(c), 0.25, g1);
  const auto cd = kernels::dropout(c, 0.25, g2);
  expect_bits(dd.out, cd.out, "dropout");
  EXPECT_EQ(g1.offset(), g2.offset());
}

TEST(DeviceDispatch, FactoriesAndStatisticsOnTheDevice) {
  StandInDevice device;
  const MemoryStats before = memory_stats(Device::cuda(0));
  {
    Tensor z = zeros({3, 3}, TensorOptions(DType::Float64, Device::cuda(0)));
    Tensor f = full({2}, 1.5, TensorOptions(DType::Float32, Device::cuda(0)));
    expect_bits(z, zeros({3, 3}, DType::Float64), "zeros");
    expect_bits(f, full({2}, 1.5), "full");
    EXPECT_EQ(memory_stats(Device::cuda(0)).current_bytes - before.current_bytes, 9 * 8 + 2 * 4);
    EXPECT_EQ(device.live_blocks(), 2);
  }
  EXPECT_EQ(memory_stats(Device::cuda(0)).current_bytes, before.current_bytes);
  EXPECT_EQ(device.live_blocks(), 0);
}

// The stand-in is only worth having if touching device memory from the CPU fails as it would on
// a GPU.
TEST(DeviceDispatchDeathTest, TheCpuCannotReadStandInMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // SIGSEGV with nothing printed, or the sanitizer build's report of it (ASan prints "SEGV" and
  // aborts); an exception would print "terminate called" and abort, which neither matches.
  const auto segfaulted = [](int status) {
    return WIFSIGNALED(status) && (WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGABRT);
  };
  EXPECT_EXIT(
      {
        StandInDevice device;
        Tensor d = cuda(full({4}, 3.0));
        volatile float v = d.data<float>()[0];
        (void)v;
      },
      segfaulted, "^$|SEGV");
}

TEST(DeviceDispatch, LeavingOutAnUnknownKernelIsAnError) {
  expect_error([] { StandInDevice device(tessera::testing::KernelsOn::Device, {"softmaxx"}); },
               {"no kernel", "softmaxx"});
  StandInDevice after;  // the refused one left nothing behind
}

TEST(DeviceDispatch, TestDeviceIsTheStandInUnlessAGpuIsThere) {
  const char* asked = std::getenv("TESSERA_TEST_DEVICE");
  const std::string before = asked ? asked : "";
  const bool stand_in_asked = before == "stand-in";
  {
    tessera::testing::TestDevice device;
    EXPECT_EQ(device.is_stand_in(), cuda_device_count() == 0 || stand_in_asked) << device.str();
    Tensor d = cuda(full({3}, 2.0));
    EXPECT_EQ(host(kernels::binary_scalar(kernels::BinaryOp::Mul, d, 2.0)).to_vector<float>(),
              std::vector<float>(3, 4.0f));
  }
  setenv("TESSERA_TEST_DEVICE", "stand-in", 1);
  {
    tessera::testing::TestDevice device;
    EXPECT_TRUE(device.is_stand_in());
    EXPECT_EQ(device.str(), "cuda:0 (stand-in, kernels on host copies)");
  }
  if (asked) {
    setenv("TESSERA_TEST_DEVICE", before.c_str(), 1);
  } else {
    unsetenv("TESSERA_TEST_DEVICE");
  }
}

TEST(DeviceDispatch, MissingKernelsWarnOncePerKernel) {
  // The device kernels (emulated) except vocab_ce_loss, with HostFallback::Missing.
  StandInDevice device(tessera::testing::KernelsOn::Device, {"vocab_ce_loss"});
  const Tensor stats = cuda(full({3, 2}, 1.0)), row_max = cuda(full({3}, 0.0));
  const Tensor target = cuda(full({3}, 1.0, DType::Int64));
  ::testing::internal::CaptureStderr();
  kernels::vocab_ce_loss(stats, row_max, target, 3);
  kernels::vocab_ce_loss(stats, row_max, target, 3);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("kernel 'vocab_ce_loss' has no cuda:0 implementation"), std::string::npos)
      << err;
  EXPECT_EQ(err.find("vocab_ce_loss"), err.rfind("vocab_ce_loss")) << "warned twice: " << err;
}

// gradcheck perturbs its inputs through host pointers: a device input is refused, not written.
TEST(DeviceDispatch, GradcheckRefusesDeviceInputs) {
  StandInDevice device;
  Tensor x = random_tensor({3}, 5, DType::Float64).to(Device::cuda(0));
  x.set_requires_grad(true);
  expect_error(
      [&] { gradcheck([](const std::vector<Tensor>& in) { return mul(in[0], in[0]); }, {x}); },
      {"gradcheck", "input 0", "on the CPU", "cuda:0"});
}
