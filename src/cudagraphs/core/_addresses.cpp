// The address check the guard runs before every replay (see addresses.py): one C call over a
// tuple of tensors against a packed array of addresses (in `unchanged`, also the modules'
// train/eval modes). Built at install time (setup.py, an optional extension: without a compiler the pure fallbacks are used). It includes Python.h
// only: each address is read through the function pointer PyTorch exports for Inductor's C++
// wrapper, bound once at import.
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

// unchanged(tensors, addresses, owners: tuple, modes: tuple, now: bytearray, seen: bytearray)
// -> bool: the module-change counter `now` still equals `seen`, each owner's `training` is
// still the object recorded in `modes`, and every tensor is at its address. The whole guard
// in one C call: it runs before every replay.
static PyObject* training_name = nullptr;

static PyObject* unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3]) ||
      !PyByteArray_Check(args[4]) || !PyByteArray_Check(args[5])) {
    PyErr_SetString(PyExc_TypeError,
                    "unchanged(tensors, addresses, owners: tuple, modes: tuple, now: bytearray, "
                    "seen: bytearray)");
    return nullptr;
  }
  PyObject* now = args[4];
  PyObject* seen = args[5];
  if (PyByteArray_GET_SIZE(now) != PyByteArray_GET_SIZE(seen) ||
      std::memcmp(PyByteArray_AS_STRING(now), PyByteArray_AS_STRING(seen),
                  PyByteArray_GET_SIZE(now)) != 0) {
    Py_RETURN_FALSE;
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
  int result = at_addresses(args[0], args[1]);
  if (result < 0) return nullptr;
  return PyBool_FromLong(result);
}


// ---------------------------------------------------------------------------------------------
// Entry: the whole call of a graph of one positional tensor, in C (see replayer.py, which builds
// the same call as a Python closure where this extension is not built). Under the lock: the
// guard's check, the input's shape, dtype, device and address, the copy, the invalidation of the
// previous outputs, the replay, the counters and the outputs. Anything that does not fit goes
// to `fallback(args, kwargs)` (the general path) or to `explain(args)` (raises the precise
// error). With `guarded` = (live, kill, message, make_storage, storage_args, make_tensor, meta)
// the one guarded output is made here too (outputs.py holds the same steps in Python).

typedef struct {
  PyObject_HEAD
  PyObject* acquire;
  PyObject* release;
  PyObject* unchanged;  // or Py_None
  PyObject* fallback;
  PyObject* explain;
  PyObject* buf;
  PyObject* shape;
  PyObject* dtype;
  long device;
  uint64_t address;
  PyObject* stride;
  PyObject* copy;
  PyObject* invalidate;  // or Py_None
  PyObject* replay;
  PyObject* emit;
  PyObject* counters;
  // guarded single output, all NULL when not used
  PyObject* live;
  PyObject* kill;
  PyObject* message;
  PyObject* make_storage;
  PyObject* storage_args;
  PyObject* make_tensor;
  PyObject* meta;
} EntryObject;

static PyObject *s_shape, *s_dtype, *s_get_device, *s_stride, *s_replays, *s_copies, *s_cdata;

static int intern_names(void) {
  if (s_shape != nullptr) return 0;
  s_shape = PyUnicode_InternFromString("shape");
  s_dtype = PyUnicode_InternFromString("dtype");
  s_get_device = PyUnicode_InternFromString("get_device");
  s_stride = PyUnicode_InternFromString("stride");
  s_replays = PyUnicode_InternFromString("replays");
  s_copies = PyUnicode_InternFromString("copies");
  s_cdata = PyUnicode_InternFromString("_cdata");
  return (s_shape && s_dtype && s_get_device && s_stride && s_replays && s_copies && s_cdata) ? 0 : -1;
}

