#pragma once
// The dtypes the kernels read: one list, used by the input checks and by every backend.

#include <algorithm>
#include <cstddef>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

// NOTE: [The dtypes nanfast reads]
// NANFAST_FOR_EACH_FLOATING_DTYPE and NANFAST_FOR_EACH_FINITE_DTYPE call _(Name) for each
// c10::ScalarType::Name the kernels read (complex tensors arrive as their real view): the first list
// holds the dtypes whose values can be NaN or infinite, the second those whose values are all finite
// (integers, bool, and float4_e2m1fn_x2, which has no NaN or infinity). describe_inputs() accepts
// exactly these, any_nonfinite reads only the first list, and visit_dtype() gives every backend the
// C++ type of each: a dtype added here is checked, dispatched and compiled everywhere. (The MX dtypes,
// float8_e8m0fnu and float4_e2m1fn_x2, are in every torch nanfast supports: 2.8 and later.)

#define NANFAST_FOR_EACH_FLOATING_DTYPE(_) \
  _(Double)                                \
  _(Float)                                 \
  _(Half)                                  \
  _(BFloat16)                              \
  _(Float8_e5m2)                           \
  _(Float8_e4m3fn)                         \
  _(Float8_e5m2fnuz)                       \
  _(Float8_e4m3fnuz)                       \
  _(Float8_e8m0fnu)

#define NANFAST_FOR_EACH_FINITE_DTYPE(_) \
  _(Byte)                                \
  _(Char)                                \
  _(Short)                               \
  _(Int)                                 \
  _(Long)                                \
  _(UInt16)                              \
  _(UInt32)                              \
  _(UInt64)                              \
  _(Bool)                                \
  _(Float4_e2m1fn_x2)

#define NANFAST_FOR_EACH_DTYPE(_)    \
  NANFAST_FOR_EACH_FLOATING_DTYPE(_) \
  NANFAST_FOR_EACH_FINITE_DTYPE(_)

namespace nanfast {

#define NANFAST_DTYPE_ENTRY(name) c10::ScalarType::name,
inline constexpr c10::ScalarType kFloatingDtypes[] = {NANFAST_FOR_EACH_FLOATING_DTYPE(NANFAST_DTYPE_ENTRY)};
inline constexpr c10::ScalarType kFiniteDtypes[] = {NANFAST_FOR_EACH_FINITE_DTYPE(NANFAST_DTYPE_ENTRY)};
#undef NANFAST_DTYPE_ENTRY

template <size_t N>
bool listed(const c10::ScalarType (&list)[N], c10::ScalarType dtype) {
  return std::find(list, list + N, dtype) != list + N;
}

// true for the dtypes that can hold NaN or infinity (NANFAST_FOR_EACH_FLOATING_DTYPE).
inline bool can_be_nonfinite(c10::ScalarType dtype) {
  return listed(kFloatingDtypes, dtype);
}

// true for the dtypes of NANFAST_FOR_EACH_DTYPE.
inline bool supported_dtype(c10::ScalarType dtype) {
  return can_be_nonfinite(dtype) || listed(kFiniteDtypes, dtype);
}

// Names a C++ type for the functions that visit_dtype() calls.
template <typename T>
struct DtypeTag {
  using type = T;
};

#define NANFAST_DTYPE_CASE(name) \
  case c10::ScalarType::name:    \
    return fn(DtypeTag<c10::impl::ScalarTypeToCPPTypeT<c10::ScalarType::name>>{});
#define NANFAST_FINITE_DTYPE_CASE(name)                                                 \
  case c10::ScalarType::name:                                                           \
    if constexpr (!kFloatingOnly) {                                                     \
      return fn(DtypeTag<c10::impl::ScalarTypeToCPPTypeT<c10::ScalarType::name>>{}); \
    }                                                                                   \
    break;

// Returns fn(DtypeTag<T>{}) with T the C++ type of `dtype`, one of NANFAST_FOR_EACH_DTYPE (describe_inputs()
// has checked it); with kFloatingOnly, one of NANFAST_FOR_EACH_FLOATING_DTYPE, and fn is instantiated for
// those only (any_nonfinite reads no other).
template <bool kFloatingOnly = false, typename Fn>
decltype(auto) visit_dtype(c10::ScalarType dtype, const Fn& fn) {
  switch (dtype) {
    NANFAST_FOR_EACH_FLOATING_DTYPE(NANFAST_DTYPE_CASE)
    NANFAST_FOR_EACH_FINITE_DTYPE(NANFAST_FINITE_DTYPE_CASE)
    default:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "nanfast: dtype ", dtype, " is not one visit_dtype reads");
}

#undef NANFAST_FINITE_DTYPE_CASE
#undef NANFAST_DTYPE_CASE

}  // namespace nanfast
