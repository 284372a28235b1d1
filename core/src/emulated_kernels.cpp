// The host executor for the portable device kernels: the launch of a stand-in device.
#include "tessera/core/detail/emulated_kernels.h"

#include <atomic>
#include <barrier>
#include <thread>
#include <vector>

#include "kernel_table.h"
#include "portable/kernels.h"

namespace tessera::detail {

namespace {

std::atomic<EmulatedMemory*> g_memory{nullptr};
std::atomic<int64_t> g_launches{0};

// A row's team on the host: kLanes threads, one per lane, meeting at a barrier to combine. Each
// lane leaves its value in its slot; after the barrier every lane combines all slots in lane
// order (so all get the same result), and a second barrier keeps the slots until all have read.
class HostTeam {
 public:
  static constexpr int kLanes = 4;
  struct Shared {
    std::barrier<> meet{kLanes};
    double slots[kLanes] = {};
  };
  HostTeam(int lane, Shared* shared) : lane_(lane), shared_(shared) {}
  int lane() const { return lane_; }
  int size() const { return kLanes; }
  template <class C>
  C sum(C v) {
    return reduce(v, [](C a, C b) { return a + b; });
  }
  template <class C>
  C max(C v) {
    return reduce(v, [](C a, C b) { return b > a ? b : a; });
  }
  template <class C, class Op>
  C reduce(C v, Op op) {
    shared_->slots[lane_] = double(v);  // exact for float and double
    shared_->meet.arrive_and_wait();
    C acc = C(shared_->slots[0]);
    for (int l = 1; l < kLanes; ++l)
      acc = op(acc, C(shared_->slots[l]));
    shared_->meet.arrive_and_wait();
    return acc;
  }

 private:
  int lane_;
  Shared* shared_;
};

// Runs the functor for every element in order, as one GPU thread per element would (the
// functors write disjoint elements, so order does not matter to the result); every row by a team
// of host threads, as a block of GPU threads shares it; and gemm by the reference loop.
struct HostExec {
  // The memory of the emulated device a launch runs on, counting the launch.
  static EmulatedMemory& launch_on(const char* op, Device device, const char* what) {
    EmulatedMemory* memory = g_memory.load();
    TESSERA_CHECK(memory != nullptr, op, ": emulated ", what, " on ", device.str(),
                  " with no emulated device alive");
    g_launches.fetch_add(1, std::memory_order_relaxed);
    return *memory;
  }

  template <class F>
  static void for_each(const char* op, Device device, int64_t n, const F& f) {
    EmulatedMemory* memory = &launch_on(op, device, "kernel launched");
    memory->open();
    for (int64_t i = 0; i < n; ++i)
      f(i);
    memory->close();
  }

  template <class F>
  static void for_each_row(const char* op, Device device, int64_t rows, const F& f) {
    EmulatedMemory* memory = &launch_on(op, device, "kernel launched");
    HostTeam::Shared shared;
    auto lane = [&](int l) {
      HostTeam team(l, &shared);
      for (int64_t r = 0; r < rows; ++r)
        f(r, team);
    };
    memory->open();
    std::vector<std::thread> others;
    for (int l = 1; l < HostTeam::kLanes; ++l)
      others.emplace_back(lane, l);
    lane(0);
    for (std::thread& t : others)
      t.join();
    memory->close();
  }

  static void gemm(const char* op, Device device, const kernels::portable::GemmCall& call) {
    kernels::portable::check_gemm_call(op, device, call);
    EmulatedMemory* memory = &launch_on(op, device, "gemm");
    memory->open();
    if (call.dtype == DType::Float64)
      kernels::portable::reference_gemm<double>(call);
    else
      kernels::portable::reference_gemm<float>(call);
    memory->close();
  }
};

}  // namespace

struct EmulatedDeviceKernels::Saved {
  kernels::registry::KernelTable table;
};

EmulatedDeviceKernels::EmulatedDeviceKernels(DeviceType type, EmulatedMemory* memory,
                                             const std::vector<std::string>& leave_out)
    : type_(type), saved_(std::make_unique<Saved>()) {
  TESSERA_CHECK(memory != nullptr, "EmulatedDeviceKernels: needs the device's memory");
  // Everything that can fail comes before anything global changes.
  saved_->table = kernels::registry::kernel_table(type);
  kernels::registry::KernelTable table = saved_->table;
  kernels::portable::fill_device_table<HostExec>(table);
  for (const std::string& name : leave_out)
    kernels::registry::clear_slot(table, name);
  EmulatedMemory* none = nullptr;
  TESSERA_CHECK(g_memory.compare_exchange_strong(none, memory),
                "EmulatedDeviceKernels: one is alive already");
  kernels::registry::set_kernel_table(type, table);
}

EmulatedDeviceKernels::~EmulatedDeviceKernels() {
  kernels::registry::set_kernel_table(type_, saved_->table);
  g_memory.store(nullptr);
}

std::vector<std::string> kernels_without_device_code() {
  kernels::registry::KernelTable table;
  kernels::portable::fill_device_table<HostExec>(table);
  return kernels::registry::empty_slots(table);
}

int64_t emulated_launches() {
  return g_launches.load();
}

}  // namespace tessera::detail
