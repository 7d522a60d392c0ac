// One-launch pack/unpack of many tensors on CUDA (see pack.h).
//
// The host cuts every part into chunks (at most `chunkLength` elements, or bytes for a raw move) and
// uploads the list per call; block b takes chunk b (grid-stride beyond the grid). A block knows its
// source, its destination, their dtypes and its length from its one record: no search per element,
// and the loop over the chunk is typed, so consecutive threads read and write consecutive addresses
// of one dtype. Parts of equal dtype to the wire with scale 1 (and every integer pack) are moved as
// raw bytes, in the widest words both ends' alignment allows.
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
#include <limits>
#include <optional>
#include <type_traits>

namespace chainermn::cuda {

namespace {

enum class Kind : int32_t { Float = 0, Double = 1, Half = 2, BFloat16 = 3, Byte = 4 };

// A stretch of one part and where it goes in the packed buffer.
struct Chunk {
  void* data;        // the part's first element (byte) of this chunk
  int64_t packedAt;  // its index in the packed buffer: wire elements, or bytes for a raw move
  int32_t count;     // elements (bytes) in the chunk
  int32_t kind;      // the part's Kind
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

// v * scale as `To`. Arithmetic in float unless a double is involved, as torch (and castScale on the
// CPU) computes; half and bfloat16 go through float both ways.
template <typename To, typename From>
__device__ __forceinline__ To scaled(From v, double scale) {
  if constexpr (std::is_same_v<To, double> || std::is_same_v<From, double>) {
    double d;
    if constexpr (std::is_same_v<From, double>) {
      d = v;
    } else {
      d = static_cast<double>(static_cast<float>(v));
    }
    if (scale != 1.0) {
      d *= scale;
    }
    if constexpr (std::is_same_v<To, double>) {
      return d;
    } else {
      return To(static_cast<float>(d));
    }
  } else {
    const float f = static_cast<float>(v);
    return To(scale == 1.0 ? f : f * static_cast<float>(scale));
  }
}

// out[k] = convert(in[k]) for k < count, by the block's threads, four loads in flight per thread.
template <typename From, typename To, typename Convert>
__device__ __forceinline__ void moveEach(const From* in, To* out, int32_t count, Convert convert) {
  const int step = blockDim.x;
  int k = threadIdx.x;
  for (; k + 3 * step < count; k += 4 * step) {
    const From a = in[k], b = in[k + step], c = in[k + 2 * step], d = in[k + 3 * step];
    out[k] = convert(a);
    out[k + step] = convert(b);
    out[k + 2 * step] = convert(c);
    out[k + 3 * step] = convert(d);
  }
  for (; k < count; k += step) {
    out[k] = convert(in[k]);
  }
}

// Calls f with a null pointer of the part's C++ type (one switch per chunk, not per element).
template <typename F>
__device__ __forceinline__ void withPartType(int32_t kind, F&& f) {
  switch (static_cast<Kind>(kind)) {
    case Kind::Float:
      return f(static_cast<float*>(nullptr));
    case Kind::Double:
      return f(static_cast<double*>(nullptr));
    case Kind::Half:
      return f(static_cast<c10::Half*>(nullptr));
    case Kind::BFloat16:
    default:
      return f(static_cast<c10::BFloat16*>(nullptr));
  }
}

template <typename W>
__global__ void packKernel(W* packed, const Chunk* chunks, int n, double scale) {
  for (int c = blockIdx.x; c < n; c += gridDim.x) {
    const Chunk chunk = chunks[c];
    withPartType(chunk.kind, [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      moveEach(static_cast<const T*>(chunk.data), packed + chunk.packedAt, chunk.count,
               [scale](T v) { return scaled<W>(v, scale); });
    });
  }
}

template <typename W>
__global__ void unpackKernel(const W* packed, const Chunk* chunks, int n, double scale) {
  for (int c = blockIdx.x; c < n; c += gridDim.x) {
    const Chunk chunk = chunks[c];
    withPartType(chunk.kind, [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      moveEach(packed + chunk.packedAt, static_cast<T*>(chunk.data), chunk.count,
               [scale](W v) { return scaled<T>(v, scale); });
    });
  }
}

// `bytes` bytes from `in` to `out` in words of `Word` (both aligned to it), then the bytes left over.
template <typename Word>
__device__ __forceinline__ void copyWords(const uint8_t* in, uint8_t* out, int32_t bytes) {
  const int32_t words = bytes / static_cast<int32_t>(sizeof(Word));
  moveEach(reinterpret_cast<const Word*>(in), reinterpret_cast<Word*>(out), words, [](Word w) { return w; });
  const int32_t done = words * static_cast<int32_t>(sizeof(Word));
  for (int32_t k = done + threadIdx.x; k < bytes; k += blockDim.x) {
    out[k] = in[k];
  }
}

// Raw bytes (same dtype, no scale): chunks count bytes, and start on 16-byte boundaries of their part.
__global__ void packBytesKernel(uint8_t* packed, const Chunk* chunks, int n, bool toPacked) {
  for (int c = blockIdx.x; c < n; c += gridDim.x) {
    const Chunk chunk = chunks[c];
    auto* data = static_cast<uint8_t*>(chunk.data);
    const uint8_t* in = toPacked ? data : packed + chunk.packedAt;
    uint8_t* out = toPacked ? packed + chunk.packedAt : data;
    const auto both = reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out);
    if (both % 16 == 0) {
      copyWords<uint4>(in, out, chunk.count);
    } else if (both % 8 == 0) {
      copyWords<uint2>(in, out, chunk.count);
    } else if (both % 4 == 0) {
      copyWords<uint32_t>(in, out, chunk.count);
    } else if (both % 2 == 0) {
      copyWords<uint16_t>(in, out, chunk.count);
    } else {
      copyWords<uint8_t>(in, out, chunk.count);
    }
  }
}

constexpr int kTableSlots = 8;
constexpr int kThreads = 256;  // a block

}  // namespace

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
  int next = 0;       // the slot the next call writes
  at::Tensor device;  // from the caching allocator, `capacity` bytes, owned by `stream`
  size_t capacity = 0;
  c10::DeviceIndex deviceIndex = -1;   // where the events and the device table live
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
  const Chunk* chunks;  // on the device
  int n;
};

