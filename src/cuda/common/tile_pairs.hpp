#pragma once
// A head's tiles of unequal work paired into units of equal work, for the persistent Hopper
// kernels' static walks. Under a causal mask a head's tiles, ranked from the heaviest, lose one
// step of work per rank, so ranks m and n - 1 - m together are the same work whatever m: a unit
// is such a pair, the heavier tile first, and an odd count leaves the middle tile alone. Walked a
// grid apart, units of equal work stay balanced without an atomic counter. Unpaired, a unit is
// one tile.
#include "common/host_device.hpp"

namespace tileattn::cuda {

struct TilePairs {
  int tiles;     // a head's tiles
  bool paired;
  int per_head;  // a head's units

  TA_HOST_DEVICE TilePairs(int tiles_, bool paired_)
      : tiles(tiles_), paired(paired_), per_head(paired_ ? (tiles_ + 1) / 2 : tiles_) {}
  // Tiles in a head's unit i: two where paired, except the middle tile of an odd count.
  TA_HOST_DEVICE int count(int i) const { return paired && 2 * i + 1 != tiles ? 2 : 1; }
  // Tile `half` of a head's unit i, as its rank from the heaviest (unpaired: tile i).
  TA_HOST_DEVICE int rank(int i, int half) const { return !paired || half == 0 ? i : tiles - 1 - i; }
};

// A unit's number as digits (index within its head, head, batch), the units being numbered within
// a head first, then head, then batch. A walk a grid apart moves every unit by the same count,
// so adding that count's own digits, with carries, moves the digits without the three integer
// divisions a number costs (each about 25 dependent instructions, in every warp of a block).
struct UnitDigits {
  int i, head, batch;

  TA_HOST_DEVICE static UnitDigits of(int unit, int per_head, int heads) {
    return {unit % per_head, unit / per_head % heads, unit / per_head / heads};
  }
  // this + step, both in digits: each digit below its base, so one carry at most.
  TA_HOST_DEVICE void add(const UnitDigits& step, int per_head, int heads) {
    i += step.i;
    const int carry_i = i >= per_head;
    i -= carry_i * per_head;
    head += step.head + carry_i;
    const int carry_head = head >= heads;
    head -= carry_head * heads;
    batch += step.batch + carry_head;
  }
};

}  // namespace tileattn::cuda
