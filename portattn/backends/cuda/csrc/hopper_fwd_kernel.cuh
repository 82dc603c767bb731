// Hopper (sm_90a) forward attention: TMA tile loads, wgmma, warp specialization.
//
// The forward of the project's Hopper path (issue #6). What it serves (dtypes,
// head dims, masks, GQA, varlen) is declared in capability/specs/cuda_sm90.py;
// dispatch sends every other call to the sm80+ kernel (fwd_kernel.cuh), and the
// entry (hopper_fwd_entry.cu) refuses such calls with a message as a second line.
//
// CTA = 3 warpgroups (384 threads); a tile is (128-row query block, head, batch)
// and a key block has kBlockN keys (128; 112 at hd192, Note [portattn hopper hd192]; 80 at
// hd256, Note [portattn hopper hd256]; 176 at
// hd128 for long calls, Note [portattn hopper 176-key blocks]).
// (kSchedThreeConsumers: 4 warpgroups, 512 threads, 192-row tiles at hd64,
// Note [portattn hopper hd64 192 rows].)
//   warpgroup 0  producer: one thread issues every TMA copy (a tile's Q, then
//                its K/V blocks into a kStages-deep ring); setmaxnreg drops it
//                to 24 registers so the consumers can have 240 (160 with three).
//   warpgroups 1, 2  consumers: 64 query rows each (the M of one wgmma). Per
//                key block: S = Q K^T (wgmma, both operands in shared memory),
//                mask, online softmax (backends/common/online_softmax.h), P to
//                fp16/bf16 registers, O += P V (wgmma, A = P from registers,
//                B = V from shared memory, transposed by the instruction).
//
// Note [portattn hopper forward schedule]
// What overlaps with what is a compile-time schedule (bits of kSchedule), so
// that one tuning build can time them side by side (hopper_fwd_entry.cu,
// PORTATTN_HOPPER_TUNING) and the measured best is the default per head dim:
//   kSchedPipelined  intra-warpgroup pipelining: S(j) = Q K(j)^T is issued
//                    together with O += P(j-1) V(j-1); block j's softmax runs
//                    while the second product is still on the tensor cores,
//                    and O is rescaled by block j's correction only after it
//                    lands (online_softmax_step_deferred). Costs a second
//                    live S/P pair: S 64 + P 32 + O 64 registers at hd128
//                    (hd256: S 40 + P 20 + O 128; not with softcap or a
//                    window there, Note [portattn hopper hd256]).
//   kSchedPingPong   the two consumer warpgroups take turns issuing their
//                    products (named barriers 1 and 2), so one's softmax runs
//                    under the other's wgmma by construction rather than by
//                    the warp scheduler's luck. Needs kSchedPipelined.
//   kSchedPersistent grid = one CTA per SM, each walking tiles blockIdx.x,
//                    + gridDim.x, ...: the producer loads the next tile's Q
//                    and K/V while the consumers finish the last one's P V
//                    and write O. A Q-empty barrier hands the Q buffer back.
//   kSchedStages3    three K/V stages at hd128 (225 KiB of shared memory)
//                    instead of two.
//   kSchedExp2Poly4/8  every 4th / 8th exponential of the softmax computed
//                    by a polynomial on the FMA pipe instead of the MUFU unit
//                    (Note [portattn polynomial exp2]).
//   kSchedThreeConsumers  hd64 only: three consumer warpgroups, 192-row
//                    query tiles (Note [portattn hopper hd64 192 rows]).
//                    Combines with every bit above that fits 160 registers;
//                    with ping-pong the three take turns round robin.
//   kSchedCrossTile  persistent pipelined schedules: a tile's last P V and
//                    the next tile's first S in one phase, O written under
//                    S (Note [portattn hopper cross-tile phase]).
//   kSchedWideKeys   hd128: key blocks of 176 instead of 128 (Note [portattn
//                    hopper 176-key blocks]).
// The bits, the head dims that admit them and the tuning builds' lists are
// data in hopper_fwd_schedule.h.
// K and V have separate "empty" barriers: K's stage is handed back as soon
// as S = Q K^T has completed, V's after P V, so the next K load starts a
// softmax earlier.
// Tile order: the query block varies fastest, reversed for causal calls so
// that the longest rows start first (their tiles finish with the rest);
// consecutive tiles share a head's K/V in L2.
//
// Shared memory: every tile is stored as column panels of 64 elements (128
// bytes per row, the widest row TMA's 128-byte swizzle allows), panel p at
// p * rows * 128 bytes, each written by one TMA copy with
// CU_TENSOR_MAP_SWIZZLE_128B. wgmma reads the same layout through its
// "128B swizzle" matrix descriptors (make_smem_desc, hopper_ptx.cuh), so no
// data is rearranged between the copy engine and the tensor cores.
//
// Budget (kBlockM = 128; kBlockN = 128, hd256 80):
//   hd64:  Q 16 KiB + 4 stages x (K 16 + V 16 KiB) = 144 KiB (+1 KiB alignment, barriers)
//          (three consumers: Q 24 KiB, 152 KiB; Note [portattn hopper hd64 192 rows])
//   hd128: Q 32 KiB + 2 (3) stages x (K 32 + V 32 KiB) = 160 (224) KiB (+1 KiB)
//   hd192: Q 48 KiB + 2 stages x (K 42 + V 42 KiB) = 216 KiB (+1 KiB)
//   hd256: Q 64 KiB + 2 stages x (K 40 + V 40 KiB) = 224 KiB (+1 KiB)
//   consumer registers per thread: S 64 fp32 (hd256: 40) + O 32 (hd64) / 64 (hd128)
//   / 128 (hd256) fp32 + P 32 (hd256: 20) packed + softmax state; 240 allowed after
//   setmaxnreg. 168 at entry, 0 spills in every kernel a call launches (nvcc 13.0).
//
// Note [portattn hopper hd256]
// Head dim 256 (Gemma) on the same kernel (the backward's hd256 kernel splits the
// head dim over two CTAs: Note [portattn hopper split head dim] in
// hopper_bwd_kernel.cuh). Decisions:
//  * kBlockM stays 128 (two consumer warpgroups x 64 rows): Q is 64 KiB.
//  * kBlockN = 80 (hopper_fwd_block_n). Shared memory: K + V are 80 KiB a
//    stage, two stages + Q = 224 KiB of the 227 KiB opt-in; no third stage
//    and no second Q buffer fit (the persistent schedule single-buffers Q).
//    80 rather than 64: S = Q K^T is an SS wgmma that re-reads its A tile
//    (Q, 2 KiB per k16 step) from shared memory for every instruction; at
//    N = 64 that read plus K's equals the tensor core's time for the step at
//    128 B/clock, at N = 80 it is 10% under it, and the per-block softmax and
//    O rescale (128 multiplies a thread) are spread over 25% more keys.
//    Registers (nvcc 13.0, -Xptxas -v, bf16; docs/kernels-hopper.md):
//    kBlockN = 64 has 0 spills in every schedule; 80 has 0 in
//    the serial loop and, without softcap and window, in the pipelined ones,
//    but the pipelined loop spills 8-88 bytes with softcap or a sliding
//    window, so those calls run the serial loop (schedule_for in
//    hopper_fwd_launch.cuh). -DPORTATTN_HOPPER_FWD_HD256_BLOCK_N=64 builds
//    the alternative for an A/B on a GPU.
//  * S = Q K^T by wgmma m64n80k16 SS (16 k16 steps), O += P V by m64n256k16
//    RS (5 k16 steps over the 80 keys; B = V MN-major across its 4 panels,
//    LBO = the 80-row panel stride, 10 KiB). TMA boxes of K/V are 80 rows.
//  * Everything that depends on the key block (mask columns, key-block
//    ranges, P packing, the tile order) is written in kBlockN already.
//
// Note [portattn hopper hd192]
// Head dim 192 has its own kernel (on the hd256 one it would run padded, 256 columns of work for
// 192: Note [portattn hopper padded head dims]). Decisions, as at hd256 above:
//  * kBlockM 128, kBlockN = 112 (FlashAttention-3's hd192 tile). Shared memory: Q 48 KiB +
//    2 stages x (K 42 + V 42 KiB) = 216 KiB (+1 KiB); 128 keys would need 240. Each K / V
//    panel is 112 rows x 128 bytes = 14 KiB, a whole number of the 1 KiB swizzle atoms.
//  * S = Q K^T by wgmma m64n112k16 SS (12 k16 steps), O += P V by m64n192k16 RS (7 k16
//    steps over the 112 keys; B = V MN-major across its 3 panels, LBO = 14 KiB).
//  * Registers: S 56 + P 28 + O 96 a thread in the pipelined loop, 8 fewer than the hd256
//    kernel's S 40 + P 20 + O 128, and enough fewer: nvcc 13.0 (-Xptxas -v, bf16) reports 0
//    spills in every schedule, softcap and window included, and no C75xx serialisation. So
//    unlike hd256, softcap and window calls keep the pipelined loop (schedule_for's `tight`
//    is hd256's only); the schedules are otherwise hd256's. Timed against every schedule a tuning
//    build carries at 192 (archive:2026-11-26-e19aed5-s18tune/hopper_fwd_tuning.md), these defaults
//    are the best or within 2% of it at every point of the grid but 16k causal, where two others
//    were 2-5% ahead in one repeat only.
//  * kSchedNarrowKeys: 80-key blocks (Q 48 KiB x 2 + 2 stages x 60 KiB = 216 KiB), so the persistent
//    schedule double-buffers Q and can take the cross-tile phase (Note [portattn hopper cross-tile
//    phase]); the short causal calls take both (hopper_fwd_launch.cuh, short_causal_added_bits).
//  * The backward has its own hd192 kernel too (Note [portattn hopper hd192 backward]); the
//    two share nothing but the LSE and O they pass through global memory.
//
// Note [portattn hopper hd64 192 rows]
// kSchedThreeConsumers: the hd64 forward with three consumer warpgroups, as
// FlashAttention-3 runs head dim 64. Why: at hd64 the softmax costs as much
// per key as at hd128 while the matrix products cost half, and ncu of the
// two-consumer kernel (archive:2026-11-21-76e7159/ncu_fwd_hd64.txt) showed the
// consumer warps stalled on fixed-latency dependencies (1.40 cycles per
// issue) with two consumer warps per scheduler: a third warpgroup gives each
// scheduler a third independent instruction stream, and each K/V byte
// loaded serves 192 query rows instead of 128.
//  * Shape: kBlockM = 192 (3 x 64 rows), kBlockN = 128, 512 threads; the
//    producer is unchanged (its Q box is 192 rows). Everything that depends
//    on the query tile is written in Traits::kBlockM / kConsumers already:
//    the Q box and its expect_tx bytes, ceil(seqlen_q / 192) tiles per head,
//    causal / window key-block ranges and the blocks that need masking,
//    rows past seqlen_q (not written), varlen tiles, the persistent tile
//    list, the empty-barrier counts (one arrival per consumer warp) and the
//    ping-pong ring (named barriers 1-3, round robin).
//  * Registers: 128 x 24 + 384 x 160 = 64512 of 65536 (setmaxnreg values are
//    multiples of 8; 168 would need 67584); 128 at entry (launch bounds).
//    The consumers hold S 64 + P 32 + O 32 fp32 a thread in the pipelined
//    loop, which leaves 32 registers for the rest. nvcc 13.0, -Xptxas -v,
//    bf16 and fp16, spill stores:
//      pipelined (65, 67, 69, 71), no mask or causal, no softcap: 0 bytes
//      pipelined with softcap: 80-100 B; with a window: 120-148 B (a
//        consumer would need ~184 registers: 176 still spills 28 B)
//      serial loop (64, 68), every mask, softcap or not: 0 spills
//    (producer at 32 or 40 registers instead of 24: the same spills.) So
//    schedule_for (hopper_fwd_launch.cuh) runs softcap and window calls of
//    this shape on the serial loop, as it does at hd256.
//  * Shared memory: Q 24 KiB (x2 in the persistent schedule) + 4 stages x
//    (K 16 + V 16 KiB) = 152 (176) KiB + 1 KiB alignment + barriers:
//    156,816 / 181,408 bytes; one CTA per SM either way.
//  * The default (hopper_fwd_launch.cuh) for no-mask calls past 1k queries and
//    causal calls past 1k keys. Measured on an H100 (docs/kernels-hopper.md): +7-19%
//    non-causal from 2k, +3-11% causal from 2k; short causal calls -4 to -8% and
//    windows on the serial loop -8 to -15%, so those keep two consumers. Tuning builds
//    run other choices: PORTATTN_HOPPER_FWD_SCHEDULE=<bits> or +64 (the bit everywhere).
//
// Note [portattn hopper O store]
// The epilogue writes O through shared memory: each consumer warpgroup stores
// its 64 x kHeadDim tile (bf16/fp16) into a staging buffer in the 128B-swizzled
// panel layout of the loads, then one thread issues a TMA store per panel.
// Why: ncu of the seqlen-512 forward (archive:2026-11-24-aa70286/
// ncu_fwd_*.tgz) had ~11% of warp samples at the top of the tile loop on long
// scoreboard: the next tile's first instructions rewrite registers that the
// last tile's 32 (hd128) 4-byte global stores a thread still read. Shared
// stores drain in a few cycles, the copy engine writes whole lines, and rows
// and columns past the tensor's end are clipped by the map. Costs: kOBytes of
// shared memory (16-32 KiB; it fits beside two Q buffers at hd128: 225 KiB in
// all), two named barriers per tile per warpgroup (buffer free, buffer
// written), and the issuing thread waits for its previous store to have read
// the buffer, one tile later. Not for a varlen tile whose rows run past its
// sequence (the packed map would write the next sequence's rows): those take the
// direct stores.
// Where: hd128, and hd64 with two consumers (PORTATTN_HOPPER_FWD_TMA_STORE=3, the default).
// Same-call A/B on an H100 (archive:2026-11-24-7d84a44/ab_T.md and ab_D.md, bf16, 16k tokens,
// forward TFLOP/s): hd128 +14% at 512 (full and causal), +8% at 1k, +2-5% at 2k, within noise
// (-5 to +8%) from 4k. O is staged by stmatrix (Note [portattn hopper O stmatrix]: at hd64 4
// instructions a thread where the 16-byte direct stores take ~90 with their quad transposes);
// hd64 two-consumer kernels: 512 causal +4.6%, many short hd64 sequences +2 to +4% over the direct stores, 512 no mask
// -2.4% (archive:2026-11-26-9f6c246-s15b/ab_grid_F.txt). Not with three consumers at hd64
// (the 160-register kernels spill 4-12 B), and hd256 or three stages at hd128 leave no room
// for the buffer.
//
// Note [portattn hopper 176-key blocks]
// kSchedWideKeys, hd128 only: key blocks of 176 (FlashAttention-3's hd128 tile) instead of
// 128. Per block the fixed costs (the softmax's row reductions, O's rescale of 64 registers
// a thread, the barrier round trips, the wgmma issue and wait latencies) are spread over
// 37% more keys. Costs: S is 88 fp32 a thread (S 88 + P 44 + O 64 in the pipelined loop:
// 0 spills without softcap; softcap spills 32-76 B, so schedule_for drops the bit there),
// K + V are 88 KiB a stage, so two stages and Q take 209 KiB and neither a second Q buffer
// nor the O staging tile fits (one Q buffer, direct O stores), and a last block is ragged
// unless seqlen_k is a multiple of 176 (up to 175 masked keys of compute a row). Same-call
// A/B on an H100 (archive:2026-11-25-0b0e86b/ab3_h100_n128_1.md and its n176 pair, bf16,
// 16k tokens, every hd128 kernel built both ways): 8k keys +1% no mask, +6% causal; 16k
// +1-4% no mask, +4-7% causal; 4k -3% no mask, -1 to +1% causal; 512-2k -5 to -23%
// (the staging tile and the second Q buffer lost, and the ragged block a larger share).
// So hopper_fwd_launch.cuh adds it from 2048 keys without a mask (kWideKeysMinSeqlenKNoMask:
// +2.5% at 2k with the softmax under P V, Note [portattn hopper softmax under P V]) and past
// 4096 keys causal (kWideKeysMinSeqlenK); not with softcap or a sliding window (not measured).
//
// Note [portattn hopper cross-tile phase]
// kSchedCrossTile (persistent pipelined schedules with two Q buffers: hd64 and hd128).
// A tile of n key blocks has n + 1 issue phases per consumer: S(0) alone, then S(j)
// with P(j-1) V(j-1), then the last P V alone, after which the warpgroup normalises O
// and writes it with nothing on the tensor cores. On short tiles (512-1k keys,
// causal tiles of 1-8 blocks) those two lone phases and the epilogue are a large share
// of the tile, and ncu of the 512-key forward put 11% of the samples at the top of the
// tile loop (archive:2026-11-24-aa70286/summary.md). With the bit, when the next tile of the CTA has
// key blocks, the last phase issues the last P V and then the next tile's S(0) (its Q
// is already in the other buffer, its first K in the next ring slot); the warpgroup
// waits for P V only, writes O under S(0), then runs S(0)'s softmax. So a CTA's tiles
// run as one stream of phases: per tile one phase fewer and the epilogue overlapped.
// Ping-pong counts phases per stream instead of per tile (the up-front opening at a
// stream's first tile, the skipped opening at its last phase). Every wgmma still
// retires inside the loop iteration that issued it (S(0) is waited for before the
// next tile's iteration starts), so ptxas keeps the chains asynchronous (no C7514-C7519
// warnings; 0 spills in every kernel, nvcc 13.0). A tile without key blocks (causal rows
// above the diagonal when seqlen_q > seqlen_k) ends a stream: its O is written alone.
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the encoder comes from cudaGetDriverEntryPoint)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../../common/fast_divide.h"
#include "../../common/mask_bits.h"
#include "../../common/online_softmax.h"
#include "../../common/params.h"
#include "../../common/seq_bounds.h"
#include "hopper_fwd_schedule.h"
#include "hopper_ptx.cuh"
#include "ptx.cuh"

