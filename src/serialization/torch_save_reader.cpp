#include "serialization/torch_save_reader.h"

#include "serialization/zip_archive_check.h"

#include <caffe2/serialize/file_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <unordered_map>
#include <vector>

namespace attn::detail {
namespace {

// A Python object, as far as a state_dict needs them. Objects refer to
// each other by plain pointers and the Unpickler that made them owns them
// all: a pickle may make a list hold itself, or nest lists a million deep,
// and neither may leak or overflow the stack when the objects are freed.
struct Object;
using ObjectPtr = Object*;
struct Object {
  enum class Kind {
    none,
    boolean,
    integer,
    floating,
    string,
    tuple,
    list,
    dict,
    global,
    tensor,
    storage
  };
  Kind kind = Kind::none;
  int64_t integer = 0; // also booleans
  double floating = 0.0;
  std::string text;                                     // a string, or a global's "module.name"
  std::vector<ObjectPtr> items;                         // tuple, list
  std::vector<std::pair<ObjectPtr, ObjectPtr>> entries; // dict, in order
  torch::Tensor tensor;                                 // a tensor, or a storage as a 1-D tensor

  const char* kind_name() const {
    constexpr const char* names[] = {"None",     "a bool",   "an int",   "a float",
                                     "a string", "a tuple",  "a list",   "a dict",
                                     "a global", "a tensor", "a storage"};
    return names[static_cast<int>(kind)];
  }
};

// Each dtype a state_dict may hold, with the names Python pickles for it:
// its storage class, named by a tensor's persistent id, and the dtype
// itself, named by _rebuild_tensor_v3. LibTorch 1.13's dtypes, so that a
// file loads alike on every LibTorch attn builds with.
struct PickledDtype {
  torch::ScalarType dtype;
  const char* storage_class;
  const char* name;
};

constexpr PickledDtype kPickledDtypes[] = {
    {torch::kFloat, "torch.FloatStorage", "torch.float32"},
    {torch::kDouble, "torch.DoubleStorage", "torch.float64"},
    {torch::kHalf, "torch.HalfStorage", "torch.float16"},
    {torch::kBFloat16, "torch.BFloat16Storage", "torch.bfloat16"},
    {torch::kLong, "torch.LongStorage", "torch.int64"},
    {torch::kInt, "torch.IntStorage", "torch.int32"},
    {torch::kShort, "torch.ShortStorage", "torch.int16"},
    {torch::kChar, "torch.CharStorage", "torch.int8"},
    {torch::kByte, "torch.ByteStorage", "torch.uint8"},
    {torch::kBool, "torch.BoolStorage", "torch.bool"},
    {torch::kComplexFloat, "torch.ComplexFloatStorage", "torch.complex64"},
    {torch::kComplexDouble, "torch.ComplexDoubleStorage", "torch.complex128"}};

using DtypeTable = std::map<std::string, torch::ScalarType>;

DtypeTable dtypes_by(const char* PickledDtype::*name) {
  DtypeTable table;
  for (const auto& pickled : kPickledDtypes) {
    table.emplace(pickled.*name, pickled.dtype);
  }
  return table;
}

// torch.storage.UntypedStorage holds bytes: PyTorch 2.x writes it for
// dtypes that have no storage class (float8, uint16), and the tensor
// rebuilt from it by _rebuild_tensor_v3 names its dtype.
const DtypeTable& storage_dtypes() {
  static const DtypeTable table = [] {
    auto by_storage_class = dtypes_by(&PickledDtype::storage_class);
    by_storage_class.emplace("torch.storage.UntypedStorage", torch::kByte);
    return by_storage_class;
  }();
  return table;
}

const DtypeTable& tensor_dtypes() {
  static const DtypeTable table = dtypes_by(&PickledDtype::name);
  return table;
}

// "a, b or c", for the errors that list what a table holds.
template <typename Table>
std::string names_of(const Table& table) {
  std::vector<std::string> names;
  names.reserve(table.size());
  for (const auto& entry : table) {
    names.push_back(entry.first);
  }
  const auto last = names.back();
  names.pop_back();
  return c10::Join(", ", names) + " or " + last;
}

class Unpickler {
 public:
  Unpickler(caffe2::serialize::PyTorchStreamReader& archive, const std::string& where)
      : archive_(archive), where_(where) {
    const auto [data, size] = archive_.getRecord("data.pkl");
    const auto* bytes = static_cast<const char*>(data.get());
    bytes_.assign(bytes, bytes + size);
  }

