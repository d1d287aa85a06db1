// RopeTwinArgs (the C ABI's description of one call) -> a checked rope::Problem, with the contract's
// checks in rope_export.reference's order. The CUDA library (cuda/rope_cuda_api.cpp) uses it; the
// twin's rope_twin_run performs the same checks.
#pragma once

#include "../rotary/rotary_problem.h"
#include "rope_c_api.h"

#include <string>

namespace rope
{

// False with the contract's message when the arguments break it (shapes, dtypes, null pointers).
bool problem_from_args(RopeTwinArgs const& a, Problem& out, std::string& err);

// The plan as the C ABI reports it.
RopeTwinPlan plan_to_c(Plan const& l);

} // namespace rope
