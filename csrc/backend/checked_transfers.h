// The protocol of point-to-point messages on the host transports.
//
// Every message is preceded by a header with its size, dtype and number, so a receive that does not
// match its send fails on the receiving rank with an error that says so, instead of overrunning its
// buffer (Gloo aborts the process then) or returning reinterpreted bytes. Headers travel on their
// own tags (user tags are below kHeaderTagBit: validate.h). A sender numbers its messages per
// (peer, tag), and a receiver receives the data of a message only after it has started receiving
// those of every earlier message from that peer on that tag: a receive whose header arrived first
// cannot take an earlier message's data (several receives on one tag are in flight at once when a
// message is sent in chunks). CUDA tensors go as they are (NCCL does not abort on a mismatch, and a
// header would cost a host round trip per message), and so do messages over a transport that carries
// each message's count and dtype itself (Transport::checksMessages: the shared-memory rings).
#pragma once

#include "comm/transport.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace chainermn {

// The numbering of one group's messages. Used on the worker thread only.
struct MessageOrder {
  std::map<std::pair<int, int>, uint64_t> sent;      // (peer, tag) -> the next message's number
  std::map<std::pair<int, int>, uint64_t> received;  // (peer, tag) -> the number whose data is next
  // (peer, tag) -> the wakes of receives whose header came before their turn: called when the
  // turn moves on, so that a worker that sleeps until a transfer wakes it tests them again.
  std::map<std::pair<int, int>, std::vector<std::function<void()>>> waiting;
};

RequestPtr sendChecked(Transport& transport, MessageOrder& order, const at::Tensor& tensor, int peer, int tag);
// peer may be kAnySource.
RequestPtr recvChecked(Transport& transport, MessageOrder& order, const at::Tensor& tensor, int peer, int tag);
// A receive of whatever CPU message `peer` sent on `tag` (any count and dtype): `received` holds it,
// a flat tensor of the sender's dtype, once the Request is done.
RequestPtr recvCheckedAnySize(Transport& transport, MessageOrder& order, int peer, int tag,
                              std::shared_ptr<at::Tensor> received);

}  // namespace chainermn