  // The pickle's result, owned by this Unpickler.
  ObjectPtr run() {
    while (true) {
      const auto opcode = static_cast<unsigned char>(read_bytes(1)[0]);
      if (opcode == '.') { // STOP
        check(stack_.size() == 1, "the pickle ends with ", stack_.size(), " objects on its stack");
        return stack_.back();
      }
      step(opcode);
    }
  }

 private:
  template <typename... Args>
  void check(bool condition, const Args&... what) {
    TORCH_CHECK(condition, where_, " is not a pickle this reader understands: ", what...);
  }

  // Content that no state_dict this reader was written for holds: most
  // likely the work of a newer PyTorch, so the error names it exactly.
  void check_known(bool condition, const std::string& what, const std::string& expected) {
    TORCH_CHECK(
        condition, where_, " uses ", what, ", which this reader does not know; expected ",
        expected);
  }

  std::string read_bytes(uint64_t n) {
    check(n <= bytes_.size() - position_, "it ends early at byte ", bytes_.size());
    std::string result(bytes_.data() + position_, n);
    position_ += n;
    return result;
  }

  // Little-endian unsigned integer of n bytes.
  uint64_t read_unsigned(size_t n) {
    const auto raw = read_bytes(n);
    uint64_t value = 0;
    for (size_t i = 0; i < n; ++i) {
      value |= static_cast<uint64_t>(static_cast<unsigned char>(raw[i])) << (8 * i);
    }
    return value;
  }

  std::string read_line() {
    const auto end = std::find(bytes_.begin() + position_, bytes_.end(), '\n');
    check(end != bytes_.end(), "an unterminated GLOBAL name");
    std::string line(bytes_.begin() + position_, end);
    position_ = static_cast<size_t>(end - bytes_.begin()) + 1;
    return line;
  }

  ObjectPtr pop() {
    check(!stack_.empty(), "an opcode needs more objects than its stack holds");
    auto* top = stack_.back();
    stack_.pop_back();
    return top;
  }

  // The objects pushed since the last MARK, removed from the stack.
  std::vector<ObjectPtr> pop_to_mark() {
    check(
        !marks_.empty() && marks_.back() <= stack_.size(),
        "an opcode needs a MARK that is missing");
    const auto mark = marks_.back();
    marks_.pop_back();
    std::vector<ObjectPtr> items(stack_.begin() + mark, stack_.end());
    stack_.resize(mark);
    return items;
  }

  ObjectPtr make(Object::Kind kind) {
    objects_.push_back(std::make_unique<Object>());
    objects_.back()->kind = kind;
    return objects_.back().get();
  }

  void push_scalar(Object::Kind kind, int64_t value) {
    auto* object = make(kind);
    object->integer = value;
    stack_.push_back(object);
  }

  void push_string(std::string text, Object::Kind kind = Object::Kind::string) {
    auto* object = make(kind);
    object->text = std::move(text);
    stack_.push_back(object);
  }

  void push_tuple(std::vector<ObjectPtr> items) {
    auto* tuple = make(Object::Kind::tuple);
    tuple->items = std::move(items);
    stack_.push_back(tuple);
  }

  ObjectPtr& top(Object::Kind kind, const char* opcode) {
    check(!stack_.empty() && stack_.back()->kind == kind, opcode, " applied to the wrong object");
    return stack_.back();
  }

  void memoize(uint64_t index) {
    check(!stack_.empty(), "a memo write with an empty stack");
    memo_[index] = stack_.back();
  }

