#pragma once
// CUDA runtime plumbing shared by the CUDA backend (cuda/runtime/): error checks, the device's
// properties, device memory and stream-ordered scratch, uploads, launch checks.

#include "attnmix/cuda/runtime/checks.cuh"
#include "attnmix/cuda/runtime/device.cuh"
#include "attnmix/cuda/runtime/error.cuh"
#include "attnmix/cuda/runtime/memory.cuh"
#include "attnmix/cuda/runtime/pointer_check.cuh"
#include "attnmix/cuda/runtime/upload.cuh"
