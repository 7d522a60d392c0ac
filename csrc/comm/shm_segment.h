// The life of one node's POSIX shared-memory segment: its name, its creation and mapping, the store
// handshake that lets the node's other ranks find it, and its removal.
//
// Rank 0 of the node creates the segment (named chainermn-<creator pid>-<n>), reserves its pages and
// publishes the name in the group's store; the other ranks open it by that name. Once every rank has
// mapped it, the name is unlinked, so the memory disappears with the processes even after a crash;
// segments whose creator died before that are reclaimed when the next is made.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstddef>
#include <string>

namespace chainermn::shm {

class Segment {
 public:
  // Collective over the node's ranks (`rank` among them, rank 0 creates): maps `bytes` bytes of the
  // segment published under `key` in the store. Throws when it cannot be created, sized or opened.
  Segment(c10d::Store& store, const std::string& key, int rank, size_t bytes);
  // Unmaps the segment, and removes its name if this rank created it and it is still there.
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  char* base() const {
    return base_;
  }
  size_t bytes() const {
    return bytes_;
  }

  // Call once every rank has mapped the segment (after a barrier): the creator removes its name, so
  // the memory goes away with the last process, however the processes end. No-op on other ranks.
  void unlinkName();

 private:
  std::string name_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  bool linked_ = false;  // this rank created the segment and its name is still in /dev/shm
};

}  // namespace chainermn::shm
