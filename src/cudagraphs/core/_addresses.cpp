// The address check the guard runs before every replay (see addresses.py): one C call over a
// tuple of tensors against a packed array of addresses. Built at install time (setup.py, an
// optional extension: without a compiler the pure fallbacks are used). It includes Python.h
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

// same(tensors: tuple, addresses: bytes of uint64) -> bool
static PyObject* same(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[0]) || !PyBytes_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "same(tensors: tuple, addresses: bytes)");
    return nullptr;
  }
  if (read_address == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
    return nullptr;
  }
  PyObject* tensors = args[0];
  Py_ssize_t n = PyTuple_GET_SIZE(tensors);
  if (PyBytes_GET_SIZE(args[1]) != n * (Py_ssize_t)sizeof(uint64_t)) {
    PyErr_SetString(PyExc_ValueError, "one 8-byte address per tensor expected");
    return nullptr;
  }
  const char* expected = PyBytes_AS_STRING(args[1]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    void* now;
    try {
      now = read_address(PyTuple_GET_ITEM(tensors, i));
    } catch (...) {
      Py_RETURN_FALSE;
    }
    uint64_t want;
    std::memcpy(&want, expected + i * sizeof(uint64_t), sizeof(uint64_t));
    if (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(now)) != want) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
  {"bind", bind, METH_O, "Set the address reader."},
  {"same", (PyCFunction)(void (*)(void))same, METH_FASTCALL, "All tensors at the addresses?"},
  {nullptr, nullptr, 0, nullptr},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_addresses", nullptr, -1, methods};

PyMODINIT_FUNC PyInit__addresses(void) { return PyModule_Create(&module); }