namespace portattn {
namespace hopper {

// The mask kinds and schedule bits (HopperFwdMask, HopperFwdScheduleBits): hopper_fwd_schedule.h.

// Keys per block, per head dim (Note [portattn hopper hd256]). 128 at hd64 and
// hd128: S (64 fp32 a thread) + P (32) + O (32 / 64) fit 240 registers with a
// second S in flight. hd256: O alone is 128 registers a thread and Q 64 KiB of
// shared memory, so 80 keys (S 40 + P 20 registers; K + V 80 KiB a stage, two
// stages + Q = 224 KiB). PORTATTN_HOPPER_FWD_HD256_BLOCK_N (a multiple of 16,
// e.g. 64) overrides it for register/speed experiments.
#ifndef PORTATTN_HOPPER_FWD_HD256_BLOCK_N
#define PORTATTN_HOPPER_FWD_HD256_BLOCK_N 80
#endif
// hd192 (Note [portattn hopper hd192]): 112 keys; 80 or 128 (which does not fit two stages)
// for experiments.
#ifndef PORTATTN_HOPPER_FWD_HD192_BLOCK_N
#define PORTATTN_HOPPER_FWD_HD192_BLOCK_N 112
#endif
// PORTATTN_HOPPER_FWD_TMA_STORE=0 builds the direct-store epilogue everywhere (A/B
// against Note [portattn hopper O store]); =2 the TMA store at every head dim whose
// shared memory has room for the staging tile (A/B for hd64); =3 also at hd64 with two
// consumer warpgroups (with three, 160 registers a thread, the staging spills 4-12 B).
#ifndef PORTATTN_HOPPER_FWD_TMA_STORE
#define PORTATTN_HOPPER_FWD_TMA_STORE 3
#endif
// PORTATTN_HOPPER_FWD_O_VEC=1 (the default) builds the direct O stores (hd64, hd256, varlen
// tails) as 16-byte stores after a quad transpose instead of each thread's 4-byte pairs; =0 the
// 4-byte loop. Same-call A/Bs on an H100, bf16, two rounds each: at 16k tokens hd64 512-2k within
// -2 to +3% (archive:2026-11-25-95d7f2a/summary.md); many short sequences (batch 512, 16 heads;
// archive:2026-11-26-0912545-tuning/grid_T1) 256 rows +3-4% no mask, +1-3% causal, 100-200 rows
// within 1%. Those calls are DRAM-bound (ncu, hd64 x 128 rows: DRAM 84% busy, cuDNN's kernel 90%),
// where whole-sector writes count.
#ifndef PORTATTN_HOPPER_FWD_O_VEC
#define PORTATTN_HOPPER_FWD_O_VEC 1
#endif
// 1: O staged for the TMA store by stmatrix (Note [portattn hopper O stmatrix]); 0: by 32-bit stores.
#ifndef PORTATTN_HOPPER_FWD_STMATRIX
#define PORTATTN_HOPPER_FWD_STMATRIX 1
#endif
// 1: the tile's LSE and 1 / row sum by the approximate MUFU forms (Note [portattn fast finalize] in
// online_softmax.h); 0: log2f and an IEEE division. Kept for A/B.
#ifndef PORTATTN_HOPPER_FWD_FAST_FINALIZE
#define PORTATTN_HOPPER_FWD_FAST_FINALIZE 1
#endif
// The edge blocks' mask: 1 (the default) with the bounds moved to each column's constant offset,
// a compare with an immediate an element; 2 as one bit per fragment column (Note [portattn hopper
// mask bits]: ~50 fewer instructions a masked block, yet 0 to -1.5% at hd64 512-1k causal in two
// A/Bs, within 1% elsewhere, so not the default); 0 with each column's index compared to both
// bounds. Kept for A/B.
#ifndef PORTATTN_HOPPER_FWD_MASK_REL
#define PORTATTN_HOPPER_FWD_MASK_REL 1
#endif
// Note [portattn hopper softmax under P V]
// The pipelined loop issues S(j) and P(j-1) V(j-1) together, waits for S(j) (wgmma.wait_group 1),
// runs block j's softmax, and only then waits for P V (wait_group 0), so that the softmax runs
// while P V is on the tensor cores. ptxas (13.0) schedules the P V wait (WARPGROUP.DEPBAR.LE gsb0,
// 0x0) to the top of the basic block that holds the softmax, ahead of all 64-88 exponentials,
// whatever the PTX order, but does not move it across a basic-block boundary. So the softmax sits
// in a block of its own: a branch on a value that is true in every launch but that neither
// compiler can know (the launch's dynamic shared memory size, read from %dynamic_smem_size). A
// branch around the wait itself serialises every wgmma (C7514); a __syncwarp or an inline-PTX
// branch before the wait is optimised away; a condition on a kernel argument is folded where the
// compiler can prove it (docs/tried-and-rejected.md). SASS of the kernels that take it: DEPBAR
// 0x1, the K release, the MUFU.EX2s, DEPBAR 0x0; no C75xx; 0 spills.
// Where: the hd128 kernels with 176-key blocks (8k-16k keys) only. Same-call A/B on an H100, two
// rounds (docs/kernels-hopper.md): there 8k causal +7.0%, 16k causal +4.7%, 16k no mask +7.2%, 8k
// no mask -1.0%; elsewhere it loses: hd64 causal -2.5 to -7.2%, hd128 128-key blocks -0.7 to
// -2.6% without a mask at 512-2k. With two warpgroups sharing the tensor cores (and taking turns
// under ping-pong), a warpgroup that waits for its own P V leaves the issue slots and the tensor
// cores to the other; only the long 176-key blocks gain from overlapping their own P V (not
// profiled).
// PORTATTN_HOPPER_FWD_SOFTMAX_UNDER_PV=0 builds it nowhere, =2 in every pipelined kernel (A/B).
#ifndef PORTATTN_HOPPER_FWD_SOFTMAX_UNDER_PV
#define PORTATTN_HOPPER_FWD_SOFTMAX_UNDER_PV 1
#endif

// Note [portattn hopper lazy rescale]
// The pipelined loop of the hd128 kernels with 128-key blocks rescales O only when some row of
// the warp sees its maximum grow by more than 2^8 (online_softmax_step_deferred_lazy, after
// Note [portattn lazy rescale] in online_softmax.h; each row decides for itself, so no vote sits
// before the exponentials): the 64 multiplies a thread does between a block's P V landing and the
// next issue mostly disappear. P may then reach 2^8, exact in bf16 / fp16 and cancelled by the
// row sum, which uses the same maximum. Where (same-call A/Bs on an H100, three rounds each,
// docs/kernels-hopper.md): hd128 with 128-key blocks (512-4k keys) +0.2 to +4.4%, every cell;
// hd128 with 176-key blocks (8k-16k) -1 to -7%; hd64 -10 to +1% (-7 to -10% at 512-1k without a
// mask). One decision per warp (a vote before the exponentials) loses 2-3% at hd128 512-1k and
// 3-7% at hd64. =0 builds the per-block rescale everywhere, =2 the lazy one in every pipelined
// kernel (A/B).
#ifndef PORTATTN_HOPPER_FWD_LAZY_RESCALE
#define PORTATTN_HOPPER_FWD_LAZY_RESCALE 1
#endif
constexpr int hopper_fwd_block_n(int head_dim) {
  return head_dim <= 128 ? 128 : head_dim <= 192 ? PORTATTN_HOPPER_FWD_HD192_BLOCK_N : PORTATTN_HOPPER_FWD_HD256_BLOCK_N;
}

template <int kHeadDim, int kSchedule>
struct HopperFwdTraits {
  static constexpr bool kPipelined = (kSchedule & kSchedPipelined) != 0;
  static constexpr bool kPingPong = (kSchedule & kSchedPingPong) != 0;
  static constexpr bool kPersistent = (kSchedule & kSchedPersistent) != 0;
  static_assert(!kPingPong || kPipelined, "ping-pong is built on the pipelined consumer loop");
  static constexpr int kPolyEvery =
      (kSchedule & kSchedExp2Poly4) ? 4 : ((kSchedule & kSchedExp2Poly8) ? 8 : 0);
  static_assert(kPolyEvery == 0 || kPipelined, "the polynomial exp2 is in the pipelined loop only");
  static constexpr bool kThreeConsumers = (kSchedule & kSchedThreeConsumers) != 0;
  static_assert(!kThreeConsumers || kHeadDim == 64,
                "three consumer warpgroups fit the register file at head dim 64 only (O is 32 fp32 a thread)");
  // Consumer warpgroups, each owning 64 query rows (the M of one wgmma).
  static constexpr int kConsumers = kThreeConsumers ? 3 : 2;
  static constexpr int kBlockM = 64 * kConsumers;
  // Keys per block (hopper_fwd_block_n): S is 64 x kBlockN fp32 per warpgroup, kBlockN / 2 registers a thread.
  // kSchedWideKeys: 176 at hd128 (Note [portattn hopper 176-key blocks]).
  static constexpr bool kWideKeys = (kSchedule & kSchedWideKeys) != 0;
  static_assert(!kWideKeys || kHeadDim == 128, "176-key blocks are an hd128 shape (admitted_bits)");
  // kSchedNarrowKeys: 80 at hd192 (Note [portattn hopper hd192]).
  static constexpr bool kNarrowKeys = (kSchedule & kSchedNarrowKeys) != 0;
  static_assert(!kNarrowKeys || kHeadDim == 192, "80-key blocks are an hd192 shape here (admitted_bits)");
  static constexpr int kBlockN = kWideKeys ? 176 : kNarrowKeys ? 80 : hopper_fwd_block_n(kHeadDim);
  // hd64 tiles are half the size, so twice the stages fit: deeper prefetch for free.
  // kSchedStages3 exists at hd128 only (hd64 has 4 stages; hd256's third would need 288 KiB).
  static constexpr int kStages =
      kHeadDim <= 64 ? 4 : ((kHeadDim == 128 && (kSchedule & kSchedStages3)) ? 3 : 2);
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg values (multiples of 8) whose sum fits the SM's 65536 registers:
  // two consumers 128 x 24 + 256 x 240 = 64512; three 128 x 24 + 384 x 160 = 64512
  // (168 would need 67584). The producer's one thread needs few either way.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kThreeConsumers ? 160 : 240;
  static constexpr int kPanel = 64;  // elements per 128-byte swizzled row
  static constexpr int kPanels = kHeadDim / kPanel;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kSmemLimit = 227 * 1024;
  // A persistent CTA double-buffers Q where shared memory allows, so the next
  // tile's Q arrives while this tile's last blocks run.
  static constexpr int kQBuffers =
      kPersistent && 2 * kQBytes + 2 * kStages * kKVBytes + 8 * (4 + 4 * kStages) + 1024 <= kSmemLimit ? 2 : 1;
  // Per Q buffer: full, empty; then per stage: K full, V full, K empty, V empty.
  static constexpr int kBarriers = 2 * kQBuffers + 4 * kStages;
  static constexpr int kMainSmemBytes = kQBuffers * kQBytes + 2 * kStages * kKVBytes + 8 * kBarriers +
                                        1024;  // slack to align the tiles to the 1 KiB swizzle atom
  // The output tile staged for TMA stores (Note [portattn hopper O store]) where it measured
  // faster and fits beside the rest: hd128 (also with two Q buffers; not with three stages), and
  // hd64 with two consumers.
  static constexpr int kOBytes = kBlockM * kHeadDim * 2;
  static constexpr bool kTmaStoreO = (PORTATTN_HOPPER_FWD_TMA_STORE == 2 || (PORTATTN_HOPPER_FWD_TMA_STORE != 0 && kHeadDim == 128) ||
                                      (PORTATTN_HOPPER_FWD_TMA_STORE == 3 && kHeadDim == 64 && !kThreeConsumers)) &&
                                     kMainSmemBytes + kOBytes <= kSmemLimit;
  static constexpr int kSmemBytes = kMainSmemBytes + (kTmaStoreO ? kOBytes : 0);
  // Note [portattn hopper cross-tile phase]: the next tile's Q must arrive in the other
  // buffer while this tile's Q is still in use (schedule_for drops the bit elsewhere).
  static constexpr bool kCrossTile = (kSchedule & kSchedCrossTile) != 0;
  static_assert(!kCrossTile || (kPersistent && kPipelined && kQBuffers == 2),
                "the cross-tile phase is a step of the persistent pipelined loop with two Q buffers");
  // Note [portattn hopper paired tiles]: an order of a persistent launch's tiles.
  static constexpr bool kPairedTiles = (kSchedule & kSchedPairedTiles) != 0;
  static_assert(!kPairedTiles || kPersistent, "paired tiles are an order of the persistent grid's walk");
  // Note [portattn hopper softmax under P V].
  static constexpr bool kSoftmaxUnderPv =
      PORTATTN_HOPPER_FWD_SOFTMAX_UNDER_PV == 2 || (PORTATTN_HOPPER_FWD_SOFTMAX_UNDER_PV == 1 && kWideKeys);
  // Note [portattn hopper lazy rescale].
  static constexpr bool kLazyRescale =
      PORTATTN_HOPPER_FWD_LAZY_RESCALE == 2 || (PORTATTN_HOPPER_FWD_LAZY_RESCALE == 1 && kHeadDim == 128 && !kWideKeys);
  static_assert(kHeadDim % kPanel == 0, "head dim must be a multiple of 64");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256,
                "kBlockN: whole k16 steps of P V, and a wgmma N (multiple of 8, <= 256) for S = Q K^T");
  static_assert(kSmemBytes <= kSmemLimit, "exceeds the sm90 shared-memory opt-in limit");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536,
                "register split exceeds the register file");
};

