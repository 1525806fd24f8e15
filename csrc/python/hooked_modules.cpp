// nanfast._C.module_pre_hook and nanfast._C.module_hook: the hooks nanfast.watch puts on the modules it
// watches, functions of this extension that run without a Python frame (see NOTE: [Module hooks
// without a Python frame]), and the table of the modules they act for.
#include <algorithm>
#include <chrono>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/util/SmallVector.h>

#include "module_hooks.h"

namespace nanfast::python {
namespace {

// NOTE: [Module hooks without a Python frame]
// Each hooked module call ran two Python hooks, each three frames deep before it reached C++ (the
// hook that acts for its own module only, NOTE: [Copies of a watched model]; the function with the
// is_compiling() guard; is_compiling() itself), right after the module's kernels had evicted the
// interpreter's caches. So the hooks on the modules are two functions of this extension, the same for
// every module and every watch, which look the calling module up in a table: the watches that hook it,
// in the order they did, each with its ModuleHooks and the module's site. A module not in the table
// does nothing: a copy of a watched module (deep or shallow, it carries the hooks it was copied with),
// a module whose watches were removed. The table holds no module alive (a weak reference each, whose
// callback takes the module out when it is freed, so a module made later at its address is not taken
// for it), and each module carries one pair of these hooks whatever the number of watches on it.
// torch.compile, tracing a hooked call, traces a Python stand-in that does nothing instead
// (torch.compiler.substitute_in_graph, nanfast/watcher/owned_hook.py), as it did the guarded Python
// hook; an export that traces without Dynamo runs the hooks, which then read torch.compiler's flag.
// Measured against the same watch with the Python hooks put back (one process, interleaved steps,
// medians of per-repeat ratios, 2-vCPU AMD EPYC, 2 threads): the watch suite's small transformer
// -0.55% of its step (-0.91..-0.17%, 300 repeats), the MLP -0.71% (-1.06..-0.25%, 400 repeats). Each
// watch was on its own copy of the model, and two copies differ by as much (NOTE: [The run's own
// null] in nanfast/cli/bench_watch.py); tree against tree, in alternating processes, the MLP's
// overhead fell by a median 1.4 points, the others' within their spread.
struct Watcher {
  py::object hooks;  // holds *impl alive
  ModuleHooks* impl;
  py::object site;  // holds *site_impl alive
  Site* site_impl;
  bool checks_output;
};

struct Hooked {
  py::object weak;  // the module, held weakly: its callback takes the entry out
  std::vector<Watcher> watchers;
};

// Never freed: the Python objects it holds must not be released after the interpreter is gone.
std::unordered_map<PyObject*, Hooked>& table() {
  static auto* hooked = new std::unordered_map<PyObject*, Hooked>();
  return *hooked;
}

// torch.compiler.is_compiling(), read from its flag where torch has one (no Python call).
bool compiling() {
  static PyObject* compiler = py::module_::import("torch.compiler").release().ptr();
  static PyObject* name = PyUnicode_InternFromString("_is_compiling_flag");
  static const bool has_flag = PyObject_HasAttr(compiler, name);
  if (has_flag) {
    const py::object flag = py::reinterpret_steal<py::object>(PyObject_GetAttr(compiler, name));
    if (!flag) {
      throw py::error_already_set();  // (the flag deleted since: never left pending for a later call)
    }
    return flag.ptr() == Py_True;
  }
  return py::handle(compiler).attr("is_compiling")().cast<bool>();
}

// Calls fn(watcher) for each watch hooking `module`, timed where that watch is profiled.
template <typename Fn>
void for_each_watcher(py::handle module, const Fn& fn) {
  const auto it = table().find(module.ptr());
  if (it == table().end() || compiling()) {
    return;
  }
  // A copy: a hook may call into Python (an evaluation read at once), which may hook or unhook modules.
  const c10::SmallVector<Watcher, 2> watchers(it->second.watchers.begin(), it->second.watchers.end());
  for (const Watcher& w : watchers) {
    if (!w.impl->profiled) {
      fn(w);
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    fn(w);
    w.impl->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
}

void module_pre_hook(py::handle module, py::handle args) {
  for_each_watcher(module, [&](const Watcher& w) { w.impl->before_module(w.site, *w.site_impl, args); });
}

void module_hook(py::handle module, py::handle /*args*/, py::handle output) {
  for_each_watcher(module, [&](const Watcher& w) {
    if (w.checks_output) {
      w.impl->after_module(w.site, *w.site_impl, output);
    }
  });
}

// Adds a watch's hooks of `module` to the table (the caller puts this file's two hooks on a module not
// in it yet).
void hook_module(py::handle module, py::object hooks, py::object site, bool checks_output) {
  auto it = table().find(module.ptr());
  if (it == table().end()) {
    PyObject* key = module.ptr();
    const py::cpp_function forget([key](py::handle /*weak*/) { table().erase(key); });
    it = table().emplace(key, Hooked{py::weakref(module, forget), {}}).first;
  }
  ModuleHooks* impl = hooks.cast<ModuleHooks*>();
  Site* site_impl = site.cast<Site*>();
  it->second.watchers.push_back(Watcher{std::move(hooks), impl, std::move(site), site_impl, checks_output});
}

// Takes a watch's hooks of `module` out of the table; true if no watch hooks it any more (the caller
// then takes this file's hooks off it).
bool unhook_module(py::handle module, py::handle hooks) {
  const auto it = table().find(module.ptr());
  if (it == table().end()) {
    return true;
  }
  auto& watchers = it->second.watchers;
  watchers.erase(std::remove_if(watchers.begin(), watchers.end(), [&](const Watcher& w) { return w.hooks.is(hooks); }),
                 watchers.end());
  if (!watchers.empty()) {
    return false;
  }
  table().erase(it);  // its weak reference goes with it, before the module: no callback
  return true;
}

bool module_hooked(py::handle module) {
  return table().count(module.ptr()) > 0;
}

}  // namespace

void bind_hooked_modules(py::module_& m) {
  m.def("module_pre_hook", &module_pre_hook,
        "The forward pre-hook nanfast.watch puts on a module (NOTE: [Module hooks without a Python frame]).",
        py::arg("module"), py::arg("args"));
  m.def("module_hook", &module_hook,
        "The forward hook nanfast.watch puts on a module (NOTE: [Module hooks without a Python frame]).",
        py::arg("module"), py::arg("args"), py::arg("output"));
  m.def("hook_module", &hook_module,
        "Adds a watch's ModuleHooks and site for `module` to the table of watched modules.", py::arg("module"),
        py::arg("hooks"), py::arg("site"), py::arg("checks_output"));
  m.def("unhook_module", &unhook_module,
        "Takes a watch's hooks of `module` out; True if no watch hooks it any more.", py::arg("module"),
        py::arg("hooks"));
  m.def("module_hooked", &module_hooked, "Whether a watch hooks `module`.", py::arg("module"));
}

}  // namespace nanfast::python
