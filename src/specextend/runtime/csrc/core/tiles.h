// Runtime counts as compile-time ones, for kernels whose tile of rows (or of lane groups) keeps its
// accumulators in registers: those need the count as a template argument. Include it inside a
// file's SPX_BEGIN_<ISA> region, so the loops below compile for that instruction set and inline the
// kernels they call.
#pragma once

#include <array>
#include <type_traits>
#include <utility>

namespace spx {

template <int N>
using Count = std::integral_constant<int, N>;

// f(Count<c>{}) for c in [1, N]; nothing for any other c.
template <int N, class F>
inline void with_count(int c, F&& f) {
  if constexpr (N > 0) {
    if (c == N)
      f(Count<N>{});
    else
      with_count<N - 1>(c, f);
  }
}

// Rows [0, nrows) in tiles of N, the last one shorter: f(Count<R>{}, r) for a tile of R rows from r.
template <int N, class F>
inline void row_tiles(int nrows, F&& f) {
  int r = 0;
  for (; r + N <= nrows; r += N) f(Count<N>{}, r);
  with_count<N - 1>(nrows - r, [&](auto rest) { f(rest, r); });
}

template <class F, int... Cs>
constexpr auto count_table(F f, std::integer_sequence<int, Cs...>) {
  return std::array{f(Count<Cs + 1>{})...};
}

// {f(Count<1>{}), ..., f(Count<N>{})}: a kernel's instances by count, looked up at run time (table[c - 1]).
template <int N, class F>
constexpr auto count_table(F f) {
  return count_table(f, std::make_integer_sequence<int, N>{});
}

}  // namespace spx
