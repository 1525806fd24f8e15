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
//
// NOTE: [Vanishing as a share]
// A module's gradient vanishes when it falls far below the other modules', not below its own past: a
// run that converges (a loss going to 1e-10) takes every gradient down together, 10x below its running
// median and further, and judged on its own each module's norm "vanished" there (a probe's healthy run
// warned so). So a vanishing series is judged on its share: its value over the median of the step's
// positive values of all vanishing series (the modules' gradient norms), against that share's running
// median. A layer cut off (dead units, a detached branch) drops its share; a converging run keeps the
// shares. Positive: a layer whose units all die zeroes the gradient of every module below it, often
// most of them, and a median of zeros would judge nothing.
// What it gives up: every module vanishing together (and a model of one module) is no module's alarm;
// a loss that stays high while the total gradient norm falls is what tells that.
// Nor is a share judged where the reference is below float32's smallest normal number: every value of
// that median module's gradient is then subnormal, and a module at 0 beside it has underflowed with the
// rest, not been cut off. A run that fits its batch exactly ("overfit one batch", a float32 loss of 0.0)
// takes every gradient there, 1e-41 and falling, its modules reaching 0 one after the other, and each
// "vanished" in turn (the watch suite's MLP, steps 51, 52 and 60 of a healthy run: session 49).
// bfloat16 has float32's range; a float16 gradient underflows far earlier, and is judged as before.
// A spike's excess over the median is also more than this many times the window's largest (see the
// rule in SpikeWindows::judge).
constexpr double kBeyondLargest = 2.0;

struct Series {
  std::deque<double> recent;    // the last `window` finite values, oldest first
  std::vector<double> ordered;  // the same values, sorted
  bool vanishing = false;       // judged for vanishing on its share (not for spikes on its value)
  int64_t low = 0;              // checked steps in a row below median / factor
  bool alarmed_up = false;      // in an excursion above the threshold: no new alarm until it is back
  bool alarmed_down = false;
};

// An alarm that fired: (position in ids, "up" or "down", the running median, the value judged: a
// vanishing series' share, as NOTE: [Vanishing as a share] computes it, else the value itself).
using Alarm = std::tuple<int64_t, std::string, double, double>;

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

  // A new series; returns its id (0, 1, ...). `vanishing`: a module's gradient norm judged for vanishing
  // (see NOTE: [Vanishing as a share]); otherwise a series judged for spikes.
  int64_t add(bool vanishing) {
    series_.emplace_back();
    series_.back().vanishing = vanishing;
    return static_cast<int64_t>(series_.size()) - 1;
  }

  // Judges one healthy step: values[i] of series ids[i] (a vanishing series': its share of the median of
  // the step's positive vanishing values), against each window as it was before the value joins it (a
  // non-finite value is judged by nothing and joins nothing). Returns the alarms that fire, in input
  // order.
  std::vector<Alarm> observe(const std::vector<int64_t>& ids, const std::vector<double>& values) {
    TORCH_CHECK(ids.size() == values.size(), "nanfast._C.SpikeWindows.observe: ", ids.size(), " ids for ",
                values.size(), " values");
    std::vector<double> vanishing_values;
    for (size_t i = 0; i < ids.size(); ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < static_cast<int64_t>(series_.size()), "nanfast._C.SpikeWindows.observe: ids[",
                  i, "]=", ids[i], " is not a series (", series_.size(), " added)");
      if (series_[ids[i]].vanishing && std::isfinite(values[i]) && values[i] > 0) {
        vanishing_values.push_back(values[i]);
      }
    }
    // NaN without any, and below float32's normal range (see the NOTE): no share is judged.
    double reference = median_of(vanishing_values);
    if (reference < std::numeric_limits<float>::min()) {
      reference = std::numeric_limits<double>::quiet_NaN();
    }
    std::vector<Alarm> fired;
    for (size_t i = 0; i < ids.size(); ++i) {
      Series& s = series_[ids[i]];
      const double x = s.vanishing ? (reference > 0 ? values[i] / reference : std::numeric_limits<double>::quiet_NaN())
                                   : values[i];
      const bool finite = std::isfinite(x);
      const auto [above, below, median] = judge(s, x, finite);
      s.low = below ? s.low + 1 : 0;
      alarm(s.alarmed_up, above && !s.vanishing, finite, i, "up", median, x, fired);
      alarm(s.alarmed_down, s.vanishing && s.low >= vanishing_steps_, finite, i, "down", median, x, fired);
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
      // And beyond twice the window's largest excess over its median: a converged classifier's loss is
      // ~0.01 with a batch holding a hard or mislabelled example at 0.3 now and then (26x its median),
      // which fired 62 times in 564 healthy steps; a blow-up leaves its window's own tail far behind.
      above = spread > 0 && x - median > (factor_ - 1) * spread && x - median > kBeyondLargest * (o.back() - median);
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

  // The median of `values` (sorted in place), as a window's: the mean of the two middle ones when even.
  static double median_of(std::vector<double>& values) {
    if (values.empty()) {
      return std::numeric_limits<double>::quiet_NaN();
    }
    std::sort(values.begin(), values.end());
    const size_t n = values.size();
    return (values[(n - 1) / 2] + values[n / 2]) / 2;
  }

  // One alarm per excursion: fires when crossed and not already in alarm; re-armed by a finite value
  // back within the threshold.
  static void alarm(bool& alarmed, bool crossed, bool finite, size_t position, const char* direction, double median,
                    double judged, std::vector<Alarm>& fired) {
    if (!crossed) {
      alarmed = alarmed && !finite;
    } else if (!alarmed) {
      alarmed = true;
      fired.emplace_back(static_cast<int64_t>(position), direction, median, judged);
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
      .def("add", &SpikeWindows::add,
           "A new series (vanishing: a module's gradient norm judged for vanishing, on its share of the "
           "step's median; otherwise judged for spikes); returns its id.",
           py::arg("vanishing"))
      .def("observe", &SpikeWindows::observe,
           "Judges one healthy step's values of the series `ids`; returns the alarms that fire, (position, "
           "'up' or 'down', running median, the value judged: a vanishing series' share).",
           py::arg("ids"), py::arg("values"))
      .def("__len__", &SpikeWindows::size);
}

}  // namespace nanfast::python
