// The kernels a Python thread calls let go of the GIL while they run, as torch's own operators
// do: the server runs the engine's steps on a thread (engine/async_engine.py), and a step held
// in one C++ call (decode_layers.cpp) would otherwise stop the event loop for the whole step.
#include <Python.h>

namespace {

// Releases the GIL for its lifetime when this thread holds it (a call from Python); a kernel
// called by another kernel here finds it released already and leaves it so.
struct WithoutGil {
  PyThreadState* state = PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  WithoutGil() = default;
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;
  ~WithoutGil() {
    if (state != nullptr) PyEval_RestoreThread(state);
  }
};

}  // namespace
