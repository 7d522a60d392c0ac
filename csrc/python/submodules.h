// Submodules of torch_chainermn._C added by the files that define them, when those files are linked in.
//
// A build's source list decides what _C holds (tools/build_sources.py): the test build links the
// harnesses of csrc/testing/bindings*.cpp, a user's build leaves them out. Each such file registers its
// submodule from a static initializer, and the module's init binds whatever registered, so no source
// is compiled differently for a test build than for a user's, and the two builds share their objects
// (a user's wheel after `make install` only relinks).
#pragma once

#include <pybind11/pybind11.h>

namespace chainermn {

using SubmoduleBinder = void (*)(pybind11::module_& submodule);

// Adds _C.<name> (with `doc`), bound by `bind`, to every later import of _C. For a static initializer:
//   static const bool registered = registerSubmodule("testing", "...", bindTesting);
bool registerSubmodule(const char* name, const char* doc, SubmoduleBinder bind);

// Creates and binds each registered submodule under `module` (the module's init calls it once).
void bindRegisteredSubmodules(pybind11::module_& module);

}  // namespace chainermn
