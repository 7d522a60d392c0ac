// A CUDA Scratch's moves (buffers/scratch.h): on the current stream of its device, which is the
// group's inside an op's scope (cuda/device.h), so they are ordered with the op's transport calls.
#include "cuda/pack_kernels.h"
#include "cuda/codes_kernels.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace chainermn::cuda {

namespace {
class DeviceMover : public Mover {
 public:
  explicit DeviceMover(at::Device device) : device_(device) {}

  void copy(void* dst, const void* src, size_t bytes) override {
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
  }
  void pack(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale) override {
    cuda::pack(table_, parts, packed, wire, scale, stream());
  }
  void unpack(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale) override {
    cuda::unpack(table_, packed, wire, parts, scale, stream());
  }
  void encode(Code code, const CodeSettings& settings, const float* values, float* residual, void* wire, int64_t rows,
              int64_t rowBytes, int64_t count) override {
    cuda::encode(code, settings, values, residual, static_cast<uint8_t*>(wire), rows, rowBytes, count, stream());
  }
  void decode(Code code, const CodeSettings& settings, const void* wire, int64_t rows, int64_t rowBytes, float* out,
              int64_t count, bool sum, bool accumulate) override {
    cuda::decode(code, settings, static_cast<const uint8_t*>(wire), rows, rowBytes, out, count, sum, accumulate,
                 stream());
  }
  size_t bytesHeld() const override {
    return table_.bytesHeld();
  }

 private:
  cudaStream_t stream() const {
    return c10::cuda::getCurrentCUDAStream(device_.index()).stream();
  }

  at::Device device_;
  PartTable table_;  // the pack kernels' table of parts
};
}  // namespace

std::unique_ptr<Mover> makeMover(at::Device device) {
  return std::make_unique<DeviceMover>(device);
}

}  // namespace chainermn::cuda
