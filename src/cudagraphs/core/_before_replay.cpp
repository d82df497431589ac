// The host-side work in front of every replay that is worth a C call: the address check the
// guard runs (see guards.py), one C call over a tuple of tensors against a packed array of
// addresses (in `unchanged`, also the modules' train/eval modes and the identity of their
// parameter, buffer and child entries); the edits of the inputs' copy nodes; and the graph's
// launch itself. Built at install time (setup.py, an optional extension: without a compiler
// the pure fallbacks are used). It includes Python.h only: each address is read through the
// function pointer PyTorch exports for Inductor's C++ wrapper, bound once at import, and the
// runtime's and PyTorch's C functions are reached through pointers handed in from Python.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>
#include <cstring>

typedef void* (*read_fn)(PyObject*);
static read_fn read_address = nullptr;

static PyObject* bind(PyObject*, PyObject* address) {
  unsigned long long value = PyLong_AsUnsignedLongLong(address);
  if (value == (unsigned long long)-1 && PyErr_Occurred()) return nullptr;
  read_address = reinterpret_cast<read_fn>(static_cast<uintptr_t>(value));
  Py_RETURN_NONE;
}

// 1: every tensor at its address; 0: one moved; -1: error set.
static int at_addresses(PyObject* tensors, PyObject* addresses) {
  if (!PyTuple_Check(tensors) || !PyBytes_Check(addresses)) {
    PyErr_SetString(PyExc_TypeError, "same(tensors: tuple, addresses: bytes) expected");
    return -1;
  }
  if (read_address == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
    return -1;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(tensors);
  if (PyBytes_GET_SIZE(addresses) != n * (Py_ssize_t)sizeof(uint64_t)) {
    PyErr_SetString(PyExc_ValueError, "one 8-byte address per tensor expected");
    return -1;
  }
  const char* expected = PyBytes_AS_STRING(addresses);
  for (Py_ssize_t i = 0; i < n; ++i) {
    void* now;
    try {
      now = read_address(PyTuple_GET_ITEM(tensors, i));
    } catch (...) {
      return 0;
    }
    uint64_t want;
    std::memcpy(&want, expected + i * sizeof(uint64_t), sizeof(uint64_t));
    if (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(now)) != want) return 0;
  }
  return 1;
}

// same(tensors: tuple, addresses: bytes of uint64) -> bool
static PyObject* same(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "same(tensors: tuple, addresses: bytes)");
    return nullptr;
  }
  int result = at_addresses(args[0], args[1]);
  if (result < 0) return nullptr;
  return PyBool_FromLong(result);
}

// Whether equality, not identity, decides that a held value is unchanged: numbers, strings,
// bytes and tuples of plain values. A tensor (even of one element, whose == gives a bool) or
// any other object must be the very same object: an equal new one lives at other memory.
// Types beyond Python's own compared by value too (NumPy's scalars), set by compare_by_value.
static PyObject* by_value_types = nullptr;

static int equality_decides(PyObject* value) {
  if (PyLong_Check(value) || PyFloat_Check(value) || PyComplex_Check(value) ||
      PyUnicode_Check(value) || PyBytes_Check(value) || PyTuple_Check(value)) {
    return 1;
  }
  if (by_value_types == nullptr || PyTuple_GET_SIZE(by_value_types) == 0) return 0;
  int found = PyObject_IsInstance(value, by_value_types);
  if (found < 0) {
    PyErr_Clear();
    return 0;
  }
  return found;
}

// compare_by_value(types: tuple of types) -> None: values of these types (NumPy's scalars,
// signature.by_value_types) are compared by equality where identity fails.
static PyObject* compare_by_value(PyObject*, PyObject* types) {
  if (!PyTuple_Check(types)) {
    PyErr_SetString(PyExc_TypeError, "compare_by_value(types: tuple) expected");
    return nullptr;
  }
  Py_INCREF(types);
  PyObject* previous = by_value_types;
  by_value_types = types;
  Py_XDECREF(previous);
  Py_RETURN_NONE;
}

// Whether `now` is `value` or, where equality decides, an equal one of the same type
// (signature.same_value's rule): 1 yes, 0 no (a comparison that fails counts as no).
static int same_object(PyObject* now, PyObject* value) {
  if (now == value) return 1;
  if (Py_TYPE(now) != Py_TYPE(value) || !equality_decides(value)) return 0;
  Py_INCREF(now);  // the comparison may run Python code that changes the owner
  int equal = PyObject_RichCompareBool(now, value, Py_EQ);
  Py_DECREF(now);
  if (equal < 0) {
    PyErr_Clear();
    return 0;
  }
  return equal;
}

