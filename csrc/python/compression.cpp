// torch_chainermn._C.codes: the registry of codes (kernels/codes.h) as Python reads it, and the one
// value that carries a code and its settings across the boundary (CompressionSpec,
// kernels/code_spec.h), bound here once. torch_chainermn/codes.py derives every list of codes and
// the settings check from this module; the torch operators (python/codes_ops.cpp), the process
// group's compressed_mean and compression_residuals take the value.
//
// The Python class is a subclass of torch.ScriptObject (python/compression.h): each instance is an
// object of torch's custom class torch.classes.torch_chainermn.CompressionSpec, the operators' `spec`,
// so the same object is what users make, what the bindings take and what torch.ops takes.
#include "python/compression.h"
#include "python/submodules.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <set>
#include <string>

namespace py = pybind11;

namespace chainermn {
namespace {

// A setting given from Python: an int (not a bool, which Python also calls an int).
int64_t intSetting(const char* op, const char* name, const py::handle& value) {
  TORCH_CHECK_VALUE(py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value), op, ": ", name,
                    " must be an int, got ", std::string(py::repr(value)));
  return value.cast<int64_t>();
}

// A number (int or float, not a bool).
double floatSetting(const char* op, const char* name, const py::handle& value) {
  TORCH_CHECK_VALUE(
      (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value)) && !py::isinstance<py::bool_>(value), op,
      ": ", name, " must be a number, got ", std::string(py::repr(value)));
  return value.cast<double>();
}

// compress_result as Python spells it: True, False, or the name of the sums' code.
std::pair<bool, std::string> sumsOf(const char* op, const py::handle& value) {
  if (py::isinstance<py::bool_>(value)) {
    return {value.cast<bool>(), ""};
  }
  TORCH_CHECK_VALUE(py::isinstance<py::str>(value), op, ": compress_result must be True, False or a code's name, got ",
                    std::string(py::repr(value)));
  return {true, value.cast<std::string>()};
}

CompressionSpec specOf(const std::string& code, const py::handle& threshold, const py::handle& block,
                       const py::handle& keep, const py::handle& compressResult, at::ScalarType resultDtype,
                       const std::string& op, const std::string& argument = "code") {
  const char* name = op.c_str();
  CodeSettings settings;
  settings.threshold = static_cast<float>(floatSetting(name, "threshold", threshold));
  settings.block = intSetting(name, "block", block);
  settings.keep = intSetting(name, "keep", keep);
  const auto [sums, sumsCode] = sumsOf(name, compressResult);
  return compressionSpec(code, settings, sums, sumsCode, resultDtype, name, argument.c_str());
}

// compress_result as the spec was given it: False, True (the code itself) or the sums' code's name.
py::object compressResultOf(const CompressionSpec& spec) {
  if (!spec.compressResult) {
    return py::bool_(false);
  }
  return spec.resultCode == spec.code ? py::object(py::bool_(true)) : py::object(py::str(spec.resultCode->name));
}

py::dict settingsOf(const CompressionSpec& spec) {
  py::dict settings;
  settings["code"] = spec.code->name;
  settings["threshold"] = static_cast<double>(spec.settings.threshold);
  settings["block"] = spec.settings.block;
  settings["keep"] = spec.settings.keep;
  settings["compress_result"] = compressResultOf(spec);
  settings["result_dtype"] = py::cast(spec.resultWire);
  return settings;
}

std::string reprOf(const CompressionSpec& spec) {
  return "CompressionSpec(" + std::string(py::repr(py::str(spec.code->name))) +
         ", threshold=" + std::string(py::repr(py::float_(spec.settings.threshold))) +
         ", block=" + std::to_string(spec.settings.block) + ", keep=" + std::to_string(spec.settings.keep) +
         ", compress_result=" + std::string(py::repr(compressResultOf(spec))) +
         ", result_dtype=" + std::string(py::str(py::cast(spec.resultWire))) + ")";
}

bool sameSpec(const PyCompressionSpec& a, const py::object& b) {
  return py::isinstance<PyCompressionSpec>(b) &&
         settingsOf(a.spec()).equal(settingsOf(b.cast<const PyCompressionSpec&>().spec()));
}

