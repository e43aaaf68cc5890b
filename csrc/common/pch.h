// Precompiled header: the heavy torch headers nearly every translation unit needs, parsed once per
// target.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <torch/nn/module.h>