// settings_hold(calls: tuple of (getter, args, value)) -> bool: each getter(*args) still
// returns value (or an equal one where equality decides). The modes a recording froze
// (modes.Modes): PyTorch's global-state guard's check, the inference-mode flag and the backend
// settings that guard leaves out, in one C call with no Python frame per setting. A getter
// that raises counts as a change (the slow path then says which).
static PyObject* settings_hold(PyObject*, PyObject* calls) {
  if (!PyTuple_Check(calls)) {
    PyErr_SetString(PyExc_TypeError, "settings_hold(calls: tuple) expected");
    return nullptr;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(calls);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* call = PyTuple_GET_ITEM(calls, i);
    if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 3 ||
        !PyTuple_Check(PyTuple_GET_ITEM(call, 1))) {
      PyErr_SetString(PyExc_TypeError, "each call: (getter, args: tuple, value) expected");
      return nullptr;
    }
    PyObject* now = PyObject_Call(PyTuple_GET_ITEM(call, 0), PyTuple_GET_ITEM(call, 1), nullptr);
    if (now == nullptr) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
    int same = same_object(now, PyTuple_GET_ITEM(call, 2));
    Py_DECREF(now);
    if (!same) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// Whether `now` (an array, through the buffer protocol) still holds `snapshot`: (bytes, element
// format, shape), as signature.buffer_holds. A buffer that is not C-contiguous now: no.
static int buffer_holds(PyObject* now, PyObject* snapshot) {
  if (!PyTuple_Check(snapshot) || PyTuple_GET_SIZE(snapshot) != 3) return 0;
  PyObject* bytes = PyTuple_GET_ITEM(snapshot, 0);
  PyObject* format = PyTuple_GET_ITEM(snapshot, 1);
  PyObject* shape = PyTuple_GET_ITEM(snapshot, 2);
  if (!PyBytes_Check(bytes) || !PyUnicode_Check(format) || !PyTuple_Check(shape)) return 0;
  const char* wanted = PyUnicode_AsUTF8(format);
  if (wanted == nullptr) {
    PyErr_Clear();
    return 0;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(now, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    PyErr_Clear();
    return 0;
  }
  Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
  int same = view.len == PyBytes_GET_SIZE(bytes) && view.ndim == ndim &&
             std::strcmp(view.format != nullptr ? view.format : "B", wanted) == 0 &&
             std::memcmp(view.buf, PyBytes_AS_STRING(bytes), view.len) == 0;
  for (Py_ssize_t i = 0; same && i < ndim; ++i) {
    same = view.shape[i] == PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyBuffer_Release(&view);
  return same;
}

// Whether what an entry's owner holds now (NULL: nothing) is what the entry recorded: absent
// (2 items), the value or an equal one (3), or the same list with the same items or the same
// array with the same memory (4).
static int entry_holds(PyObject* entry, Py_ssize_t size, PyObject* now) {
  if (size == 2) return now == nullptr;
  if (now == nullptr) return 0;
  PyObject* value = PyTuple_GET_ITEM(entry, 2);
  if (size == 3) return same_object(now, value);
  PyObject* items = PyTuple_GET_ITEM(entry, 3);
  if (now != value) return 0;
  if (!PyList_Check(now)) return buffer_holds(now, items);
  if (!PyTuple_Check(items)) return 0;
  Py_ssize_t count = PyTuple_GET_SIZE(items);
  if (PyList_GET_SIZE(now) != count) return 0;
  for (Py_ssize_t j = 0; j < count; ++j) {
    if (j >= PyList_GET_SIZE(now)) return 0;  // a comparison shortened the list
    if (!same_object(PyList_GET_ITEM(now, j), PyTuple_GET_ITEM(items, j))) return 0;
  }
  return 1;
}

// 1: each entry still holds (python_values.ValueWatch); 0: one changed; -1: error set. The
// plain Python values a recording read, checked before every replay. Entries:
//   (dict, key, value)         the dict holds value (or an equal one) under key;
//   (class, key, value)        the class's attribute lookup (its bases in order, no
//                              descriptors run) finds value, so neither the class nor a base
//                              before it was given another;
//   (dict, key)                key is absent (the class's value is not shadowed);
//   (dict, key, list, items)   the dict holds a list whose items are still items (a tuple);
//   (dict, key, array, memory) the dict holds an array whose memory is still memory
//                              ((bytes, format, shape): buffer_holds);
//   (object, None, class)      the object's class is still that very class;
//   (cell, key, value[, items]) a closure cell holds value (or, a list, those items);
//   (object, key, value[, items]) another object (one with __slots__) holds it as attribute key;
//   (list, index, value[, items]) a list (one inside a list read) holds it at index;
//   (getter, Ellipsis, value)  a host setting's getter, called with no arguments, returns it.
static int values_hold(PyObject* held) {
  if (!PyTuple_Check(held)) {
    PyErr_SetString(PyExc_TypeError, "values: a tuple of entries expected");
    return -1;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(held);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* entry = PyTuple_GET_ITEM(held, i);
    Py_ssize_t size = PyTuple_Check(entry) ? PyTuple_GET_SIZE(entry) : 0;
    if (size < 2 || size > 4) {
      PyErr_SetString(PyExc_TypeError, "values: each entry is a tuple of 2 to 4 items");
      return -1;
    }
    PyObject* owner = PyTuple_GET_ITEM(entry, 0);
    PyObject* key = PyTuple_GET_ITEM(entry, 1);
    PyObject* now;
    PyObject* owned = nullptr;  // a new reference (an attribute read) to release below
    if (key == Py_None && size == 3) {
      if (reinterpret_cast<PyObject*>(Py_TYPE(owner)) != PyTuple_GET_ITEM(entry, 2)) return 0;
      continue;
    }
    if (PyCell_Check(owner) && size >= 3) {  // a closure variable: NULL once emptied
      now = PyCell_GET(owner);
    } else if (PyList_Check(owner) && PyLong_Check(key) && size >= 3) {  // a nested list's item
      Py_ssize_t index = PyLong_AsSsize_t(key);
      if (index == -1 && PyErr_Occurred()) return -1;
      now = index >= 0 && index < PyList_GET_SIZE(owner) ? PyList_GET_ITEM(owner, index) : nullptr;
    } else if (key == Py_Ellipsis && size == 3) {  // a host setting: what its getter returns
      owned = PyObject_CallNoArgs(owner);
      if (owned == nullptr) {
        PyErr_Clear();  // a getter that raises now: a change (the slow path says which)
        return 0;
      }
      now = owned;
    } else if (PyDict_Check(owner)) {
      now = PyDict_GetItemWithError(owner, key);
      if (now == nullptr && PyErr_Occurred()) return -1;
    } else if (PyType_Check(owner) && PyUnicode_Check(key) && size == 3) {
      now = _PyType_Lookup(reinterpret_cast<PyTypeObject*>(owner), key);
    } else if (PyUnicode_Check(key) && size >= 3) {  // a slot: read through the object
      owned = PyObject_GetAttr(owner, key);
      if (owned == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();  // an emptied slot: the value is gone
        return 0;
      }
      now = owned;
    } else {
      PyErr_SetString(PyExc_TypeError,
                      "values: an entry's owner is a dict, a class, a cell or an object with "
                      "the attribute key, or its key is None");
      return -1;
    }
    int holds = entry_holds(entry, size, now);
    Py_XDECREF(owned);
    if (!holds) return 0;
  }
  return 1;
}

static PyObject* reads_nested_lists_and_getters(PyObject*, PyObject*) { Py_RETURN_TRUE; }

// values_same(held: tuple of entries) -> bool
static PyObject* values_same(PyObject*, PyObject* held) {
  int result = values_hold(held);
  if (result < 0) return nullptr;
  return PyBool_FromLong(result);
}

// unchanged(tensors, addresses, owners: tuple, modes: tuple, entries: tuple[, values]) -> bool:
// each owner's `training` is still the object recorded in `modes`, each (mapping, values) of
// `entries` still holds those very objects (a module's parameters, buffers, children and
// hooks: `.to()` and `module.buf = t` put new objects there) and each bare dict of `entries`
// is still empty (most of a model's hook and slot dicts), every plain value of `values` is still
// what the recording read (values_hold), and every tensor is at its address. The whole guard in
// one C call: it runs before every replay.
static PyObject* training_name = nullptr;

static PyObject* unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if ((nargs != 5 && nargs != 6) || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3]) ||
      !PyTuple_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "unchanged(tensors, addresses, owners: tuple, modes: tuple, entries: tuple"
                    "[, values: tuple])");
    return nullptr;
  }
  PyObject* owners = args[2];
  PyObject* modes = args[3];
  Py_ssize_t n = PyTuple_GET_SIZE(owners);
  if (PyTuple_GET_SIZE(modes) != n) {
    PyErr_SetString(PyExc_ValueError, "one recorded mode per owner expected");
    return nullptr;
  }
  if (training_name == nullptr && (training_name = PyUnicode_InternFromString("training")) == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* value = PyObject_GetAttr(PyTuple_GET_ITEM(owners, i), training_name);
    if (value == nullptr) {
      PyErr_Clear();  // the slow check explains
      Py_RETURN_FALSE;
    }
    bool same_mode = value == PyTuple_GET_ITEM(modes, i);
    Py_DECREF(value);
    if (!same_mode) Py_RETURN_FALSE;
  }
  // Each (mapping, values): the dict holds exactly those objects, in that order (a slot that
  // is replaced keeps its place). PyDict_Next walks the entries without hashing a key.
  PyObject* entries = args[4];
  Py_ssize_t m = PyTuple_GET_SIZE(entries);
  for (Py_ssize_t i = 0; i < m; ++i) {
    PyObject* entry = PyTuple_GET_ITEM(entries, i);
    if (PyDict_Check(entry)) {  // empty at capture: one size read, no pair to unpack
      if (PyDict_GET_SIZE(entry) != 0) Py_RETURN_FALSE;
      continue;
    }
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2 ||
        !PyDict_Check(PyTuple_GET_ITEM(entry, 0)) || !PyTuple_Check(PyTuple_GET_ITEM(entry, 1))) {
      PyErr_SetString(PyExc_TypeError, "entries: (dict, tuple of values) pairs or dicts expected");
      return nullptr;
    }
    PyObject* mapping = PyTuple_GET_ITEM(entry, 0);
    PyObject* values = PyTuple_GET_ITEM(entry, 1);
    if (PyDict_GET_SIZE(mapping) != PyTuple_GET_SIZE(values)) Py_RETURN_FALSE;
    Py_ssize_t pos = 0, k = 0;
    PyObject* key;
    PyObject* value;
    while (PyDict_Next(mapping, &pos, &key, &value)) {
      if (value != PyTuple_GET_ITEM(values, k++)) Py_RETURN_FALSE;
    }
  }
  if (nargs == 6) {
    int held = values_hold(args[5]);
    if (held < 0) return nullptr;
    if (!held) Py_RETURN_FALSE;
  }
  int result = at_addresses(args[0], args[1]);
  if (result < 0) return nullptr;
  return PyBool_FromLong(result);
}


