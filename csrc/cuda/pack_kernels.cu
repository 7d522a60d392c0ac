// One-launch pack/unpack of many tensors on CUDA (see pack.h).
//
// The table uploaded per call holds, for n parts: offsets[0..n] (prefix sums of the parts' element
// counts, offsets[0] = 0) and n Part records. Each element i of the packed buffer binary-searches
// offsets for its part, so a launch covers any number of parts of any sizes with no per-part launch
// and no host loop over elements. Parts of equal dtype to the wire with scale 1 (and every integer
// pack) are moved as raw bytes by the same kernel shape.
#include "cuda/pack_kernels.h"

#include "cuda/device.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
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

constexpr int kTableSlots = 8;

} // namespace

// A ring of pinned host copies of the table, each with the event recorded after the host-to-device
// copy out of it, and one device table. A call writes the next slot on the host, so the host waits
// for the GPU only when the copy out of that slot, kTableSlots calls ago, is still queued (behind
// the caller's kernels and NCCL's): rare, where waiting for the last upload on every call would
// busy-wait the host on each pack and turn the group's wait() into a host wait.
// The device table needs no ring: the copy into it is queued on the stream behind the kernels that
// read its previous contents, so it is ordered after them.
struct PartTable::State {
  struct Slot {
    at::Tensor host;               // pinned, `capacity` bytes
    cudaEvent_t copied = nullptr;  // recorded on the stream after the copy out of `host`
    bool pending = false;          // `copied` recorded since `host` was allocated
  };
  std::array<Slot, kTableSlots> slots;
  int next = 0;                    // the slot the next call writes
  at::Tensor device;               // from the caching allocator, `capacity` bytes, owned by `stream`
  size_t capacity = 0;
  c10::DeviceIndex deviceIndex = -1;  // where the events and the device table live
  std::optional<cudaStream_t> stream;  // the stream `device` was allocated on and `slots` are marked for
};

PartTable::PartTable() : state(std::make_unique<State>()) {}

PartTable::~PartTable() {
  // Nothing is waited for: the last uploads may sit on the stream behind an NCCL kernel that waits
  // for a peer (at teardown, perhaps one that is gone). The buffers go back to torch's allocators,
  // which reuse them only once the stream has passed their last use (the device table's block
  // belongs to the stream; the pinned blocks are marked for it), and an event destroyed before it
  // completes is released by CUDA when it does. Best effort, as the CUDA runtime may be gone at
  // process exit: errors are dropped, and cleared so that no later check reports them.
  for (auto& slot : state->slots) {
    if (slot.copied && cudaEventDestroy(slot.copied) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
}

size_t PartTable::bytesHeld() const {
  size_t total = state->device.defined() ? state->device.nbytes() : 0;
  for (const auto& slot : state->slots) {
    total += slot.host.defined() ? slot.host.nbytes() : 0;
  }
  return total;
}

namespace {

struct Uploaded {
  const int64_t* offsets;
  const Part* parts;
  int n;
  int64_t total;
};

// Makes room for a table of `need` bytes uploaded on `stream` (on the current device). All slots
// grow at once, so that a size seen once is warmed up for every slot ("nothing allocated per call
// once warmed up" holds from the next call on, not kTableSlots calls later).
void prepare(PartTable::State& s, size_t need, cudaStream_t stream) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  if (s.deviceIndex < 0) {
    for (auto& slot : s.slots) {
      if (!slot.copied) {
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming));
      }
    }
    s.deviceIndex = device;
  }
  TORCH_CHECK(
      device == s.deviceIndex, "chainermn: a pack table of device ", static_cast<int>(s.deviceIndex),
      " used on device ", static_cast<int>(device));
  const bool grow = need > s.capacity;
  if (!grow && s.stream == stream) {
    return;
  }
  const c10::cuda::CUDAStream cudaStream = c10::cuda::getStreamFromExternal(stream, device);
  const size_t capacity = grow ? std::max<size_t>({need, s.capacity * 2, 4096}) : s.capacity;
  // The caching allocator gives a block to the stream current at allocation and reuses it, once
  // freed, only for allocations on that stream: stream-ordered after every kernel queued there, so
  // the old table is dropped without waiting while kernels may still read it. The callers run with
  // the group's stream current; the guard makes sure of it for any other `stream`, which then gets
  // its own device table (a table read on one stream and rewritten on another would race).
  at::Tensor deviceTable;
  {
    std::optional<c10::cuda::CUDAStreamGuard> guard;
    if (c10::cuda::getCurrentCUDAStream(device).stream() != stream) {
      guard.emplace(cudaStream);
    }
    deviceTable =
        at::empty({static_cast<int64_t>(capacity)}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
  }
  if (grow) {
    std::array<at::Tensor, kTableSlots> hosts;
    for (auto& host : hosts) {
      host = pinnedFor(capacity, cudaStream);
    }
    for (int i = 0; i < kTableSlots; ++i) {
      // The old buffer may still be copied out of: the host allocator holds it until then. The new
      // one is unused, so its slot's pending event (the old buffer's) need not be waited for.
      s.slots[i].host = std::move(hosts[i]);
      s.slots[i].pending = false;
    }
  } else {
    for (auto& slot : s.slots) {
      markUsedBy(slot.host, cudaStream);
    }
  }
  s.device = std::move(deviceTable);
  s.capacity = capacity;
  s.stream = stream;
}

// Writes offsets and parts into the next pinned slot and copies it to the device on `stream`.
Uploaded upload(PartTable::State& s, const std::vector<FlatBuffer>& parts, bool bytes, cudaStream_t stream) {
  const int n = static_cast<int>(parts.size());
  const size_t offsetBytes = (static_cast<size_t>(n) + 1) * sizeof(int64_t);
  const size_t partsAt = (offsetBytes + alignof(Part) - 1) / alignof(Part) * alignof(Part);
  const size_t need = partsAt + static_cast<size_t>(n) * sizeof(Part);
  prepare(s, need, stream);
  auto& slot = s.slots[s.next];
  s.next = (s.next + 1) % kTableSlots;
  if (slot.pending) {
    // The copy out of this slot, kTableSlots calls ago, must be over before it is rewritten. It
    // normally is, and then this returns at once; it waits only when the stream is that far behind.
    C10_CUDA_CHECK(cudaEventSynchronize(slot.copied));
    slot.pending = false;
  }
  auto* host = static_cast<char*>(slot.host.data_ptr());
  auto* device = static_cast<char*>(s.device.data_ptr());
  auto* offsets = reinterpret_cast<int64_t*>(host);
  auto* records = reinterpret_cast<Part*>(host + partsAt);
  offsets[0] = 0;
  for (int p = 0; p < n; ++p) {
    const int64_t count = bytes ? parts[p].count * static_cast<int64_t>(c10::elementSize(parts[p].dtype)) : parts[p].count;
    offsets[p + 1] = offsets[p] + count;
    records[p] = Part{parts[p].data, bytes ? static_cast<int32_t>(Kind::Byte) : static_cast<int32_t>(kindOf(parts[p].dtype)), 0};
  }
  // Into the one device table: queued behind the kernels that read its previous contents.
  C10_CUDA_CHECK(cudaMemcpyAsync(device, host, need, cudaMemcpyHostToDevice, stream));
  C10_CUDA_CHECK(cudaEventRecord(slot.copied, stream));
  slot.pending = true;
  return Uploaded{
      reinterpret_cast<const int64_t*>(device), reinterpret_cast<const Part*>(device + partsAt), n, offsets[n]};
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
