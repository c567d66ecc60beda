// Bound operator calls: a torch operator's constant arguments converted once, its tensors passed per call.
// Built and loaded by lucid_fx/kernels/bound_ops.py (see there why). Three classes:
//   BoundOp("onednn::qconv2d_pointwise", "binary", values, slots)  converts `values` (one per schema argument) to
//   IValues now; a call BoundOp(t0, t1, ...) puts tensor i at argument slots[i] and calls the operator through
//   the dispatcher (the same boxed call torch.ops makes from Python, with the same profiler record), GIL released.
//   NativeStep(name, calls, inputs, buffers, result)  planned calls of lucid_fx's C kernels, one after another
//   (lucid_fx/kernels/native_step.py): a call checks its tensors' dtypes, shapes and strides against `inputs` (else
//   None: the caller's checked path serves them), allocates `buffers`, and calls each C function (fn, scalars,
//   returns, pointers) at address `fn` with `pointers` (tensors', buffers' and constant addresses) and the address of
//   its scalars' struct; it returns buffer `result`. A nonzero status (`returns`: its width in bytes, 0 for a void
//   kernel) gives None too.
//   NativeProgram(names, defaults, has_default, registers, constants, code, output)  a program's graph run from C++
//   (lucid_fx/passes/run_program_natively.py), below.
// And one function, runner_method: a converted model's call (lucid_fx/program.py, ProgramRunner.__call__) for its
// common case, positional CPU tensors of a signature it has a program for, in C++; any other call goes to the
// Python method, which decides as before.
#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

namespace {

PyObject* const* items(const py::tuple& tuple) { return reinterpret_cast<PyTupleObject*>(tuple.ptr())->ob_item; }

std::atomic<bool> recording{false};  // native steps as profiler events (lucid_fx.kernels.native.record_in_profiler)

class BoundOp {
 public:
  BoundOp(const std::string& name, const std::string& overload, const py::sequence& values, std::vector<int64_t> slots)
      : op_(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str())), slots_(std::move(slots)) {
    const c10::FunctionSchema& schema = op_.schema();
    const auto& arguments = schema.arguments();
    TORCH_CHECK(values.size() == arguments.size(), schema.name(), " takes ", arguments.size(), " arguments, bound with ",
                values.size());
    TORCH_CHECK(schema.returns().size() == 1, schema.name(), " does not return one value");
    const c10::TypePtr& returned = schema.returns()[0].type();
    list_ = returned->kind() == c10::TypeKind::ListType &&
            returned->containedType(0)->kind() == c10::TypeKind::TensorType;
    TORCH_CHECK(list_ || returned->kind() == c10::TypeKind::TensorType, schema.name(),
                " returns neither a tensor nor a list of tensors");
    for (int64_t slot : slots_) {
      TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(arguments.size()), "slot ", slot, " is not an argument of ",
                  schema.name());
      TORCH_CHECK(arguments[slot].type()->kind() == c10::TypeKind::TensorType, "argument ", slot, " of ",
                  schema.name(), " is not a tensor");
    }
    for (size_t i = 0; i < arguments.size(); ++i) {
      bool slot = std::find(slots_.begin(), slots_.end(), static_cast<int64_t>(i)) != slots_.end();
      values_.push_back(slot ? c10::IValue() : torch::jit::toIValue(values[i], arguments[i].type()));
    }
  }

  py::object call(const py::args& tensors) const { return run(items(tensors), tensors.size()); }

  // The operator on `count` tensors: its tensor, or a tuple of its tensors (split_with_sizes).
  py::object run(PyObject* const* tensors, size_t count) const {
    if (count != slots_.size()) {
      throw py::type_error(name() + " bound call takes " + std::to_string(slots_.size()) + " tensors, got " +
                           std::to_string(count));
    }
    torch::jit::Stack stack(values_);
    for (size_t i = 0; i < count; ++i) {
      if (!THPVariable_Check(tensors[i])) {
        throw py::type_error(name() + " bound call: argument " + std::to_string(i) + " is not a tensor");
      }
      stack[slots_[i]] = THPVariable_Unpack(tensors[i]);
    }
    try {
      py::gil_scoped_release released;
      op_.callBoxed(stack);
    } catch (const c10::Error& error) {
      throw std::runtime_error(error.what_without_backtrace());  // torch's own message, as torch.ops raises it
    }
    if (!list_) return py::reinterpret_steal<py::object>(THPVariable_Wrap(stack.back().toTensor()));
    std::vector<at::Tensor> results = stack.back().toTensorVector();
    py::tuple out(results.size());  // a tuple, as torch's Python functions return a list of tensors (split)
    for (size_t i = 0; i < results.size(); ++i) out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(results[i]));
    return std::move(out);
  }

  std::string name() const {
    const auto& schema = op_.schema();
    return schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
  }

  std::vector<int64_t> slots() const { return slots_; }

 private:
  c10::OperatorHandle op_;
  bool list_ = false;
  std::vector<int64_t> slots_;
  std::vector<c10::IValue> values_;
};