py::dict describe(Code code) {
  py::dict info;
  info["name"] = code->name;
  info["summary"] = code->summary;
  py::list reads;
  for (const auto& [flag, name] : {std::pair{code->readsThreshold, "threshold"}, std::pair{code->readsBlock, "block"},
                                   std::pair{code->readsKeep, "keep"}}) {
    if (flag) {
      reads.append(name);
    }
  }
  info["reads"] = py::tuple(reads);
  info["block_multiple"] = code->blockMultiple;
  info["max_block"] = code->maxBlock;
  info["needs_residual"] = code->needsResidual;
  info["carries_sums"] = code->carriesSums;
  info["has_cuda"] = code->encodeCuda != nullptr;
  return info;
}

// torch.ScriptObject forwards Python's operators to the TorchScript class's methods, which this class
// does not have: each would raise NotImplementedError, and bool(spec) would call __len__.
// Here a CompressionSpec behaves as a plain Python object: it is true, a comparison or arithmetic
// gives NotImplemented (so Python raises its TypeError), and the container protocol raises TypeError.
void dropScriptObjectOperators(py::object cls) {
  static const std::set<std::string> kept = {"__init__", "__doc__", "__module__", "__getattr__", "__hash__"};
  const std::string binaryPrefixes =
      " lt le gt ge add sub mul matmul truediv floordiv mod pow lshift rshift and or xor ";
  const py::dict own = cls.attr("__dict__");
  const py::dict base = py::module_::import("torch").attr("ScriptObject").attr("__dict__");
  for (const auto& [key, value] : base) {
    const std::string name = py::str(key);
    if (name.size() < 5 || name.rfind("__", 0) != 0 || name.substr(name.size() - 2) != "__" || kept.count(name) ||
        own.contains(key)) {
      continue;
    }
    std::string bare = name.substr(2, name.size() - 4);
    if (bare.size() > 1 && bare[0] == 'i' && binaryPrefixes.find(" " + bare.substr(1) + " ") != std::string::npos) {
      bare = bare.substr(1);  // in place: as the operator
    }
    if (binaryPrefixes.find(" " + bare + " ") != std::string::npos) {
      cls.attr(key) = py::cpp_function(
          [](const py::object&, const py::args&) {
            return py::object(py::reinterpret_borrow<py::object>(Py_NotImplemented));
          },
          py::is_method(cls));
    } else {
      cls.attr(key) = py::cpp_function(
          [name](const py::object&, const py::args&) -> py::object {
            throw py::type_error("CompressionSpec has no " + name + " (a code and its settings)");
          },
          py::is_method(cls));
    }
  }
  cls.attr("__bool__") = py::cpp_function([](const py::object&) { return true; }, py::is_method(cls));
}

