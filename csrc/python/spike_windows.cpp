// nanfast._C.SpikeWindows: the running windows of the watch's spike alarms (the rule: NOTE: [Spikes] in
// nanfast/watcher/spikes.py), every series of a step judged in one call.
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"

namespace nanfast::python {
namespace {

// NOTE: [Spike windows in C++]
// A healthy step's spike judgement walks every series: each loss, the total gradient norm, each
// module's gradient norm (about a hundred on a 12-layer transformer). In Python that cost about 3 us a
// series at the step's end, where every line pays cold caches (56 us a step on the watch suite's small
// transformer); here one call judges them all and hands back only the alarms that fire, which Python
// describes. Each series keeps its last `window` finite values twice: in arrival order, and sorted
// (median and quartiles by index; an update is one erase and one insert into a vector of at most
// `window` doubles).
struct Series {
  std::deque<double> recent;    // the last `window` finite values, oldest first
  std::vector<double> ordered;  // the same values, sorted
  bool can_vanish = false;      // a module's gradient norm: also alarms when it stays low
  int64_t low = 0;              // checked steps in a row below median / factor
  bool alarmed_up = false;      // in an excursion above the threshold: no new alarm until it is back
  bool alarmed_down = false;
};

class SpikeWindows {
 public:
  SpikeWindows(int64_t window, double factor, int64_t warmup, int64_t vanishing_steps)
      : window_(window), factor_(factor), warmup_(warmup), vanishing_steps_(vanishing_steps) {
    TORCH_CHECK(window >= 1 && warmup >= 1 && warmup <= window && vanishing_steps >= 1,
                "nanfast._C.SpikeWindows: window, warmup and vanishing_steps must be >= 1 and warmup <= window, got ",
                window, ", ", warmup, ", ", vanishing_steps);
    TORCH_CHECK(std::isfinite(factor) && factor > 1, "nanfast._C.SpikeWindows: factor must be finite and > 1, got ",
                factor);
  }

  // A new series; returns its id (0, 1, ...).
  int64_t add(bool can_vanish) {
    series_.emplace_back();
    series_.back().can_vanish = can_vanish;
    return static_cast<int64_t>(series_.size()) - 1;
  }

  // Judges one healthy step: values[i] of series ids[i], against each window as it was before the value
  // joins it (a non-finite value is judged by nothing and joins nothing). Returns the alarms that fire,
  // (position in ids, "up" or "down", the running median), in input order.
  std::vector<std::tuple<int64_t, std::string, double>> observe(const std::vector<int64_t>& ids,
                                                                const std::vector<double>& values) {
    TORCH_CHECK(ids.size() == values.size(), "nanfast._C.SpikeWindows.observe: ", ids.size(), " ids for ",
                values.size(), " values");
    std::vector<std::tuple<int64_t, std::string, double>> fired;
    for (size_t i = 0; i < ids.size(); ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < static_cast<int64_t>(series_.size()), "nanfast._C.SpikeWindows.observe: ids[",
                  i, "]=", ids[i], " is not a series (", series_.size(), " added)");
      Series& s = series_[ids[i]];
      const double x = values[i];
      const bool finite = std::isfinite(x);
      const auto [above, below, median] = judge(s, x, finite);
      s.low = below ? s.low + 1 : 0;
      const bool vanished = s.can_vanish && s.low >= vanishing_steps_;
      alarm(s.alarmed_up, above, finite, i, "up", median, fired);
      alarm(s.alarmed_down, vanished, finite, i, "down", median, fired);
    }
    return fired;
  }

  int64_t size() const {
    return static_cast<int64_t>(series_.size());
  }

 private:
  // (x above the threshold, x below median / factor, the median) against the window before x joins it
  // (if finite).
  std::tuple<bool, bool, double> judge(Series& s, double x, bool finite) const {
    std::vector<double>& o = s.ordered;
    const size_t n = o.size();
    const double median = n ? (o[(n - 1) / 2] + o[n / 2]) / 2 : std::numeric_limits<double>::quiet_NaN();
    bool above = false;
    bool below = false;
    if (!finite) {
      return {above, below, median};
    }
    if (static_cast<int64_t>(n) >= warmup_) {
      // 1.5 interquartile ranges: about 2 median absolute deviations for symmetric noise. A window
      // mostly exactly 0 (a hinge loss, an expert rarely routed to) has neither: its largest |value|
      // sets the scale, and a window all 0 has none, so nothing above it is judged a spike.
      double spread = std::max(std::abs(median), 1.5 * (o[(3 * n) / 4] - o[n / 4]));
      if (spread == 0) {
        spread = std::max(std::abs(o.front()), std::abs(o.back()));
      }
      above = spread > 0 && x - median > (factor_ - 1) * spread;
      below = median > 0 && x < median / factor_;
    }
    if (static_cast<int64_t>(s.recent.size()) == window_) {
      o.erase(std::lower_bound(o.begin(), o.end(), s.recent.front()));
      s.recent.pop_front();
    }
    s.recent.push_back(x);
    o.insert(std::upper_bound(o.begin(), o.end(), x), x);
    return {above, below, median};
  }

  // One alarm per excursion: fires when crossed and not already in alarm; re-armed by a finite value
  // back within the threshold.
  static void alarm(bool& alarmed, bool crossed, bool finite, size_t position, const char* direction, double median,
                    std::vector<std::tuple<int64_t, std::string, double>>& fired) {
    if (!crossed) {
      alarmed = alarmed && !finite;
    } else if (!alarmed) {
      alarmed = true;
      fired.emplace_back(static_cast<int64_t>(position), direction, median);
    }
  }

  int64_t window_;
  double factor_;
  int64_t warmup_;
  int64_t vanishing_steps_;
  std::vector<Series> series_;
};

}  // namespace

void bind_spike_windows(py::module_& m) {
  py::class_<SpikeWindows>(m, "SpikeWindows",
                           "The running windows of the watch's spike alarms (see NOTE: [Spike windows in C++]).")
      .def(py::init<int64_t, double, int64_t, int64_t>(), py::arg("window"), py::arg("factor"), py::arg("warmup"),
           py::arg("vanishing_steps"))
      .def("add", &SpikeWindows::add, "A new series (can_vanish: a module's gradient norm); returns its id.",
           py::arg("can_vanish"))
      .def("observe", &SpikeWindows::observe,
           "Judges one healthy step's values of the series `ids`; returns the alarms that fire, (position, "
           "'up' or 'down', running median).",
           py::arg("ids"), py::arg("values"))
      .def("__len__", &SpikeWindows::size);
}

}  // namespace nanfast::python
