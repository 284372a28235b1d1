#pragma once
#include <cstdint>
#include <string>

namespace tessera {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::CUDA, index}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

// The device of a type that work goes to when only the type is named (a DeviceMesh of that
// type puts its DTensors' pieces there): PyTorch's torch.cuda.set_device / current_device. Index
// 0 until set; a process driving one GPU of several sets it once, before making meshes.
void set_current_device(Device device);
Device current_device(DeviceType type);

// True when this build has CUDA support compiled in (it may still have no device to run on).
bool cuda_compiled();
// The CUDA devices this process can use: 0 without CUDA support, without a driver or without a
// GPU (never an error).
int cuda_device_count();
// Waits until the work queued on `device` so far has finished (torch.cuda.synchronize): what a
// timing of device work ends with. Nothing to wait for on the CPU, whose kernels finish before
// they return.
void synchronize(Device device);

}  // namespace tessera