// Scalars of one launch; the tensor maps travel as separate __grid_constant__ params.
struct HopperFwdArgs {
  void* out;
  PortattnTensor4 out_strides;
  float* lse;
  int64_t lse_batch_stride;
  int64_t lse_head_stride;
  int seqlen_q;  // varlen: the maximum over the batch
  int seqlen_k;
  const int32_t* cu_seqlens_q;  // varlen (packed rows; tensor maps with one "batch"), else null
  const int32_t* cu_seqlens_k;
  int64_t total_q;  // rows of q / k along the sequence axis (params.h), the clamp of seq_bounds.h
  int64_t total_k;
  int nheads;
  int head_dim;      // the call's: below kHeadDim when this kernel serves it padded (Note [portattn hopper padded head dims])
  int heads_per_kv;  // nheads / nheads_k
  int num_m_blocks;  // query blocks per (head, batch)
  int num_tiles;     // num_m_blocks * nheads * batch
  int group_heads;   // masked persistent order: (head, batch) pairs per L2 group
  // decode_tile's divisors (common/fast_divide.h): every tile a CTA takes is decoded by
  // its producer and every consumer thread, and short calls take ~60-120 tiles a CTA.
  FastDivisor div_m_blocks;     // num_m_blocks
  FastDivisor div_heads;        // nheads
  FastDivisor div_heads_per_kv;  // heads_per_kv
  FastDivisor div_group_tiles;  // group_heads * num_m_blocks: the tiles of a full group
  FastDivisor div_group_heads;  // group_heads
  FastDivisor div_last_group;   // the (head, batch) pairs of the last group, which may be short
  int last_group;               // its index
  int paired_tiles;  // kSchedPairedTiles launches: 1 when the walk pairs tiles (more tiles than CTAs)
  int window_left;   // kMaskLocal: -1 = unbounded
  int window_right;
  float scale_log2;  // softmax_scale * log2(e); log2(e) with softcap (scores capped first)
  float softcap;     // kSoftcap: s = softcap * tanh(s * softcap_scale)
  float softcap_scale;  // softmax_scale / softcap
};