at::ScalarType scalar_type(const std::string& name) {
  if (name == "uint8") return at::kByte;
  if (name == "int8") return at::kChar;
  if (name == "int32") return at::kInt;
  if (name == "float32") return at::kFloat;
  TORCH_CHECK(false, "native step: no dtype ", name);
}

using P = void*;

template <typename R>
R invoke(uintptr_t fn, const std::vector<P>& a) {
  switch (a.size()) {
    case 1: return reinterpret_cast<R (*)(P)>(fn)(a[0]);
    case 2: return reinterpret_cast<R (*)(P, P)>(fn)(a[0], a[1]);
    case 3: return reinterpret_cast<R (*)(P, P, P)>(fn)(a[0], a[1], a[2]);
    case 4: return reinterpret_cast<R (*)(P, P, P, P)>(fn)(a[0], a[1], a[2], a[3]);
    case 5: return reinterpret_cast<R (*)(P, P, P, P, P)>(fn)(a[0], a[1], a[2], a[3], a[4]);
    case 6: return reinterpret_cast<R (*)(P, P, P, P, P, P)>(fn)(a[0], a[1], a[2], a[3], a[4], a[5]);
    case 7: return reinterpret_cast<R (*)(P, P, P, P, P, P, P)>(fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6]);
    case 8: return reinterpret_cast<R (*)(P, P, P, P, P, P, P, P)>(fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    default: TORCH_CHECK(false, "native step: ", a.size(), " pointers");
  }
}

class NativeStep {
 public:
  using Input = std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::string>;
  using Buffer = std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::string>;
  using Pointer = std::tuple<int64_t, uintptr_t>;  // (0: input, 1: buffer, 2: an address), its index or address
  using Call = std::tuple<uintptr_t, uintptr_t, int64_t, std::vector<Pointer>>;  // fn, scalars, returns, pointers
  NativeStep(std::string name, std::vector<Call> calls, std::vector<Input> inputs, std::vector<Buffer> buffers,
             int64_t result)
      : name_(std::move(name)), calls_(std::move(calls)), result_(result) {
    for (const auto& [shape, strides, dtype] : inputs) inputs_.emplace_back(shape, strides, scalar_type(dtype));
    for (const auto& [shape, strides, dtype] : buffers) buffers_.emplace_back(shape, strides, scalar_type(dtype));
    TORCH_CHECK(!calls_.empty() && result_ >= 0 && result_ < static_cast<int64_t>(buffers_.size()), "native step ",
                name_, ": no call, or no buffer ", result_);
    for (const auto& [fn, scalars, returns, pointers] : calls_) {
      TORCH_CHECK(fn != 0 && (returns == 0 || returns == 4 || returns == 8), "native step ", name_,
                  ": no function, or a status of ", returns, " bytes");
      TORCH_CHECK(pointers.size() + (scalars != 0) <= 8, "native step ", name_, ": more than 8 pointers");
      for (const auto& [kind, value] : pointers) {
        TORCH_CHECK(kind == 2 || (kind == 0 && value < inputs_.size()) || (kind == 1 && value < buffers_.size()),
                    "native step ", name_, ": pointer (", kind, ", ", value, ") names no operand");
      }
    }
  }

