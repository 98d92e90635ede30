// Agreement across the ranks of a Comm: checks that must end the same way on
// every rank. A rank that raised alone would leave the others waiting in their
// next collective (a timeout, or "Connection closed by peer"); agreeing first
// makes every rank raise the same error, at once.
#pragma once

#include <string>
#include <vector>

#include "core/comm/comm.h"

namespace rfsdp {

// Every rank's string, in rank order (one all-reduce of the lengths, one
// all-gather of the bytes). Collective.
std::vector<std::string> all_gather_strings(Comm& comm, const std::string& mine);

// Whether every rank holds the same lines (one all-reduce of a 64-bit hash per
// rank). If not, throws std::invalid_argument on every rank naming `what`, the
// first line where a rank differs from rank 0 (both versions) and every rank
// that differs; the lines travel only then. Collective.
void agree_lines(Comm& comm, const std::vector<std::string>& lines, const std::string& what);

}  // namespace rfsdp