  // NOLINTNEXTLINE(readability-function-size): one case per pickle opcode, read as a table.
  void step(unsigned char opcode) {
    using Kind = Object::Kind;
    switch (opcode) {
      case 0x80: { // PROTO
        const auto protocol = read_unsigned(1);
        check_known(protocol <= 5, c10::str("pickle protocol ", protocol), "protocol 2 to 5");
        break;
      }
      case 0x95: read_bytes(8); break;                  // FRAME
      case '(': marks_.push_back(stack_.size()); break; // MARK
      case '0': pop(); break;                           // POP
      case '1': pop_to_mark(); break;                   // POP_MARK
      case 'N': stack_.push_back(make(Kind::none)); break;
      case 0x88: push_scalar(Kind::boolean, 1); break; // NEWTRUE
      case 0x89: push_scalar(Kind::boolean, 0); break; // NEWFALSE
      case 'J': push_scalar(Kind::integer, static_cast<int32_t>(read_unsigned(4))); break;
      case 'K': push_scalar(Kind::integer, static_cast<int64_t>(read_unsigned(1))); break;
      case 'M': push_scalar(Kind::integer, static_cast<int64_t>(read_unsigned(2))); break;
      case 0x8a: { // LONG1
        const auto n = read_unsigned(1);
        check(n <= 8, "an integer of ", n, " bytes");
        auto value = n == 0 ? 0 : read_unsigned(n);
        if (n > 0 && n < 8 && (value >> (8 * n - 1)) != 0) {
          value |= ~uint64_t{0} << (8 * n); // sign-extend
        }
        push_scalar(Kind::integer, static_cast<int64_t>(value));
        break;
      }
      case 'G': { // BINFLOAT, big-endian
        auto raw = read_bytes(8);
        std::reverse(raw.begin(), raw.end());
        auto* object = make(Kind::floating);
        std::memcpy(&object->floating, raw.data(), 8);
        stack_.push_back(object);
        break;
      }
      case 'X': push_string(read_bytes(read_unsigned(4))); break;  // BINUNICODE
      case 0x8c: push_string(read_bytes(read_unsigned(1))); break; // SHORT_BINUNICODE
      case 0x8d: push_string(read_bytes(read_unsigned(8))); break; // BINUNICODE8
      case ')': push_tuple({}); break;                             // EMPTY_TUPLE
      case 't': push_tuple(pop_to_mark()); break;                  // TUPLE
      case 0x85:
      case 0x86:
      case 0x87: { // TUPLE1..3
        const size_t n = opcode - 0x84;
        check(stack_.size() >= n, "a tuple of more objects than the stack holds");
        std::vector<ObjectPtr> items(stack_.end() - n, stack_.end());
        stack_.resize(stack_.size() - n);
        push_tuple(std::move(items));
        break;
      }
      case ']': stack_.push_back(make(Kind::list)); break; // EMPTY_LIST
      case 'a': {                                          // APPEND
        auto* item = pop();
        top(Kind::list, "APPEND")->items.push_back(item);
        break;
      }
      case 'e': { // APPENDS
        auto items = pop_to_mark();
        auto& list = top(Kind::list, "APPENDS")->items;
        list.insert(list.end(), items.begin(), items.end());
        break;
      }
      case '}': stack_.push_back(make(Kind::dict)); break; // EMPTY_DICT
      case 's': {                                          // SETITEM
        auto* value = pop();
        auto* key = pop();
        top(Kind::dict, "SETITEM")->entries.emplace_back(key, value);
        break;
      }
      case 'u': { // SETITEMS
        auto items = pop_to_mark();
        check(items.size() % 2 == 0, "SETITEMS with an odd number of objects");
        auto& dict = top(Kind::dict, "SETITEMS")->entries;
        for (size_t i = 0; i < items.size(); i += 2) {
          dict.emplace_back(items[i], items[i + 1]);
        }
        break;
      }
      case 'c': { // GLOBAL
        auto module = read_line();
        push_string(module + "." + read_line(), Kind::global);
        break;
      }
      case 0x93: { // STACK_GLOBAL
        auto* name = pop();
        auto* module = pop();
        check(
            name->kind == Kind::string && module->kind == Kind::string,
            "STACK_GLOBAL without a module and a name");
        // The strings may come from the memo, again and again: a bound on
        // the name keeps each STACK_GLOBAL's copy small.
        const auto length = module->text.size() + name->text.size();
        check(length <= kLongestGlobalName, "a global name of ", length, " bytes");
        push_string(module->text + "." + name->text, Kind::global);
        break;
      }
      case 'q': memoize(read_unsigned(1)); break; // BINPUT
      case 'r': memoize(read_unsigned(4)); break; // LONG_BINPUT
      case 0x94: memoize(memo_.size()); break;    // MEMOIZE
      case 'h':
      case 'j': { // BINGET, LONG_BINGET
        const auto found = memo_.find(read_unsigned(opcode == 'h' ? 1 : 4));
        check(found != memo_.end(), "a memo read of an unwritten entry");
        stack_.push_back(found->second);
        break;
      }
      case 'Q': stack_.push_back(load_storage(pop())); break; // BINPERSID
      case 'R': {                                             // REDUCE
        auto* arguments = pop();
        auto* callable = pop();
        check(
            callable->kind == Kind::global && arguments->kind == Kind::tuple,
            "REDUCE without a global and its arguments");
        stack_.push_back(call(callable->text, arguments->items));
        break;
      }
      case 'b': pop(); break; // BUILD: an OrderedDict's _metadata, not needed
      default:
        check_known(
            false,
            c10::str(
                "pickle opcode 0x", std::hex, static_cast<int>(opcode), std::dec, " at byte ",
                position_ - 1, " of data.pkl"),
            "the opcodes torch.save writes for a state_dict of tensors");
    }
  }

