// The FIFO of posted ops every transport keeps per connection and direction: linked through
// Op::next_, so posting never allocates. Ops complete in posting order (transport.h), so the
// head is always the op whose bytes move next.
#pragma once

#include "transport/transport.h"

namespace pipesgd::transport {

struct OpQueue {
  Op* head = nullptr;
  Op* tail = nullptr;

  void Push(Op* op) {
    op->next_ = nullptr;
    if (tail) {
      tail->next_ = op;
    } else {
      head = op;
    }
    tail = op;
  }
  // The queue must not be empty.
  Op* Pop() {
    Op* op = head;
    head = op->next_;
    if (!head) tail = nullptr;
    op->next_ = nullptr;
    return op;
  }
};

}  // namespace pipesgd::transport
