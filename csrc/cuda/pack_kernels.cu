// One-launch pack/unpack of many tensors on CUDA (see pack.h).
//
// The table uploaded per call holds, for n parts: offsets[0..n] (prefix sums of the parts' element
// counts, offsets[0] = 0) and n Part records. Each element i of the packed buffer binary-searches
// offsets for its part, so a launch covers any number of parts of any sizes with no per-part launch
// and no host loop over elements. Parts of equal dtype to the wire with scale 1 (and every integer
// pack) are moved as raw bytes by the same kernel shape.
#include "kernels/pack.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

namespace chainermn::cuda {

namespace {

enum class Kind : int32_t { Float = 0, Double = 1, Half = 2, BFloat16 = 3, Byte = 4 };

struct Part {
  void* data;
  int32_t kind;
  int32_t pad;
};

Kind kindOf(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return Kind::Float;
    case c10::ScalarType::Double:
      return Kind::Double;
    case c10::ScalarType::Half:
      return Kind::Half;
    case c10::ScalarType::BFloat16:
      return Kind::BFloat16;
    default:
      TORCH_CHECK(false, "chainermn: the CUDA pack kernel casts floating dtypes only, got ", dtype);
  }
}

// The part holding element i: the last p with offsets[p] <= i (offsets has n + 1 entries).
__device__ __forceinline__ int findPart(const int64_t* offsets, int n, int64_t i) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ T loadAs(const Part& part, int64_t j) {
  switch (static_cast<Kind>(part.kind)) {
    case Kind::Float:
      return static_cast<T>(static_cast<const float*>(part.data)[j]);
    case Kind::Double:
      return static_cast<T>(static_cast<const double*>(part.data)[j]);
    case Kind::Half:
      return static_cast<T>(static_cast<float>(static_cast<const c10::Half*>(part.data)[j]));
    case Kind::BFloat16:
    default:
      return static_cast<T>(static_cast<float>(static_cast<const c10::BFloat16*>(part.data)[j]));
  }
}

template <typename T>
__device__ __forceinline__ void storeFrom(const Part& part, int64_t j, T value) {
  switch (static_cast<Kind>(part.kind)) {
    case Kind::Float:
      static_cast<float*>(part.data)[j] = static_cast<float>(value);
      break;
    case Kind::Double:
      static_cast<double*>(part.data)[j] = static_cast<double>(value);
      break;
    case Kind::Half:
      static_cast<c10::Half*>(part.data)[j] = c10::Half(static_cast<float>(value));
      break;
    case Kind::BFloat16:
    default:
      static_cast<c10::BFloat16*>(part.data)[j] = c10::BFloat16(static_cast<float>(value));
      break;
  }
}

template <typename W>
__device__ __forceinline__ float wireToFloat(W v) {
  return static_cast<float>(v);
}

// Arithmetic in float unless a double is involved, as torch (and castScale on the CPU) computes.
template <typename W>
__global__ void packKernel(W* packed, const int64_t* offsets, const Part* parts, int n, int64_t total, double scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int p = findPart(offsets, n, i);
    const Part part = parts[p];
    const int64_t j = i - offsets[p];
    if (std::is_same_v<W, double> || static_cast<Kind>(part.kind) == Kind::Double) {
      packed[i] = static_cast<W>(loadAs<double>(part, j) * scale);
    } else {
      const float v = loadAs<float>(part, j);
      packed[i] = static_cast<W>(scale == 1.0 ? v : v * static_cast<float>(scale));
    }
  }
}

template <typename W>
__global__ void unpackKernel(const W* packed, const int64_t* offsets, const Part* parts, int n, int64_t total, double scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int p = findPart(offsets, n, i);
    const Part part = parts[p];
    const int64_t j = i - offsets[p];
    if (std::is_same_v<W, double> || static_cast<Kind>(part.kind) == Kind::Double) {
      storeFrom<double>(part, j, static_cast<double>(packed[i]) * scale);
    } else {
      const float v = static_cast<float>(packed[i]);
      storeFrom<float>(part, j, scale == 1.0 ? v : v * static_cast<float>(scale));
    }
  }
}

// Raw bytes (same dtype, no scale): offsets count bytes.
__global__ void packBytesKernel(uint8_t* packed, const int64_t* offsets, const Part* parts, int n, int64_t total, bool toPacked) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int p = findPart(offsets, n, i);
    auto* data = static_cast<uint8_t*>(parts[p].data);
    const int64_t j = i - offsets[p];
    if (toPacked) {
      packed[i] = data[j];
    } else {
      data[j] = packed[i];
    }
  }
}

int blocksFor(int64_t total) {
  constexpr int64_t kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  // Grid-stride beyond this: enough blocks to fill any current GPU many times over.
  return static_cast<int>(std::min<int64_t>(blocks, 65535));
}

} // namespace

struct PartTable::State {
  char* host = nullptr;    // pinned
  char* device = nullptr;  // device memory of the current device
  size_t capacity = 0;
  cudaEvent_t uploaded = nullptr;  // the last upload out of `host`: it may be rewritten after it
  int deviceIndex = -1;
};

PartTable::PartTable() : state(std::make_unique<State>()) {}