  // The objects torch.save builds by calling a global, by the global's name.
  using Call =
      ObjectPtr (Unpickler::*)(const std::string& name, const std::vector<ObjectPtr>& arguments);
  static const std::map<std::string, Call>& calls() {
    static const std::map<std::string, Call> table = {
        {"collections.OrderedDict", &Unpickler::make_dict},
        {"torch._utils._rebuild_tensor", &Unpickler::rebuild_tensor},
        {"torch._utils._rebuild_tensor_v2", &Unpickler::rebuild_tensor},
        {"torch._utils._rebuild_tensor_v3", &Unpickler::rebuild_tensor_of_dtype},
        {"torch._utils._rebuild_parameter", &Unpickler::rebuild_parameter}};
    return table;
  }

  ObjectPtr call(const std::string& name, const std::vector<ObjectPtr>& arguments) {
    const auto found = calls().find(name);
    check_known(found != calls().end(), name, "a call of " + names_of(calls()));
    return (this->*found->second)(name, arguments);
  }

  ObjectPtr make_dict(const std::string&, const std::vector<ObjectPtr>&) {
    return make(Object::Kind::dict);
  }

  // (storage, storage_offset, size, stride, ...), in the storage's dtype.
  ObjectPtr rebuild_tensor(const std::string& name, const std::vector<ObjectPtr>& arguments) {
    check(
        arguments.size() >= 4 && arguments[0]->kind == Object::Kind::storage, name,
        " with unexpected arguments");
    return view_storage(arguments[0]->tensor, name, arguments);
  }

  // (storage, storage_offset, size, stride, requires_grad, hooks, dtype, ...):
  // the storage's bytes as elements of `dtype`, as Python's torch.load reads
  // them whatever the storage's class.
  ObjectPtr rebuild_tensor_of_dtype(
      const std::string& name,
      const std::vector<ObjectPtr>& arguments) {
    check(
        arguments.size() >= 7 && arguments[0]->kind == Object::Kind::storage &&
            arguments[6]->kind == Object::Kind::global,
        name, " with unexpected arguments");
    const auto& dtype_name = arguments[6]->text;
    const auto dtype = tensor_dtypes().find(dtype_name);
    check_known(dtype != tensor_dtypes().end(), "dtype " + dtype_name, names_of(tensor_dtypes()));
    const auto& storage = arguments[0]->tensor;
    const auto bytes = storage.numel() * storage.element_size();
    const auto element_size = static_cast<int64_t>(c10::elementSize(dtype->second));
    check(
        bytes % element_size == 0, "a storage of ", bytes, " bytes read as ", dtype_name,
        " elements of ", element_size, " bytes");
    return view_storage(storage.view(dtype->second), name, arguments);
  }

  ObjectPtr rebuild_parameter(const std::string& name, const std::vector<ObjectPtr>& arguments) {
    // (tensor, requires_grad, hooks)
    check(
        !arguments.empty() && arguments[0]->kind == Object::Kind::tensor, name,
        " without a tensor");
    return arguments[0];
  }

