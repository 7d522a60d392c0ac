// Point to point between the ranks of one node through their shared-memory segment.
//
// Every ordered pair of ranks (sender, receiver) has a ring in the segment: the sender appends
// messages (a 16-byte frame header with the count, dtype and tag, then the payload) and advances `head`;
// the receiver copies them out and advances `tail`. A message larger than the ring streams through
// it. A send completes once its last byte is in the ring (its buffer may then be reused); a receive
// completes once its message is in the caller's buffer.
//
// Matching is MPI's: by sender and tag, messages from one sender on one tag in the order they were
// sent, a receive from any source takes the first that arrives. A message no receive is waiting for
// stays in the ring while nothing is behind it and it fits in half the ring, and its receive then
// takes it straight from there (the usual case: a receive posted just after its message arrived);
// otherwise it is copied into a buffer of its own (so the messages behind it, on other tags, still
// get through, and its sender has room), and a receive that comes while it is still arriving takes
// what came so far and the rest in place.
//
// Transfers progress without the caller: each rank has a progress thread that sleeps on the rank's
// doorbell, a futex in the segment a peer rings when it wrote a message or freed room in a ring. So
// a rank inside a collective (or busy computing) still drains its rings and fills its peers', and a
// send and a receive never wait for the rank's worker. The caller's test() also progresses, so a
// message that is already there is taken without a thread hop.
#pragma once

#include "comm/transport.h"

#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>

namespace chainermn::shm {

class Mailboxes {
 public:
  // Bytes the rings of `size` ranks take in the segment (whole pages).
  static size_t bytes(int size);

  // Over `area` (bytes(size) bytes, zeroed, shared by the node's ranks).
  Mailboxes(char* area, int rank, int size);
  // Stops the progress thread; requests still in flight fail, and never touch the segment again.
  ~Mailboxes();
  Mailboxes(const Mailboxes&) = delete;
  Mailboxes& operator=(const Mailboxes&) = delete;

  // As Transport::send and recv; peer may be kAnySource for a receive. A message carries its count
  // and dtype: a receive that expects others fails naming both, its buffer untouched, and the
  // message is dropped (the pair stays usable).
  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag);
  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag);
  // As Transport::sendGathered: a message of bytes written into the ring straight from the pieces
  // while nothing is queued ahead of it and there is room; the rest is copied before this returns.
  RequestPtr sendGathered(const std::vector<Piece>& pieces, int peer, int tag);
  // As Transport::recvAnySize: `allocate` runs on whichever thread matches the message.
  RequestPtr recvAnySize(int peer, int tag, Transport::Allocate allocate);

  struct State;

 private:
  void startProgress();
  // Files a receive (recv, recvAnySize: `allocate` set, `buf` null) and progresses once.
  RequestPtr receive(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag, Transport::Allocate allocate);

  std::shared_ptr<State> state_;
  std::once_flag progressStarted_;
  std::thread progress_;  // started with the first transfer
};

}  // namespace chainermn::shm