struct HopperTile {
  int m_block, head, batch;
  int q_start, k_start;    // first row of the sequence (varlen), else 0
  int seqlen_q, seqlen_k;  // of this sequence
  int tma_batch;           // the batch coordinate of the tensor maps (0 for varlen)
  bool rows;               // the tile has rows of its sequence (varlen: not past its end)
  int n_end;     // one past the last key block any row of the tile sees
  int n_blocks;  // key blocks n_end - n_blocks .. n_end - 1 (0: only empty rows)
};

// Tile t of the launch. Non-causal tiles cost the same, so the query block
// varies fastest (a head's K/V stays hot in L2). Causal tiles cost in
// proportion to their query block: a launch of one CTA per tile lists the
// longest first within each head (the hardware hands out CTAs as SMs free
// up). A persistent launch deals a fixed list out in snake order
// (tile_of_cta), so the list must be sorted longest first to balance: the
// (head, batch) pairs are cut into groups of group_heads whose K/V fit in
// about half the L2, and inside a group the query block is the slowest
// index, longest first. (Longest first over the whole launch balanced
// perfectly but thrashed L2: 132 heads' K/V at once; measured 0.73x of the
// one-CTA-per-tile launch at 1k tokens. A plain stride over the per-head
// order left one CTA 1.6x the mean at 16k tokens: 128 query blocks against
// 132 CTAs.)
//
// Note [portattn hopper paired tiles]
// kSchedPairedTiles, masked persistent launches with more tiles than CTAs: the
// walk deals equal-cost pairs instead of single tiles. A causal tile of query
// block m costs about m + 1 key blocks, so blocks m and nm - 1 - m of one head
// cost nm + 1 together, whatever m. Each head's blocks are listed as nm - 1, 0,
// nm - 2, 1, ... and odd heads' lists reversed, so launch positions 2q, 2q + 1
// always hold such a pair, or (nm odd) the middle blocks of two neighbouring
// heads, which cost the same. CTA c takes pairs c, c + gridDim.x, ...: every CTA
// ends within one pair of the others (ceil(pairs / CTAs) / (pairs / CTAs), 1.03
// at 16k tokens). The group order's deal of single tiles ends 9-15% (hd64) and
// 14-20% (hd128) past the mean in a model that charges each tile its key blocks
// plus one (bench/tools/tile_balance.py): the last rounds hand some CTAs only long
// tiles. A pair's two tiles share K/V in L2, and 132 CTAs run 264 consecutive
// tiles: 66 heads at 512 keys, 33 at 1k. Varlen keeps the pairing of the
// longest sequence's blocks (a shorter sequence's pair may be unequal).
template <int kMask, bool kPersistent, bool kPaired, int kBlockM, int kBlockN>
__device__ __forceinline__ HopperTile decode_tile(int t, const HopperFwdArgs& args) {
  constexpr bool kLongestFirst = kMask != kMaskNone;
  HopperTile tile;
  int hb;
  if (kPaired && args.paired_tiles) {
    // Note [portattn hopper paired tiles]: a head's query blocks listed as
    // nm-1, 0, nm-2, 1, ... (reversed for odd heads), so positions 2q and 2q+1
    // of the launch hold one long and one short block, or two middle blocks.
    int i;
    hb = fast_divmod(t, args.div_m_blocks, i);
    const int listed = (hb & 1) ? args.num_m_blocks - 1 - i : i;
    tile.m_block = (listed & 1) ? listed / 2 : args.num_m_blocks - 1 - listed / 2;
  } else if (kLongestFirst && kPersistent) {
    // Groups of group_heads (head, batch) pairs; the last group may hold fewer.
    int index;
    const int group = fast_divmod(t, args.div_group_tiles, index);
    int within;
    const FastDivisor& size = group == args.last_group ? args.div_last_group : args.div_group_heads;
    const int from_end = fast_divmod(index, size, within);
    hb = group * args.group_heads + within;
    tile.m_block = args.num_m_blocks - 1 - from_end;
  } else {
    int m;
    hb = fast_divmod(t, args.div_m_blocks, m);
    tile.m_block = kLongestFirst ? args.num_m_blocks - 1 - m : m;
  }
  int head;
  tile.batch = fast_divmod(hb, args.div_heads, head);
  tile.head = head;
  // seqused_k is refused on this path (hopper_host.h), hence null.
  const SeqBounds seq = seq_bounds(args.cu_seqlens_q, args.cu_seqlens_k, nullptr, args.seqlen_q, args.seqlen_k,
                                   args.total_q, args.total_k, tile.batch);
  tile.q_start = seq.q_start;
  tile.k_start = seq.k_start;
  tile.seqlen_q = seq.len_q;
  tile.seqlen_k = seq.len_k;
  tile.tma_batch = args.cu_seqlens_q != nullptr ? 0 : tile.batch;
  tile.rows = tile.m_block * kBlockM < tile.seqlen_q;
  // Key j is visible to query i when i + diag - window_left <= j <= i + diag + window_right.
  // The masking rule, written out here rather than through common/block_range.h
  // (Note [portattn visible keys]): the port to the helpers measured 7-11% slower
  // forward at some points (0-5%) on an H100 (block_range.h says where).
  const int diag = tile.seqlen_k - tile.seqlen_q;
  const int right = kMask == kMaskCausal ? 0 : args.window_right;
  int n_end = (tile.seqlen_k + kBlockN - 1) / kBlockN;
  if (kMask != kMaskNone && right >= 0) {
    const int last_row = min((tile.m_block + 1) * kBlockM, tile.seqlen_q) - 1;
    const int last_key = last_row + diag + right;
    n_end = last_key < 0 ? 0 : min(n_end, last_key / kBlockN + 1);
  }
  int n_begin = 0;
  if (kMask == kMaskLocal && args.window_left >= 0) {
    const int first_key = tile.m_block * kBlockM + diag - args.window_left;
    n_begin = first_key <= 0 ? 0 : first_key / kBlockN;
  }
  tile.n_end = n_end;
  tile.n_blocks = tile.rows && n_end > n_begin ? n_end - n_begin : 0;
  return tile;
}

