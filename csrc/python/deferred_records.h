#pragma once
// A fused watch's deferred records and which of them counts a tensor written in place between its
// record and the flush that reads it (NOTE: [Deferred tensors changed in place] and the two after it):
// the rules that keep the producer's name what the default watch gives.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace nanfast::python {

// NOTE: [Deferred tensors changed in place]
// A deferred record is read at the flush, as its tensors are then. An in-place op in between that
// wrote NaN or inf into one (a module's `x.mul_(...)` or `x[:, 0].fill_(...)` on the output it was
// given, returned as its own; an input buffer refilled with copy_ for the next microbatch) made the
// earlier record count what the later op wrote: the fused watch named the module before as the
// producer, or the first microbatch for the second's dirty batch (a probe, session 42). A record keeps
// its tensors' versions; at the flush, a tensor changed since its record that a later record of the
// flush holds at its current version counts there only: its row in the earlier record is zeroed. One
// changed with no later record keeps its NaN and +inf (a Conv2d's or a BatchNorm's output, which an
// unhooked ReLU(inplace=True) rewrites: that record is the only one, and ReLU keeps NaN and +inf: a
// probe, session 54, saw AlexNet's overflowing first conv named as the second when they were dropped),
// but not its -inf, nor its headroom: -inf is what code writes on purpose into a module's output after
// it returned (attention scores `masked_fill_(pad, -inf)`, a policy's illegal actions' logits), and the
// fused watch blamed the healthy module for it on every step (a probe, session 53); a module's own -inf
// rewritten by a ReLU is 0 anyway. A -inf the module did make, rewritten in place otherwise, is named
// where it reaches the next check, or not at all where something absorbs it (a softmax). Left as it
// was: +inf written on purpose (a distance matrix's `fill_diagonal_(inf)` before its min) is blamed on
// the module (`ignore=` names it), and a value a later op made finite is not seen (what a fused watch
// gives up).
//
// NOTE: [Non-finite values an in-place activation keeps]
// A hooked activation of torch's that writes in place (torchvision mobilenet_v3's
// `Hardswish(inplace=True)` after each BatchNorm, DCGAN's `LeakyReLU(0.2, inplace=True)`) returns the
// tensor the module before it recorded, one version later. By the rule above that record's counts went
// to the activation's: a NaN the BatchNorm made was named at the activation, where the default watch
// names the BatchNorm (a probe, session 54). These activations make no NaN or inf from finite values
// (only from -inf: Hardswish and Mish give NaN), so where the later record is such an activation's and
// its write is the only one since the earlier record (one version on), the earlier record keeps its
// counts: both count the value, the earlier first, as the default watch does. Any other write in
// between (the parent's `y[0] = nan` before the activation) leaves the rule above: the activation is
// named, as by the default watch, which saw the earlier output clean.
//
// NOTE: [A child's output a module changes in place and returns]
// torchvision's ResNet blocks end `out = self.bn2(...); out += identity; out = self.relu(out)` (an
// in-place ReLU) and return `out`: the block's record holds bn2's output, changed in place since bn2's
// record. By the first rule a NaN bn2 made was named at the block (`output of layer1.0 (BasicBlock)`),
// where the default watch names bn2 (a probe, session 55). A record made inside the call of the module
// whose record, the very next one, holds the tensor (a child's output the module's own code wrote into)
// is treated as one with no later record: it keeps its NaN and +inf (a residual add and an in-place
// activation keep them) but not its -inf. Only the very next: where other records come in between (a
// downsampling block's `identity = self.downsample(x)` runs after bn2), what the add brings in may be
// theirs, and a NaN weight of the downsampling convolution was named at bn2 (ResNet-50's layer1.0.bn3,
// the same probe); there the rule above stands (the block is named for bn2's own NaN, the convolution
// for its). What it gives up: a NaN or +inf that the module's own in-place op makes there (an
// overflowing residual add in float16, `h.log_()` before `return h`) is named at the child, as it is
// where the module returns another tensor (the rule above). With its ReLU hooked
// (`pass_through=()`) the block returns the ReLU's record unchanged, which holds the tensor two writes
// after bn2's (the add and the ReLU's): the ReLU's second call is named there.
inline int64_t version_of(const at::Tensor& t) {
  return t.is_inference() ? -1 : static_cast<int64_t>(t._version());  // an inference tensor keeps none
}

// A record whose tensors wait for the next flush: its entry's index, its tensors (owned), their
// versions when recorded (see NOTE: [Deferred tensors changed in place]) and whether an in-place
// activation made it (NOTE: [Non-finite values an in-place activation keeps]).
struct Deferred {
  size_t entry;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> versions;
  bool kept_in_place = false;
  // The number of entries when the call of the module that made it began (-1: not a module's output);
  // the entries from there on were made inside that call (NOTE: [A child's output a module changes in
  // place and returns]).
  int64_t call_began = -1;
};

// Which counts the deferred records (in execution order) keep of the tensors changed in place since their
// record (see the NOTEs above): calls zero(entry, k, from) for row `k` of the record at entry `entry` to
// count nothing from column `from` on (0: nothing at all; 2: no -inf). Once their entries are filled.
template <typename Zero>
void zero_rewritten_rows(const std::vector<Deferred>& deferred, const Zero& zero) {
  const auto changed = [](const Deferred& d) {
    for (size_t k = 0; k < d.tensors.size(); ++k) {
      if (d.versions[k] != version_of(d.tensors[k])) {
        return true;
      }
    }
    return false;
  };
  if (std::none_of(deferred.begin(), deferred.end(), changed)) {
    return;  // the usual flush: nothing written in place since its record, no list to build
  }
  struct Held {
    const c10::TensorImpl* tensor;
    int64_t version;
    const Deferred* record;  // the later record that holds it
  };
  std::vector<Held> later;  // the tensors of the records after, as recorded, the nearest last
  for (auto d = deferred.rbegin(); d != deferred.rend(); ++d) {
    for (size_t k = 0; k < d->tensors.size(); ++k) {
      const at::Tensor& t = d->tensors[k];
      const int64_t now = version_of(t);
      if (d->versions[k] == now) {
        continue;
      }
      // Counted where a later record holds it as it is; else its -inf may be a later op's.
      const auto holder = std::find_if(later.rbegin(), later.rend(), [&](const Held& h) {
        return h.tensor == t.unsafeGetTensorImpl() && h.version == now;
      });
      // Made inside the call of the module whose record, the next one, holds it as it is.
      const Deferred* by = holder == later.rend() ? nullptr : holder->record;
      const bool inside_holder = by != nullptr && by->entry == d->entry + 1 && by->call_began >= 0 &&
          by->call_began <= static_cast<int64_t>(d->entry);
      if (by == nullptr || inside_holder) {
        zero(d->entry, static_cast<int64_t>(k), 2);
      } else if (!(by->kept_in_place && now == d->versions[k] + 1)) {
        zero(d->entry, static_cast<int64_t>(k), 0);
      }  // else only an in-place activation wrote it since: both records count it
    }
    for (size_t k = 0; k < d->tensors.size(); ++k) {
      later.push_back(Held{d->tensors[k].unsafeGetTensorImpl(), d->versions[k], &*d});
    }
  }
}

}  // namespace nanfast::python