  py::object call(const py::args& args) const {
    std::optional<at::Tensor> out = run(items(args), args.size());
    return out ? py::cast(*out) : py::none();
  }

  // The step on `count` objects: its result, or nothing where they are not the tensors it was planned for or a
  // kernel reports a status.
  std::optional<at::Tensor> run(PyObject* const* objects, size_t count) const {
    if (count != inputs_.size()) {
      throw py::type_error(name_ + " step takes " + std::to_string(inputs_.size()) + " tensors, got " +
                           std::to_string(count));
    }
    std::vector<at::Tensor> tensors;
    tensors.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      if (!THPVariable_Check(objects[i])) return std::nullopt;
      const at::Tensor& t = THPVariable_Unpack(objects[i]);
      const auto& [shape, strides, dtype] = inputs_[i];
      if (t.scalar_type() != dtype || !t.device().is_cpu() || t.sizes() != c10::IntArrayRef(shape) ||
          t.strides() != c10::IntArrayRef(strides)) {
        return std::nullopt;  // not what the step was planned for: the checked path
      }
      tensors.push_back(t);
    }
    std::vector<at::Tensor> buffers;
    buffers.reserve(buffers_.size());
    for (const auto& [shape, strides, dtype] : buffers_) {
      buffers.push_back(at::empty_strided(shape, strides, at::TensorOptions().dtype(dtype)));
    }
    int64_t status = 0;
    {
      py::gil_scoped_release released;
      std::optional<at::RecordFunction> event;  // a "native::<kernel>" event, as native.py records a ctypes call
      if (recording.load(std::memory_order_relaxed)) {
        event.emplace(at::RecordScope::USER_SCOPE);
        if (event->isActive()) event->before(name_.c_str());
      }
      std::vector<P> pointers;
      for (const auto& [fn, scalars, returns, planned] : calls_) {
        pointers.clear();
        for (const auto& [kind, value] : planned) {
          pointers.push_back(kind == 0 ? tensors[value].data_ptr() : kind == 1 ? buffers[value].data_ptr()
                                                                               : reinterpret_cast<P>(value));
        }
        if (scalars != 0) pointers.push_back(reinterpret_cast<P>(scalars));
        if (returns == 8) {
          status = invoke<int64_t>(fn, pointers);
        } else if (returns == 4) {
          status = invoke<int32_t>(fn, pointers);
        } else {
          invoke<void>(fn, pointers);
        }
        if (status != 0) break;
      }
    }
    if (status != 0) return std::nullopt;
    return buffers[result_];
  }

  size_t arity() const { return inputs_.size(); }

  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::vector<Call> calls_;
  int64_t result_;
  std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::ScalarType>> inputs_;
  std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::ScalarType>> buffers_;
};

// A program's calls run one after another from C++ (lucid_fx/passes/run_program_natively.py): no generated Python
// forward between its kernels. Registers hold the values: the inputs first, then one per call; an argument is a
// register or a constant. A call's kind says how it runs:
//   CALL    a Python callable (a torch function, a kernel's Python function, a module), vectorcall;
//   METHOD  a method of its first argument by name (`x.reshape(...)`), as fx's call_method;
//   BOUND   a BoundOp on its tensors, no Python;
//   STEP    a planned call: its NativeStep on the operands the kernel's Python function passes it (their indices among
//           the arguments), else, where the step refuses them, the Python function as CALL;
//   TUPLE, LIST  its arguments packed (a list of values an op takes, the output's structure);
//   GUARDED a float module's call as its operator, a BoundOp on the operands among its arguments, unless the module
//           has hooks: then the Python function (which calls the module).
// After each call the registers nothing reads later are dropped, as the generated forward's `x = None`.
class NativeProgram {
 public:
  enum Kind : int64_t { CALL = 0, METHOD = 1, BOUND = 2, STEP = 3, TUPLE = 4, LIST = 5, GUARDED = 6 };
  using Arg = std::pair<int64_t, int64_t>;  // (0: a register, 1: a constant), its index
  // kind, target, arguments (positional, then keyword values), keyword names, the register written, registers dropped
  using Instruction = std::tuple<int64_t, py::object, std::vector<Arg>, py::tuple, int64_t, std::vector<int64_t>>;