// Edits of an instantiated graph's copy node (see launch.py), through function pointers to
// the CUDA runtime that PyTorch loaded, handed in from Python; both return the cudaError_t.
// The signatures are the runtime's stable ABI:
//   cudaGraphExecMemcpyNodeSetParams1D(exec, node, dst, src, count, kind)
//   cudaGraphNodeSetEnabled(exec, node, enabled)
typedef int (*set_params_fn)(void*, void*, void*, const void*, size_t, int);
typedef int (*set_enabled_fn)(void*, void*, unsigned int);
static const int DEVICE_TO_DEVICE = 3;  // cudaMemcpyDeviceToDevice

static bool as_words(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want,
                     unsigned long long* out, const char* usage) {
  if (nargs != want) {
    PyErr_SetString(PyExc_TypeError, usage);
    return false;
  }
  for (Py_ssize_t i = 0; i < want; ++i) {
    out[i] = PyLong_AsUnsignedLongLong(args[i]);
    if (out[i] == (unsigned long long)-1 && PyErr_Occurred()) return false;
  }
  if (out[0] == 0) {
    PyErr_SetString(PyExc_ValueError, "no runtime function");
    return false;
  }
  return true;
}

static void* word(unsigned long long w) { return reinterpret_cast<void*>(static_cast<uintptr_t>(w)); }

