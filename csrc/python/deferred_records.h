#pragma once
// A fused watch's deferred records and which of them counts a tensor written in place between its
// record and the flush that reads it (NOTE: [Deferred tensors changed in place] and the two after it):
// the rules that keep the producer's name what the default watch gives.
#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
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

// NOTE: [Deferred bytes that only the records keep alive]
// The bound on deferred tensors (NOTE: [Fused records]) is a bound on memory kept alive past its use.
// Most of a forward's records hold tensors that autograd saves for backward anyway (a Linear's input, a
// GELU's, a BatchNorm's output), and a tensor is recorded while its caller still holds it: keeping those
// costs nothing until backward lets them go. Counted by every deferred byte, the bound flushed (two
// launches on a GPU) memory autograd held anyway: ResNet-18 224x224's records were read in 9 calls a
// step. So once the deferred bytes reach the bound, each record adds up the
// storages that nothing but the records keeps alive, and flushes when that reaches the bound: now 4
// calls, and the d=256 transformer's 2 where they were 3 (benchmarks/results/watch-profile.md). A
// storage is the records' alone when every tensor on it is theirs and each of those has no reference
// besides theirs but its Python object's, where it has one: since pytorch/pytorch#167564 (late 2025;
// torch 2.14 has it) a tensor's Python object holds a reference for as long as C++ holds the tensor,
// whether or not Python code still uses the object, and a count cannot tell the two apart. So a tensor
// Python code keeps counts as the records' (flushed sooner: the rule errs toward reading early, never
// toward holding more); with an older torch, whose slot cannot say whether there is an object, one
// reference is allowed to every tensor, so one that autograd saved as itself (an op's input) counts as
// the records' too, and little is saved there. A view keeps its whole storage. What it gives up: memory
// between two records can pass the bound by what backward released in between (one module's saved
// tensors), and a record past the bound asks two reference counts of each deferred storage not yet known
// to be the records' alone (a few hundred at most). "Past the bound" is weighed by storages too: a small
// view recorded of a large tensor (a model's last token's logits, `logits[:, -1]`) keeps the whole of it
// alive, and a bound on the views' own bytes never looked at it. A view holds its base (autograd's view
// metadata), so the base counts as the records' where nothing else holds it either.

// The reference a tensor's Python object holds while C++ holds the tensor (see the NOTE above): 1 where
// it has one, 0 where it has none (a gradient made in backward, an op's intermediate); 1 where this
// torch's PyObjectSlot cannot say (an older torch: the allowance then errs toward reading early).
template <typename Slot>
auto python_object_references(const Slot* slot, int) -> decltype(slot->load_pyobj(), uint32_t{}) {
  return slot->load_pyobj() != nullptr ? 1 : 0;
}
template <typename Slot>
uint32_t python_object_references(const Slot*, long) {
  return 1;
}

// The deferred tensors' storages, each with the records' tensors on it and their references: kept as
// records come, so that a check asks only the reference counts (see the NOTE above).
class HeldStorages {
 public:
  // A deferred tensor, kept alive by its record as long as this.
  void add(const at::Tensor& t) {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    // unsafe_storage(): no throw for a tensor that refuses storage access; one without a storage to
    // ask about counts as held, by its elements
    const c10::Storage& storage = impl->unsafe_storage();
    if (!storage) {
      storageless_bytes_ += t.numel() * t.element_size();
      return;
    }
    const auto [at, added] = index_.try_emplace(storage.unsafeGetStorageImpl(), storages_.size());
    if (added) {
      storages_.push_back(Storage{storage, {}, 0});
      storage_bytes_ += static_cast<int64_t>(storage.nbytes());
    }
    Storage& held = storages_[at->second];
    alone_bytes_ -= std::exchange(held.alone_bytes, 0);  // held by the caller too now
    if (allow(held, impl) && t.is_view()) {
      // A view holds its base (autograd's view metadata, for any view made outside inference mode),
      // which nothing else may hold: a temporary the view was taken from.
      const at::TensorBase& base = t._base();
      if (base.defined() && base.unsafeGetTensorImpl()->unsafe_storage().is_alias_of(storage)) {
        allow(held, base.unsafeGetTensorImpl());
      }
    }
  }

  // The bytes of the storages the records' tensors are on (a view's whole storage), whoever else holds
  // them: at least alone_bytes().
  int64_t referenced_bytes() const {
    return storage_bytes_ + storageless_bytes_;
  }

  // The bytes of the storages that nothing but the records keeps alive. A storage found alone stays
  // so until a record adds it again (nothing else can take a reference to it but through them).
  int64_t alone_bytes() {
    for (Storage& held : storages_) {
      // The tensors on it that the records hold or their views' bases, and the reference this holds
      if (held.alone_bytes > 0 || held.storage.use_count() != held.tensors.size() + 1) {
        continue;
      }
      const bool alone = std::all_of(held.tensors.begin(), held.tensors.end(), [](const auto& tensor) {
        const c10::TensorImpl* impl = tensor.first;
        return c10::raw::intrusive_ptr::use_count(tensor.first) <=
            tensor.second + python_object_references(impl->pyobj_slot(), 0);
      });
      if (alone) {
        held.alone_bytes = std::max<int64_t>(static_cast<int64_t>(held.storage.nbytes()), 1);
        alone_bytes_ += held.alone_bytes;
      }
    }
    return alone_bytes_ + storageless_bytes_;
  }

 private:
  struct Storage {
    c10::Storage storage;  // held: a tensor's storage can be replaced (set_) while it waits
    // The tensors on it that the records hold, or that their views hold as their base, each with the
    // references those make to it (a base lives as long as its views: the pointer stays valid).
    std::vector<std::pair<c10::TensorImpl*, uint32_t>> tensors;
    int64_t alone_bytes;  // > 0: nothing but the records keeps it alive (its bytes then, at least 1)
  };

  // One more reference from the records' side to `impl`, on `held`; whether `impl` is new there.
  static bool allow(Storage& held, c10::TensorImpl* impl) {
    const auto ref = std::find_if(held.tensors.begin(), held.tensors.end(),
                                  [&](const auto& tensor) { return tensor.first == impl; });
    if (ref != held.tensors.end()) {
      ++ref->second;
      return false;
    }
    held.tensors.emplace_back(impl, 1);
    return true;
  }

  std::vector<Storage> storages_;
  std::unordered_map<const c10::StorageImpl*, size_t> index_;
  int64_t storage_bytes_ = 0;
  int64_t alone_bytes_ = 0;
  int64_t storageless_bytes_ = 0;
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