  NativeProgram(std::vector<std::string> names, py::list defaults, std::vector<bool> has_default, int64_t registers,
                py::list constants, std::vector<Instruction> code, Arg output)
      : names_(std::move(names)), has_default_(std::move(has_default)), registers_(registers), output_(output) {
    TORCH_CHECK(has_default_.size() == names_.size() && defaults.size() == names_.size() &&
                    registers_ >= static_cast<int64_t>(names_.size()), "native program: inputs do not match");
    for (const auto& value : defaults) defaults_.push_back(py::reinterpret_borrow<py::object>(value));
    for (const auto& value : constants) constants_.push_back(py::reinterpret_borrow<py::object>(value));
    for (auto& [kind, target, args, kwnames, out, drop] : code) {
      Step step{kind, target, args, kwnames, out, drop, nullptr, nullptr, py::object(), {}, py::object()};
      TORCH_CHECK(kind >= CALL && kind <= GUARDED && out >= 0 && out < registers_, "native program: instruction");
      for (const auto& [source, index] : args) {
        TORCH_CHECK(source == 0 ? index < registers_ : index < static_cast<int64_t>(constants_.size()),
                    "native program: no argument ", source, ":", index);
      }
      if (kind == BOUND) step.bound = target.cast<const BoundOp*>();
      if (kind == GUARDED || kind == STEP) {
        // STEP: (the NativeStep, the function, its operands' indices); GUARDED: (the BoundOp, the function, its
        // operands' indices, the module)
        auto planned = target.cast<py::tuple>();
        if (kind == STEP) step.step = planned[0].cast<const NativeStep*>();
        if (kind == GUARDED) step.bound = planned[0].cast<const BoundOp*>(), step.guard = planned[3];
        step.fallback = planned[1];
        step.operands = planned[2].cast<std::vector<size_t>>();
        size_t takes = kind == STEP ? step.step->arity() : step.bound->slots().size();
        std::string name = kind == STEP ? step.step->name() : step.bound->name();
        TORCH_CHECK(step.operands.size() == takes && takes <= 8, "native program: step ", name, " takes ", takes,
                    " operands");
        for (size_t operand : step.operands) TORCH_CHECK(operand < args.size(), "native program: no operand ", operand);
      }
      code_.push_back(std::move(step));
    }
    TORCH_CHECK(output_.first == 0 ? output_.second < registers_ : output_.second < static_cast<int64_t>(constants_.size()),
                "native program: no output");
  }

  py::object call(const py::args& args, const py::kwargs& kwargs) const {
    std::vector<py::object> regs(registers_);
    size_t inputs = names_.size();
    if (args.size() > inputs) {
      throw py::type_error("forward() takes " + std::to_string(inputs) + " arguments, got " + std::to_string(args.size()));
    }
    for (size_t i = 0; i < args.size(); ++i) regs[i] = args[i];
    for (const auto& [key, value] : kwargs) {
      std::string name = py::str(key);
      auto at = std::find(names_.begin(), names_.end(), name);
      if (at == names_.end() || regs[at - names_.begin()]) {
        throw py::type_error("forward() got an unexpected or repeated argument '" + name + "'");
      }
      regs[at - names_.begin()] = py::reinterpret_borrow<py::object>(value);
    }
    for (size_t i = 0; i < inputs; ++i) {
      if (regs[i]) continue;
      if (!has_default_[i]) throw py::type_error("forward() missing argument '" + names_[i] + "'");
      regs[i] = defaults_[i];
    }
    constexpr size_t kLocal = 24;
    PyObject* local[kLocal];
    std::vector<PyObject*> spill;
    for (const Step& s : code_) {
      PyObject** argv = local;
      if (s.args.size() > kLocal) {
        spill.resize(s.args.size());
        argv = spill.data();
      }
      for (size_t i = 0; i < s.args.size(); ++i) argv[i] = get(regs, s.args[i]);
      regs[s.out] = run(s, argv, s.args.size());
      for (int64_t dropped : s.drop) regs[dropped] = py::object();
    }
    return py::reinterpret_borrow<py::object>(get(regs, output_));
  }

