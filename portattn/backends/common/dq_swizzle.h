// The layout of the Hopper backward's bulk dQ rows (Note [portattn hopper bulk dQ] in
// backends/cuda/csrc/hopper_bwd_kernel.cuh): host and device, so the convert kernel, the main
// kernel's staging addresses and a host driver (tests/test_dq_swizzle.py) share one definition.
#pragma once

#include "host_device.h"

namespace portattn {
namespace cuda {

// The swizzle key of a dQ accumulator row (dq_chunk_swizzle): with row bits r2 r1 r0,
// key = (r1, r0 ^ r2, r2) from bit 2 down, a permutation of 0..7 (so every aligned group of 8
// chunks maps onto itself). What it must do: the Hopper backward stages dQ in shared memory
// in this layout, and a store instruction's lanes must land on different banks. A row is a
// multiple of 128 bytes, so only the chunk (c ^ key) sets the bank, and a lane's two-chunk
// pair {2m, 2m + 1} goes to pair m ^ (key >> 1): the key's bits 1-2 must differ across the
// rows one store instruction writes. Those are
//  * the 64-query kernels' 8-byte stores (STS.64): lane (g, q4) writes row g (mod 8), chunk
//    2j + (q4 >> 1), served a half warp (rows 0-3, then 4-7) at a time;
//  * the 80-query kernel's 4-byte stores of dQ^T (Note [portattn hopper 80-query steps]): lane
//    (g, q4) writes row 2 q4 + h (mod 8), so rows {0, 2, 4, 6} or {1, 3, 5, 7}.
// (r1, r0 ^ r2) differs within each of the four sets. The key (r1, r0, r2) serves the first
// pair only (the 80-query stores would go at 2 wavefronts where 1 does), and row & 7 serves
// neither (4 wavefronts a 64-bit store where 2 do: ncu source page, hd128 2k causal, 8.6% of the
// kernel's shared-memory wavefronts; archive:2026-11-26-53ce50d/ncu_details_bwd_hd128_s2k_causal.txt).
// tests/test_dq_swizzle.py checks the permutation and both store patterns.
PORTATTN_HD int dq_chunk_key(int row) {
  return ((row & 2) << 1) | (((row ^ (row >> 2)) & 1) << 1) | ((row >> 2) & 1);
}

// Byte offset in a dQ accumulator row of the byte at `byte` when the row's 16-byte chunks are
// stored swizzled by the row's index in its sequence: chunk c at c ^ dq_chunk_key(row).
PORTATTN_HD int dq_chunk_swizzle(int row, int byte) {
  return ((byte >> 4) ^ dq_chunk_key(row)) << 4 | (byte & 15);
}

}  // namespace cuda
}  // namespace portattn