// The tile this CTA takes in round r (one round per gridDim.x tiles), or
// num_tiles when it has none in that round: rounds alternate direction.
// kPaired (Note [portattn hopper paired tiles]): rounds 2k and 2k+1 take the two
// tiles of pair k * gridDim.x + blockIdx.x.
template <bool kPaired>
__device__ __forceinline__ int tile_of_cta(int round, int num_tiles, bool paired) {
  const int t = kPaired && paired
                    ? 2 * ((round >> 1) * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x)) + (round & 1)
                    : round * gridDim.x + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  return t < num_tiles ? t : num_tiles;
}

// Whether round r can hold a tile of this launch for any CTA (the walks' bound).
template <bool kPaired>
__device__ __forceinline__ bool round_in_launch(int round, int num_tiles, bool paired) {
  const int ctas = static_cast<int>(gridDim.x);
  return kPaired && paired ? 2 * (round >> 1) * ctas < num_tiles : round * ctas < num_tiles;
}

// named_barrier_arrive / named_barrier_sync: hopper_ptx.cuh. Ids 1-3: the ping-pong
// turns; kOStoreBarrier + wg: warpgroup wg's output staging (Note [portattn hopper O store]).
constexpr int kOStoreBarrier = 4;

// ---- the kernel ---------------------------------------------------------------------

