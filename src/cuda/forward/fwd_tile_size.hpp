#pragma once
// The one place the sm80 forward tile shapes are decided. Each warp owns 16 * m_tiles query rows
// and walks the whole key tile, so P never leaves registers; m_tiles = 2 halves shared-memory
// reads of K and V per MMA, at the price of twice the accumulator registers.
namespace tileattn::cuda {

struct FwdTileSize {
  int block_m;  // query rows per block
  int block_n;  // keys per mainloop step
  int warps;
};

// Register budget per thread (255) for the fp32 accumulators: S is (block_m/warps) x block_n,
// O is (block_m/warps) x headdim; both live for the whole loop.
constexpr FwdTileSize fwd_tile_size(int headdim) {
  if (headdim <= 64) return {128, 128, 4};   // S 128 + O <= 64 registers
  if (headdim <= 128) return {128, 64, 4};   // S 64 + O <= 128
  if (headdim <= 192) return {128, 64, 8};   // O 96; shared memory 96 KiB
  // 128 rows would need 128 KiB of shared memory, more than sm_86/sm_89 offer (99 KiB).
  return {64, 64, 4};
}

// Problems with at most this many (GQA-packed) query rows run the decode kernel
// (decode_fwd_sm80.cuh): one 16-row mma tile.
constexpr int kDecodeRows = 16;

}  // namespace tileattn::cuda