// 1: x matches the capture and sits at the buffer's address with its strides (no copy needed);
// 0: it matches and needs a copy; -1: it does not match (nothing raised yet).
static int check_input(EntryObject* self, PyObject* x) {
  PyObject* shape = PyObject_GetAttr(x, s_shape);
  if (shape == nullptr) { PyErr_Clear(); return -1; }
  int same = PyObject_RichCompareBool(shape, self->shape, Py_EQ);
  Py_DECREF(shape);
  if (same != 1) { PyErr_Clear(); return -1; }
  PyObject* dtype = PyObject_GetAttr(x, s_dtype);
  if (dtype == nullptr) { PyErr_Clear(); return -1; }
  same = dtype == self->dtype;
  Py_DECREF(dtype);
  if (!same) return -1;
  PyObject* device = PyObject_CallMethodNoArgs(x, s_get_device);
  if (device == nullptr) { PyErr_Clear(); return -1; }
  long index = PyLong_AsLong(device);
  Py_DECREF(device);
  if (index == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
  if (index != self->device) return -1;
  void* now;
  try {
    now = read_address(x);
  } catch (...) {
    return -1;  // no storage to point at, or a dead (stale) output: explain() says which
  }
  if (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(now)) != self->address) return 0;
  PyObject* stride = PyObject_CallMethodNoArgs(x, s_stride);
  if (stride == nullptr) { PyErr_Clear(); return -1; }
  same = PyObject_RichCompareBool(stride, self->stride, Py_EQ);
  Py_DECREF(stride);
  if (same < 0) { PyErr_Clear(); return -1; }
  return same == 1 ? 1 : 0;
}

static int bump(PyObject* counters, PyObject* name, long by) {
  PyObject* value = PyObject_GetAttr(counters, name);
  if (value == nullptr) return -1;
  PyObject* step = PyLong_FromLong(by);
  PyObject* sum = step ? PyNumber_Add(value, step) : nullptr;
  Py_DECREF(value);
  Py_XDECREF(step);
  if (sum == nullptr) return -1;
  int result = PyObject_SetAttr(counters, name, sum);
  Py_DECREF(sum);
  return result;
}

static int kill_live(EntryObject* self) {
  Py_ssize_t n = PyList_GET_SIZE(self->live);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* cdata = PyObject_GetAttr(PyList_GET_ITEM(self->live, i), s_cdata);
    if (cdata == nullptr) return -1;
    PyObject* done = PyObject_CallFunctionObjArgs(self->kill, cdata, self->message, nullptr);
    Py_DECREF(cdata);
    if (done == nullptr) return -1;
    Py_DECREF(done);
  }
  return n ? PyList_SetSlice(self->live, 0, n, nullptr) : 0;
}

static PyObject* guarded_output(EntryObject* self) {
  PyObject* storage = PyObject_Call(self->make_storage, self->storage_args, nullptr);
  if (storage == nullptr) return nullptr;
  if (PyList_Append(self->live, storage) < 0) { Py_DECREF(storage); return nullptr; }
  PyObject* out = PyObject_CallFunctionObjArgs(self->make_tensor, self->meta, storage, nullptr);
  Py_DECREF(storage);
  return out;
}

