#pragma once
// Private to core: one device type's column of the dispatch table as a plain struct, one function
// pointer per line of kernel_list.h (null: no implementation). A device backend fills the slots
// it implements and installs the column; a stand-in device saves the column, installs its own
// and puts the saved one back.
#include <string>
#include <string_view>
#include <vector>

#include "kernel_list.h"

namespace tessera::kernels::registry {

struct KernelTable {
#define TESSERA_KERNEL_SLOT(name, result, params, args) result(*name) params = nullptr;
  TESSERA_KERNELS(TESSERA_KERNEL_SLOT)
#undef TESSERA_KERNEL_SLOT
};

// The implementations registered for `type` now.
KernelTable kernel_table(DeviceType type);
// Makes `table` the implementations of `type`, every slot (a null slot removes one). Not
// thread-safe against concurrent kernel calls: install a column before work starts. The CPU
// column is fixed; installing one for DeviceType::CPU is an error.
void set_kernel_table(DeviceType type, const KernelTable& table);

// The names of `table`'s empty slots, in list order.
std::vector<std::string> empty_slots(const KernelTable& table);

// Empties the slot of the kernel called `name` (as in kernel_list.h); an unknown name is an error.
void clear_slot(KernelTable& table, std::string_view name);

}  // namespace tessera::kernels::registry