// The parts' units (elements, or bytes for a raw move).
int64_t unitsOf(const FlatBuffer& part, bool bytes) {
  return bytes ? part.count * static_cast<int64_t>(c10::elementSize(part.dtype)) : part.count;
}

// Chunks of about total / kTargetChunks units: enough blocks to fill the GPU several times over (an
// H100 holds about 1000 blocks of 256 threads at once) with a table of tens of kB, at least
// kMinChunk units (a few per thread) and a multiple of 16, so that each chunk of a raw move starts on
// its part's 16-byte alignment.
int64_t chunkLength(int64_t total) {
  constexpr int64_t kTargetChunks = 2048;
  constexpr int64_t kMinChunk = 4096;
  constexpr int64_t kMaxChunk = int64_t{1} << 30;  // Chunk::count is 32-bit
  const int64_t length = std::clamp<int64_t>((total + kTargetChunks - 1) / kTargetChunks, kMinChunk, kMaxChunk);
  return (length + 15) / 16 * 16;
}

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
  TORCH_CHECK(device == s.deviceIndex, "chainermn: a pack table of device ", static_cast<int>(s.deviceIndex),
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

// Writes the parts' chunks into the next pinned slot and copies them to the device on `stream`.
Uploaded upload(PartTable::State& s, const std::vector<FlatBuffer>& parts, bool bytes, cudaStream_t stream) {
  int64_t total = 0;
  for (const auto& part : parts) {
    total += unitsOf(part, bytes);
  }
  const int64_t length = chunkLength(total);
  int64_t n = 0;
  for (const auto& part : parts) {
    n += (unitsOf(part, bytes) + length - 1) / length;
  }
  if (n == 0) {
    return Uploaded{nullptr, 0};
  }
  TORCH_CHECK(n <= std::numeric_limits<int>::max(), "chainermn: too many parts to pack on CUDA: ", parts.size());
  const size_t need = static_cast<size_t>(n) * sizeof(Chunk);
  prepare(s, need, stream);
  auto& slot = s.slots[s.next];
  s.next = (s.next + 1) % kTableSlots;
  if (slot.pending) {
    // The copy out of this slot, kTableSlots calls ago, must be over before it is rewritten. It
    // normally is, and then this returns at once; it waits only when the stream is that far behind.
    C10_CUDA_CHECK(cudaEventSynchronize(slot.copied));
    slot.pending = false;
  }
  auto* chunks = static_cast<Chunk*>(slot.host.data_ptr());
  int64_t c = 0;
  int64_t packedAt = 0;
  for (const auto& part : parts) {
    const int64_t units = unitsOf(part, bytes);
    const int64_t unitSize = bytes ? 1 : static_cast<int64_t>(c10::elementSize(part.dtype));
    const auto kind = static_cast<int32_t>(bytes ? Kind::Byte : kindOf(part.dtype));
    for (int64_t from = 0; from < units; from += length) {
      chunks[c++] = Chunk{static_cast<char*>(part.data) + from * unitSize, packedAt + from,
                          static_cast<int32_t>(std::min(length, units - from)), kind};
    }
    packedAt += units;
  }
  // Into the one device table: queued behind the kernels that read its previous contents.
  C10_CUDA_CHECK(cudaMemcpyAsync(s.device.data_ptr(), chunks, need, cudaMemcpyHostToDevice, stream));
  C10_CUDA_CHECK(cudaEventRecord(slot.copied, stream));
  slot.pending = true;
  return Uploaded{static_cast<const Chunk*>(s.device.data_ptr()), static_cast<int>(n)};
}

// Raw bytes suffice when nothing is cast or scaled (and integers are never cast).
bool moveAsBytes(const std::vector<FlatBuffer>& parts, c10::ScalarType wire, double scale) {
  return scale == 1.0 &&
         std::all_of(parts.begin(), parts.end(), [wire](const FlatBuffer& p) { return p.dtype == wire; });
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

void run(PartTable& table, const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale,
         void* rawStream, bool toPacked) {
  if (parts.empty()) {
    return;
  }
  auto stream = static_cast<cudaStream_t>(rawStream);
  const bool bytes = moveAsBytes(parts, wire, scale);
  const Uploaded t = upload(*table.state, parts, bytes, stream);
  if (t.n == 0) {
    return;
  }
  // One block per chunk; grid-stride beyond a grid that fills any current GPU many times over.
  const int blocks = std::min(t.n, 1 << 16);
  if (bytes) {
    packBytesKernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint8_t*>(packed), t.chunks, t.n, toPacked);
  } else {
    dispatchWire(wire, [&](auto tag) {
      using W = decltype(tag);
      if (toPacked) {
        packKernel<W><<<blocks, kThreads, 0, stream>>>(static_cast<W*>(packed), t.chunks, t.n, scale);
      } else {
        unpackKernel<W><<<blocks, kThreads, 0, stream>>>(static_cast<const W*>(packed), t.chunks, t.n, scale);
      }
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void pack(PartTable& table, const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale,
          void* stream) {
  run(table, parts, packed, wire, scale, stream, /*toPacked=*/true);
}

void unpack(PartTable& table, const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts,
            double scale, void* stream) {
  run(table, parts, const_cast<void*>(packed), wire, scale, stream, /*toPacked=*/false);
}

}  // namespace chainermn::cuda