template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, int kSchedule>
__global__ void __launch_bounds__(HopperFwdTraits<kHeadDim, kSchedule>::kThreads, 1)
    hopper_fwd_kernel(const __grid_constant__ CUtensorMap tm_q,
                      const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                      const HopperFwdArgs args) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = HopperFwdTraits<kHeadDim, kSchedule>;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr bool kPaired = Traits::kPairedTiles && kMask != kMaskNone;
  constexpr int kPanelBytesQ = kBlockM * 128;
  constexpr int kPanelBytesKV = kBlockN * 128;
  constexpr int kSCols = kBlockN / 4;   // S fragment columns per thread row
  constexpr int kOCols = kHeadDim / 4;  // O fragment columns per thread row

  extern __shared__ uint8_t smem_raw[];
  // Swizzle atoms must start 1 KiB aligned for base offset 0 in the descriptors.
  const uint32_t smem_base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  constexpr int kQBuffers = Traits::kQBuffers;
  const uint32_t s_q = smem_base;                                   // kQBuffers x kQBytes
  const uint32_t s_k = s_q + kQBuffers * Traits::kQBytes;           // kStages x kKVBytes
  const uint32_t s_v = s_k + kStages * Traits::kKVBytes;            // kStages x kKVBytes
  const uint32_t s_o = s_v + kStages * Traits::kKVBytes;  // kTmaStoreO: kOBytes, panels as Q's
  const uint32_t bars = s_o + (Traits::kTmaStoreO ? Traits::kOBytes : 0);
  auto bar_q_full = [&](int b) { return bars + 8u * b; };
  auto bar_q_empty = [&](int b) { return bars + 8u * (kQBuffers + b); };
  constexpr int kKVBars = 2 * kQBuffers;
  auto bar_k_full = [&](int s) { return bars + 8u * (kKVBars + s); };
  auto bar_v_full = [&](int s) { return bars + 8u * (kKVBars + kStages + s); };
  auto bar_k_empty = [&](int s) { return bars + 8u * (kKVBars + 2 * kStages + s); };
  auto bar_v_empty = [&](int s) { return bars + 8u * (kKVBars + 3 * kStages + s); };

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int b = 0; b < kQBuffers; ++b) {
      sm90::mbar_init(bar_q_full(b), 1);
      sm90::mbar_init(bar_q_empty(b), Traits::kConsumers * 4);  // one arrival per consumer warp
    }
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(bar_k_full(s), 1);
      sm90::mbar_init(bar_v_full(s), 1);
      sm90::mbar_init(bar_k_empty(s), Traits::kConsumers * 4);
      sm90::mbar_init(bar_v_empty(s), Traits::kConsumers * 4);
    }
    // Make the initialised barriers visible to the copy engine (async proxy).
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer ----
    sm90::setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x == 0) {
      sm90::prefetch_tensormap(&tm_q);
      sm90::prefetch_tensormap(&tm_k);
      sm90::prefetch_tensormap(&tm_v);
      int q_fills = 0, kv_fills = 0;  // across tiles: buffer index and phase parity
      for (int round = 0; round_in_launch<kPaired>(round, args.num_tiles, args.paired_tiles != 0); ++round) {
        const int t = tile_of_cta<kPaired>(round, args.num_tiles, args.paired_tiles != 0);
        if (t == args.num_tiles) continue;
        const HopperTile tile = decode_tile<kMask, Traits::kPersistent, kPaired, kBlockM, kBlockN>(t, args);
        if (tile.n_blocks == 0) continue;
        const int head_k = fast_div(tile.head, args.div_heads_per_kv);
        const int qb = q_fills % kQBuffers;
        sm90::mbar_wait(bar_q_empty(qb), ((q_fills / kQBuffers) & 1) ^ 1);
        ++q_fills;
        sm90::mbar_arrive_expect_tx(bar_q_full(qb), Traits::kQBytes);
#pragma unroll
        for (int p = 0; p < Traits::kPanels; ++p)
          sm90::tma_load_4d(s_q + qb * Traits::kQBytes + p * kPanelBytesQ, &tm_q, bar_q_full(qb),
                            p * Traits::kPanel, tile.q_start + tile.m_block * kBlockM, tile.head,
                            tile.tma_batch);
        for (int it = 0; it < tile.n_blocks; ++it, ++kv_fills) {
          const int stage = kv_fills % kStages;
          const uint32_t free_parity = ((kv_fills / kStages) & 1) ^ 1;
          const int n_block = tile.n_end - 1 - it;
          // K then V of the block, each into its ring slot once the consumers freed it.
          auto load = [&](const CUtensorMap* map, uint32_t dst, uint32_t empty, uint32_t full) {
            sm90::mbar_wait(empty, free_parity);
            sm90::mbar_arrive_expect_tx(full, Traits::kKVBytes);
#pragma unroll
            for (int p = 0; p < Traits::kPanels; ++p)
              sm90::tma_load_4d(dst + p * kPanelBytesKV, map, full, p * Traits::kPanel,
                                tile.k_start + n_block * kBlockN, head_k, tile.tma_batch);
          };
          load(&tm_k, s_k + stage * Traits::kKVBytes, bar_k_empty(stage), bar_k_full(stage));
          load(&tm_v, s_v + stage * Traits::kKVBytes, bar_v_empty(stage), bar_v_full(stage));
        }
      }
    }
  } else {
    // ---- consumers ----
    sm90::setmaxnreg_inc<Traits::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int q4 = lane % 4;
    // This warpgroup's 64 rows of each Q panel start wg * 64 * 128 bytes into its buffer.
    // Descriptors (Note [portattn hopper backward descriptors], hopper_bwd_kernel.cuh: the
    // same reasons): every operand's from one base plus a byte offset, made warp-uniform by a
    // shuffle of lane 0's value (Q's once a tile, K's and V's stage once a product). Against
    // per-instruction descriptors (docs/kernels-hopper.md): hd64 short causal +2-5%, hd128 8k-16k
    // +4-11%, and the one loss, many short hd64 sequences of 100 rows without a mask, -3%.
    const uint64_t desc_base = sm90::make_smem_desc(smem_base, 0, 1024);
    auto q_offset_of = [&](int buffer) {
      return __shfl_sync(0xffffffffu, static_cast<uint32_t>(buffer * Traits::kQBytes + wg * 64 * 128), 0);
    };
    uint32_t q_off_wg = q_offset_of(0);

    // Ping-pong (Note [portattn hopper forward schedule]): warpgroup wg waits
    // on barrier 1 + wg before issuing products and then opens the next
    // one's, round robin (0 -> 1 -> 0, or 0 -> 1 -> 2 -> 0 with three
    // consumers). Per non-empty tile each warpgroup has n + 1 issue phases
    // (with kCrossTile, per stream of fused tiles: one less per tile fused
    // into the next, Note [portattn hopper cross-tile phase]); the last
    // warpgroup opens the first's barrier once up front and skips its own
    // last opening, so every barrier phase gets exactly 256 threads (the
    // waiting warpgroup and the one before it).
    constexpr int kLastWg = Traits::kConsumers - 1;
    auto turn_wait = [&]() {
      if constexpr (Traits::kPingPong) sm90::named_barrier_sync(1 + wg, 256);
    };
    auto turn_pass = [&](bool last_phase) {
      if constexpr (Traits::kPingPong) {
        // (2 - wg written out for two: the same value, but the two-consumer
        // kernels' SASS stays what was measured.)
        const int next = Traits::kConsumers == 2 ? 2 - wg : (wg == kLastWg ? 1 : 2 + wg);
        if (!(last_phase && wg == kLastWg)) sm90::named_barrier_arrive(next, 256);
      }
    };
    // Lane 0 of each warp hands a buffer back once the whole warp is past it.
    auto release = [&](uint32_t bar) {
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(bar);
    };
    // A stage's K / V offset from the base, warp-uniform; taken before the waits that precede
    // the issue, so the shuffle's latency is not between a turn's wait and its products.
    auto k_offset = [&](int stage) {
      return __shfl_sync(0xffffffffu, (s_k - smem_base) + stage * Traits::kKVBytes, 0);
    };
    auto v_offset = [&](int stage) {
      return __shfl_sync(0xffffffffu, (s_v - smem_base) + stage * Traits::kKVBytes, 0);
    };
    // Note [portattn hopper forward descriptors]: a product's first descriptor from the runtime
    // offset, every later k16 step's by a compile-time advance of it. Written as one
    // smem_desc_at(base, offset + step) a step, ptxas added the step to the offset and then
    // shifted, a dependent pair of uniform operations (UIADD3, ULEA.HI) before each of the 12
    // wgmma a block at hd64; an advance is one add with an immediate.
    auto issue_s = [&](float (&s)[2][kSCols], uint32_t k_stage_off) {
      const uint64_t desc_q0 = sm90::smem_desc_at(desc_base, q_off_wg, 16);
      const uint64_t desc_k0 = sm90::smem_desc_at(desc_base, k_stage_off, 16);
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const uint32_t offset = (kk % 4) * 32;  // k16 step inside the 128-byte panel row
        const uint64_t desc_q = sm90::smem_desc_advance(desc_q0, (kk / 4) * kPanelBytesQ + offset);
        const uint64_t desc_k = sm90::smem_desc_advance(desc_k0, (kk / 4) * kPanelBytesKV + offset);
        sm90::wgmma_ss<Elem, 0, 0, kSCols>(s, desc_q, desc_k, kk > 0 ? 1 : 0);  // N = kBlockN
      }
      sm90::wgmma_commit();
    };
    auto issue_pv = [&](float (&o)[2][kOCols], const uint32_t (&p)[kBlockN / 16][4], uint32_t v_stage_off) {
      const uint64_t desc_v0 = sm90::smem_desc_at(desc_base, v_stage_off, kPanelBytesKV);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        sm90::wgmma_rs<Elem>(o, p[kk], sm90::smem_desc_advance(desc_v0, kk * 16 * 128));
      sm90::wgmma_commit();
    };
    // P as the A fragment of k16 step kk: columns 16kk..16kk+15 = chunks 2kk, 2kk+1.
    auto pack_p = [&](uint32_t (&p)[kBlockN / 16][4], const float (&s)[2][kSCols]) {
      sm90::pack_a_fragment<Elem>(p, s);
    };
    // A tile's state: O, the softmax rows, and S / P of the block in flight. They live across
    // tiles because with kCrossTile a tile's first block runs in the last tile's final phase
    // (Note [portattn hopper cross-tile phase]).
    float o[2][kOCols];
    softmax::RowState<2> state;
    float s[2][kSCols];
    uint32_t p[kBlockN / 16][4];
    float correction[2];
    auto start_tile = [&]() {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < kOCols; ++c) o[r][c] = 0.f;
      state.init();
    };
    // Softcap, then the mask: keys past seqlen_k (TMA zero-filled them)
    // and outside each row's window. Only blocks that straddle an edge pay
    // for the mask: the right edge is tightest for the tile's first row,
    // the left edge for its last.
    auto mask = [&](float (&s)[2][kSCols], int it, const HopperTile& tile) {
      if constexpr (kSoftcap) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int c = 0; c < kSCols; ++c) s[r][c] = args.softcap * tanhf(s[r][c] * args.softcap_scale);
      }
      const int diag = tile.seqlen_k - tile.seqlen_q;
      const int m0 = tile.m_block * kBlockM;
      const int row0 = m0 + wg * 64 + warp * 16 + g;  // fragment row r (0/1) is row0 + 8r
      const int right = kMask == kMaskCausal ? 0 : args.window_right;
      const bool right_bound = kMask != kMaskNone && right >= 0;
      const bool left_bound = kMask == kMaskLocal && args.window_left >= 0;
      const int col_base = (tile.n_end - 1 - it) * kBlockN;
      // (Varlen keys past the sequence's end are the next sequence's rows.)
      const bool edge = col_base + kBlockN > tile.seqlen_k ||
                        (right_bound && col_base + kBlockN - 1 > m0 + diag + right) ||
                        (left_bound && col_base < m0 + kBlockM - 1 + diag - args.window_left);
      if (edge) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + 8 * r;
          const int hi = right_bound ? min(tile.seqlen_k - 1, row + diag + right) : tile.seqlen_k - 1;
          const int lo = left_bound ? row + diag - args.window_left : 0;