PartTable::~PartTable() {
  // Best effort at teardown (the CUDA runtime may be gone at process exit): errors are ignored.
  if (state->uploaded) {
    cudaEventSynchronize(state->uploaded);
    cudaEventDestroy(state->uploaded);
  }
  if (state->host) {
    cudaFreeHost(state->host);
  }
  if (state->device) {
    cudaFree(state->device);
  }
}

size_t PartTable::bytesHeld() const {
  return state->capacity;
}

namespace {

struct Uploaded {
  const int64_t* offsets;
  const Part* parts;
  int n;
  int64_t total;
};

// Writes offsets and parts into the pinned table and copies it to the device on `stream`.
Uploaded upload(PartTable::State& s, const std::vector<FlatBuffer>& parts, bool bytes, cudaStream_t stream) {
  const int n = static_cast<int>(parts.size());
  const size_t offsetBytes = (static_cast<size_t>(n) + 1) * sizeof(int64_t);
  const size_t partsAt = (offsetBytes + alignof(Part) - 1) / alignof(Part) * alignof(Part);
  const size_t need = partsAt + static_cast<size_t>(n) * sizeof(Part);
  if (s.uploaded) {
    // The previous call's copy out of the pinned table must be over before it is rewritten.
    C10_CUDA_CHECK(cudaEventSynchronize(s.uploaded));
  } else {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&s.uploaded, cudaEventDisableTiming));
  }
  if (need > s.capacity) {
    const size_t capacity = std::max<size_t>({need, s.capacity * 2, 4096});
    if (s.host) {
      C10_CUDA_CHECK(cudaFreeHost(s.host));
    }
    if (s.device) {
      // Earlier kernels on this stream may still read the old table.
      C10_CUDA_CHECK(cudaStreamSynchronize(stream));
      C10_CUDA_CHECK(cudaFree(s.device));
    }
    C10_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&s.host), capacity));
    C10_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&s.device), capacity));
    s.capacity = capacity;
  }
  auto* offsets = reinterpret_cast<int64_t*>(s.host);
  auto* records = reinterpret_cast<Part*>(s.host + partsAt);
  offsets[0] = 0;
  for (int p = 0; p < n; ++p) {
    const int64_t count = bytes ? parts[p].count * static_cast<int64_t>(c10::elementSize(parts[p].dtype)) : parts[p].count;
    offsets[p + 1] = offsets[p] + count;
    records[p] = Part{parts[p].data, bytes ? static_cast<int32_t>(Kind::Byte) : static_cast<int32_t>(kindOf(parts[p].dtype)), 0};
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(s.device, s.host, need, cudaMemcpyHostToDevice, stream));
  C10_CUDA_CHECK(cudaEventRecord(s.uploaded, stream));
  return Uploaded{
      reinterpret_cast<const int64_t*>(s.device), reinterpret_cast<const Part*>(s.device + partsAt), n, offsets[n]};
}

// Raw bytes suffice when nothing is cast or scaled (and integers are never cast).
bool moveAsBytes(const std::vector<FlatBuffer>& parts, c10::ScalarType wire, double scale) {
  if (scale != 1.0) {
    return false;
  }
  for (const auto& part : parts) {
    if (part.dtype != wire) {
      return false;
    }
  }
  return true;
}

template <typename F>
void dispatchWire(c10::ScalarType wire, F&& f) {
  switch (wire) {
    case c10::ScalarType::Float:
      return f(float{});
    case c10::ScalarType::Double:
      return f(double{});
    case c10::ScalarType::Half:
      return f(c10::Half{});
    case c10::ScalarType::BFloat16:
      return f(c10::BFloat16{});
    default:
      TORCH_CHECK(false, "chainermn: the CUDA pack kernel's wire dtype must be floating, got ", wire);
  }
}

void run(
    PartTable& table,
    const std::vector<FlatBuffer>& parts,
    void* packed,
    c10::ScalarType wire,
    double scale,
    void* rawStream,
    bool toPacked) {
  if (parts.empty()) {
    return;
  }
  auto stream = static_cast<cudaStream_t>(rawStream);
  const bool bytes = moveAsBytes(parts, wire, scale);
  const Uploaded t = upload(*table.state, parts, bytes, stream);
  if (t.total == 0) {
    return;
  }
  const int blocks = blocksFor(t.total);
  if (bytes) {
    packBytesKernel<<<blocks, 256, 0, stream>>>(static_cast<uint8_t*>(packed), t.offsets, t.parts, t.n, t.total, toPacked);
  } else {
    dispatchWire(wire, [&](auto tag) {
      using W = decltype(tag);
      if (toPacked) {
        packKernel<W><<<blocks, 256, 0, stream>>>(static_cast<W*>(packed), t.offsets, t.parts, t.n, t.total, scale);
      } else {
        unpackKernel<W><<<blocks, 256, 0, stream>>>(static_cast<const W*>(packed), t.offsets, t.parts, t.n, t.total, scale);
      }
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

void pack(PartTable& table, const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale, void* stream) {
  run(table, parts, packed, wire, scale, stream, /*toPacked=*/true);
}

void unpack(PartTable& table, const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale, void* stream) {
  run(table, parts, const_cast<void*>(packed), wire, scale, stream, /*toPacked=*/false);
}

} // namespace chainermn::cuda
