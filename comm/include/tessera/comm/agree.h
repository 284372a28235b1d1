#pragma once
// Errors that every rank hears about. Work that can fail on some ranks only (a disk error, a
// damaged block, a wrong shape in one rank's dict, a file one rank cannot read) must not leave
// the other ranks waiting in the next collective: each rank runs its local work, then the ranks
// exchange whether it failed, and if any did, every rank throws the same error, naming the ranks
// and their messages. Each call is collective over the group, on success too.
#include <functional>
#include <string>
#include <vector>

#include "tessera/comm/process_group.h"

namespace tessera {

// Runs `f` (which must not communicate) and agrees on the outcome over `pg`.
void run_agreed(const ProcessGroupPtr& pg, const std::string& context,
                const std::function<void()>& f);

// Agrees on an outcome found elsewhere: `error` empty is success on this rank.
void agree(const ProcessGroupPtr& pg, const std::string& context, const std::string& error);

// Every member's `text`, in group-rank order (collective over `pg`; texts may differ in length).
std::vector<std::string> all_gather_strings(const ProcessGroupPtr& pg, const std::string& text);

// The text of the exception in flight, prefixed with this rank when it does not carry one.
std::string current_error_text();

}  // namespace tessera
