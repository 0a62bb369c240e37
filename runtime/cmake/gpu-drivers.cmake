# pcp's hook into eerie-sys's CMake build of the IREE runtime.
#
# eerie-sys 0.5 (eerie 0.7) hard-codes `-DIREE_HAL_DRIVER_HIP=OFF` and offers no
# build-script option for it. cmake-rs passes `CMAKE_TOOLCHAIN_FILE` from the
# environment (set in .cargo/config.toml), and CMake reads this file at the
# first `project()`, after the command line's cache entries: so the settings
# below win, and nothing of eerie-sys is patched or copied.
#
# It turns on IREE's CUDA, HIP and Vulkan HAL drivers. Each one dlopens its
# vendor library (libcuda.so, libamdhip64.so, libvulkan.so) at run time, so the
# binary builds and runs on a machine with no GPU SDK. The headers they compile
# against come from `$PCP_GPU_SDK` (default `.data/gpu-sdk`), which
# scripts/setup.sh fills from PyPI's triton wheel: HIP's API headers, cuda.h
# and libdevice (which IREE's CUDA CMake insists on finding).
#
# Only the IREE runtime build defines IREE_HAL_DRIVER_HIP on its command line;
# any other CMake project that reads this file is left alone.
if(NOT DEFINED IREE_HAL_DRIVER_HIP OR DEFINED PCP_GPU_DRIVERS_DONE)
  return()
endif()
set(PCP_GPU_DRIVERS_DONE ON)

set(_pcp_sdk "$ENV{PCP_GPU_SDK}")
if(_pcp_sdk STREQUAL "" OR NOT EXISTS "${_pcp_sdk}/hip/include/hip/hip_version.h"
   OR NOT EXISTS "${_pcp_sdk}/cuda/include/cuda.h")
  message(FATAL_ERROR "pcp: GPU driver headers not found under PCP_GPU_SDK='${_pcp_sdk}'; run scripts/setup.sh")
endif()

set(IREE_HAL_DRIVER_CUDA ON CACHE BOOL "" FORCE)
set(IREE_HAL_DRIVER_HIP ON CACHE BOOL "" FORCE)
set(IREE_HAL_DRIVER_VULKAN ON CACHE BOOL "" FORCE)
set(HIP_API_HEADERS_ROOT "${_pcp_sdk}/hip/include" CACHE PATH "" FORCE)
# IREE's "minimal CUDA deps" path: cuda.h and libdevice, no toolkit search
# (and no download).
set(ENV{IREE_CUDA_DEPS_DIR} "${_pcp_sdk}/cuda")
set(IREE_CUDA_LIBDEVICE_PATH "${_pcp_sdk}/cuda/nvvm/libdevice/libdevice.10.bc" CACHE FILEPATH "" FORCE)
# No ROCm test chip: IREE would otherwise run rocminfo at configure time.
set(IREE_ROCM_TEST_TARGET_CHIP "" CACHE STRING "" FORCE)