  // The tensor that `arguments`' offset, sizes and strides make of `storage`,
  // after checking that it stays inside it.
  ObjectPtr view_storage(
      const torch::Tensor& storage,
      const std::string& name,
      const std::vector<ObjectPtr>& arguments) {
    using Kind = Object::Kind;
    check(
        arguments[1]->kind == Kind::integer && arguments[2]->kind == Kind::tuple &&
            arguments[3]->kind == Kind::tuple,
        name, " with unexpected arguments");
    const auto ints = [&](const ObjectPtr& tuple) {
      std::vector<int64_t> values;
      for (const auto& item : tuple->items) {
        check(item->kind == Kind::integer, "a tensor size or stride that is not an integer");
        values.push_back(item->integer);
      }
      return values;
    };
    // A memo'd tuple may be passed to many calls: a bound on the dims keeps
    // each call's work small.
    check(
        arguments[2]->items.size() <= kMostDims && arguments[3]->items.size() <= kMostDims,
        "a tensor of more than ", kMostDims, " dims");
    const auto size = ints(arguments[2]), stride = ints(arguments[3]);
    const auto offset = arguments[1]->integer;
    check(
        size.size() == stride.size(), "a tensor with ", size.size(), " sizes and ", stride.size(),
        " strides");
    check(
        fits_storage(size, stride, offset, storage.numel()),
        "a tensor that reaches past its storage");
    auto* tensor = make(Kind::tensor);
    tensor->tensor = storage.as_strided(size, stride, offset);
    return tensor;
  }

  // Whether the elements of the view (size, stride, offset) all lie in a
  // storage of `numel` elements. Every step is compared before it is
  // added, so no sum or product can overflow, whatever the file claims.
  static bool fits_storage(
      const std::vector<int64_t>& size,
      const std::vector<int64_t>& stride,
      int64_t offset,
      int64_t numel) {
    if (offset < 0 || offset > numel) {
      return false;
    }
    for (size_t d = 0; d < size.size(); ++d) {
      if (size[d] < 0 || stride[d] < 0) {
        return false;
      }
    }
    if (std::find(size.begin(), size.end(), 0) != size.end()) {
      return true; // no elements, whatever the strides (torch.save keeps its shape's)
    }
    if (offset == numel) {
      return false; // the first element is past the end
    }
    int64_t last = offset; // the index of the last element so far, < numel
    for (size_t d = 0; d < size.size(); ++d) {
      const int64_t steps = size[d] - 1;
      if (steps > 0 && stride[d] > 0) {
        if (steps > (numel - 1 - last) / stride[d]) {
          return false;
        }
        last += steps * stride[d];
      }
    }
    return true;
  }

  // A persistent id ('storage', type, key, location, numel) as a 1-D tensor
  // of the storage's dtype, read from the archive's data/<key>.
  ObjectPtr load_storage(const ObjectPtr& id) {
    using Kind = Object::Kind;
    const auto& items = id->items;
    check(
        id->kind == Kind::tuple && items.size() >= 5 && items[0]->kind == Kind::string &&
            items[0]->text == "storage" && items[1]->kind == Kind::global &&
            items[2]->kind == Kind::string && items[4]->kind == Kind::integer,
        "a persistent id that is not a storage");
    const auto& key = items[2]->text;
    if (const auto found = storages_.find(key); found != storages_.end()) {
      return found->second;
    }
    const auto dtype = storage_dtypes().find(items[1]->text);
    check_known(
        dtype != storage_dtypes().end(), "storage type " + items[1]->text,
        names_of(storage_dtypes()));
    const auto numel = items[4]->integer;
    const auto element_size = static_cast<int64_t>(c10::elementSize(dtype->second));
    const auto [data, size] = archive_.getRecord("data/" + key);
    check(
        numel >= 0 && numel <= static_cast<int64_t>(size) / element_size &&
            static_cast<size_t>(numel * element_size) == size,
        "storage ", key, " holds ", size, " bytes for ", numel, " elements of ", dtype->second);
    auto* storage = make(Kind::storage);
    storage->tensor = torch::empty({numel}, torch::TensorOptions(dtype->second));
    if (size > 0) { // an empty storage's tensor has no data pointer to copy to
      std::memcpy(storage->tensor.data_ptr(), data.get(), size);
    }
    storages_[key] = storage;
    return storage;
  }

  // No known global's name is longer; no tensor a state_dict holds has more
  // dims.
  static constexpr size_t kLongestGlobalName = 256;
  static constexpr size_t kMostDims = 64;

