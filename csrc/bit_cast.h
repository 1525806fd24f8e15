#pragma once
// nanfast::bit_cast: std::bit_cast for C++17. torch 2.11 builds extensions as C++17 (2.14 as C++20),
// where <bit> has no bit_cast (seen on a GPU machine); the memcpy compiles to a register move.

#include <cstring>
#include <type_traits>

namespace nanfast {

template <typename To, typename From>
inline To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From), "bit_cast: the two types differ in size");
  static_assert(std::is_trivially_copyable_v<To> && std::is_trivially_copyable_v<From>,
                "bit_cast: both types must be trivially copyable");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

}  // namespace nanfast
