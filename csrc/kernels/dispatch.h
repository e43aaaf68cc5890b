// Typed entry points to every torch.ops.fusible kernel op for C++ callers, declared by each kernel
// family beside its schemas. Each goes through the dispatcher, so C++ and Python get the same CPU /
// CUDA / Meta routing.
#pragma once

#include "kernels/activation/activation.h"
#include "kernels/bias/bias.h"
#include "kernels/dropout/dropout.h"
#include "kernels/elementwise/elementwise.h"
#include "kernels/fp8/fp8.h"
#include "kernels/fp8/fp8_block.h"
#include "kernels/fp8/fp8_gemm.h"
#include "kernels/grouped/grouped.h"
#include "kernels/linear/linear.h"
#include "kernels/loss/loss.h"
#include "kernels/norm/norm.h"
#include "kernels/rotary/rotary.h"