// set_copy_source(fn, exec, node, dst, src, nbytes) -> int
static PyObject* set_copy_source(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  unsigned long long v[6];
  if (!as_words(args, nargs, 6, v, "set_copy_source(fn, exec, node, dst, src, nbytes)")) return nullptr;
  set_params_fn fn = reinterpret_cast<set_params_fn>(static_cast<uintptr_t>(v[0]));
  int result = fn(word(v[1]), word(v[2]), word(v[3]), word(v[4]), static_cast<size_t>(v[5]),
                  DEVICE_TO_DEVICE);
  return PyLong_FromLong(result);
}

// set_node_enabled(fn, exec, node, enabled) -> int
static PyObject* set_node_enabled(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  unsigned long long v[4];
  if (!as_words(args, nargs, 4, v, "set_node_enabled(fn, exec, node, enabled)")) return nullptr;
  set_enabled_fn fn = reinterpret_cast<set_enabled_fn>(static_cast<uintptr_t>(v[0]));
  int result = fn(word(v[1]), word(v[2]), static_cast<unsigned int>(v[3]));
  return PyLong_FromLong(result);
}

// A graph's launch on the current stream of its device, as CUDAGraph.replay() makes it for a
// graph that draws no random numbers (that replay first advances the generators' offsets), in
// one C call: the stream through the function PyTorch exports for Inductor's AOT C wrapper
// (aoti_torch_get_current_cuda_stream), the device switched for the launch where another is
// current, the GIL released while the runtime may block on a full launch queue.
//   launch_graph(launch, current_stream, get_device, set_device, exec, device) -> int
// The cudaError_t, or -1 where the current stream could not be read.
typedef int (*launch_fn)(void*, void*);              // cudaGraphLaunch(exec, stream)
typedef int (*current_stream_fn)(int32_t, void**);   // aoti_torch_get_current_cuda_stream
typedef int (*get_device_fn)(int*);                  // cudaGetDevice
typedef int (*set_device_fn)(int);                   // cudaSetDevice