  caffe2::serialize::PyTorchStreamReader& archive_;
  std::string where_;
  std::vector<char> bytes_;
  size_t position_ = 0;
  std::vector<std::unique_ptr<Object>> objects_; // every object made, in order
  std::vector<ObjectPtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, ObjectPtr> memo_;
  std::unordered_map<std::string, ObjectPtr> storages_;
};

// Storages are copied byte for byte, so they must be in the byte order of
// the machines attn runs on (x86-64, AArch64): little-endian. PyTorch 2.x
// records the order of the machine that saved the file; older files have no
// record and are little-endian.
void check_byte_order(caffe2::serialize::PyTorchStreamReader& archive, const std::string& where) {
  if (!archive.hasRecord("byteorder")) {
    return;
  }
  const auto [data, size] = archive.getRecord("byteorder");
  const std::string order(static_cast<const char*>(data.get()), size);
  TORCH_CHECK(
      order == "little", where, " holds storages in byte order '", order,
      "' (its byteorder record); this reader expected 'little'");
}

// The bytes of a file in memory, for LibTorch's reader. Reads past the end
// return fewer bytes, as a file's do (LibTorch 1.13's own MemoryReadAdapter
// copies whatever it is asked for).
class MemoryReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  MemoryReader(const void* data, size_t size)
      : data_(static_cast<const char*>(data)), size_(size) {}

  size_t size() const override { return size_; }

  size_t read(uint64_t position, void* buffer, size_t n, const char* /*what*/) const override {
    // An empty record's buffer may be null: nothing to copy into it.
    if (position >= size_ || n == 0) {
      return 0;
    }
    n = std::min<uint64_t>(n, size_ - position);
    std::memcpy(buffer, data_ + position, n);
    return n;
  }

 private:
  const char* data_;
  size_t size_;
};

// The message of any exception: LibTorch's reader throws c10::Errors, and
// also lets through the standard library's (std::stoull of a version
// record that is no number).
std::string message_of(const std::exception& error) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  return torch_error != nullptr ? torch_error->what_without_backtrace() : error.what();
}

std::map<std::string, torch::Tensor> read_archive(
    const std::shared_ptr<caffe2::serialize::ReadAdapterInterface>& source,
    const std::string& where) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  std::string problem;
  try {
    problem = zip_archive_problem(*source);
    if (problem.empty()) {
      archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(source);
      if (!archive->hasRecord("data.pkl")) {
        problem = "no data.pkl record";
      }
    }
  } catch (const std::exception& error) {
    problem = message_of(error);
  }
  TORCH_CHECK(
      problem.empty(), where, " is not a file written by Python's torch.save (zip format, ",
      "PyTorch >= 1.6): ", problem);
  check_byte_order(*archive, where);
  std::map<std::string, torch::Tensor> tensors;
  try {
    Unpickler unpickler(*archive, where);
    auto* const root = unpickler.run();
    TORCH_CHECK(
        root->kind == Object::Kind::dict, where,
        " must hold a state_dict (a dict of tensors), got ", root->kind_name());
    for (const auto& [key, value] : root->entries) {
      if (key->kind == Object::Kind::string && value->kind == Object::Kind::tensor) {
        tensors[key->text] = value->tensor;
      }
    }
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) { // e.g. a length that cannot be allocated
    TORCH_CHECK(false, where, " could not be read: ", error.what());
  }
  return tensors;
}

} // namespace

std::map<std::string, torch::Tensor> read_saved_tensor_dict(
    const std::string& path,
    const char* caller) {
  TORCH_CHECK(std::ifstream(path).good(), caller, ": cannot open '", path, "' for reading");
  const auto where = c10::str(caller, ": '", path, "'");
  std::shared_ptr<caffe2::serialize::ReadAdapterInterface> file;
  try {
    file = std::make_shared<caffe2::serialize::FileAdapter>(path);
  } catch (const c10::Error& error) {
    TORCH_CHECK(
        false, caller, ": cannot open '", path, "' for reading: ", error.what_without_backtrace());
  }
  return read_archive(file, where);
}

std::map<std::string, torch::Tensor> read_saved_tensor_dict(
    const void* data,
    size_t size,
    const std::string& name,
    const char* caller) {
  return read_archive(
      std::make_shared<MemoryReader>(data, size), c10::str(caller, ": '", name, "'"));
}

} // namespace attn::detail
