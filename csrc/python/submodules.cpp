// The registry of csrc/python/submodules.h.
#include "python/submodules.h"

#include <vector>

namespace chainermn {
namespace {

struct Submodule {
  const char* name;
  const char* doc;
  SubmoduleBinder bind;
};

// A function's static, not a global: registrations run from other files' static initializers, in an
// order the linker chooses, and this must exist before the first of them.
std::vector<Submodule>& registered() {
  static std::vector<Submodule> submodules;
  return submodules;
}

}  // namespace

bool registerSubmodule(const char* name, const char* doc, SubmoduleBinder bind) {
  registered().push_back(Submodule{name, doc, bind});
  return true;
}

void bindRegisteredSubmodules(pybind11::module_& module) {
  for (const Submodule& submodule : registered()) {
    auto added = module.def_submodule(submodule.name, submodule.doc);
    submodule.bind(added);
  }
}

}  // namespace chainermn