  std::string describe() const {
    int64_t counts[7] = {0, 0, 0, 0, 0, 0, 0};
    for (const Step& s : code_) ++counts[s.kind];
    return "<lucid_fx native program: " + std::to_string(code_.size()) + " calls (" +
           std::to_string(counts[BOUND] + counts[GUARDED]) +
           " bound, " + std::to_string(counts[STEP]) + " planned, " + std::to_string(counts[CALL] + counts[METHOD]) +
           " Python)>";
  }

 private:
  struct Step {
    int64_t kind;
    py::object target;
    std::vector<Arg> args;
    py::tuple kwnames;
    int64_t out;
    std::vector<int64_t> drop;
    const BoundOp* bound;
    const NativeStep* step;
    py::object fallback;
    std::vector<size_t> operands;
    py::object guard;
  };

  // Whether a module has forward hooks or pre-hooks (what call_float_modules' functions check).
  static bool hooked(const py::object& module) {
    py::object dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(module.ptr(), nullptr));
    if (!dict) throw py::error_already_set();
    for (const char* name : {"_forward_hooks", "_forward_pre_hooks"}) {
      PyObject* hooks = PyDict_GetItemString(dict.ptr(), name);
      if (hooks == nullptr || !PyDict_Check(hooks) || PyDict_GET_SIZE(hooks) != 0) return true;
    }
    return false;
  }

  PyObject* get(const std::vector<py::object>& regs, const Arg& arg) const {
    PyObject* value = arg.first == 0 ? regs[arg.second].ptr() : constants_[arg.second].ptr();
    if (value == nullptr) throw std::logic_error("native program: a register read before it was written");
    return value;
  }

  // A STEP's or GUARDED call's operands, picked from its arguments into `operands` (at most 8); how many.
  static size_t gather(const Step& s, PyObject* const* argv, PyObject** operands) {
    for (size_t i = 0; i < s.operands.size(); ++i) operands[i] = argv[s.operands[i]];
    return s.operands.size();
  }

  static py::object vectorcall(PyObject* callable, PyObject* const* argv, size_t count, const py::tuple& kwnames) {
    size_t keywords = kwnames.size();
    PyObject* out = PyObject_Vectorcall(callable, argv, count - keywords, keywords ? kwnames.ptr() : nullptr);
    if (out == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(out);
  }

  py::object run(const Step& s, PyObject* const* argv, size_t count) const {
    switch (s.kind) {
      case CALL:
        return vectorcall(s.target.ptr(), argv, count, s.kwnames);
      case METHOD: {
        size_t keywords = s.kwnames.size();
        PyObject* out = PyObject_VectorcallMethod(s.target.ptr(), argv, count - keywords,
                                                  keywords ? s.kwnames.ptr() : nullptr);
        if (out == nullptr) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(out);
      }
      case BOUND:
        return s.bound->run(argv, count);
      case GUARDED: {
        if (!hooked(s.guard)) {
          PyObject* operands[8];
          return s.bound->run(operands, gather(s, argv, operands));
        }
        return vectorcall(s.fallback.ptr(), argv, count, s.kwnames);  // the function: the module's call, its hooks
      }
      case STEP: {
        PyObject* operands[8];
        std::optional<at::Tensor> out = s.step->run(operands, gather(s, argv, operands));
        if (out) return py::reinterpret_steal<py::object>(THPVariable_Wrap(*out));
        return vectorcall(s.fallback.ptr(), argv, count, s.kwnames);  // the checked path, as the function takes it
      }
      default: {
        py::tuple packed(count);
        for (size_t i = 0; i < count; ++i) packed[i] = py::reinterpret_borrow<py::object>(argv[i]);
        if (s.kind == TUPLE) return std::move(packed);
        return py::list(packed);
      }
    }
  }

  std::vector<std::string> names_;
  std::vector<py::object> defaults_;
  std::vector<bool> has_default_;
  int64_t registers_;
  std::vector<py::object> constants_;
  std::vector<Step> code_;
  Arg output_;
};

