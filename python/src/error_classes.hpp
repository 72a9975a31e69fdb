#pragma once
// The Python classes of tileattn's refusals, for both extensions' exception translators.
#include <Python.h>

namespace tileattn::python {

// tileattn.errors' class `name`, a subclass of `fallback` and of RuntimeError (flash-attn's and
// SDPA's checks raise RuntimeError); `fallback` itself where that module does not import. A
// borrowed reference: the module keeps the class alive.
inline PyObject* error_class(const char* name, PyObject* fallback) {
  PyObject* module = PyImport_ImportModule("tileattn.errors");
  PyObject* cls = module != nullptr ? PyObject_GetAttrString(module, name) : nullptr;
  Py_XDECREF(module);
  if (cls == nullptr) {
    PyErr_Clear();
    return fallback;
  }
  Py_DECREF(cls);
  return cls;
}

}  // namespace tileattn::python
