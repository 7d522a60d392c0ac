// Intra-node collectives on CPU tensors through one POSIX shared-memory segment.
//
// The ranks of a node map one segment: a flag per rank, a slot per rank and two result buffers.
// A collective runs chunk by chunk: every rank copies its chunk into its slot, a barrier, every rank
// reduces its own slice of the chunk from all slots (the ranks reduce in parallel), a barrier, every
// rank copies the result out. One of at most 16 KiB a rank takes one barrier instead: every rank
// writes its cell of an exchange area, and after the barrier reads (and reduces) every cell itself.
// That barrier also carries the op's cross-rank check (Transport::carryCheck) in the cell's head,
// so a small collective costs one barrier, check included. Collectives that gain nothing from the
// segment (gather, scatter, all-to-all, point to point) go to `fallback`, the library's transport
// over the same ranks.
//
// The segment's life (creation, the store handshake, unlinking, reclaiming orphans) is in
// comm/shm_segment.h; the barrier (flags, futex waits, dead peers, the timeout) in comm/shm_barrier.h.
#pragma once

#include "comm/transport.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstddef>
#include <string>

namespace chainermn::shm {

// Bytes of one rank's slot: a collective moves data through the segment this much at a time
// (CHAINERMN_SHM_CHUNK_BYTES, read by torch_chainermn/settings.py; rounded up to 64).
constexpr size_t kDefaultChunkBytes = size_t{1} << 20;
constexpr size_t kMinChunkBytes = 4096;

// Collective over fallback's ranks, which must all run on this host. `key` names the segment in
// the store (unique per group and node). `timeout` bounds every wait for a peer. `pointToPoint`:
// sends and receives go through the segment (the transport is a whole group's: its point to point
// is the group's); else through `fallback`, so the rings take no memory.
TransportPtr createTransport(c10d::Store& store, const std::string& key, TransportPtr fallback,
                             std::chrono::milliseconds timeout, bool pointToPoint,
                             size_t chunkBytes = kDefaultChunkBytes);

}  // namespace chainermn::shm
