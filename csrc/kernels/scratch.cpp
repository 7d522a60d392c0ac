#include "kernels/scratch.h"

#include <c10/util/Exception.h>

#include <cstring>

#ifdef CHAINERMN_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace chainermn {

#ifdef CHAINERMN_WITH_CUDA
namespace {
void* currentStream(at::Device device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}
} // namespace
#endif

Scratch::Scratch(at::Device device) : device_(device) {
  TORCH_CHECK(
      device_.is_cpu()
#ifdef CHAINERMN_WITH_CUDA
          || device_.is_cuda()
#endif
      ,
      "chainermn: no staging buffers for device ", device_);
#ifdef CHAINERMN_WITH_CUDA
  if (device_.is_cuda()) {
    table_ = std::make_unique<cuda::PartTable>();
  }
#endif
}

Scratch::~Scratch() = default;

void Scratch::copy(void* dst, const void* src, size_t bytes) {
  if (dst == src || bytes == 0) {
    return;
  }
  if (device_.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef CHAINERMN_WITH_CUDA
  C10_CUDA_CHECK(cudaMemcpyAsync(
      dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(currentStream(device_))));
#endif
}

void Scratch::pack(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale) {
  if (device_.is_cpu()) {
    packCpu(parts, packed, wire, scale);
    return;
  }
#ifdef CHAINERMN_WITH_CUDA
  cuda::pack(*table_, parts, packed, wire, scale, currentStream(device_));
#endif
}

void Scratch::unpack(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale) {
  if (device_.is_cpu()) {
    unpackCpu(packed, wire, parts, scale);
    return;
  }
#ifdef CHAINERMN_WITH_CUDA
  cuda::unpack(*table_, packed, wire, parts, scale, currentStream(device_));
#endif
}

size_t Scratch::bytesHeld() const {
  size_t total = 0;
  for (const auto& buffer : buffers_) {
    total += buffer.defined() ? static_cast<size_t>(buffer.numel()) : 0;
  }
#ifdef CHAINERMN_WITH_CUDA
  if (table_) {
    total += table_->bytesHeld();
  }
#endif
  return total;
}

} // namespace chainermn