static PyObject* entry_body(EntryObject* self, PyObject* args, PyObject* kwargs) {
  if ((kwargs != nullptr && PyDict_GET_SIZE(kwargs) > 0) || PyTuple_GET_SIZE(args) != 1) {
    goto general;
  }
  if (self->unchanged != Py_None) {
    PyObject* ok = PyObject_CallNoArgs(self->unchanged);
    if (ok == nullptr) return nullptr;
    int fine = PyObject_IsTrue(ok);
    Py_DECREF(ok);
    if (fine < 0) return nullptr;
    if (!fine) goto general;
  }
  {
    PyObject* x = PyTuple_GET_ITEM(args, 0);
    long copied = 0;
    if (x != self->buf) {
      int state = check_input(self, x);
      if (state < 0) {
        PyObject* r = PyObject_CallOneArg(self->explain, args);  // raises the precise error
        Py_XDECREF(r);
        if (r != nullptr) PyErr_SetString(PyExc_AssertionError, "cudagraphs: the input check and its explanation disagree; please report");
        return nullptr;
      }
      if (state == 0) {
        PyObject* r = PyObject_CallOneArg(self->copy, x);
        if (r == nullptr) return nullptr;
        Py_DECREF(r);
        copied = 1;
      }
    }
    // The previous outputs are marked dead after the launch (Replayer._replay says why), and
    // also when the launch failed, keeping its exception.
    PyObject* r = PyObject_CallNoArgs(self->replay);
    PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
    if (r == nullptr) PyErr_Fetch(&type, &value, &trace);
    Py_XDECREF(r);
    int killed = 0;
    if (self->live != nullptr) {
      killed = kill_live(self);
    } else if (self->invalidate != Py_None) {
      PyObject* done = PyObject_CallNoArgs(self->invalidate);
      killed = done == nullptr ? -1 : 0;
      Py_XDECREF(done);
    }
    if (type != nullptr || value != nullptr) {
      if (killed < 0) {
        Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(trace);
        return nullptr;  // the marking's own error
      }
      PyErr_Restore(type, value, trace);
      return nullptr;
    }
    if (killed < 0) return nullptr;
    if (bump(self->counters, s_replays, 1) < 0 || (copied && bump(self->counters, s_copies, 1) < 0)) {
      return nullptr;
    }
    return self->live != nullptr ? guarded_output(self) : PyObject_CallNoArgs(self->emit);
  }
general:
  {
    PyObject* empty = nullptr;
    if (kwargs == nullptr) {
      empty = PyDict_New();
      if (empty == nullptr) return nullptr;
    }
    PyObject* r = PyObject_CallFunctionObjArgs(self->fallback, args, kwargs ? kwargs : empty, nullptr);
    Py_XDECREF(empty);
    return r;
  }
}

static PyObject* entry_call(PyObject* op, PyObject* args, PyObject* kwargs) {
  EntryObject* self = reinterpret_cast<EntryObject*>(op);
  PyObject* held = PyObject_CallNoArgs(self->acquire);
  if (held == nullptr) return nullptr;
  Py_DECREF(held);
  PyObject* result = entry_body(self, args, kwargs);
  // Release even when the call failed, keeping the call's exception.
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  PyObject* released = PyObject_CallNoArgs(self->release);
  if (released == nullptr) {
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(trace);
    Py_XDECREF(result);
    return nullptr;
  }
  Py_DECREF(released);
  PyErr_Restore(type, value, trace);
  return result;
}

static int entry_traverse(PyObject* op, visitproc visit, void* arg) {
  EntryObject* self = reinterpret_cast<EntryObject*>(op);
  Py_VISIT(self->acquire); Py_VISIT(self->release); Py_VISIT(self->unchanged);
  Py_VISIT(self->fallback); Py_VISIT(self->explain); Py_VISIT(self->buf); Py_VISIT(self->shape);
  Py_VISIT(self->dtype); Py_VISIT(self->stride); Py_VISIT(self->copy); Py_VISIT(self->invalidate);
  Py_VISIT(self->replay); Py_VISIT(self->emit); Py_VISIT(self->counters); Py_VISIT(self->live);
  Py_VISIT(self->kill); Py_VISIT(self->message); Py_VISIT(self->make_storage);
  Py_VISIT(self->storage_args); Py_VISIT(self->make_tensor); Py_VISIT(self->meta);
  return 0;
}

static int entry_clear(PyObject* op) {
  EntryObject* self = reinterpret_cast<EntryObject*>(op);
  Py_CLEAR(self->acquire); Py_CLEAR(self->release); Py_CLEAR(self->unchanged);
  Py_CLEAR(self->fallback); Py_CLEAR(self->explain); Py_CLEAR(self->buf); Py_CLEAR(self->shape);
  Py_CLEAR(self->dtype); Py_CLEAR(self->stride); Py_CLEAR(self->copy); Py_CLEAR(self->invalidate);
  Py_CLEAR(self->replay); Py_CLEAR(self->emit); Py_CLEAR(self->counters); Py_CLEAR(self->live);
  Py_CLEAR(self->kill); Py_CLEAR(self->message); Py_CLEAR(self->make_storage);
  Py_CLEAR(self->storage_args); Py_CLEAR(self->make_tensor); Py_CLEAR(self->meta);
  return 0;
}

static void entry_dealloc(PyObject* op) {
  PyObject_GC_UnTrack(op);
  entry_clear(op);
  Py_TYPE(op)->tp_free(op);
}

