#pragma once

#include <Python.h>

namespace chainermn {

// Releases Python's GIL for the life of this object when the calling thread holds it.
//
// A group's threads are joined by whichever thread drops the last reference to the group, and that
// can be a Python thread holding the GIL (the interpreter freeing a DDP Reducer, which holds the
// group). The worker, finishing its last op, may meanwhile free a tensor whose Python object needs
// the GIL to go: joining it with the GIL held would wait forever (torch's advice,
// pytorch/pytorch#56297: release the GIL before blocking). Nothing here runs Python code.
class GilReleased {
 public:
  GilReleased() : saved_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilReleased() {
    if (saved_ != nullptr) {
      PyEval_RestoreThread(saved_);
    }
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* saved_;
};

}  // namespace chainermn
