// The Hopper forward's compile-time choices as data: the mask kinds, the
// schedule bits (Note [portattn hopper forward schedule] in
// hopper_fwd_kernel.cuh says what each bit does), which head dims admit a bit,
// and the schedules a tuning build carries. Host and device code alike read
// it: the kernel and its launch (hopper_fwd_launch.cuh), and the entry
// (hopper_fwd_entry.cu), which reports the tuning lists to Python
// (build_config()["hopper"]["fwd_tuning"]) so tests and benchmarks never
// repeat them.
#pragma once

namespace portattn {
namespace hopper {

// Which keys a query sees (Note [portattn semantics] in params.h). kMaskCausal
// is window (-1, 0); kMaskLocal any other window with a bound.
enum HopperFwdMask : int { kMaskNone = 0, kMaskCausal = 1, kMaskLocal = 2 };

enum HopperFwdScheduleBits : int {
  kSchedPipelined = 1,
  kSchedPingPong = 2,
  kSchedPersistent = 4,
  kSchedStages3 = 8,
  kSchedExp2Poly4 = 16,  // every 4th exponential on the FMA pipe (Note [portattn polynomial exp2])
  kSchedExp2Poly8 = 32,  // every 8th
  kSchedThreeConsumers = 64,  // 192-row tiles, three consumer warpgroups (Note [portattn hopper hd64 192 rows])
  kSchedCrossTile = 128,  // a tile's last P V issued with the next tile's first S (Note [portattn hopper cross-tile phase])
  kSchedWideKeys = 256,   // hd128: 176-key blocks (Note [portattn hopper 176-key blocks])
  kSchedPairedTiles = 512,  // masked persistent launches: equal-cost tile pairs per CTA (Note [portattn hopper paired tiles])
  kSchedNarrowKeys = 1024,  // hd192: 80-key blocks, room for a second Q buffer (Note [portattn hopper hd192])
};

// The bits of `bits` a head dim's kernels can take: three consumer warpgroups
// fit the register file at head dim 64 only (HopperFwdTraits asserts it); the
// cross-tile phase needs the persistent schedule's second Q buffer, which hd256's
// shared memory has no room for; 176-key blocks are an hd128 shape.
// Three stages leave room for the cross-tile phase's second Q buffer at head dim 64 only.
// 80-key blocks are an hd192 shape, and with them hd192 has room for the second Q buffer.
constexpr int admitted_bits(int head_dim, int bits) {
  const bool narrow = head_dim == 192 && (bits & kSchedNarrowKeys) != 0;
  return (head_dim == 64 ? bits : bits & ~kSchedThreeConsumers) &
         (head_dim <= 128 || narrow ? ~0 : ~kSchedCrossTile) & (head_dim == 128 ? ~0 : ~kSchedWideKeys) &
         (head_dim == 192 ? ~0 : ~kSchedNarrowKeys) &
         (head_dim > 64 && (bits & kSchedStages3) != 0 ? ~kSchedCrossTile : ~0);
}

// The smallest head dim the kernel of `kernel_head_dim` columns serves (Note [portattn hopper
// padded head dims] in hopper_fwd_launch.cuh): a padded head dim fills part of the kernel's last
// 64-column panel or leaves it empty, never more (a smaller kernel would serve it). hd64 serves
// only itself, so its store loop carries no column guard. variants.HOPPER_FWD_PADDED must keep
// within it (variants.py asserts it); the launch refuses a call outside it. (__host__ __device__:
// the kernel's store loop reads it too; every includer is compiled by nvcc.)
__host__ __device__ constexpr int hopper_fwd_min_head_dim(int kernel_head_dim) {
  return kernel_head_dim <= 64 ? kernel_head_dim : kernel_head_dim - 64;
}

// Tuning builds (-DPORTATTN_HOPPER_TUNING, hopper_fwd_launch.cuh):
// PORTATTN_HOPPER_FWD_SCHEDULE=<bits> runs one of these (bf16, no mask or
// causal, no softcap) at the head dims that admit it;
// PORTATTN_HOPPER_FWD_SCHEDULE=+<bits> runs the default choices (run_default:
// every mask, softcap, varlen, both dtypes) with one of the additions below
// added where admitted, which is what a change of the defaults would launch.
constexpr int kTuningSchedules[] = {0, 1, 3, 5, 7, 13, 17, 64, 65, 67, 68, 69, 71, 133, 135, 141, 519, 583, 647, 655, 775};
// (kSchedPairedTiles is not among the additions: the defaults carry it wherever schedule_for admits
// it, so `+512` would rerun the default kernels.)
constexpr int kTuningAdditions[] = {kSchedThreeConsumers, kSchedCrossTile};
constexpr int kNumTuningSchedules = sizeof(kTuningSchedules) / sizeof(kTuningSchedules[0]);
constexpr int kNumTuningAdditions = sizeof(kTuningAdditions) / sizeof(kTuningAdditions[0]);

}  // namespace hopper
}  // namespace portattn
