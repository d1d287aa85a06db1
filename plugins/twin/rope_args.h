// RopeTwinArgs (the C ABI's description of one call) -> a checked rope::Problem, with the contract's
// checks in rope_export.reference's order. Both the twin's rope_twin_run and the CUDA library
// (cuda/rope_cuda_api.cpp) start from it.
#pragma once

#include "../rotary/rotary_problem.h"
#include "rope_c_api.h"

#include <string>

namespace rope
{

// A C ABI shape (int64 array + rank) as the core's Dims; ranks past kMaxRank are bad_rank.
Dims to_dims(int64_t const* d, int32_t rank);
bool bad_rank(int32_t rank);

// False with the contract's message when the arguments break it (shapes, dtypes, null or
// element-misaligned pointers).
bool problem_from_args(RopeTwinArgs const& a, Problem& out, std::string& err);

// The plan as the C ABI reports it.
RopeTwinPlan plan_to_c(Plan const& l);

// The C ABI's error return: ``msg`` into the caller's buffer (truncated, NUL-terminated), then 1.
int32_t report(std::string const& msg, char* err, int64_t err_len);

} // namespace rope