#if PORTATTN_HOPPER_FWD_MASK_REL == 2
          // Note [portattn hopper mask bits]: the columns this row keeps, one bit per fragment column.
          const int first = col_base + 2 * q4;
          const auto keep = mask_bits::row_keep<kSCols>(hi - first, left_bound ? lo - first : 0);
#pragma unroll
          for (int c = 0; c < kSCols; ++c)
            if (!mask_bits::kept(keep, c)) s[r][c] = softmax::neg_inf();
#elif PORTATTN_HOPPER_FWD_MASK_REL
          // Column c of this thread is col_base + 2 q4 + a constant: the bounds are moved to that
          // constant's side once per row, so an element costs a compare with an immediate and a
          // select; the left bound is tested only where there is one (columns are never negative).
          const int first = col_base + 2 * q4;
#pragma unroll
          for (int c = 0; c < kSCols; ++c) {
            const int offset = (c / 2) * 8 + (c % 2);
            if (offset > hi - first || (left_bound && offset < lo - first)) s[r][c] = softmax::neg_inf();
          }
#else
#pragma unroll
          for (int c = 0; c < kSCols; ++c) {
            const int col = col_base + (c / 2) * 8 + 2 * q4 + (c % 2);
            if (col > hi || col < lo) s[r][c] = softmax::neg_inf();
          }
#endif
        }
      }
    };
    // O normalised and written, and the LSE: the tile's end.
    auto finish_tile = [&](const HopperTile& tile) {
      const int m0 = tile.m_block * kBlockM;
      const int row0 = m0 + wg * 64 + warp * 16 + g;
      float lse[2];
      softmax::online_softmax_finalize<2, kOCols, sm90::QuadReduce, PORTATTN_HOPPER_FWD_FAST_FINALIZE != 0>(
          o, state, args.scale_log2, 1.f, lse);
      // Note [portattn hopper O store]: this warpgroup's 64 rows through shared memory
      // and one TMA store per panel, unless a varlen tile's rows run past its sequence
      // (the packed map would write the next sequence's rows there).
      const int wg_row = m0 + wg * 64;
      if (Traits::kTmaStoreO && (args.cu_seqlens_q == nullptr || wg_row + 64 <= tile.seqlen_q)) {
        const uint32_t s_o_wg = s_o + wg * 64 * 128;
        if (tid == 0) sm90::bulk_wait_group_read<0>();  // the last tile's store has read the buffer
        sm90::named_barrier_sync(kOStoreBarrier + wg, 128);
#if PORTATTN_HOPPER_FWD_STMATRIX
        // Note [portattn hopper O stmatrix]: each stmatrix.x4 writes four 8 x 8 matrices of the
        // warp's 16 rows: (rows 0-7, chunk 2k), (rows 8-15, chunk 2k), (0-7, 2k + 1), (8-15, 2k + 1),
        // 8-column chunks, in the order of its registers. Lane l addresses row l % 8 of matrix l / 8.
        // Every 8-row group starts at a multiple of 8, so a row's index mod 8 is l % 8 and the 128B
        // swizzle puts chunk c of it at c ^ (l % 8); the chunk's parity is the matrix's
        // ((l / 16) & 1), so the swizzled position is (2k mod 8) ^ lane_x with lane_x below. One
        // instruction for 4 of the 32-bit stores before (hd128: 8 a thread instead of 32).
        const uint32_t lane_x = static_cast<uint32_t>(((lane >> 4) & 1) ^ (lane & 7));
        const uint32_t s_o_lane = s_o_wg + (warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * 128;
#pragma unroll
        for (int k = 0; k < kOCols / 4; ++k) {
          const int chunk = 2 * k;
          const uint32_t addr = s_o_lane + (chunk / 8) * kPanelBytesQ + (((chunk % 8) ^ lane_x) << 4);
          sm90::stmatrix_x4(addr, ptx::ElemTraits<Elem>::pack(o[0][4 * k], o[0][4 * k + 1]),
                            ptx::ElemTraits<Elem>::pack(o[1][4 * k], o[1][4 * k + 1]),
                            ptx::ElemTraits<Elem>::pack(o[0][4 * k + 2], o[0][4 * k + 3]),
                            ptx::ElemTraits<Elem>::pack(o[1][4 * k + 2], o[1][4 * k + 3]));
        }
#else
        // Row warp * 16 + g (+ 8) of the warpgroup's 64, so the row mod 8 is g: the 128B
        // swizzle puts 16-byte chunk k of a 128-byte panel row at chunk k ^ g.
        const uint32_t s_o_thread = s_o_wg + (warp * 16 + g) * 128 + q4 * 4;
        const uint32_t g16 = static_cast<uint32_t>(g) * 16;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int c = 0; c < kOCols; c += 2) {
            const int chunk = c / 2;  // 8 columns each
            sm90::st_shared_b32(s_o_thread + r * 8 * 128 + (chunk / 8) * kPanelBytesQ +
                                    ((static_cast<uint32_t>(chunk % 8) * 16) ^ g16),
                                ptx::ElemTraits<Elem>::pack(o[r][c], o[r][c + 1]));
          }
        }
#endif
        sm90::fence_proxy_async_smem();  // the writes above, before the copy engine reads them
        sm90::named_barrier_sync(kOStoreBarrier + wg, 128);
        if (tid == 0) {
#pragma unroll
          for (int p = 0; p < Traits::kPanels; ++p)
            sm90::tma_store_4d(&tm_o, s_o_wg + p * kPanelBytesQ, p * Traits::kPanel, tile.q_start + wg_row,
                               tile.head, tile.tma_batch);
          sm90::bulk_commit_group();
        }
      } else {
        Elem* out = static_cast<Elem*>(args.out) + tile.batch * args.out_strides.batch_stride +
                    tile.head * args.out_strides.head_stride;
#if PORTATTN_HOPPER_FWD_O_VEC
        // 16-byte stores (PORTATTN_HOPPER_FWD_O_VEC): the quad transposes each group of
        // four 8-column chunks so a lane holds one chunk whole; a warp's store then writes 8 rows x
        // 64 contiguous bytes (whole sectors) instead of 8 x 16 (half sectors, ncu: 50% excess).
        // hopper_host.h admits only 16-byte aligned outputs with strides of multiples of 8 elements.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + 8 * r;
          Elem* out_row = out + static_cast<int64_t>(tile.q_start + row) * args.out_strides.row_stride;
#pragma unroll
          for (int group = 0; group < kOCols / 8; ++group) {
            uint32_t v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
              v[j] = ptx::ElemTraits<Elem>::pack(o[r][8 * group + 2 * j], o[r][8 * group + 2 * j + 1]);
            sm90::quad_transpose_pairs(v, q4);  // every lane, before the row test
            const int col = (4 * group + q4) * 8;
            // Padded serving: as in the 4-byte loop below, per 8-column chunk.
            const bool padding = col >= hopper_fwd_min_head_dim(kHeadDim) && col >= args.head_dim;
            if (row < tile.seqlen_q && !padding)
              *reinterpret_cast<uint4*>(out_row + col) = make_uint4(v[0], v[1], v[2], v[3]);
          }
        }
#else
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + 8 * r;
          if (row >= tile.seqlen_q) continue;
          Elem* out_row = out + static_cast<int64_t>(tile.q_start + row) * args.out_strides.row_stride;
#pragma unroll
          for (int c = 0; c < kOCols; c += 2) {
            const int col = (c / 2) * 8 + 2 * q4;
            // Padded serving (Note [portattn hopper padded head dims]): columns at or past the call's
            // head dim are not the call's. Only the last panel's can be (hopper_fwd_min_head_dim), so
            // the compare exists there only (and not at all at hd64), and it is uniform: a kernel
            // arg against a constant, not a second instantiation per kernel. (The TMA store above
            // needs none: its map's innermost extent is the call's head dim, past which it clips.)
            if ((c / 2) * 8 >= hopper_fwd_min_head_dim(kHeadDim) && (c / 2) * 8 >= args.head_dim) continue;
            *reinterpret_cast<uint32_t*>(out_row + col) = ptx::ElemTraits<Elem>::pack(o[r][c], o[r][c + 1]);
          }
        }
