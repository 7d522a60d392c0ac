// How messages meet their receives in the shared-memory mailboxes (comm/shm_mailbox.h): by sender
// and tag in order; a message no receive wants yet waits in the ring while it may, else in a buffer
// of its own; a receive of any size gets its buffer when its message is matched. Under the state's
// lock, called by shm_mailbox.cpp's progress and posting.
#include "comm/shm_mailbox_state.h"
#include "types.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace chainermn::shm {

std::string Mailboxes::State::mismatch(int source, const Posted& expected, const FrameHeader& sent) const {
  auto described = [](int64_t count, c10::ScalarType dtype) {
    return std::to_string(count) + " " + dtypeName(dtype) + " elements";
  };
  return "recv on rank " + std::to_string(rank) + " expected " + described(expected.count, expected.dtype) +
         " from rank " + std::to_string(source) + " (tag " + std::to_string(expected.tag) + "), which sent " +
         described(sent.count, static_cast<c10::ScalarType>(sent.dtype)) + "; the tensor was not written";
}

bool Mailboxes::State::matches(const Posted& posted, const FrameHeader& sent) {
  return posted.allocate || (posted.count == sent.count && static_cast<int16_t>(posted.dtype) == sent.dtype);
}

char* Mailboxes::State::destination(Posted& posted, const FrameHeader& sent) {
  if (posted.allocate && posted.data == nullptr) {
    posted.data = static_cast<char*>(posted.allocate(sent.count, static_cast<c10::ScalarType>(sent.dtype)));
  }
  return posted.data;
}

void Mailboxes::State::begin(Incoming& in, int from, const FrameHeader& header) {
  in = Incoming{};
  in.active = true;
  in.bytes = header.bytes();
  auto match = std::find_if(posted.begin(), posted.end(), [&](const Posted& p) {
    return (p.peer == from || p.peer == kAnySource) && p.tag == header.tag;
  });
  if (match != posted.end()) {
    match->status->source = from;
    if (matches(*match, header)) {
      in.dest = destination(*match, header);
      in.status = match->status;
    } else {
      refuse(*match->status, mismatch(from, *match, header));
    }
    posted.erase(match);
    return;
  }
  // No receive yet: the message is usually wanted soon (the backend's data follows its header, and
  // a model-parallel payload its header); left in the ring, it then goes straight to its receive,
  // without a buffer of its own and a second copy.
  in.waiting = true;
  in.header = header;
}

bool Mailboxes::State::keepInRing(const Incoming& in, int from) {
  return in.bytes <= rings.capacity() / 2 && rings.readable(from) <= in.bytes;
}

void Mailboxes::State::stash(Incoming& in, int from) {
  unexpected.push_back(Arrived{from, in.header, std::unique_ptr<char[]>(new char[in.bytes])});
  in.waiting = false;
  in.arrived = &unexpected.back();
  in.dest = in.arrived->data.get();
}

bool Mailboxes::State::takeWaiting(Posted& receive) {
  for (int from = 0; from < size; ++from) {
    Incoming& in = incoming[from];
    if (!in.active || !in.waiting || in.header.tag != receive.tag ||
        (receive.peer != kAnySource && receive.peer != from)) {
      continue;
    }
    in.waiting = false;
    receive.status->source = from;
    if (matches(receive, in.header)) {
      in.dest = destination(receive, in.header);
      in.status = receive.status;
    } else {
      refuse(*receive.status, mismatch(from, receive, in.header));  // the message is skipped: in.dest is null
    }
    return true;
  }
  return false;
}

void Mailboxes::State::end(Incoming& in) {
  if (in.status) {
    finish(*in.status, "");
  } else if (in.arrived != nullptr) {
    in.arrived->complete = true;
    if (in.arrived->claimant) {
      deliver(in.arrived);
    }
  }
  in = Incoming{};
}

void Mailboxes::State::deliver(Arrived* arrived) {
  if (!arrived->drop) {
    std::memcpy(arrived->claimantData, arrived->data.get(), arrived->header.bytes());
    finish(*arrived->claimant, "");
  }
  unexpected.remove_if([arrived](const Arrived& a) { return &a == arrived; });
}

void Mailboxes::State::postReceive(Posted receive) {
  auto arrived = std::find_if(unexpected.begin(), unexpected.end(), [&](const Arrived& a) {
    return !a.claimant && (receive.peer == kAnySource || a.source == receive.peer) && a.header.tag == receive.tag;
  });
  if (arrived == unexpected.end()) {
    if (!takeWaiting(receive)) {
      posted.push_back(std::move(receive));
    }
    return;
  }
  const StatusPtr& status = receive.status;
  status->source = arrived->source;
  arrived->claimant = status;
  if (!matches(receive, arrived->header)) {
    refuse(*status, mismatch(arrived->source, receive, arrived->header));
    arrived->drop = true;
  } else if (!arrived->complete) {
    // Still arriving (a receive posted just after its message began, as the backend's own headers
    // and the model-parallel functions' do): what came so far is copied now, the rest lands in place.
    Incoming& in = incoming[arrived->source];
    TORCH_INTERNAL_ASSERT(in.arrived == &*arrived, "shared memory: an incomplete message that is not arriving");
    in.dest = destination(receive, arrived->header);
    if (in.taken > 0) {
      std::memcpy(in.dest, arrived->data.get(), in.taken);
    }
    in.status = status;
    in.arrived = nullptr;
    unexpected.erase(arrived);
    return;
  } else {
    arrived->claimantData = destination(receive, arrived->header);
  }
  if (arrived->complete) {
    deliver(&*arrived);
  }
}

}  // namespace chainermn::shm
