#pragma once
// The counter behind comm_op_counts() (internal to comm/): the checked group in front of every
// backend counts each operation it is asked for, before any check, so that a test sees what the
// caller issued.
namespace tessera::detail {
void count_comm_op(const char* op);
}