void bindCodes(py::module_& m) {
  m.def(
      "registered",
      [] {
        py::list codes;
        for (Code code : registeredCodes()) {
          codes.append(describe(code));
        }
        return py::tuple(codes);
      },
      "Every registered code, by name: a dict of its name, summary, the settings it reads and their rules "
      "(block_multiple, max_block), needs_residual, carries_sums and has_cuda (kernels/code.h)");
  m.def(
      "check_settings",
      [](const std::string& op, const std::string& code, py::handle threshold, py::handle block, py::handle keep,
         const std::string& argument) {
        const Code found = codeNamed(code, op.c_str(), argument.c_str());
        CodeSettings settings;
        settings.threshold = static_cast<float>(floatSetting(op.c_str(), "threshold", threshold));
        settings.block = intSetting(op.c_str(), "block", block);
        settings.keep = intSetting(op.c_str(), "keep", keep);
        checkCodeSettings(found, settings, op.c_str());
      },
      "A ValueError naming `op` unless `code` is registered and the settings it reads follow its rules", py::arg("op"),
      py::arg("code"), py::arg("threshold") = 0.5, py::arg("block") = 256, py::arg("keep") = 8,
      py::arg("argument") = "code");

  py::class_<PyCompressionSpec, torch::jit::Object> spec(m, "CompressionSpec",
                                                         R"(A code and its settings: what a compressed exchange between
nodes sends (docs/codes.md). Checked when made (a ValueError naming `op` and the argument); the same value
every consumer takes (compression=) and that the ranks compare before any data moves.

    CompressionSpec('int8', block=256)
    CompressionSpec('4bit', compress_result='int8')   # 4 bits a value there, the sums back in int8
    CompressionSpec('2bit', threshold=0.5)

code: a registered code (torch_chainermn.codes.CODES). threshold, block, keep: the settings, each read
by the codes that name it (codes.describe). compress_result: also compress the sums on their way back:
True (in the same code) or a code that carries sums. result_dtype: otherwise the sums' dtype.

A torch.ScriptObject of the custom class torch.classes.torch_chainermn.CompressionSpec: the torch
operators (torch.ops.torch_chainermn.encode/decode/wire_row_bytes) take it as their `spec`.)");
  spec.def(py::init([](const std::string& code, py::handle threshold, py::handle block, py::handle keep,
                       py::handle compressResult, at::ScalarType resultDtype, const std::string& op,
                       const std::string& argument) {
             return PyCompressionSpec(specOf(code, threshold, block, keep, compressResult, resultDtype, op, argument));
           }),
           py::arg("code"), py::kw_only(), py::arg("threshold") = 0.5, py::arg("block") = 256, py::arg("keep") = 8,
           py::arg("compress_result") = false, py::arg("result_dtype") = at::kFloat, py::arg("op") = "CompressionSpec",
           py::arg("argument") = "code")
      .def_property_readonly("code", [](const PyCompressionSpec& self) { return self.spec().code->name; })
      .def_property_readonly("threshold", [](const PyCompressionSpec& self) { return self.spec().settings.threshold; })
      .def_property_readonly("block", [](const PyCompressionSpec& self) { return self.spec().settings.block; })
      .def_property_readonly("keep", [](const PyCompressionSpec& self) { return self.spec().settings.keep; })
      .def_property_readonly("compress_result",
                             [](const PyCompressionSpec& self) { return compressResultOf(self.spec()); })
      .def_property_readonly("result_dtype", [](const PyCompressionSpec& self) { return self.spec().resultWire; })
      .def(
          "settings", [](const PyCompressionSpec& self) { return settingsOf(self.spec()); },
          "Every field, as the constructor takes them (code first)")
      .def_property_readonly(
          "compared", [](const PyCompressionSpec& self) { return self.spec().named->fields; },
          "(name, value) of every field the ranks compare: the code and what it reads, compress_result, result_dtype")
      .def("__eq__", &sameSpec)
      .def("__ne__", [](const PyCompressionSpec& a, const py::object& b) { return !sameSpec(a, b); })
      .def("__hash__", [](const PyCompressionSpec& self) { return self.spec().named->digest; })
      .def("__repr__", [](const PyCompressionSpec& self) { return reprOf(self.spec()); })
      .def("__str__", [](const PyCompressionSpec& self) { return reprOf(self.spec()); })
      // A value: its fields are not set (torch.ScriptObject's __setattr__ would say "no attribute"), and
      // a copy is the same object (torch.ScriptObject's own would drop the Python class).
      .def("__setattr__",
           [](const py::object& self, const py::str& name, const py::object& /*value*/) {
             throw py::attribute_error("CompressionSpec is a value: its " + std::string(name) +
                                       " cannot be set (make another CompressionSpec)");
           })
      .def("__copy__", [](const py::object& self) { return self; })
      .def("__deepcopy__", [](const py::object& self, const py::object& /*memo*/) { return self; })
      .def(py::pickle([](const PyCompressionSpec& self) { return settingsOf(self.spec()); },
                      [](const py::dict& settings) {
                        return PyCompressionSpec(
                            specOf(settings["code"].cast<std::string>(), settings["threshold"], settings["block"],
                                   settings["keep"], settings["compress_result"],
                                   settings["result_dtype"].cast<at::ScalarType>(), "CompressionSpec"));
                      }));
  dropScriptObjectOperators(spec);
}

const bool registered = registerSubmodule("codes", "the registry of codes and the CompressionSpec value", bindCodes);

}  // namespace
}  // namespace chainermn
