// The Hopper forward's host side (hopper_fwd_kernel.cuh): the launch of one
// kernel instantiation and `run_hopper_fwd<kHeadDim, Elem>`, the run template of the
// "hopper_fwd" family (Note [portattn cuda variants]): each generated
// hopper_fwd_hd<D>_<dtype>.cu instantiates it once; hopper_fwd_entry.cu looks the
// call up in the generated table.
//
// Tensor maps and the calls the Hopper path refuses: hopper_host.h.
#pragma once
#include <stdio.h>
#include <stdlib.h>

#include <type_traits>
#include <utility>

#include "hopper_fwd_kernel.cuh"
#include "hopper_host.h"
#include "variant_table.h"

namespace portattn {
namespace hopper {

// Its own opt-in flags: the sm80+ kernels' SmemOptIn<hd, Elem, bool> would alias.
template <class Kernel>
struct HopperSmemOptIn {
  static portattn::cuda::SmemOptInState state;
};
template <class Kernel>
portattn::cuda::SmemOptInState HopperSmemOptIn<Kernel>::state = {0ull};

// One kernel's compile-time choices (the type that keys its opt-in flag).
template <int kHeadDim_, typename Elem_, int kMask_, bool kSoftcap_, int kSchedule_>
struct HopperFwdVariantKey {};

// The schedules calls run (Note [portattn hopper forward schedule]), chosen
// from the tuning runs on an H100 (archive:2026-11-24-e744ac3/hopper_fwd_tuning.md,
// summary in docs/kernels-hopper.md): intra-warpgroup pipelining everywhere (+5-13%
// over the serial loop); non-causal calls persistent (+8-11% at 1k, +1-3% at
// 4k, within the +-4% run-to-run spread at 16k); causal calls with ping-pong
// and one CTA per tile (the hardware's dynamic CTA hand-out balances their
// unequal tiles better than the group order: persistent loses 8-15% at 4k-16k;
// the paired order below is ahead of both up to 8k keys), except
// short ones (seqlen_k <= 1024: 8 key blocks, 13 at hd256), where the persistent
// grid's overlap of one tile's end with the
// next's start wins (+11% hd64 1k). Sliding windows run like causal calls
// (their tiles differ in cost near the sequence start). Three stages and the
// polynomial exp2 measure within noise or slower and are built only in
// tuning builds. hd256 (docs/kernels-hopper.md) departs from this: schedule_for.
//
// Three consumer warpgroups (192-row tiles, hd64 only: admitted_bits drops the bit
// at the other head dims; Note [portattn hopper hd64 192 rows]) where the A/B in
// one device call measured them ahead (archive:2026-11-24-e744ac3/
// hopper_fwd_tuning.md, 16k tokens, bf16): non-causal +3% at 512, equal at 1k,
// +7-14% from 2k; causal over 1k keys +3-11%; softcap (serial loop) +0.5-9%. Only
// past 1k queries (kShortCausalMaxSeqlenK): not for causal calls up to 1k keys (-4
// to -8%: a 192-row tile wastes more of a short causal sequence) nor short
// non-causal ones (equal at 1k; unmeasured below 512, where a 192-row tile covers
// a 200-row sequence with 384 rows against 256); not for sliding windows (-8 to
// -15% on the serial loop the 160 registers leave them). Varlen without a mask over
// 1k keys: kVarlenSchedule below.
//
// Paired tiles (Note [portattn hopper paired tiles]; archive:2026-11-25-7285f9b/summary.md, same-call
// A/Bs, H100, bf16, 16k tokens): masked persistent walks deal equal-cost pairs of tiles. Short
// causal calls: +6-7% at hd64 512-1k, +9-11% at hd128, +3-8% at hd256. Long dense causal calls
// (over 1k keys, no softcap) up to kPairedCausalMaxSeqlenK run persistent with it, where one CTA
// per tile is ahead of the group order: hd64 (192 rows) +0-5% at 2k-8k, hd128 +4-7% at 2k-4k
// and (176-key blocks) +0-9% at 8k, hd256 +4-10% at 2k-8k. Past 8k keys one CTA per tile stays:
// through the public API (bench_attention.py, archive:2026-11-25-88c02d9/run5) the paired walk loses 8%
// at hd128 16k causal (653 -> 594-601 TFLOP/s) and 3% at hd64; a tile there averages 64 key blocks,
// so the prologue and epilogue that persistence overlaps are ~2% of it, and the pairs' tail (1.03 of
// the mean at 16k tokens, bench/tools/tile_balance.py) costs more than the hardware's hand-out of
// single tiles (~1.00). Softcap and varlen causal calls keep one CTA per tile: persistent was not
// measured with them (varlen tiles differ by sequence, which the hardware's hand-out balances; the
// no-mask varlen A/B below). kPairedMaxTilesPerCta: the exception for many short sequences.
constexpr int kNonCausalSchedule = kSchedPipelined | kSchedPersistent | kSchedThreeConsumers;
constexpr int kShortNonCausalSchedule = kSchedPipelined | kSchedPersistent;
constexpr int kCausalSchedule = kSchedPipelined | kSchedPingPong | kSchedThreeConsumers;
constexpr int kPairedCausalSchedule = kCausalSchedule | kSchedPersistent | kSchedPairedTiles;
constexpr int kWindowSchedule = kSchedPipelined | kSchedPingPong;
constexpr int kShortCausalSchedule = kSchedPipelined | kSchedPingPong | kSchedPersistent | kSchedPairedTiles;
constexpr int kShortCausalMaxSeqlenK = 1024;
// hd64's dense causal calls of kShortCausalMaxSeqlenK + 1 to kWideKeysMinSeqlenK - 1 keys (kCausal: three
// consumers, the paired persistent walk) with the cross-tile phase too (Note [portattn hopper cross-tile phase]).
// Same-call A/Bs on an H100, three rounds each (archive:2026-11-26-f6a6626-s19/ab_fwd_G_C2_c9.md and
// ab_fwd_G_C2_c10.md): forward 2k causal +2.5% / +1.0% (every round ahead in both), 4k -0.7% / +1.5%; 0
// spills. From 4097 keys hd64 runs kLongCausal, the same schedule without it: with the phase there too,
// 8k causal measures -0.8% (three rounds, ab_fwd_H_X2.md in the same folder). =0 leaves it out (A/B).
// (Moving 2k causal calls to the two-consumer short schedule instead measures -1.8%.)
#ifndef PORTATTN_HOPPER_FWD_HD64_CAUSAL_XTILE
#define PORTATTN_HOPPER_FWD_HD64_CAUSAL_XTILE 1
#endif
constexpr int kPairedCausalMaxSeqlenK = 8192;
// Many short sequences (at most kShortCausalMaxSeqlenK query rows, more than kPairedMaxTilesPerCta
// tiles a CTA) walk the paired order too, except at hd128 and up with an odd number of query blocks,
// which walk the group order (paired_walk_for_many_short below). Why: both orders end within 3% of
// even there (bench/tools/tile_balance.py), so what decides is DRAM traffic, and these calls are
// DRAM-bound (docs/kernels-hopper.md): a pair is two query blocks of one head back to back
// on one CTA, so its K/V come from DRAM once; the group order runs a head's blocks ~group_heads
// tiles apart, and some re-reads miss L2 (ncu, hd64 batch 512 x 256 causal: L2 hits 46 -> 52%, 442
// -> 404 us). Same-call A/B, three rounds, batch 512 x 16 heads (archive:2026-11-26-005ccb7-paired/paired_P1_r1):
// hd64 200-768 rows +1 to +9%; hd128 200 rows +18%, 256 +10%, 512-768 -1 to +3%, but 384 rows (three
// query blocks: the middle ones pair across two heads) -8%, hence the exception.
// -DPORTATTN_HOPPER_PAIRED_MAX_TILES_PER_CTA=<n> moves the limit (A/B builds; the exception applies
// past it).
#ifndef PORTATTN_HOPPER_PAIRED_MAX_TILES_PER_CTA
#define PORTATTN_HOPPER_PAIRED_MAX_TILES_PER_CTA 64
#endif
constexpr int kPairedMaxTilesPerCta = PORTATTN_HOPPER_PAIRED_MAX_TILES_PER_CTA;
constexpr bool paired_walk_for_many_short(int kernel_head_dim, int num_m_blocks) {
  return kernel_head_dim < 128 || num_m_blocks % 2 == 0;
}
// The cross-tile phase (Note [portattn hopper cross-tile phase]) where same-call A/Bs measured it
// ahead (archive:2026-11-25-0b0e86b/, bf16, 16k tokens): hd64 short causal calls, +4%
// at 512 keys and +2.6% at 1k on an H100 (pipe+pp+pers against default in ab2_h100_A1_schedules.md and
// ab2_h100_A2_schedules.md), +4% / +3.5% on an H200 (ab1_h200_default_vs_xtile.md). Not elsewhere: no-mask calls lose 2-12% with it on the
// default pipe+pers (pipe+pers+xtile) and only match the default with ping-pong as well
// (pipe+pp+pers+xtile, within 1% at 512-1k); hd128 short causal calls are within the spread
// (-3 to +0%).
// hd192's short causal calls on 80-key blocks, whose smaller K / V stages leave room for the
// persistent schedule's second Q buffer and so for the cross-tile phase (Note [portattn hopper
// hd192]). Same-call A/B on an H100, four rounds (archive:2026-11-26-a0722e3-s18nw/ab_O_NW.md):
// forward 512 causal +2.8% (every round), 1k causal -0.1%; forward+backward +0.4 / 0.0%. =0 keeps
// them on 112-key blocks.
#ifndef PORTATTN_HOPPER_FWD_HD192_SHORT_NARROW
#define PORTATTN_HOPPER_FWD_HD192_SHORT_NARROW 1
#endif
constexpr int short_causal_added_bits(int kernel_head_dim) {
  return kernel_head_dim == 64 ? kSchedCrossTile
         : (kernel_head_dim == 192 && PORTATTN_HOPPER_FWD_HD192_SHORT_NARROW != 0) ? kSchedNarrowKeys | kSchedCrossTile
                                                                                   : 0;
}
// Calls without a mask whose keys fit one block (seqlen_k <= kBlockN): every tile is one S and
// one P V, so a warpgroup's tile is a serial chain (S, softmax, P V, epilogue) unless the next
// tile's S runs under it. At hd64 they take ping-pong and the cross-tile phase, as short causal
// calls do (calls of up to kShortCausalMaxSeqlenK query rows, which otherwise run kShortNone).
// Same-call A/B, H100, batch 512 x 16 heads, bf16 (archive:2026-11-26-103c53a/
// sched_short): 100 rows +14-15% (116 -> 132-133 TFLOP/s), 128 rows +2%; 200 rows (two blocks)
// equal, 256 -7 to 0%; hd128 within 1% at 100-128 rows, so it keeps kShortNonCausalSchedule.
constexpr int single_block_added_bits(int kernel_head_dim) {
  return kernel_head_dim == 64 ? kSchedPingPong | kSchedCrossTile : 0;
}
// Dense calls of this many keys or more take 176-key blocks at hd128 (Note [portattn hopper 176-key
// blocks]). Causal: ahead from 8k keys, behind up to 4k; the boundary sits between the
// two measured points. Without a mask, with the softmax under P V (Note [portattn hopper softmax
// under P V], 176-key kernels only), the break-even is lower: same-call A/B on an H100, three
// rounds (archive:2026-11-26-f6a6626-s19/ab_fwd_O_F3.md): 2k keys +2.5% (647 against 629-634
// TFLOP/s, every round), 4k within 0.5%; causal 2k -7%, 4k within 0.6%, so causal calls keep 4097.
// Short no-mask calls (at most kShortCausalMaxSeqlenK query rows) stay on 128-key blocks: on 176
// they measure -3% at 1k keys and -10% at 512 (same folder, ab_fwd_T_S1.md / ab_fwd_T_S5.md).
#ifndef PORTATTN_HOPPER_FWD_WIDE_KEYS_MIN
#define PORTATTN_HOPPER_FWD_WIDE_KEYS_MIN 4097
#endif
#ifndef PORTATTN_HOPPER_FWD_WIDE_KEYS_MIN_NO_MASK
#define PORTATTN_HOPPER_FWD_WIDE_KEYS_MIN_NO_MASK 2048
#endif
constexpr int kWideKeysMinSeqlenK = PORTATTN_HOPPER_FWD_WIDE_KEYS_MIN;
constexpr int kWideKeysMinSeqlenKNoMask = PORTATTN_HOPPER_FWD_WIDE_KEYS_MIN_NO_MASK;
// Varlen without a mask, longest sequence over kShortCausalMaxSeqlenK keys: tiles
// cost in proportion to their sequence's keys, so a fixed deal of the tile list
// (persistent) leaves some CTAs long sequences' tiles and others empty or short
// ones; one CTA per tile lets the hardware hand tiles out as SMs free up. A/B in
// one device call (archive:2026-11-24-2641db7/varlen_sched_A.md and varlen_sched_B.md, 16k
// tokens): mixed lengths 64-2795 +21-23% at hd128, +11% at hd64; 4 x 4k +9% / 0%;
// 16 x 1k (max 1024) -13% at hd64, so sequences up to 1024 keys stay persistent,
// as dense ones do. Three consumers at hd64 (A/B in one device call,
// archive:2026-11-24-e2a3c50/varlen_three_consumers.md): mixed lengths
// +12%, 4 x 4k +4%.
constexpr int kVarlenSchedule = kSchedPipelined | kSchedThreeConsumers;

// Bits added to every schedule above at the head dims that admit them
// (admitted_bits, hopper_fwd_schedule.h); tuning builds' `+<bits>` adds others
// (bench/tools/hopper_fwd_tuning.py times `+64`, three consumers everywhere, against
// `default`, the choices above).
constexpr int kDefaultAddedBits = 0;

// The schedule a (head dim, mask, softcap) kernel runs instead of `wanted`.
// The pipelined loop's second S/P pair (S(j) in flight while P(j-1) feeds
// P V) spills once softcap or a sliding window's mask adds its live values
// where the consumers have the fewest registers to spare, so those calls run
// the serial loop (persistence kept; ping-pong needs the pipelined loop, so
// it goes too; nvcc 13.0, -Xptxas -v):
//   hd256 (Note [portattn hopper hd256]): O is 128 registers a thread of 240;
//     8-88 bytes at kBlockN = 80. (hd192's 112-key blocks spill nothing, so hd192 keeps the
//     pipelined loop: Note [portattn hopper hd192].)
//   three consumers at hd64 (Note [portattn hopper hd64 192 rows]): S 64 +
//     P 32 + O 32 of 160 registers; 80-148 bytes.
// Calls without softcap and window keep the measured choices above (0 spills).
// The cross-tile phase (Note [portattn hopper cross-tile phase]) is a step of the persistent
// pipelined loop with two Q buffers: dropped from any other schedule, which it would only
// duplicate, and from 176-key blocks (one Q buffer; a tuning build's +128 met it there).
// 176-key blocks (Note [portattn hopper 176-key blocks]) likewise only where measured: not with
// softcap (spills) or a sliding window.
constexpr int schedule_for(int head_dim, int mask, bool softcap, int wanted) {
  const int admitted =
      admitted_bits(head_dim, wanted) & (softcap || mask == kMaskLocal ? ~kSchedWideKeys : ~0);
  const bool tight = head_dim == 256 || (admitted & kSchedThreeConsumers) != 0;
  const int bits = tight && (softcap || mask == kMaskLocal)
                       ? (admitted & (kSchedPersistent | kSchedThreeConsumers | kSchedPairedTiles))
                       : admitted;
  // (176-key blocks leave room for one Q buffer only, Note [portattn hopper 176-key blocks].)
  const bool streams =
      (bits & kSchedPersistent) != 0 && (bits & kSchedPipelined) != 0 && (bits & kSchedWideKeys) == 0;
  // Paired tiles order a masked persistent walk (Note [portattn hopper paired tiles]); elsewhere
  // the bit would only duplicate a kernel.
  const bool pairs = (bits & kSchedPersistent) != 0 && mask != kMaskNone;
  return (streams ? bits : bits & ~kSchedCrossTile) & (pairs ? ~0 : ~kSchedPairedTiles);
}

// Note [portattn hopper padded head dims]
// Head dim 96 runs on the hd128 forward and backward kernels (hd192 and hd256 have kernels of
// their own: Notes [portattn hopper hd192], [portattn hopper hd192 backward] and [portattn hopper
// split head dim] in hopper_bwd_kernel.cuh). The tables "served head dim -> kernel head dim" are
// data: variants.HOPPER_FWD_PADDED and HOPPER_BWD_PADDED; the generated tables' hd96 entries
// point at run_hopper_fwd<128, ...> and run_hopper_bwd<128, ...>.
//  * Why it is exact: Q, K and V's tensor maps are encoded with the call's head dim
//    as the innermost extent, so TMA zero-fills every box column past it (the
//    second half of hd128's last panel at 96).
//    Q K^T then sums zeros over the padding, and P V's extra output columns are
//    zero: the kernel stores only columns below args.head_dim (the O map's extent
//    clips the TMA stores; a guard in the direct store loop). Nothing else reads the kernel's head
//    dim: the softmax scale comes from the caller (1/sqrt(the call's head dim) in
//    Python), the LSE is per row, strides are the tensors' own. TMA needs 16-byte
//    row strides: 96 * 2 and 192 * 2 bytes are.
//  * Cost: the kernel's full work. hd96 computes 128 columns, 33% more MMA work
//    than a native hd96 kernel would (the same for both products). (hd192 padded to the
//    hd256 kernels would compute 256 columns, 33% more: hence its own kernels.)
//  * Why it is declared anyway: the sm80+ path's native hd96/hd192 kernels run
//    mma.sync without TMA or warp specialization, and the padded Hopper kernels beat
//    them. Measured on an H100: forward 1.19-1.51x at hd96 (archive:2026-11-24-ee2d963/padded_head_dims.md);
//    hd96 forward+backward 1.41-1.67x (archive:2026-11-24-4507308/hd96_training.md). Should
//    that stop holding on some GPU, remove the head dim from HOPPER_*_PADDED and the
//    spec, and dispatch sends it back to the sm80+ path.
//  * The backward (run_hopper_bwd, hopper_bwd_kernel.cuh), the same way: Q, K, V, dO's
//    maps have the call's head dim as innermost extent, so S^T = K Q^T and dP^T = V dO^T
//    sum zeros over the padding and dV = P^T dO, dK = dS^T Q, dQ = dS K come out with zero
//    columns past it; the dK/dV maps (TMA-store epilogue) clip those columns, the direct
//    stores skip them (a test on the last panel only). The preprocess (delta = rowsum(dO *
//    O)) reads the call's columns, the LSE is per row.
//    The fp32 accumulators (dQ; dK/dV for GQA in the default mode) keep rows of the
//    kernel's head dim (BwdArgs::acc_head_dim = hopper_bwd_acc_head_dim(96) = 128), not
//    the call's. Why: the kernel's dQ adds are one bulk copy of a contiguous 64 x kHeadDim
//    fp32 tile with 16-byte chunks swizzled by row (Note [portattn hopper bulk dQ]), which
//    a 96-float row could only take as 64 per-row copies (slow: Note [portattn hopper bulk dQ])
//    or a 96-wide staging layout whose 384-byte rows break the swizzle's bank argument; the
//    per-element adds and the GQA reductions then use the same pitch, which keeps their
//    addressing a compile-time kHeadDim. Cost: the scratch of a 128-column call (+33% of
//    dQ's at 96) and the zero columns' adds. The size Python allocates
//    (portattn_cuda_hopper_bwd_workspace_bytes) and the launch's layout (run_bwd_sequence)
//    take the pitch from the same rule, which run_hopper_bwd checks against its kHeadDim;
//    the convert kernels read the first f.headdim columns of each row (bwd_convert_dq: a
//    swizzled chunk stays in its group of 8, so chunks 0-23 of a 32-chunk row hold exactly
//    columns 0-95). The sm80+ backward keeps acc_head_dim = f.headdim.
template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, int kSchedule>
cudaError_t launch(const PortattnFwdParams& params) {
  using Traits = HopperFwdTraits<kHeadDim, kSchedule>;
  auto kernel = &hopper_fwd_kernel<kHeadDim, Elem, kMask, kSoftcap, kSchedule>;
  // The store loop guards columns from hopper_fwd_min_head_dim on only; a smaller
  // head dim here would be a table error (variants.HOPPER_FWD_PADDED), not a call's.
  if (params.headdim > kHeadDim || params.headdim < hopper_fwd_min_head_dim(kHeadDim)) {
    char text[128];
    snprintf(text, sizeof(text), "head_dim %d cannot run on the hd%d kernel (it serves %d-%d)", params.headdim,
             kHeadDim, hopper_fwd_min_head_dim(kHeadDim), kHeadDim);
    portattn::cuda::set_error_detail(text);
    return cudaErrorInvalidValue;
  }
  cudaError_t err = portattn::cuda::ensure_dynamic_smem(
      reinterpret_cast<const void*>(kernel), Traits::kSmemBytes,
      &HopperSmemOptIn<HopperFwdVariantKey<kHeadDim, Elem, kMask, kSoftcap, kSchedule>>::state);
  if (err != cudaSuccess) return err;
  CUtensorMap tm_q, tm_k, tm_v, tm_o;
  // Varlen: rows past a sequence's end are masked in the kernel. The call's head dim,
  // not kHeadDim, is the maps' innermost extent (Note [portattn hopper padded head dims]).
  MapExtents extents;
  err = map_extents(params, &extents);
  if (err == cudaSuccess)
    err = encode_bshd(&tm_q, params.q, params.q_strides, params.dtype, extents.batch, extents.rows_q,
                      params.nheads, params.headdim, Traits::kBlockM);
  if (err == cudaSuccess)
    err = encode_bshd(&tm_k, params.k, params.k_strides, params.dtype, extents.batch, extents.rows_k,
                      params.nheads_k, params.headdim, Traits::kBlockN);
  if (err == cudaSuccess)
    err = encode_bshd(&tm_v, params.v, params.v_strides, params.dtype, extents.batch, extents.rows_k,
                      params.nheads_k, params.headdim, Traits::kBlockN);
  // The output's map (Note [portattn hopper O store]): 64-row boxes, one warpgroup's rows;
  // its innermost extent, the call's head dim, clips a padded kernel's extra columns.
  if (err == cudaSuccess)
    err = encode_bshd(&tm_o, params.out, params.out_strides, params.dtype, extents.batch, extents.rows_q,
                      params.nheads, params.headdim, 64);
  if (err != cudaSuccess) return err;
  HopperFwdArgs args;
  args.out = params.out;
  args.out_strides = params.out_strides;
  args.lse = params.lse;
  args.lse_batch_stride = params.lse_batch_stride;
  args.lse_head_stride = params.lse_head_stride;
  args.seqlen_q = params.seqlen_q;
  args.seqlen_k = params.seqlen_k;
  args.cu_seqlens_q = params.cu_seqlens_q;
  args.cu_seqlens_k = params.cu_seqlens_k;
  args.total_q = extents.rows_q;
  args.total_k = extents.rows_k;
  args.nheads = params.nheads;
  args.head_dim = params.headdim;
  args.heads_per_kv = params.nheads / params.nheads_k;
  args.num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t tiles = static_cast<int64_t>(args.num_m_blocks) * params.nheads * params.batch;
  if (tiles > INT32_MAX) {
    portattn::cuda::set_error_detail("more than 2^31 query tiles");
    return cudaErrorInvalidValue;
  }
  args.num_tiles = static_cast<int>(tiles);
  {
    // K + V of one head in bf16/fp16; groups fill about half of an H100's 50 MB L2.
    const int64_t kv_bytes = 4 * static_cast<int64_t>(params.seqlen_k) * params.headdim;
    const int64_t heads_batches = static_cast<int64_t>(params.nheads) * params.batch;
    const int64_t group = (int64_t(24) << 20) / (kv_bytes > 0 ? kv_bytes : 1);
    args.group_heads = static_cast<int>(group < 1 ? 1 : (group > heads_batches ? heads_batches : group));
    args.last_group = static_cast<int>((heads_batches - 1) / args.group_heads);
    args.div_last_group = make_fast_divisor(static_cast<int>(heads_batches - int64_t(args.last_group) * args.group_heads));
  }
  args.div_m_blocks = make_fast_divisor(args.num_m_blocks);
  args.div_heads = make_fast_divisor(args.nheads);
  args.div_heads_per_kv = make_fast_divisor(args.heads_per_kv);
  args.div_group_heads = make_fast_divisor(args.group_heads);
  args.div_group_tiles = make_fast_divisor(args.group_heads * args.num_m_blocks);
  args.window_left = params.window_left;
  args.window_right = params.window_right;
  // With softcap the kernel caps the scaled scores itself, so the softmax
  // works on them in natural units (scale 1).
  args.scale_log2 = (kSoftcap ? 1.f : params.softmax_scale) * softmax::kLog2e;
  args.softcap = params.softcap;
  args.softcap_scale = kSoftcap ? params.softmax_scale / params.softcap : 0.f;
  int grid = args.num_tiles;
  if (Traits::kPersistent) {
    // One CTA per SM (the shared memory admits no second): each walks a
    // strided share of the tiles. The share is fixed at launch, so a CTA that
    // finds its SM held by another kernel (NCCL's, in ring attention) runs its
    // whole share late: sm_margin SMs are left out of the grid for those kernels.
    int device = 0, sms = 0;
    err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    sms = sms > params.sm_margin ? sms - params.sm_margin : 1;
    grid = grid < sms ? grid : sms;
  }
  // Note [portattn hopper paired tiles]: with no more tiles than CTAs each takes one, unpaired;
  // many short sequences: paired_walk_for_many_short.
  const bool many_short = params.seqlen_q <= kShortCausalMaxSeqlenK &&
                          args.num_tiles > static_cast<int64_t>(kPairedMaxTilesPerCta) * grid;
  const bool group_order = many_short && !paired_walk_for_many_short(kHeadDim, args.num_m_blocks);
  args.paired_tiles = Traits::kPairedTiles && args.num_tiles > grid && !group_order ? 1 : 0;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, static_cast<cudaStream_t>(params.stream)>>>(
      tm_q, tm_k, tm_v, tm_o, args);
  return cudaGetLastError();
}

inline int mask_of(const PortattnFwdParams& params) {
  if (params.window_left < 0 && params.window_right < 0) return kMaskNone;
  if (params.window_left < 0 && params.window_right == 0) return kMaskCausal;
  return kMaskLocal;
}

// The tuning sweep covers the two masks the issue's grid times (none, causal),
// no softcap, and refuses the rest rather than drop their mask or cap.
template <int kHeadDim, typename Elem, int kSchedule>
cudaError_t run_schedule(const PortattnFwdParams& params) {
  if (mask_of(params) == kMaskLocal || params.softcap > 0.f) {
    portattn::cuda::set_error_detail(
        "PORTATTN_HOPPER_FWD_SCHEDULE=<bits> runs no-mask and causal calls without softcap only "
        "(+<bits>: the defaults with <bits> added, every call)");
    return cudaErrorInvalidValue;
  }
  return mask_of(params) == kMaskCausal ? launch<kHeadDim, Elem, kMaskCausal, false, kSchedule>(params)
                                        : launch<kHeadDim, Elem, kMaskNone, false, kSchedule>(params);
}

// kAdded: bits added to every choice where the head dim admits them
// (kDefaultAddedBits; tuning builds also run it with other additions).
template <int kHeadDim, typename Elem, bool kSoftcap, int kAdded = kDefaultAddedBits>
cudaError_t run_default(const PortattnFwdParams& params) {
  constexpr int kNone = schedule_for(kHeadDim, kMaskNone, kSoftcap, kNonCausalSchedule | kAdded);
  constexpr int kLongNone = schedule_for(kHeadDim, kMaskNone, kSoftcap, kNonCausalSchedule | kSchedWideKeys | kAdded);
  constexpr int kShortNone = schedule_for(kHeadDim, kMaskNone, kSoftcap, kShortNonCausalSchedule | kAdded);
  // (Softcap was not measured with the single-block schedule: it keeps kShortNone.)
  constexpr int kSingleBlockNone = kSoftcap ? kShortNone
                                            : schedule_for(kHeadDim, kMaskNone, kSoftcap,
                                                           kShortNonCausalSchedule | single_block_added_bits(kHeadDim) | kAdded);
  constexpr int kVarlen = schedule_for(kHeadDim, kMaskNone, kSoftcap, kVarlenSchedule | kAdded);
  constexpr int kShortCausal =
      schedule_for(kHeadDim, kMaskCausal, kSoftcap, kShortCausalSchedule | short_causal_added_bits(kHeadDim) | kAdded);
  // Softcap keeps one CTA per tile over 1k keys (paired persistent not measured with it).
  constexpr int kDenseCausal = kSoftcap ? kCausalSchedule : kPairedCausalSchedule;
  constexpr int kCausal = schedule_for(kHeadDim, kMaskCausal, kSoftcap,
                                       kDenseCausal | kAdded |
                                           (kHeadDim == 64 && PORTATTN_HOPPER_FWD_HD64_CAUSAL_XTILE ? kSchedCrossTile : 0));
  constexpr int kLongCausal = schedule_for(kHeadDim, kMaskCausal, kSoftcap, kDenseCausal | kSchedWideKeys | kAdded);
  constexpr int kLongestCausal =
      schedule_for(kHeadDim, kMaskCausal, kSoftcap, kCausalSchedule | kSchedWideKeys | kAdded);
  constexpr int kVarlenCausal = schedule_for(kHeadDim, kMaskCausal, kSoftcap, kCausalSchedule | kAdded);
  constexpr int kLocal = schedule_for(kHeadDim, kMaskLocal, kSoftcap, kWindowSchedule | kAdded);
  switch (mask_of(params)) {
    case kMaskNone:
      if (params.cu_seqlens_q != nullptr && params.seqlen_k > kShortCausalMaxSeqlenK)
        return launch<kHeadDim, Elem, kMaskNone, kSoftcap, kVarlen>(params);
      if (params.seqlen_q <= kShortCausalMaxSeqlenK) {
        // (Long queries over one key block, e.g. cross-attention to a short context, keep the
        // three-consumer kNone below: the single-block schedule was measured against kShortNone only.)
        if (params.seqlen_k <= HopperFwdTraits<kHeadDim, kSingleBlockNone>::kBlockN)
          return launch<kHeadDim, Elem, kMaskNone, kSoftcap, kSingleBlockNone>(params);
        return launch<kHeadDim, Elem, kMaskNone, kSoftcap, kShortNone>(params);
      }
      return params.seqlen_k >= kWideKeysMinSeqlenKNoMask
                 ? launch<kHeadDim, Elem, kMaskNone, kSoftcap, kLongNone>(params)
                 : launch<kHeadDim, Elem, kMaskNone, kSoftcap, kNone>(params);
    case kMaskCausal:
      if (params.seqlen_k <= kShortCausalMaxSeqlenK)
        return launch<kHeadDim, Elem, kMaskCausal, kSoftcap, kShortCausal>(params);
      // (Varlen keeps 128-key blocks, not measured with 176, and one CTA per tile.)
      if (params.cu_seqlens_q != nullptr) return launch<kHeadDim, Elem, kMaskCausal, kSoftcap, kVarlenCausal>(params);
      if (params.seqlen_k > kPairedCausalMaxSeqlenK)
        return launch<kHeadDim, Elem, kMaskCausal, kSoftcap, kLongestCausal>(params);
      return params.seqlen_k >= kWideKeysMinSeqlenK ? launch<kHeadDim, Elem, kMaskCausal, kSoftcap, kLongCausal>(params)
                                                    : launch<kHeadDim, Elem, kMaskCausal, kSoftcap, kCausal>(params);
    default:
      return launch<kHeadDim, Elem, kMaskLocal, kSoftcap, kLocal>(params);
  }
}

#ifdef PORTATTN_HOPPER_TUNING
// Tuning builds (PORTATTN_NVCC_FLAGS=-DPORTATTN_HOPPER_TUNING) carry the
// schedules of kTuningSchedules (bf16, no mask or causal, no softcap) and the
// defaults with each of kTuningAdditions added (every mask, softcap, both
// dtypes); PORTATTN_HOPPER_FWD_SCHEDULE=<bits> or +<bits> picks one at run
// time (hopper_fwd_schedule.h) so a single device call can time them side by
// side, and the GPU tests can run the defaults a change would make.
struct TuningChoice {
  int bits;    // -1: none (run the defaults)
  bool added;  // "+<bits>": run_default with <bits> added
};

// Read on every call (a tuning build only), so one process can switch schedules.
inline TuningChoice tuning_choice() {
  const char* text = getenv("PORTATTN_HOPPER_FWD_SCHEDULE");
  if (text == nullptr || *text == '\0') return TuningChoice{-1, false};
  if (*text == '+') return TuningChoice{atoi(text + 1), true};
  return TuningChoice{atoi(text), false};
}

// Runs kBits when it is `wanted` and admitted at kHeadDim (a schedule the
// head dim cannot take is not instantiated there); false when it is not wanted.
template <int kHeadDim, typename Elem, bool kAdded, int kBits>
bool run_if_wanted(const PortattnFwdParams& params, int wanted, cudaError_t* result) {
  if constexpr (kAdded) {
    if (wanted != kBits) return false;
    *result = params.softcap > 0.f ? run_default<kHeadDim, Elem, true, kBits>(params)
                                   : run_default<kHeadDim, Elem, false, kBits>(params);
    return true;
  } else if constexpr (admitted_bits(kHeadDim, kBits) == kBits) {
    if (wanted != kBits) return false;
    *result = run_schedule<kHeadDim, Elem, kBits>(params);
    return true;
  }
  return false;
}

template <int kHeadDim, typename Elem, bool kAdded, size_t... I>
cudaError_t run_tuning(const PortattnFwdParams& params, int wanted, std::index_sequence<I...>) {
  constexpr const int* kList = kAdded ? kTuningAdditions : kTuningSchedules;
  cudaError_t result = cudaErrorInvalidValue;
  if (!(run_if_wanted<kHeadDim, Elem, kAdded, kList[I]>(params, wanted, &result) || ...)) {
    char text[160];
    snprintf(text, sizeof(text), "PORTATTN_HOPPER_FWD_SCHEDULE=%s%d names no schedule this build has at head dim %d",
             kAdded ? "+" : "", wanted, kHeadDim);
    portattn::cuda::set_error_detail(text);
  }
  return result;
}
#endif

// The family's run template: the mask, softcap and schedule are run-time choices here.
template <int kHeadDim, typename Elem>
cudaError_t run_hopper_fwd(const PortattnFwdParams& params) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return cudaSuccess;
#ifdef PORTATTN_HOPPER_TUNING
  const TuningChoice choice = tuning_choice();
  if (choice.bits >= 0 && choice.added)
    return run_tuning<kHeadDim, Elem, true>(params, choice.bits, std::make_index_sequence<kNumTuningAdditions>());
  if constexpr (std::is_same<Elem, __nv_bfloat16>::value) {  // (fp16: not even instantiated)
    if (choice.bits >= 0)
      return run_tuning<kHeadDim, Elem, false>(params, choice.bits, std::make_index_sequence<kNumTuningSchedules>());
  }
#endif
  return params.softcap > 0.f ? run_default<kHeadDim, Elem, true>(params)
                              : run_default<kHeadDim, Elem, false>(params);
}

}  // namespace hopper
}  // namespace portattn