// Entry(acquire, release, unchanged, fallback, explain, buf, shape, dtype, device, address,
//       stride, copy, invalidate, replay, emit, counters, guarded)
static PyObject* entry_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (intern_names() < 0) return nullptr;
  if (read_address == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
    return nullptr;
  }
  PyObject *acquire, *release, *unchanged, *fallback, *explain, *buf, *shape, *dtype, *stride,
      *copy, *invalidate, *replay, *emit, *counters, *guarded;
  long device;
  unsigned long long address;
  static const char* names[] = {"acquire", "release", "unchanged", "fallback", "explain", "buf",
                                "shape", "dtype", "device", "address", "stride", "copy",
                                "invalidate", "replay", "emit", "counters", "guarded", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOlKOOOOOOO", const_cast<char**>(names),
                                   &acquire, &release, &unchanged, &fallback, &explain, &buf,
                                   &shape, &dtype, &device, &address, &stride, &copy, &invalidate,
                                   &replay, &emit, &counters, &guarded)) {
    return nullptr;
  }
  PyObject* parts[7] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (guarded != Py_None) {
    if (!PyTuple_Check(guarded) || PyTuple_GET_SIZE(guarded) != 7 ||
        !PyList_Check(PyTuple_GET_ITEM(guarded, 0)) || !PyTuple_Check(PyTuple_GET_ITEM(guarded, 4))) {
      PyErr_SetString(PyExc_TypeError,
                      "guarded: (live: list, kill, message, make_storage, storage_args: tuple, "
                      "make_tensor, meta) or None");
      return nullptr;
    }
    for (int i = 0; i < 7; ++i) parts[i] = PyTuple_GET_ITEM(guarded, i);
  }
  EntryObject* self = reinterpret_cast<EntryObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  PyObject** slots[] = {&self->acquire, &self->release, &self->unchanged, &self->fallback,
                        &self->explain, &self->buf, &self->shape, &self->dtype, &self->stride,
                        &self->copy, &self->invalidate, &self->replay, &self->emit,
                        &self->counters};
  PyObject* values[] = {acquire, release, unchanged, fallback, explain, buf, shape, dtype, stride,
                        copy, invalidate, replay, emit, counters};
  for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); ++i) {
    Py_INCREF(values[i]);
    *slots[i] = values[i];
  }
  PyObject** guarded_slots[] = {&self->live, &self->kill, &self->message, &self->make_storage,
                                &self->storage_args, &self->make_tensor, &self->meta};
  for (int i = 0; i < 7; ++i) {
    Py_XINCREF(parts[i]);
    *guarded_slots[i] = parts[i];
  }
  self->device = device;
  self->address = address;
  return reinterpret_cast<PyObject*>(self);
}

static PyTypeObject EntryType = {
  PyVarObject_HEAD_INIT(nullptr, 0)
};

static PyMethodDef methods[] = {
  {"bind", bind, METH_O, "Set the address reader."},
  {"same", (PyCFunction)(void (*)(void))same, METH_FASTCALL, "All tensors at the addresses?"},
  {"unchanged", (PyCFunction)(void (*)(void))unchanged, METH_FASTCALL,
   "Counter, modes and addresses all as recorded?"},
  {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_addresses", nullptr, -1, methods};

PyMODINIT_FUNC PyInit__addresses(void) {
  EntryType.tp_name = "cudagraphs.core._addresses.Entry";
  EntryType.tp_basicsize = sizeof(EntryObject);
  EntryType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  EntryType.tp_doc = "The one-tensor call of a captured graph, in C (see replayer.py).";
  EntryType.tp_new = entry_new;
  EntryType.tp_call = entry_call;
  EntryType.tp_traverse = entry_traverse;
  EntryType.tp_clear = entry_clear;
  EntryType.tp_dealloc = entry_dealloc;
  if (PyType_Ready(&EntryType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&EntryType);
  if (PyModule_AddObject(m, "Entry", reinterpret_cast<PyObject*>(&EntryType)) < 0) {
    Py_DECREF(&EntryType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