static PyObject* launch_graph(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  unsigned long long v[6];
  if (!as_words(args, nargs, 6, v,
                "launch_graph(launch, current_stream, get_device, set_device, exec, device)")) {
    return nullptr;
  }
  launch_fn launch = reinterpret_cast<launch_fn>(static_cast<uintptr_t>(v[0]));
  current_stream_fn stream_of = reinterpret_cast<current_stream_fn>(static_cast<uintptr_t>(v[1]));
  get_device_fn get_device = reinterpret_cast<get_device_fn>(static_cast<uintptr_t>(v[2]));
  set_device_fn set_device = reinterpret_cast<set_device_fn>(static_cast<uintptr_t>(v[3]));
  int device = static_cast<int>(v[5]);
  void* stream = nullptr;
  if (stream_of(static_cast<int32_t>(device), &stream) != 0) return PyLong_FromLong(-1);
  int result, current = device;
  Py_BEGIN_ALLOW_THREADS
  if (get_device(&current) != 0) current = device;
  if (current != device) set_device(device);
  result = launch(word(v[4]), stream);
  if (current != device) set_device(current);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
  {"values_same", values_same, METH_O, "Does every dict still hold its recorded value?"},
  {"reads_nested_lists_and_getters", reads_nested_lists_and_getters, METH_NOARGS,
   "A marker: values_hold reads list items by index and calls host getters"},
  {"compare_by_value", compare_by_value, METH_O, "Compare values of these types by equality too."},
  {"settings_hold", settings_hold, METH_O, "Does every getter still return its recorded value?"},
  {"launch_graph", (PyCFunction)(void (*)(void))launch_graph, METH_FASTCALL,
   "Launch an instantiated graph on the current stream of its device; return the cudaError_t."},
  {"bind", bind, METH_O, "Set the address reader."},
  {"same", (PyCFunction)(void (*)(void))same, METH_FASTCALL, "All tensors at the addresses?"},
  {"unchanged", (PyCFunction)(void (*)(void))unchanged, METH_FASTCALL,
   "Modes, module entries and addresses all as recorded?"},
  {"set_copy_source", (PyCFunction)(void (*)(void))set_copy_source, METH_FASTCALL,
   "Point an instantiated graph's copy node at a source; return the cudaError_t."},
  {"set_node_enabled", (PyCFunction)(void (*)(void))set_node_enabled, METH_FASTCALL,
   "Switch an instantiated graph's node on or off; return the cudaError_t."},
  {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_before_replay", nullptr, -1, methods};

PyMODINIT_FUNC PyInit__before_replay(void) { return PyModule_Create(&module); }
