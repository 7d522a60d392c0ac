// The state behind Mailboxes (comm/shm_mailbox.h), shared by its requests and its progress thread;
// what is in the segment is in comm/shm_rings.h. Internal to shm_mailbox.cpp.
#pragma once

#include "comm/shm_mailbox.h"
#include "comm/shm_rings.h"

#include <c10/core/ScalarType.h>

#include <atomic>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace chainermn::shm {

// What goes into a ring before each message's payload.
struct FrameHeader {
  int64_t count;
  int32_t tag;
  int16_t dtype;
  uint16_t magic;

  uint64_t bytes() const {
    return static_cast<uint64_t>(count) * c10::elementSize(static_cast<c10::ScalarType>(dtype));
  }
};

// What a request and the mailboxes share: whether it is done, how, and whom to tell.
struct Status {
  std::atomic<bool> done{false};
  std::string error;      // set before done
  bool mismatch = false;  // the error is the caller's (a receive that does not match its message)
  int source = -1;
  std::function<void()> wake;  // Request::wakeWhenReady
};
using StatusPtr = std::shared_ptr<Status>;

struct Mailboxes::State {
  State(char* area, int rank, int size)
      : rank(rank), size(size), rings(area, rank, size), outgoing(size), incoming(size) {}
  // A send not yet wholly in its ring. `data` points at byte `dataOffset` of the payload (a send
  // dropped half-way keeps the rest in `owned`).
  struct Outgoing {
    StatusPtr status;
    const char* data;
    FrameHeader header;
    uint64_t bytes;
    size_t headerWritten = 0;
    uint64_t written = 0;  // of the payload
    uint64_t dataOffset = 0;
    std::vector<char> owned;
  };
  // A receive no message has matched yet.
  struct Posted {
    StatusPtr status;
    char* data;
    int64_t count;
    c10::ScalarType dtype;
    int peer;
    int tag;
    Transport::Allocate allocate = nullptr;  // a receive of any size: data comes from it at the match
  };
  // A message that came before its receive: copied out of the ring so messages behind it pass. A
  // receive that comes while it is still arriving takes what came so far, and the rest goes straight
  // into the receive's buffer (postReceive).
  struct Arrived {
    int source;
    FrameHeader header;
    std::unique_ptr<char[]> data;  // header.bytes(), not zeroed: every byte is written before it is read
    bool complete = false;
    StatusPtr claimant;  // the receive that took it while it was still arriving
    char* claimantData = nullptr;
    bool drop = false;  // its receive failed or is gone
  };
  // The message being copied out of one sender's ring.
  struct Incoming {
    bool active = false;
    uint64_t bytes = 0, taken = 0;
    char* dest = nullptr;        // null: dropped (its receive failed or is gone)
    StatusPtr status;            // the receive it goes to, or
    Arrived* arrived = nullptr;  // the buffer it goes to
    // No receive yet: its bytes stay in the ring for the receive to come, as long as nothing is
    // behind them and they are at most half the ring (keepInRing); else they go to an Arrived.
    bool waiting = false;
    FrameHeader header{};
  };
  // Under the lock. The first outcome stays.
  void finish(Status& status, std::string error);
  // Under the lock.
  void refuse(Status& status, std::string error);
  // As checked_transfers.cpp words it for the transports that need its headers.
  std::string mismatch(int source, const Posted& expected, const FrameHeader& sent) const;

  // Whether a message is what a receive expects (count and dtype; any, for a receive of any size).
  static bool matches(const Posted& posted, const FrameHeader& sent);
  // Where a matched message goes: the receive's buffer (allocated now for a receive of any size).
  static char* destination(Posted& posted, const FrameHeader& sent);
  // Files a gathered send (Mailboxes::sendGathered) to `to`: into the ring as far as it goes, the
  // rest copied into the send's own buffer. Under the lock.
  void enqueueGathered(const StatusPtr& status, int to, const FrameHeader& header, const std::vector<Piece>& pieces);
  // Writes bytes [done, n) of `from` (null: zeros) into the ring to `to` while there is room;
  // returns whether all are in. Under the lock.
  bool writeFrom(int to, const char* from, uint64_t n, uint64_t& done);
  // Moves what fits of the sends queued for `to` into their ring. Under the lock.
  void progressSends(int to);
  // Takes what has arrived from `from`. Under the lock.
  void progressReceives(int from);
  // A message's header arrived: to the first receive waiting for it, else it waits in the ring.
  void begin(Incoming& in, int from, const FrameHeader& header);
  // Whether a message that no receive wants yet may stay in the ring from `from`: nothing is behind
  // it there (so no message waits on it) and it fits in half the ring (so its sender has room).
  bool keepInRing(const Incoming& in, int from);
  // The waiting message from `from` goes to a buffer of its own, so that what follows it passes.
  void stash(Incoming& in, int from);
  // Under the lock: the waiting message a receive takes, straight from the ring; false if none.
  bool takeWaiting(Posted& receive);

  // The message is in: to its receive, or marked complete for the receive to come.
  void end(Incoming& in);
  // An arrived message to the receive that claimed it.
  void deliver(Arrived* arrived);

  // Under the lock.
  void progressAll();
  // Runs the wakes collected under the lock. Without the lock.
  void runWakes(std::vector<std::function<void()>>& taken);
  // Progresses everything; with `onlyIfFree`, not when another thread is at it already.
  void progress(bool onlyIfFree);
  // Under the lock. A ring found corrupt fails every transfer: nothing more can be trusted.
  void progressAllOrFail();

  // A new request: `enqueue` files it under the lock, then everything is progressed once.
  StatusPtr post(std::function<void(const StatusPtr&)> enqueue);

  // Under the lock: the first message that arrived for it, else into `posted`.
  void postReceive(Posted receive);
  // A request dropped before it was done: nothing may touch its buffer from now on.
  void cancel(const StatusPtr& status);
  // The transport is going away: every request still in flight fails, and the segment is not
  // touched again.
  void close();
  // Under the lock.
  void failEverything(const std::string& reason);
  // The progress thread: sleeps until a peer rings, then moves what it can.
  void progressLoop();

  const int rank;
  const int size;
  Rings rings;

  std::mutex mutex;  // everything below
  bool closed = false;
  std::vector<std::deque<Outgoing>> outgoing;  // per receiver, in posting order
  std::deque<Posted> posted;                   // in posting order
  std::list<Arrived> unexpected;               // in arrival order
  std::vector<Incoming> incoming;              // per sender
  std::vector<std::function<void()>> wakes;    // collected under the lock, run after it
  std::atomic<bool> stopping{false};
};

}  // namespace chainermn::shm