// What a converted model's call reads (lucid_fx/program.py): the forced CPU kinds' list (non-empty: a kind is
// forced), the variable that sets one, the detected kind's name, the Python call, and the attribute names.
struct Runner {
  py::object forced, kind, python_call, programs, hooks, pre_hooks, forward;
  std::string variable;
};

py::object runner_call(const Runner& r, py::handle self, const py::args& args, const py::kwargs& kwargs) {
  auto python = [&]() { return r.python_call(self, *args, **kwargs); };
  if (kwargs.size() != 0 || PyList_GET_SIZE(r.forced.ptr()) != 0 || std::getenv(r.variable.c_str()) != nullptr) {
    return python();
  }
  py::object dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(self.ptr(), nullptr));
  if (!dict) throw py::error_already_set();
  PyObject* programs = PyDict_GetItem(dict.ptr(), r.programs.ptr());  // borrowed; no error raised
  if (programs == nullptr || !PyDict_Check(programs) || PyDict_GET_SIZE(programs) == 0) return python();
  for (PyObject* name : {r.hooks.ptr(), r.pre_hooks.ptr()}) {
    PyObject* hooks = PyDict_GetItem(dict.ptr(), name);
    if (hooks == nullptr || !PyDict_Check(hooks) || PyDict_GET_SIZE(hooks) != 0) return python();
  }
  // The key program.py's _signature makes: (kind, (shape, strides, dtype) per tensor); a tuple equals a torch.Size.
  py::tuple key(args.size() + 1);
  key[0] = r.kind;
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* object = args[i].ptr();
    if (!THPVariable_CheckExact(object)) return python();  // a subclass (a fake tensor while tracing), a scalar
    const at::Tensor& t = THPVariable_Unpack(object);
    if (t.requires_grad() || !t.device().is_cpu() || t.layout() != at::kStrided) return python();
    py::tuple shape(t.dim()), strides(t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) {
      shape[d] = py::int_(t.size(d));
      strides[d] = py::int_(t.stride(d));
    }
    key[i + 1] = py::make_tuple(shape, strides, py::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()))));
  }
  PyObject* program = PyDict_GetItemWithError(programs, key.ptr());
  if (program == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return python();
  }
  if (program == Py_None) return python();
  return py::getattr(program, r.forward)(*args);  // a program has no hooks: no Module.__call__
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<BoundOp>(m, "BoundOp")
      .def(py::init<const std::string&, const std::string&, const py::sequence&, std::vector<int64_t>>())
      .def("__call__", &BoundOp::call)
      .def_property_readonly("name", &BoundOp::name)
      .def_property_readonly("slots", &BoundOp::slots)
      .def("__repr__", [](const BoundOp& op) { return "<lucid_fx bound call of " + op.name() + ">"; });
  m.def("set_recording", [](bool on) { recording.store(on); });
  m.def("runner_method", [](py::object cls, py::object python_call, py::object forced, std::string variable, py::str kind,
                            py::str programs) {
    auto r = std::make_shared<Runner>(Runner{forced, kind, python_call, programs,
                                             py::str("_forward_hooks"), py::str("_forward_pre_hooks"), py::str("forward"),
                                             std::move(variable)});
    return py::cpp_function(
        [r](py::handle self, py::args args, py::kwargs kwargs) { return runner_call(*r, self, args, kwargs); },
        py::is_method(cls), py::name("__call__"));
  });
  py::class_<NativeStep>(m, "NativeStep", py::dynamic_attr())
      .def(py::init<std::string, std::vector<NativeStep::Call>, std::vector<NativeStep::Input>,
                    std::vector<NativeStep::Buffer>, int64_t>())
      .def("__call__", &NativeStep::call)
      .def_property_readonly("name", &NativeStep::name)
      .def("__repr__", [](const NativeStep& step) { return "<lucid_fx native step " + step.name() + ">"; });
  py::class_<NativeProgram>(m, "NativeProgram")
      .def(py::init<std::vector<std::string>, py::list, std::vector<bool>, int64_t, py::list,
                    std::vector<NativeProgram::Instruction>, NativeProgram::Arg>())
      .def("__call__", &NativeProgram::call)
      .def("__repr__", &NativeProgram::describe);
}
