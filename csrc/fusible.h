// fusible's public C++ header: operations, fusion registry, OperationFuser, Sequential, kernels.
#pragma once

#include "fuser/operation_fuser.h"
#include "fuser/sequential.h"
#include "kernels/ops.h"
#include "ops/basic/activations.h"
#include "ops/basic/basic_linear.h"
#include "ops/basic/bias.h"
#include "ops/basic/dropout.h"
#include "ops/basic/extra_io.h"
#include "ops/basic/norms.h"
#include "ops/basic/simple_ops.h"
#include "ops/fused/forward_linear_bias_activation.h"
#include "ops/fusible_operation.h"
#include "ops/fusion_registry.h"
#include "ops/linear.h"