#endif
      }
      if (args.lse != nullptr && q4 == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + 8 * r;
          if (row < tile.seqlen_q)
            args.lse[tile.batch * args.lse_batch_stride + tile.head * args.lse_head_stride + tile.q_start + row] =
                lse[r];
        }
      }
    };

    // The tile this CTA takes from round `round` on (advanced to it); false when none is
    // left. Varlen tiles past their sequence's end (rows of another) are skipped, as the
    // producer skips them.
    auto next_tile = [&](int& round, HopperTile& tile) {
      for (; round_in_launch<kPaired>(round, args.num_tiles, args.paired_tiles != 0); ++round) {
        const int t = tile_of_cta<kPaired>(round, args.num_tiles, args.paired_tiles != 0);
        if (t == args.num_tiles) continue;
        tile = decode_tile<kMask, Traits::kPersistent, kPaired, kBlockM, kBlockN>(t, args);
        if (tile.rows) return true;
      }
      return false;
    };
    // Note [portattn hopper softmax under P V]: true in every launch (the kernel always has dynamic
    // shared memory), which only the launch knows.
    const bool softmax_block = sm90::dynamic_smem_bytes() != 0;
    int q_uses = 0, kv_uses = 0;
    int round = 0;
    HopperTile tile, next;
    // kCrossTile: this tile (`next`, of round `round`) had its first block run in the last
    // tile's final phase (Note [portattn hopper cross-tile phase]).
    bool entered = false;
    for (;;) {
      if (entered) tile = next;
      else if (!next_tile(round, tile)) break;
      bool fuse = false;
      const int n_blocks = tile.n_blocks;
      auto stage_of = [&](int it) { return (kv_uses + it) % kStages; };
      auto parity_of = [&](int it) { return static_cast<uint32_t>(((kv_uses + it) / kStages) & 1); };
      if (!entered) start_tile();

      const int qb = q_uses % kQBuffers;
      if (n_blocks > 0) {
        if constexpr (Traits::kPipelined) {
          if (!entered) {
            q_off_wg = q_offset_of(qb);
            sm90::mbar_wait(bar_q_full(qb), (q_uses / kQBuffers) & 1);
            if (Traits::kPingPong && wg == kLastWg) sm90::named_barrier_arrive(1, 256);
            // Phase 0: S(0) alone.
            const uint32_t k_off = k_offset(stage_of(0));
            turn_wait();
            sm90::mbar_wait(bar_k_full(stage_of(0)), parity_of(0));
            sm90::wgmma_fence();
            issue_s(s, k_off);
            turn_pass(false);
            sm90::wgmma_wait<0>();
            sm90::fence_operands(s);
            release(bar_k_empty(stage_of(0)));
            mask(s, 0, tile);
            softmax::online_softmax_step_deferred<true, 2, kSCols, sm90::QuadReduce, Traits::kPolyEvery>(
                s, state, args.scale_log2, correction);
            pack_p(p, s);
          }
          // Phase it: S(it) and P(it-1) V(it-1) in flight together.
          for (int it = 1; it < n_blocks; ++it) {
            const uint32_t k_off = k_offset(stage_of(it)), v_off = v_offset(stage_of(it - 1));
            turn_wait();
            // Both waits before the first issue: ptxas serialises wgmma
            // chains that straddle a branch (warning C7519).
            sm90::mbar_wait(bar_k_full(stage_of(it)), parity_of(it));
            sm90::mbar_wait(bar_v_full(stage_of(it - 1)), parity_of(it - 1));
            sm90::fence_operands(o);
            sm90::wgmma_fence();
            issue_s(s, k_off);
            issue_pv(o, p, v_off);
            turn_pass(false);
            sm90::wgmma_wait<1>();  // S(it) has landed; P V may still run
            sm90::fence_operands(s);
            release(bar_k_empty(stage_of(it)));
            mask(s, it, tile);
            bool rescale = true;  // (Note [portattn hopper lazy rescale])
            // Note [portattn hopper softmax under P V]: always taken; it keeps the P V wait below.
            if (Traits::kSoftmaxUnderPv ? softmax_block : true) {
              if constexpr (Traits::kLazyRescale) {
                rescale = softmax::online_softmax_step_deferred_lazy<2, kSCols, sm90::QuadReduce, Traits::kPolyEvery>(
                    s, state, args.scale_log2, correction);
              } else {
                softmax::online_softmax_step_deferred<false, 2, kSCols, sm90::QuadReduce, Traits::kPolyEvery>(
                    s, state, args.scale_log2, correction);
              }
            }
            sm90::wgmma_wait<0>();
            sm90::fence_operands(o);
            sm90::fence_fragment(p);
            release(bar_v_empty(stage_of(it - 1)));
            if (rescale) softmax::rescale_rows(o, correction);
            pack_p(p, s);
          }
          // Every S of the tile is done: Q can be refilled for the next tile.
          release(bar_q_empty(qb));
          int next_round = round + 1;
          if constexpr (Traits::kCrossTile) fuse = next_tile(next_round, next) && next.n_blocks > 0;
          if (fuse) round = next_round - 1;  // the loop's step takes it to `next`'s round
          if (fuse) {
            // Phase n, fused: the last P V, then the next tile's S(0) (its Q buffer and first K
            // block: (q_uses + 1), block kv_uses + n_blocks); the epilogue runs under S(0).
            const int next_qb = (q_uses + 1) % kQBuffers;
            const uint32_t k_off = k_offset(stage_of(n_blocks)), v_off = v_offset(stage_of(n_blocks - 1));
            q_off_wg = q_offset_of(next_qb);  // (this tile's S products are all issued)
            turn_wait();
            sm90::mbar_wait(bar_v_full(stage_of(n_blocks - 1)), parity_of(n_blocks - 1));
            sm90::mbar_wait(bar_q_full(next_qb), ((q_uses + 1) / kQBuffers) & 1);
            sm90::mbar_wait(bar_k_full(stage_of(n_blocks)), parity_of(n_blocks));
            sm90::fence_operands(o);
            sm90::wgmma_fence();
            issue_pv(o, p, v_off);
            issue_s(s, k_off);
            turn_pass(false);
            sm90::wgmma_wait<1>();  // P V has landed; S(0) of the next tile may still run
            sm90::fence_operands(o);
            sm90::fence_fragment(p);
            release(bar_v_empty(stage_of(n_blocks - 1)));
            finish_tile(tile);
            ++q_uses;
            kv_uses += n_blocks;
            start_tile();
            sm90::wgmma_wait<0>();
            sm90::fence_operands(s);
            release(bar_k_empty(kv_uses % kStages));
            mask(s, 0, next);
            softmax::online_softmax_step_deferred<true, 2, kSCols, sm90::QuadReduce, Traits::kPolyEvery>(
                s, state, args.scale_log2, correction);
            pack_p(p, s);
          } else {
            // Phase n: the last P V alone.
            const uint32_t v_off = v_offset(stage_of(n_blocks - 1));
            turn_wait();
            sm90::mbar_wait(bar_v_full(stage_of(n_blocks - 1)), parity_of(n_blocks - 1));
            sm90::fence_operands(o);
            sm90::wgmma_fence();
            issue_pv(o, p, v_off);
            turn_pass(true);
            sm90::wgmma_wait<0>();
            sm90::fence_operands(o);
            sm90::fence_fragment(p);
            release(bar_v_empty(stage_of(n_blocks - 1)));
            ++q_uses;
            kv_uses += n_blocks;
          }
        } else {
          q_off_wg = q_offset_of(qb);
          sm90::mbar_wait(bar_q_full(qb), (q_uses / kQBuffers) & 1);
          // One block at a time: S, softmax, P V, each waiting for the last.
          for (int it = 0; it < n_blocks; ++it) {
            sm90::mbar_wait(bar_k_full(stage_of(it)), parity_of(it));
            sm90::wgmma_fence();
            issue_s(s, k_offset(stage_of(it)));
            sm90::wgmma_wait<0>();
            sm90::fence_operands(s);
            release(bar_k_empty(stage_of(it)));
            mask(s, it, tile);
            if (it == 0) {
              softmax::online_softmax_step<true, 2, kSCols, kOCols, sm90::QuadReduce>(
                  s, o, state, args.scale_log2);
            } else {
              softmax::online_softmax_step<false, 2, kSCols, kOCols, sm90::QuadReduce>(
                  s, o, state, args.scale_log2);
            }
            pack_p(p, s);
            sm90::mbar_wait(bar_v_full(stage_of(it)), parity_of(it));
            sm90::fence_operands(o);
            sm90::wgmma_fence();
            issue_pv(o, p, v_offset(stage_of(it)));
            sm90::wgmma_wait<0>();
            sm90::fence_operands(o);
            sm90::fence_fragment(p);
            release(bar_v_empty(stage_of(it)));
          }
          release(bar_q_empty(qb));
          ++q_uses;
          kv_uses += n_blocks;
        }
      }
      // (The fused phase wrote this tile's O already. A tile without a visible key: O = 0, LSE = -inf.)
      if (!fuse) finish_tile(tile);
      entered = fuse;
      ++round;
    }
    // The shared-memory source of the last store must stay until the copy engine read it.
    if (Traits::kTmaStoreO && tid == 0) sm90::bulk_wait_group_read<0>();
  }
#endif
}

}  // namespace hopper
}  // namespace portattn
