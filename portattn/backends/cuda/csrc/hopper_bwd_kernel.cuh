// Hopper (sm_90a) backward attention: TMA tile loads, wgmma, warp specialization.
//
// Note [portattn hopper backward]
// What it serves is declared in capability/specs/cuda_sm90.py (the Hopper
// forward's calls, varlen included, at head dims 64, 128 and 96 on the hd128 kernel,
// padded: Note [portattn hopper padded head dims] in hopper_fwd_launch.cuh, backward
// part), 192 (its own kernel, output columns in parts of 128 and 64: Note [portattn hopper hd192
// backward]) and 256 with the head dim split over two CTAs (Note [portattn hopper split head dim]),
// in the default (atomic or bulk dQ) and the deterministic mode. Other calls stay on the sm80+ backward
// (bwd_kernel.cuh); hopper_bwd_entry.cu refuses them with a message. The launch
// sequence, workspace and math are those of Note [portattn cuda backward]:
// the same preprocess (delta = rowsum(dO * O)) and convert kernels run around
// this main kernel, and it writes the same fp32 dQ accumulator (and, for GQA in
// the default mode, the same dK/dV accumulators), so only the main kernel differs.
//
// CTA = 3 warpgroups (384 threads), one CTA per (128-key block, head, batch)
// (deterministic: per (128-key block, KV head, batch), walking the group's query heads):
//   warpgroup 0  producer (setmaxnreg 24). Warp 0 lane 0 issues the TMA
//                copies (K and V of the key block once into their own buffers,
//                then Q and dO of each query block into a kStages-deep ring);
//                warp 1's lanes fill the stage's LSE (log2 units, +inf for rows
//                without a visible key or past seqlen_q, so their P is exactly
//                0) and delta rows from global memory. Per key block only the
//                query blocks its window reaches are loaded (m_range).
//   warpgroups 1, 2  consumers (setmaxnreg 240), 64 keys each (the M of one
//                wgmma). Per query block of kBlockM = 64 rows:
//     S^T  = K Q^T        m64n64k16 SS (both K-major)       \ issued together;
//     dP^T = V dO^T       m64n64k16 SS                       / S waited first
//                         (hd64: RS, K and V's fragments in registers, kKvInRegs)
//     P^T  = exp2(S^T * scale * log2e - lse2)   (masked on edge blocks only)
//            softcap: exp2(c * tanh(S^T * scale / c) * log2e - lse2), the
//            forward's tanhf argument; dS^T then carries (1 - tanh^2)
//     dV  += P^T dO       m64nDk16 RS (A = P^T packed in registers, exactly
//                         the forward's P fragment; B = dO MN-major) overlaps dS
//     dS^T = P^T * (dP^T - delta)
//     dK  += dS^T Q       RS, like dV
//     dQ   = dS K         contracts over all 128 keys, i.e. over both
//                         consumers: each writes its packed dS^T into shared
//                         memory (128B-swizzled like a TMA tile), fence.proxy.async,
//                         then a named barrier; each computes half of the head
//                         dim's columns (hd64 without a mask: one consumer the
//                         whole tile, by turns, Note [portattn hopper dQ by step]):
//                         m64n{32,64}k16 SS with A = dS^T read
//                         transposed (MN-major A, legal for 16-bit types) and
//                         B = K MN-major, and adds them to the fp32 accumulator
//                         with v2 reductions (accum_add2, bwd_kernel.cuh).
//   Bulk variant (kBulkDq): instead of those reductions,
//   Note [portattn hopper bulk dQ] below.
//   dS^T has two buffers (by step parity): a consumer passes step i + 1's
//   barrier only after both have waited for their step-i dQ wgmma, so step
//   i + 2 may overwrite step i's buffer with no second barrier. The next step's
//   S^T and dP^T are issued before this step's staged dQ is handed over (Note
//   [portattn hopper backward pipeline]).
//   Epilogue: dK * softmax_scale and dV through the K/V buffers and TMA stores
//   (Note [portattn hopper dK/dV store]), else straight from registers (4-byte
//   stores), or fp32 reductions into the GQA accumulators.
// Determinism: Note [portattn hopper ordered dQ] below.
//
// Shared memory (kBlockN = 128, kBlockM = 64; every tile in 64-column panels
// of 128-byte swizzled rows, Note [portattn wgmma descriptors]):
//   hd64:  K 16 + V 16 + 4 stages x (Q 8 + dO 8) + dS^T 2 x 16 = 128 KiB (+LSE/delta, 1 KiB align)
//   hd128: K 32 + V 32 + 2 stages x (Q 16 + dO 16) + dS^T 2 x 16 = 160 KiB (+...)
// Consumer registers per thread (hd128): dV 64 + dK 64 fp32, S^T/P^T 32 + dP^T/dS^T
// 32 fp32, P^T and dS^T packed 16 + 16; the dQ accumulator (32) lives after S/dP die.
// hd64 adds K's and V's register fragments (16 + 16), and without a mask a 32-register
// dQ tile (kDqByStep), where the pair would not fit next to softcap's or the ordered
// adds' live values (those keep K / V in shared memory: kKvRegs).
// ptxas (nvcc 13.0): 0 spills at 24 / 240 registers for every variant without
// softcap (the producer spilled at 24 while one warp did both of its jobs, hence
// the split over two warps). hd128 with softcap spills a few loop-invariant words
// (4-12 bytes, docs/kernels-hopper.md), hd64 with softcap none; no kernel draws
// ptxas's wgmma-serialisation warnings (C7514-C7517).
// Speed on an H100 against its peers: bench/results/latest/hopper_bench.md; analysis
// in docs/kernels-hopper.md.
//
// Note [portattn hopper bulk dQ]
// The alternative dQ path (PORTATTN_HOPPER_BWD_DQ=bulk, hopper_bwd_entry.cu;
// in the deterministic mode ordered per query block, Note [portattn hopper
// ordered dQ]). Why: with per-element `red.global` the consumers' reductions and
// global loads fill the LSU queue (lg_throttle, long_scoreboard stalls,
// docs/kernels-hopper.md); FA3 stages dQ in shared memory and lets the copy
// engine add it. Per step (one 64-query block):
//   consumers  wait empty[b] (not for the first kDqStages steps), write their
//              64 x kDqCols fp32 fragment into buffer b, fence.proxy.async,
//              `bar.arrive full[b]`.
//   producer   warp 2 (idle before): `bar.sync full[b]`, then lane 0 issues one
//              `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`
//              for the tile's rows below len_q (the rows after them belong to
//              the sequence's padding or the next head), commits, waits
//              `cp.async.bulk.wait_group.read 0`, and the warp arrives on
//              empty[b] (skipped for the last kDqStages steps, which nobody
//              waits for).
// One copy per step needs the staging buffer to hold the rows exactly as the
// global accumulator does: contiguous 64 x head dim fp32, no padding. A row is
// head dim * 4 bytes (a multiple of 128), so a plain layout would put the 8
// rows of one v2 store instruction on the same banks (8-way conflicts); instead
// both the staging buffer and the accumulator (bulk mode only) keep each row's
// 16-byte chunk c at chunk c ^ key(row) (cuda::dq_chunk_swizzle, common/dq_swizzle.h, says
// which key and why), which spreads each half warp's rows over all 32 banks, and the convert kernel reads it
// back (BwdArgs::dq_swizzled). Rows padded by 32 bytes instead would need one
// copy per row (64 a step) and leave room for one buffer only at hd128, where
// the consumers waited for it at 13% of the kernel's stall samples (ncu,
// docs/kernels-hopper.md). b = step % kDqStages; the named barrier ids and counts
// are in HopperBwdTraits.
//
// Note [portattn hopper ordered dQ]
// The deterministic mode. dK/dV: a CTA owns one key block of one KV head and
// walks the group's query heads itself, so they sum in registers in a fixed
// order. dQ: every key block reaching a query block adds into the same fp32
// rows, so the order of those adds is fixed instead: per (batch, head, 64-query
// block) a count in the workspace (BwdArgs::dq_order, zeroed per chunk) says how
// many key blocks have added, and key block n adds only when the count equals
// the number of key blocks after n that reach the query block (the adds go from
// the last key block down). One thread of the consumers waits for that value
// (ld.acquire), `bar.sync kBarDqOrder` releases the other 255, all add (v2
// reductions), a second bar.sync, and one thread moves the count on
// (fence.acq_rel + red), so the next block sees every add. With bulk dQ (the
// default, Note [portattn hopper bulk dQ]) the consumers stage the tile as in the
// default mode and write its turn (count address and value) next to it; warp 2
// waits for the count, issues the one bulk reduction, waits for it to be
// performed (not only read), and moves the count on, with fence.proxy.async.global
// on both sides because the adds are async-proxy and the counts generic-proxy
// accesses. So the consumers wait for their turn only when both staging buffers
// are still queued. The rank needs the
// last key block reaching the query block: m_begin_of is nondecreasing, so a
// binary search over [n, n_blocks) on the same lambda the loops use finds it
// (no second copy of the masking rule to drift).
// Why descending: with a right bound (causal, windows) key block n starts at
// query block m_begin(n), later than block n - 1 did; adds in ascending order
// would hold block n until blocks 0..n-1 had swept up to m_begin(n), a wavefront
// that runs causal calls at 2.1-2.4x the default's backward time on an H100
// (archive:2026-11-24-e588a72/determinism.md). In descending order the later blocks, which start
// further down, are always ahead. CTA n_blocks - 1 - blockIdx.x takes key block
// n, so the blocks a CTA waits for belong to lower blockIdx.x of the same
// (head, batch), which the hardware starts first: a waiting CTA's predecessors
// are running or done, never queued behind it (the deadlock this order avoids).
// The sm80+ scheme instead (each split adds into its own fp32 copy of dQ) means ~2 GiB of
// slices at 16k tokens whose reductions miss the L2: 1.55-1.78x the default's
// forward+backward time.
//
// Note [portattn hopper split head dim]
// Head dim 256 (Gemma). A consumer's dK and dV for 64 keys over all 256 columns would be 256
// fp32 registers a thread, so the head dim is split over two CTAs per key block, as the sm80+
// backward does (BwdTileConfig::kDSplit): blockIdx.x = key block * 2 + half. Each CTA loads K, V,
// Q and dO at full width and computes S^T and dP^T over all 256 columns, then keeps dK, dV and
// dQ for its 128 columns only (the dV / dK products' B operands start at its half's first panel
// of dO / Q, dQ's at its K panels, the stores and the accumulators at column half * 128): the
// registers are the hd128 kernel's, the MMA work 1.4x an unsplit kernel's (S^T and dP^T twice).
// Shared memory: K 64 + V 64 + one Q / dO stage 32 + 32 + dS^T 2 x 16 = 224 KiB, so one stage
// (the next query block loads after the step releases the stage) and dQ added per element from
// registers (the bulk path's two 32 KiB staging tiles do not fit: kBulkDqFits). The deterministic
// mode orders dQ's adds per key block as hd128 does (Note [portattn hopper ordered dQ]); the two halves
// write disjoint columns, so each waits until the count has passed both halves of every later
// block (kHalves x the turn, wait_count_at_least) and counts up once. Head dim 192 has its own
// kernel (next Note): padded to this one it would do a third more MMA work than its own columns
// need.
//
// Note [portattn hopper hd192 backward]
// Head dim 192 does not split into two halves of whole 64-column panels (the MN-major B operands
// of dV = P^T dO and dK = dS^T Q, and the dQ columns of K, must start at a panel), so its output
// columns go to two parts of unequal width: part 0 keeps dK / dV / dQ for columns 0-127 (the hd256
// half's registers), part 1 for columns 128-191 (hd64's: dK / dV 32 fp32 each, dQ N = 64 or 32).
// Each CTA still loads K, V, Q and dO at full width and computes S^T and dP^T over all 192
// columns (12 k16 steps). The parts' accumulators differ in shape (compile-time wgmma N, register
// arrays), so each is its own instantiation of the kernel's body (hopper_bwd_body's kPart), and
// they run either
//  * in one launch (kBothParts; the default where it compiles without spills: hd192_one_launch),
//    blockIdx.x = key block * 2 + part, a branch on its parity choosing the body, the two CTAs of
//    a key block side by side like hd256's halves (and its dQ order: wait_count_at_least); or
//  * in two launches one after the other on the stream (launch_main's kPart 0, then 1), where the
//    deterministic mode zeroes the dQ order counts between them (a memset on the stream).
//  One launch against two, same-call A/B on an H100, three rounds
//  (archive:2026-11-26-7e565ef-s18ol/ab_O_OL.md): forward+backward causal +1.9 to +7.3% at 512-8k (-0.7% at 16k),
//  unmasked +4.3 / +1.6% at 512 / 1k, -1.1 to +0.6% from 2k: the parts of a key block share
//  their loads in L2 and one launch has one tail, which matter most where key blocks have few
//  steps.
//  * Work: per key block 192 + 192 + 3 x 128 and 192 + 192 + 3 x 64 (S^T, dP^T, dV, dK, dQ, in
//    units of 64 x 64 x 16 products) = 1344, against 2 x (256 + 256 + 3 x 128) = 1792 padded on
//    the hd256 kernel: a quarter less.
//  * Shared memory: K 48 + V 48 + two Q / dO stages of 24 + 24 + dS^T 2 x 16 = 224 KiB (+ LSE /
//    delta, barriers and the 1 KiB alignment: 231,472 of 232,448 bytes), so two stages where
//    hd256 has one.
//  * The accumulators' pitch is 192 (hopper_bwd_acc_head_dim), their rows unswizzled: dQ is added
//    per element (the bulk path's two 48 KiB staging tiles do not fit beside the two stages).
//  * Part 1 has hd64's output width, and like hd64 (Note [portattn hopper dQ by step]) its
//    consumers take turns at the whole 64-column dQ tile where the mask admits it (no mask; causal
//    without softcap). Same-call A/B on an H100, three rounds
//    (archive:2026-11-26-614d1ef-s18x/ab_O_X.md): hd192 forward+backward +2.1 to +3.6% unmasked, +3.6 to +5.6%
//    causal, every round, against the two consumers splitting its 64 columns.
//
// Note [portattn hopper dK/dV store]
// The epilogue writes dK (scaled) and dV through shared memory: once both
// consumers are past their last product (`bar.sync kBarEpilogue, 256`: the dQ
// product reads all 128 rows of K), each writes its 64 keys' rows into the K and
// V buffers in their 128B-swizzled panel layout, and one thread per warpgroup
// issues a TMA store per panel and waits until the copy engine has read them.
// Why: like the forward's output (Note [portattn hopper O store]), the direct
// epilogue is 64 (hd64) or 128 (hd128) 4-byte stores a thread spread over 8 rows
// each, which the CTA must issue before it retires and the next key block's CTA
// can start on the SM; shared stores with the swizzle are conflict-free and the
// copy engine writes whole lines. Only where nothing refills K/V afterwards (the
// block is the CTA's last, which the grid of one CTA per key block makes every
// block) and not for GQA in the default mode (fp32 reductions into the
// accumulators) or a varlen block that runs past its sequence (the packed map
// would write the next sequence's rows): those keep the direct stores.
//
// Note [portattn hopper dQ by step]
// hd64 without a mask. The dQ product of a step contracts over all 128 keys, so it
// needs both consumers' dS^T. Split by columns (the default elsewhere) each consumer
// runs eight m64n32k16 SS wgmmas a step, and both read the same 64 x 128 dS operand:
// per flop, m64n32 with both operands in shared memory reads 1.5x the bytes of m64n64.
// Here consumer (step & 1) computes the whole 64 x 64 tile (m64n64) and stages it
// alone (its own staging buffer: b = step % 2 = its index), while the other only
// arrives on the dS^T barrier and moves on to the next step, so the two also drift
// out of lockstep by up to a step. The barrier takes an id per step parity (kBarDs,
// HopperBwdTraits says why). Measured on an H100 (main kernel alone, same device
// call, archive:2026-11-24-aefb5f6/kbreak_ab.txt): 6-9% less time without a mask; causal
// 5-8% less from 2k (archive:2026-11-24-1d55b4e/kbreak_ab.txt), with the masked and the plain
// P^T loop apart: in one loop the 32 more registers push the masked loop's predicates
// through registers (P2R) and causal loses 17-25% (archive:2026-11-24-45a4058/kbreak_ab.txt).
// Causal with softcap (its own masked loop still spills predicates with it) and windows keep
// the split.
//
// Note [portattn hopper backward pipeline]
// Per step a consumer issues S^T and dP^T, waits, computes P^T and dS^T, issues dV, dK
// and dQ, waits for them (dQ's result and the dS^T buffer's reuse need it), then hands
// dQ on. Serially the tensor cores idle from dQ's completion until the next step's S^T
// is issued, through the hand-off: with bulk dQ, a wait for a free staging buffer, the
// fp32 stores, `fence.proxy.async` (which waits for those stores) and `bar.arrive`. So
// the hand-off is split: the stores stay at the end of step i - 1, and step i issues
// S^T and dP^T (kAhead of them) before it publishes them (fence + arrive), so the fence
// waits under the tensor cores' work. The issue cannot move further up: in-flight
// accumulators that cross the loop's back edge, or dQ registers read after the next
// products are issued, make ptxas serialise every wgmma of the kernel (C7514/C7515) or
// wait for all of them before the read (C7517), which the kernel budget below checks.
// Measured on an H100 (main kernel alone, same device call,
// archive:2026-11-24-1c5ca0e/kbreak_ab.txt): 1-5% less time at hd64 than the serial loop, within the spread
// (-1 to +2%) at hd128; with K / V in registers at hd64, 5-8%.
//
// Note [portattn hopper staging addresses]
// A consumer's shared-memory traffic per step, other than the wgmma operands: the dS^T tile
// (16 4-byte stores a thread), the dQ staging (16 8-byte stores at hd128) and the LSE / delta
// reads (8 + 8 8-byte loads). Taking each store's address from the swizzle formula
// (swizzle128, dq_chunk_swizzle) costs 2-4 integer instructions: a hd128 step issued ~580
// instructions a consumer warp (cuobjdump), and the kernel 18.4 a wgmma against flash-attn-4's
// 15.0 at the same tile (ncu, hd128 2k causal). Both swizzles only permute 16-byte
// chunks inside aligned groups of eight by a key fixed per thread, so:
// - dS^T: the tile base and key_row * 128 keep bits 4-6 clear; ds_lane_b32 puts g there, and
//   chunk c of the thread's row is then (s_ds + ds_lane_b32) ^ (16 c), plus 1024 for row + 8.
//   PORTATTN_HOPPER_BWD_DS_STMATRIX=1 writes the tile by stmatrix instead, 4 x4 stores a step: a
//   lane gives the address of one 16-byte row of one 8x8 matrix, ds_lane its swizzled chunk for
//   the first k16 block, and block kk's is that XOR 32 kk. 13 fewer instructions a hd128 step,
//   within the spread on an H100 (two rounds, hd64 / hd128 1k-8k: 0.990-1.029 of the 4-byte
//   stores, archive:2026-11-26-550e392-s16h/summary.md), so not the default.
// - dQ: chunk 2 j + (q4 >> 1) of row warp * 16 + g goes to (2 j + (q4 >> 1)) ^ key, with key
//   dq_chunk_swizzle's key of g: for j = 4 jh + jl that is 8 jh + ((2 jl + (q4 >> 1)) ^ key),
//   so four per-thread offsets (dq_stage_off, by jl) plus immediates (jh * 128 bytes, 8 rows
//   further for the second row) give every store.
// - Not adopted: LSE / delta stored permuted so a thread's 16 are contiguous (four 16-byte
//   loads each instead of eight 8-byte ones): the 16-byte loads' register quads pushed the
//   hd64 bulk kernels' consumers to 20-40 bytes of spills (nvcc 13.0).
// The addresses agree with both swizzle formulas for every lane, row and step (hd64, hd128);
// the GPU tests compare every gradient with the reference.
//
// Note [portattn hopper late dK]
// Where a step's dQ is staged relative to dK's product. With dK issued before the dS^T
// barrier (the default), the step's last product in the tensor pipe is dQ, so the pipe
// idles from dQ's completion through the consumer's wait, its staging stores and the
// next step's first issue. With PORTATTN_HOPPER_BWD_LATE_DK=1, dK is queued behind dQ
// (FA3 / flash-attn-4's order): wait<1> retires dV and dQ, the staging stores run under
// dK, and only then wait<0>. The cost: nothing of this consumer's own is left in the
// pipe under the dS^T stores and barrier (dV, issued before the dS^T math, has usually
// retired by then). Measured on an H100 (same-call A/B, three rounds,
// archive:2026-11-26-6cdf00c-s16a/summary.md): hd128 forward+backward without a mask +1.2 to
// +2.5% at 1k-8k, every round above every round of the dK-first order at 1k and 4k; causal -1.0
// to +1.2% (its kernel also spills 4 bytes with it), so causal, windowed and softcap kernels
// issue dK first. hd64's no-mask and causal kernels compute dQ by step and cannot take it.
//
// Note [portattn hopper 80-query steps]
// FlashAttention-3's and flash-attn-4's hd128 tile without a mask: 80 queries a step instead of
// 64, a quarter more MMA work for the same barriers, waits and hand-offs. Built as an option
// (PORTATTN_HOPPER_BWD_WIDE_STEPS=1: hd128, no mask or softcap, the default mode's bulk dQ;
// wide_steps says where), off because it measured at parity:
//  * S^T and dP^T are m64n80 (40 fp32 each), dV and dK five k16 steps.
//  * dS^T's 80 queries do not fit one 128-byte swizzled row, so dS is stored queries x keys
//    (stmatrix.trans; each consumer's 64 keys are one panel) and dQ^T = K^T dS^T: m64n80, A = K
//    read MN-major, B = dS K-major. dQ^T's 40 fp32 go back into the staging tile's rows with
//    4-byte stores, one wavefront each under dq_chunk_key (common/dq_swizzle.h).
//  * Registers: with P^T's 40 fp32 live until dS^T, the consumers spilled 76 bytes and ptxas
//    serialised every wgmma (C7512), so dS^T reads P^T back from its packed 16-bit copy (the dV
//    operand; dQ's error 1.9e-3 against 1.5e-3 in a smoke test, within the error rule).
//  * Shared memory: K 32 + V 32 + two stages of Q 20 + dO 20 + dS 2 x 20 + one dQ staging tile of
//    40 = 224 KiB, so one staging buffer: a step's staging waits for the previous step's copy.
// Same-call A/B on an H100, forward+backward hd128 unmasked
// (archive:2026-11-26-f6a6626-s19/ab_bwd_O_N.md): 0.93 at 512 (seven steps for 6.4 steps of
// work), 0.98 at 1k, 0.99-1.02 from 2k, and the same with dQ published right after its staging
// or dK before dQ; with a wait for dV before dQ, or 2-way bank conflicts in the staging, -2.5 to
// -8%. ncu at 2k: 1.165 against 1.166 ms, tensor pipe 62.7 against 61.6% active, instructions
// 275M against 287M; the wait for the one staging buffer ~2.5% of the samples.
// flash-attn-4's kernel is this shape (its SASS: the same HGMMA shapes, as often) and 10% ahead;
// it issues 495 instructions a consumer warp and step to this kernel's 680, with the same
// floating-point work (docs/kernels-hopper.md).
//
// Note [portattn hopper key blocks per CTA]
// PORTATTN_HOPPER_BWD_BLOCKS_PER_CTA=n (default mode): a CTA walks key blocks b, b + the grid's
// width, ... (n of them), so the producer loads the next block's K / V under the last one's
// epilogue, which the one-block CTAs leave exposed (one CTA fits an SM). Same-call A/B on an
// H100 (archive:2026-11-26-f6a6626-s19): n = 2 forward+backward hd128 -16% at 512, -6% at 1k, -2 to -3% at
// 2k-4k, -0.3 to -5% from 8k; hd64 -0.5 to -3%; n = 4 worse. Only a CTA's last block stores dK /
// dV through TMA (earlier ones from registers), and fewer, longer CTAs balance worse. Off (1).
#pragma once
#include <cuda.h>  // CUtensorMap (a type only)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "bwd_kernel.cuh"
#include "hopper_ptx.cuh"

#ifndef PORTATTN_HOPPER_BWD_TMA_STORE
#define PORTATTN_HOPPER_BWD_TMA_STORE 1
#endif
#ifndef PORTATTN_HOPPER_BWD_PIPELINE
#define PORTATTN_HOPPER_BWD_PIPELINE 2
#endif
#ifndef PORTATTN_HOPPER_BWD_KV_REGS
#define PORTATTN_HOPPER_BWD_KV_REGS 1
#endif
#ifndef PORTATTN_HOPPER_BWD_DQ_BY_STEP
#define PORTATTN_HOPPER_BWD_DQ_BY_STEP 1
#endif
#ifndef PORTATTN_HOPPER_BWD_DQ_BY_STEP_CAUSAL
#define PORTATTN_HOPPER_BWD_DQ_BY_STEP_CAUSAL 1
#endif
// 1: masked kernels read a step's LSE columns into registers before the S^T wait (kLseEarly in
// the kernel says why and what it measured); 0 reads them after it everywhere (A/B).
#ifndef PORTATTN_HOPPER_BWD_LSE_EARLY
#define PORTATTN_HOPPER_BWD_LSE_EARLY 1
#endif
// 1: in kernels without a mask or softcap, dK += dS^T Q issued after the dQ product, so a
// step's dQ is staged while dK runs on the tensor cores (Note [portattn hopper late dK]);
// 0 issues dK before the dS^T barrier everywhere (A/B).
#ifndef PORTATTN_HOPPER_BWD_LATE_DK
#define PORTATTN_HOPPER_BWD_LATE_DK 1
#endif
// 1: dS^T written by stmatrix (4 x4 stores a step instead of 16 4-byte ones); measured
// within the spread (Note [portattn hopper staging addresses]), so 0 keeps the 4-byte stores.
// Note [portattn hopper one-stage release]
// The hd256 kernel has one Q / dO stage (Note [portattn hopper split head dim]), so each step's
// loads start only when the consumers release the stage, and the step waits for them (the
// largest stall in ncu's source page: 19% of samples unmasked, 14% causal). Its
// consumers release the stage as soon as their dV and dK are complete, with dQ (the step's last
// product, which reads dS^T and K only) still on the tensor cores, and, without a mask, in the
// order dV, dK, dQ instead of Note [portattn hopper late dK]'s (whose dQ adds come before the
// release). Same-call A/B on an H100, three rounds (archive:2026-11-26-5555396-s18rel/ab_O_E1.md):
// hd256 forward+backward +6 to +8% unmasked (the order alone: +5 to +7%), +1.5 to +3.4% causal,
// every round. At hd192 (two stages) it measures -1 to -2.4% unmasked and +0.5 to +1.1% causal, so
// the kernels with more than one stage keep the release at the step's end. =0 builds it nowhere
// (and late dK wherever it applies), =2 in every kernel without late dK or dQ by step (A/B).
// hd192's part 1 (Note [portattn hopper hd192 backward]) computes dQ by step as hd64 does; =0
// splits its 64 dQ columns over the two consumers instead (A/B).
// hd192's two parts in one launch, interleaved by key block (kBothParts), where that kernel compiles
// without spills (hd192_one_launch); =0 never, =2 in every kernel (A/B).
#ifndef PORTATTN_HOPPER_BWD_HD192_ONE_LAUNCH
#define PORTATTN_HOPPER_BWD_HD192_ONE_LAUNCH 1
#endif
#ifndef PORTATTN_HOPPER_BWD_HD192_DQ_BY_STEP
#define PORTATTN_HOPPER_BWD_HD192_DQ_BY_STEP 1
#endif
#ifndef PORTATTN_HOPPER_BWD_EARLY_RELEASE
#define PORTATTN_HOPPER_BWD_EARLY_RELEASE 1
#endif
#ifndef PORTATTN_HOPPER_BWD_DS_STMATRIX
#define PORTATTN_HOPPER_BWD_DS_STMATRIX 0
#endif
// 1: hd128 kernels without a mask take 80-query steps (Note [portattn hopper 80-query steps]);
// measured at parity, so 0 keeps 64 everywhere.
#ifndef PORTATTN_HOPPER_BWD_WIDE_STEPS
#define PORTATTN_HOPPER_BWD_WIDE_STEPS 0
#endif
// Key blocks a CTA of the default mode walks (Note [portattn hopper key blocks per CTA]).
#ifndef PORTATTN_HOPPER_BWD_BLOCKS_PER_CTA
#define PORTATTN_HOPPER_BWD_BLOCKS_PER_CTA 1
#endif

namespace portattn {
namespace hopper {

// kDqByStepWanted: the kernel's mask admits kDqByStep (no mask only, see there). The shared
// memory layout and the launch shape do not depend on it.
// kPart: which part of the hd192 backward (Note [portattn hopper hd192 backward]): 0 the
// columns 0-127, 1 the columns 128-191; 0 at every other head dim.
constexpr int kHopperBwdBlocksPerCta = PORTATTN_HOPPER_BWD_BLOCKS_PER_CTA;

// kWide: 80-query steps (Note [portattn hopper 80-query steps]); wide_steps says where.
constexpr int kWideStepRows = 80;
template <int kHeadDim_, bool kBulkDq_ = false, bool kDqByStepWanted = false, int kPart = 0, bool kWide_ = false>
struct HopperBwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  // Note [portattn hopper split head dim]: at 256 two CTAs share a key block, each owning
  // kOutDim = 128 of dK / dV / dQ's columns (blockIdx.x = key block * kHalves + half).
  static constexpr int kHalves = kHeadDim == 256 ? 2 : 1;
  // Note [portattn hopper hd192 backward]: two parts, of 128 and 64 output columns.
  static constexpr int kParts = kHeadDim == 192 ? 2 : 1;
  static_assert(kPart >= 0 && kPart < kParts, "kPart names one of the head dim's parts");
  static constexpr int kOutDim = kHeadDim == 192 ? (kPart == 0 ? 128 : 64) : kHeadDim / kHalves;
  static constexpr int kColOffset = kPart * 128;  // this part's first output column (hd192 part 1: 128)
  // The bulk dQ path's two staging tiles (64 rows of kHeadDim fp32 each) fit up to hd128 only.
  static constexpr bool kBulkDqFits = kHeadDim <= 128;
  // dQ into the fp32 accumulator: false = v2 reductions from the consumers'
  // registers; true = Note [portattn hopper bulk dQ].
  static constexpr bool kBulkDq = kBulkDq_;
  static_assert(!kBulkDq || kBulkDqFits, "bulk dQ does not fit the split head dim's shared memory");
  static constexpr int kBlockN = 128;  // two consumer warpgroups x wgmma M (64 keys)
  // dK/dV written through the K/V buffers and TMA stores (Note [portattn hopper dK/dV store]);
  // -DPORTATTN_HOPPER_BWD_TMA_STORE=0 builds the direct stores (A/B).
  static constexpr bool kTmaStoreDkv = PORTATTN_HOPPER_BWD_TMA_STORE != 0;
  // 64 queries keep S^T and dP^T at 32 fp32 each next to the 128 of dK + dV (hd128); 80 where
  // the kernel has no mask to keep live (Note [portattn hopper 80-query steps]).
  static constexpr bool kWide = kWide_;
  static_assert(!kWide || kHeadDim == 128, "80-query steps are built at hd128 only");
  static constexpr int kBlockM = kWide ? kWideStepRows : 64;
  // How many of step i's two products (S^T, then dP^T) are issued before step i - 1's
  // staged dQ is handed to the reducing warp (Note [portattn hopper backward pipeline]).
  // -DPORTATTN_HOPPER_BWD_PIPELINE=0 builds the serial loop, =1 issues S^T only first (A/B).
  static constexpr int kAhead = PORTATTN_HOPPER_BWD_PIPELINE < 2 ? PORTATTN_HOPPER_BWD_PIPELINE : 2;
  // hd64: this consumer's 64 rows of K and V as register A operands of S^T and dP^T (32
  // registers), so those products read only Q / dO from shared memory (with the pipeline,
  // 5-8% less main-kernel time on an H100, archive:2026-11-24-1c5ca0e/kbreak_ab.txt).
  // -DPORTATTN_HOPPER_BWD_KV_REGS=0 keeps them in shared memory (A/B).
  static constexpr bool kKvInRegs = PORTATTN_HOPPER_BWD_KV_REGS != 0 && kHeadDim == 64;
  // hd64's Q/dO tiles are half the size: twice the stages in a smaller budget; hd256's
  // full-width K and V leave room for one (Note [portattn hopper split head dim]), hd192's
  // for two (226 KiB: Note [portattn hopper hd192 backward]).
  static constexpr int kStages = kHeadDim <= 64 ? 4 : kHeadDim <= 192 ? 2 : 1;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kPanel = 64;  // elements per 128-byte swizzled row
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;  // dS^T: keys x queries (kWide: dS, queries x keys)
  static constexpr int kDsPanelBytes = kBlockM * 128;  // kWide: dS's 64-key panels of kBlockM query rows
  static constexpr int kPanelBytesKV = kBlockN * 128;
  static constexpr int kPanelBytesQ = kBlockM * 128;
  // hd64 without a mask: the consumers take turns (by step parity) computing the whole
  // 64 x 64 dQ tile (Note [portattn hopper dQ by step]). -DPORTATTN_HOPPER_BWD_DQ_BY_STEP=0
  // builds the column split everywhere (A/B).
  // hd192's part 1 has hd64's 64 output columns, and dQ by step measured ahead there too (Note
  // [portattn hopper hd192 backward]).
  static constexpr bool kDqByStep =
      PORTATTN_HOPPER_BWD_DQ_BY_STEP != 0 && kDqByStepWanted &&
      (kHeadDim == 64 || (PORTATTN_HOPPER_BWD_HD192_DQ_BY_STEP != 0 && kHeadDim == 192 && kPart == 1));
  static constexpr int kDqConsumers = kDqByStep ? 1 : kConsumers;  // consumers computing a step's dQ
  static constexpr int kDqCols = kOutDim / kDqConsumers;  // dQ columns per computing consumer
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kKVBytes;
  static constexpr int kOffQ = 2 * kKVBytes;
  static constexpr int kOffDo = kOffQ + kStages * kQBytes;
  static constexpr int kOffDs = kOffDo + kStages * kQBytes;
  // Bulk dQ staging: the 64 x head dim fp32 tile exactly as the accumulator holds
  // those rows (unpadded, 16-byte chunks swizzled by row, dq_chunk_swizzle), so one
  // bulk copy adds a step's tile. Two buffers: a step's copy reads its buffer while
  // the next step fills the other.
  static constexpr int kDqPitch = kHeadDim * 4;
  static constexpr int kDqBytes = kBlockM * kDqPitch;
  // (kWide: one, the 40 KiB tile of 80 rows; two do not fit next to two Q / dO stages.)
  static constexpr int kDqStages = kBulkDq ? (kWide ? 1 : 2) : 0;
  static constexpr int kOffDq = kOffDs + 2 * kDsBytes;
  static constexpr int kOffLse = kOffDq + kDqStages * kDqBytes;
  static constexpr int kOffDelta = kOffLse + kStages * kBlockM * 4;
  static constexpr int kOffBars = kOffDelta + kStages * kBlockM * 4;
  static constexpr int kBarriers = 2 + 2 * kStages;  // K/V full + empty; per stage full + empty
  // Bulk dQ in the deterministic mode: per staging buffer, the tile's turn (the
  // dq_order count to wait for, and the count's address), handed from the consumers
  // to the reducing warp (Note [portattn hopper ordered dQ]).
  static constexpr int kOffDqTurn = kOffBars + 8 * kBarriers;
  static constexpr int kDqTurnBytes = 16;
  static constexpr int kSmemBytes = kOffDqTurn + kDqStages * kDqTurnBytes + 1024;  // + alignment to the 1 KiB atom
  static_assert(kHeadDim % kPanel == 0, "head dim must be a multiple of 64");
  static_assert(kWide || kBlockM == kPanel, "dS^T rows are one 128-byte swizzled row of queries");
  static_assert(!kWide || (kBulkDq && !kDqByStep), "80-query steps stage dQ^T for the bulk reduction");
  static_assert(kDqCols == 32 || kDqCols == 64, "dQ wgmma is instantiated for N = 32 and 64");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm90 shared-memory opt-in limit");
  static_assert(kDqPitch % 128 == 0, "the bulk dQ swizzle assumes rows that start on the same bank");
  static_assert(kOffDs % 128 == 0 && kDsBytes % 128 == 0,
                "dS^T tiles start on 128-byte rows (Note [portattn hopper staging addresses])");
  // Named barriers: 0 __syncthreads, 1-2 dS^T (consumers, by step parity); bulk dQ:
  // full[b] (consumers arrive, the reducing warp waits) and empty[b] (the reverse).
  // dS^T takes two ids because with kDqByStep one consumer only arrives: on one id, its
  // arrival at step i + 1 could complete step i's barrier (a named barrier counts
  // arrivals, it has no phases) before the other consumer has arrived at step i. With
  // two, its next arrival on step i's id (step i + 2) follows its wait at step i + 1,
  // which needs the other's arrival at i + 1, so that one is past step i's barrier.
  static constexpr int kBarDs = 1;
  static constexpr int kBarDqFull = kBarDs + 2;
  static constexpr int kBarDqEmpty = kBarDqFull + kDqStages;
  static constexpr int kDqBarThreads = 128 * kDqConsumers + 32;  // dQ's consumers + the reducing warp
  // Deterministic mode with per-element adds: the consumers' barrier around the
  // ordered dQ adds (Note [portattn hopper ordered dQ]).
  static constexpr int kBarDqOrder = kBarDqEmpty + kDqStages;
  static_assert(kWide || kBlockM == cuda::kDqOrderRows, "dq_order counts are per 64-query block");
  // The epilogue's staging (Note [portattn hopper dK/dV store]): both consumers past K and
  // V, then each warpgroup's staging written.
  static constexpr int kBarEpilogue = kBarDqOrder + 1;
  static constexpr int kBarStaged = kBarEpilogue + 1;  // + warpgroup
  static_assert(kBarStaged + kConsumers <= 16, "named barrier ids run 0-15");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536,
                "register split exceeds the register file");
};

// Byte offset of element (row, col) of a 128B-swizzled tile of 128-byte rows
// (what TMA's CU_TENSOR_MAP_SWIZZLE_128B writes and the descriptors read).
__device__ __forceinline__ uint32_t swizzle128(int row, int col) {
  return row * 128 + ((((col * 2) >> 4) ^ (row & 7)) << 4) + ((col * 2) & 15);
}

// Note [portattn hopper backward descriptors]
// Every wgmma operand in shared memory is addressed by one descriptor of the shared-memory
// base (make_smem_desc) plus a byte offset and the operand's LBO (smem_desc_at), advanced per
// k16 step by a compile-time offset (smem_desc_advance): a 32-bit add of the low word each.
// The offsets that depend on the warpgroup (its K / V rows, dQ's K columns) are made
// warp-uniform by a shuffle of lane 0's value where they are used, so the compiler keeps the
// descriptors in uniform registers. Rebuilding both descriptors for each of a step's 32 wgmma
// instructions (hd128) from a byte address (mask, shift, OR with the LBO / SBO words) in
// per-thread registers, the warpgroup index coming from threadIdx.x, costs: ncu's source page
// (hd128 2k causal, archive:2026-11-26-53ce50d-swizzle/breakdown_S1_r1) counted 772
// instructions a consumer warp issued per step, ~240 of them the step's arithmetic, loads,
// stores and wgmma and ~470 integer, move and uniform-datapath instructions, most of them this
// arithmetic (the step loop's query block and head, which a signed division per step would
// give, are counters). With the shared base: ~580 a step (archive:2026-11-26-9bb4369-lse/ncu_bwd.log);
// main kernel hd128 -1.5 to -1.9%, hd64 -4.6 to -9.4% (archive:2026-11-26-44a3791-desc/breakdown_B1_r1).
// Shuffling the warpgroup index once, at the consumers' start, instead of the offsets at their
// use makes ptxas spill 40-450 bytes in every hd128 variant (the hoisted uniform values stay
// live across the loop).

// acc (64 keys x 64 queries) = a (64 rows of K or V) * b (64 rows of Q or dO)^T,
// contracting over the head dim (both K-major, in 64-column panels of kBlockN and
// kBlockM rows: descriptors of the panels' first rows, SBO 1024), issued and committed
// as one wgmma group.
template <typename Traits, typename Elem>
__device__ __forceinline__ void product_ss(float (&acc)[2][Traits::kBlockM / 4], uint64_t desc_a, uint64_t desc_b) {
  constexpr int kHeadDim = Traits::kHeadDim;
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const uint32_t step = (kk % 4) * 32;  // k16 step inside the 128-byte panel row
    sm90::wgmma_ss<Elem, 0, 0>(acc, sm90::smem_desc_advance(desc_a, (kk / 4) * Traits::kPanelBytesKV + step),
                               sm90::smem_desc_advance(desc_b, (kk / 4) * Traits::kPanelBytesQ + step),
                               kk > 0 ? 1 : 0);
  }
  sm90::wgmma_commit();
}

// acc (64 keys x head dim) += a (64 keys x 64 queries, packed registers) *
// tile (64 queries x head dim: Q or dO of a stage, MN-major = transpose-B; its
// descriptor: LBO = one panel, SBO 1024), issued and committed as one wgmma group.
template <typename Traits, typename Elem, int kOCols>
__device__ __forceinline__ void accumulate_rs(float (&acc)[2][kOCols], uint32_t (&a)[Traits::kBlockM / 16][4],
                                              uint64_t desc_tile) {
  sm90::fence_operands(acc);
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
    sm90::wgmma_rs<Elem>(acc, a[kk], sm90::smem_desc_advance(desc_tile, kk * 16 * 128));
  sm90::wgmma_commit();
}

// Which keys a query sees (Note [portattn semantics]): kBwdMaskCausal is the
// window (-1, 0), kBwdMaskLocal any other window with a bound. The forward's
// choice (hopper_fwd_kernel.cuh: HopperFwdMask) made on the same rule.
enum HopperBwdMask : int { kBwdMaskNone = 0, kBwdMaskCausal = 1, kBwdMaskLocal = 2 };

// Whether a kernel takes 80-query steps (Note [portattn hopper 80-query steps]): hd128 without a
// mask or softcap, the default mode's bulk dQ. The kernel's Traits, its launch and the Q / dO
// maps' boxes (run_hopper_bwd) all ask here.
__host__ __device__ constexpr bool wide_steps(int head_dim, int mask, bool softcap, bool bulk_dq, bool ordered_dq) {
  return PORTATTN_HOPPER_BWD_WIDE_STEPS != 0 && head_dim == 128 && mask == kBwdMaskNone && !softcap && bulk_dq &&
         !ordered_dq;
}

#ifndef PORTATTN_HOPPER_BWD_TIMELINE
#define PORTATTN_HOPPER_BWD_TIMELINE 0
#endif
// Note [portattn hopper backward timeline]
// A measurement build only (PORTATTN_HOPPER_BWD_TIMELINE=1 on one translation unit:
// bench/tools/bwd_timeline.py): lane 0 of every warp of timeline::kCtas CTAs in the middle of the
// launch (blockIdx.x = timeline::kX0 + c, y = gridDim.y / 2, z = gridDim.z / 2) writes the SM's cycle
// counter at each of a step's landmarks (the event list is bench/tools/bwd_timeline.py's) into a
// device array that portattn_cuda_hopper_bwd_timeline copies out. The stores add ~15
// instructions a step; the default build has none of it.
#if PORTATTN_HOPPER_BWD_TIMELINE
namespace timeline {
constexpr int kCtas = 4, kWarps = 12, kSteps = 64, kEvents = 16, kX0 = 8;
static __device__ unsigned long long stamps[kCtas][kWarps][kSteps][kEvents];
}  // namespace timeline
extern "C" int portattn_cuda_hopper_bwd_timeline(unsigned long long* dst, long long count) {
  const long long all = static_cast<long long>(sizeof(timeline::stamps) / sizeof(unsigned long long));
  if (dst == nullptr) return static_cast<int>(all);
  const cudaError_t err = cudaMemcpyFromSymbol(dst, timeline::stamps, (count < all ? count : all) * 8);
  return err == cudaSuccess ? 0 : -1;
}
#define PORTATTN_BWD_STAMP(step_, event_)                                                                   \
  do {                                                                                                       \
    if (stamp_cta >= 0 && (threadIdx.x % 32) == 0 && (step_) < timeline::kSteps)                              \
      timeline::stamps[stamp_cta][threadIdx.x / 32][(step_)][(event_)] = clock64();                         \
  } while (0)
#else
#define PORTATTN_BWD_STAMP(step_, event_) \
  do {                                     \
  } while (0)
#endif

// kOrderedDq: the deterministic mode's dQ adds (Note [portattn hopper ordered dQ]),
// a separate instantiation so the default mode's add loop stays as it was (a
// run-time branch around it cost the hd64 atomic-dQ backward ~25% on an H100).
// The kernel's body, for one part of the head dim's columns (kPart; Note [portattn hopper hd192
// backward]). kOneLaunch: hd192's two parts share one launch, blockIdx.x = key block * 2 + part
// (PORTATTN_HOPPER_BWD_HD192_ONE_LAUNCH).
template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq, bool kOrderedDq, int kPart,
          bool kOneLaunch>
__device__ __forceinline__ void hopper_bwd_body(const CUtensorMap& tm_q, const CUtensorMap& tm_k,
                                                const CUtensorMap& tm_v, const CUtensorMap& tm_do,
                                                const CUtensorMap& tm_dk, const CUtensorMap& tm_dv,
                                                const cuda::BwdArgs& args, const float softcap_scale) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // dQ by step (Note [portattn hopper dQ by step]) without a mask, and causal without softcap (whose
  // masked loop then moved its predicates through registers: 26 P2R in cuobjdump's SASS).
  using Traits = HopperBwdTraits<kHeadDim, kBulkDq,
                                 kMask == kBwdMaskNone || (kMask == kBwdMaskCausal && !kSoftcap &&
                                                           PORTATTN_HOPPER_BWD_DQ_BY_STEP_CAUSAL != 0),
                                 kPart, wide_steps(kHeadDim, kMask, kSoftcap, kBulkDq, kOrderedDq)>;
  constexpr bool kWide = Traits::kWide;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kPanels = kHeadDim / Traits::kPanel;
  constexpr int kSCols = kBlockM / 4;   // S^T fragment columns per thread row
  constexpr int kOCols = Traits::kOutDim / 4;  // dK/dV fragment columns per thread row
  // CTAs per key block: hd256's halves, or hd192's parts in one launch.
  constexpr int kHalves = kOneLaunch ? 2 : Traits::kHalves;
  // dQ's accumulator columns a thread row: kDqCols of the 64 queries, or (kWide) dQ^T's 80 queries.
  constexpr int kQCols = kWide ? kBlockM / 4 : Traits::kDqCols / 4;
  constexpr int kMSteps = kBlockM / 16;  // k16 steps of the dV/dK products
  // A step's LSE columns read into registers before its S^T wait, in masked kernels: there the
  // P^T loop has an edge and a plain copy, each with its own loads after the wait, and the first
  // exponent stalled on them (ncu source page, hd128 2k causal: short scoreboard at the first
  // FFMA). Same-call A/B, three rounds (archive:2026-11-26-9bb4369-lse/breakdown_B4_r1): main kernel
  // hd128 2k causal -1.8%, 8k causal -2.0%, hd64 causal -0.5 to 0; without a mask it loses
  // (hd64 1k +2%, hd128 4k +0.9%: 16 more live registers across the wait, no second copy to share).
  // Not with softcap (not measured; its hd128 kernels already spill a few words).
  constexpr bool kLseEarly = PORTATTN_HOPPER_BWD_LSE_EARLY != 0 && kMask != kBwdMaskNone && !kSoftcap;
  // Note [portattn hopper late dK]: kernels without a mask or softcap (where it was measured
  // to pay). Never with dQ by step, where whether a consumer has a dQ group in flight depends
  // on the step's parity: ptxas then serialises every wgmma (C7514).
  // Not in the one-stage kernels (hd256), where the stage's early release below pays more.
  constexpr bool kLateDk = PORTATTN_HOPPER_BWD_LATE_DK != 0 && !Traits::kDqByStep && kMask == kBwdMaskNone &&
                           !kSoftcap && (Traits::kStages > 1 || PORTATTN_HOPPER_BWD_EARLY_RELEASE == 0);
  // Note [portattn hopper one-stage release].
  constexpr bool kEarlyRelease =
      (PORTATTN_HOPPER_BWD_EARLY_RELEASE == 2 || (PORTATTN_HOPPER_BWD_EARLY_RELEASE == 1 && Traits::kStages == 1)) &&
      !kLateDk && !Traits::kDqByStep;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // swizzle atoms start 1 KiB aligned
  uint8_t* const base_ptr = smem_raw + (base - raw);
  const uint32_t s_k = base + Traits::kOffK;
  const uint32_t s_v = base + Traits::kOffV;
  const uint32_t bars = base + Traits::kOffBars;
  const uint32_t bar_kv_full = bars;
  const uint32_t bar_kv_empty = bars + 8;
  auto bar_full = [&](int s) { return bars + 8u * (2 + s); };
  auto bar_empty = [&](int s) { return bars + 8u * (2 + kStages + s); };
  float* const s_lse = reinterpret_cast<float*>(base_ptr + Traits::kOffLse);
  float* const s_delta = reinterpret_cast<float*>(base_ptr + Traits::kOffDelta);

  const PortattnBwdParams& p = args.p;
  const PortattnFwdParams& f = p.fwd;
  const int batch = blockIdx.z;
  const bool det = p.deterministic != 0;
  const int group = f.nheads / f.nheads_k;
  const cuda::BwdHeads cta_heads = cuda::bwd_heads(args, det, group);
  const int head_k = cta_heads.head_k;
  const int head_first = cta_heads.head_first;
  const int heads = cta_heads.heads;
  // This sequence's rows (seq_bounds.h, clamped to the tensors whatever cu_seqlens
  // holds). Varlen: the tensor maps see the packed rows as one "batch" (map
  // coordinate 0) and the sequence starts at row q_start / k_start; rows of a
  // tile past its sequence's end are the next sequence's (or TMA's zero fill past
  // the tensor): queries there get lse2 = +inf and delta = 0 (P^T = dS^T = 0, dQ
  // rows never added), keys there are masked like keys past seqlen_k of a dense
  // call (P^T = 0, dK/dV rows never stored). seqused_k is refused by the entry.
  const SeqBounds bounds = seq_bounds(f, batch);
  const int len_q = bounds.len_q;
  const int len_k = bounds.len_k;
  const int tma_batch = f.cu_seqlens_q != nullptr ? 0 : batch;
  const int diag = len_k - len_q;
  const int n_blocks = (len_k + kBlockN - 1) / kBlockN;
  // One key block per CTA in both modes (the grid covers the longest sequence's blocks).
  const int n_step = static_cast<int>(gridDim.x) / kHalves;
  const int m_total = (len_q + kBlockM - 1) / kBlockM;
  // The masking rule, written out here rather than through common/block_range.h
  // (Note [portattn visible keys]): the port to the helpers measured 7-11% slower
  // forward+backward at hd 64 causal on an H100 (block_range.h says where).
  // Key j is visible to query i when i + diag - wl <= j <= i + diag + wr.
  const int wl = f.window_left;
  const int wr = kMask == kBwdMaskCausal ? 0 : f.window_right;
  const bool right_bound = kMask != kBwdMaskNone && wr >= 0;
  const bool left_bound = kMask == kBwdMaskLocal && wl >= 0;
  // Query blocks [m_begin, m_begin + m_blocks) see key block n: the right bound
  // fixes the first (the first row that reaches the block's first key), the
  // left bound the last (the last row that still reaches its last key).
  // Both ends are nondecreasing in n_block.
  auto m_begin_of = [&](int n_block) { return right_bound ? max(0, n_block * kBlockN - diag - wr) / kBlockM : 0; };
  auto m_end_of = [&](int n_block) {
    const int n0 = n_block * kBlockN;
    return left_bound ? min(m_total, max(0, min(n0 + kBlockN, len_k) - 1 - diag + wl + kBlockM) / kBlockM)
                      : m_total;
  };
  auto m_range = [&](int n_block, int& m_begin, int& m_blocks) {
    m_begin = m_begin_of(n_block);
    m_blocks = max(m_end_of(n_block) - m_begin, 0);
  };
  // This CTA's (first) key block. Deterministic: the last first, as its dQ adds go
  // in descending key-block order (Note [portattn hopper ordered dQ]), so the CTAs
  // a block waits for have lower blockIdx.x, which the hardware starts earlier.
  // Recomputed from the special registers at each use: held in a register from here
  // on, it grows the hd64 causal kernel by ~200 instructions of predicate shuffling
  // (P2R/LOP3 in cuobjdump's SASS), which cost 7-10% at hd64 causal
  // (archive:2026-11-24-7b49e7e/ab_old_A.md).
  auto n_first = [] {
    const int x = static_cast<int>(blockIdx.x) / kHalves;
    return kOrderedDq ? static_cast<int>(gridDim.x) / kHalves - 1 - x : x;
  };

  const int warpgroup = threadIdx.x / 128;
#if PORTATTN_HOPPER_BWD_TIMELINE
  const int stamp_cta = (blockIdx.y == gridDim.y / 2 && blockIdx.z == gridDim.z / 2 &&
                         blockIdx.x >= timeline::kX0 && blockIdx.x < timeline::kX0 + timeline::kCtas)
                            ? static_cast<int>(blockIdx.x) - timeline::kX0
                            : -1;
#endif
  if (threadIdx.x == 0) {
    sm90::mbar_init(bar_kv_full, 1);
    sm90::mbar_init(bar_kv_empty, Traits::kConsumers * 4);  // one arrival per consumer warp
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(bar_full(s), 1 + 32);  // the TMA issue (expect_tx) + warp 1's LSE/delta lanes
      sm90::mbar_init(bar_empty(s), Traits::kConsumers * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    sm90::fence_proxy_async_smem();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer: warp 0 lane 0 issues TMA, warp 1 fills LSE/delta ----
    // (two warps, so each role's loop fits the 24 registers left to it)
    sm90::setmaxnreg_dec<Traits::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if constexpr (kBulkDq) {
      if (warp == 2) {
        // ---- bulk dQ: warp 2 adds each step's staged dQ tile to the accumulator ----
        // The consumers' step sequence over this CTA's key blocks (one, unless the launch gives a
        // CTA several: Note [portattn hopper key blocks per CTA]).
        // (Written to fit the 24 registers: pointers stepped, no per-step ws_row.)
        // The consumers' steps exactly: none where a key block lies past the
        // sequence's keys (varlen: a short sequence in a grid sized by the longest),
        // else this warp would wait at kBarDqFull for arrivals that never come.
        int left = 0;  // steps not yet reduced, over all of the CTA's key blocks
        for (int n_block = n_first(); n_block < n_blocks; n_block += n_step) {
          int m_begin, m_blocks;
          m_range(n_block, m_begin, m_blocks);
          left += heads * m_blocks;
        }
        int b = 0;
        for (int n_block = n_first(); n_block < n_blocks; n_block += n_step) {
          int m_begin, m_blocks;
          m_range(n_block, m_begin, m_blocks);
          for (int h = 0; h < heads; ++h) {
            // The first query block of head h, and its rows left in the sequence.
            float* g_dq = args.dq_accum + cuda::ws_row(args, batch, head_first + h, m_begin * kBlockM) * kHeadDim;
            int rows = len_q - m_begin * kBlockM;
            for (int mb = 0; mb < m_blocks; ++mb, --left) {
              PORTATTN_BWD_STAMP(mb, 0);
              sm90::named_barrier_sync(Traits::kBarDqFull + b, Traits::kDqBarThreads);
              PORTATTN_BWD_STAMP(mb, 1);
              if (lane == 0) {
                // Rows at or past len_q belong to the padding or the next head: never added.
                const uint32_t bytes = static_cast<uint32_t>(min(rows, kBlockM)) * Traits::kDqPitch;
                if constexpr (kOrderedDq) {
                  // Deterministic: this tile's turn (the consumers wrote it with the tile),
                  // the add, its completion, then the turn passed on.
                  const uint8_t* turn = base_ptr + Traits::kOffDqTurn + b * Traits::kDqTurnBytes;
                  int* const order = *reinterpret_cast<int* const*>(turn);
                  sm90::wait_count_equals(order, *reinterpret_cast<const int*>(turn + 8));
                  sm90::fence_proxy_async_global();  // the adds before ours, then ours (async proxy)
                  sm90::bulk_reduce_add_f32(g_dq, base + Traits::kOffDq + b * Traits::kDqBytes, bytes);
                  sm90::bulk_commit_group();
                  sm90::bulk_wait_group<0>();  // performed, not only read
                  sm90::fence_proxy_async_global();
                  sm90::count_up_release(order);
                } else {
                  sm90::bulk_reduce_add_f32(g_dq, base + Traits::kOffDq + b * Traits::kDqBytes, bytes);
                  sm90::bulk_commit_group();
                  sm90::bulk_wait_group_read<0>();  // the copy has read the buffer
                }
              }
              __syncwarp();
              PORTATTN_BWD_STAMP(mb, 2);
              if (left > Traits::kDqStages)  // the consumers wait only for buffers they reuse
                sm90::named_barrier_arrive(Traits::kBarDqEmpty + b, Traits::kDqBarThreads);
              b = b + 1 == Traits::kDqStages ? 0 : b + 1;
              g_dq += kBlockM * kHeadDim;
              rows -= kBlockM;
            }
          }
        }
        sm90::bulk_wait_group<0>();  // every reduction performed before the CTA retires
        return;
      }
    }
    if (warp > 1 || (warp == 0 && lane > 0)) return;
    if (warp == 0) {
      sm90::prefetch_tensormap(&tm_q);
      sm90::prefetch_tensormap(&tm_k);
      sm90::prefetch_tensormap(&tm_v);
      sm90::prefetch_tensormap(&tm_do);
    }
    int step = 0;  // Q/dO ring position, continued across key blocks
    uint32_t kv_round = 0;
    for (int n_block = n_first(); n_block < n_blocks; n_block += n_step) {
      int m_begin, m_blocks;
      m_range(n_block, m_begin, m_blocks);
      const int iters = heads * m_blocks;
      if (iters == 0) continue;
      if (warp == 0) {
        sm90::mbar_wait(bar_kv_empty, (kv_round & 1u) ^ 1u);
        sm90::mbar_arrive_expect_tx(bar_kv_full, 2 * Traits::kKVBytes);
#pragma unroll
        for (int p = 0; p < kPanels; ++p) {
          sm90::tma_load_4d(s_k + p * Traits::kPanelBytesKV, &tm_k, bar_kv_full, p * Traits::kPanel,
                            bounds.k_start + n_block * kBlockN, head_k, tma_batch);
          sm90::tma_load_4d(s_v + p * Traits::kPanelBytesKV, &tm_v, bar_kv_full, p * Traits::kPanel,
                            bounds.k_start + n_block * kBlockN, head_k, tma_batch);
        }
      }
      ++kv_round;
      // Step it's query block and head, counted as the consumers count them.
      int head = head_first, m_index = 0;
      for (int it = 0; it < iters; ++it, ++step) {
        const int stage = step % kStages;
        const int m0 = (m_begin + m_index) * kBlockM;
        PORTATTN_BWD_STAMP(it, 0);
        sm90::mbar_wait(bar_empty(stage), ((step / kStages) & 1u) ^ 1u);
        PORTATTN_BWD_STAMP(it, 1);
        if (warp == 0) {
          const uint32_t s_q = base + Traits::kOffQ + stage * Traits::kQBytes;
          const uint32_t s_do = base + Traits::kOffDo + stage * Traits::kQBytes;
          sm90::mbar_arrive_expect_tx(bar_full(stage), 2 * Traits::kQBytes);
#pragma unroll
          for (int p = 0; p < kPanels; ++p) {
            sm90::tma_load_4d(s_q + p * Traits::kPanelBytesQ, &tm_q, bar_full(stage),
                              p * Traits::kPanel, bounds.q_start + m0, head, tma_batch);
            sm90::tma_load_4d(s_do + p * Traits::kPanelBytesQ, &tm_do, bar_full(stage),
                              p * Traits::kPanel, bounds.q_start + m0, head, tma_batch);
          }
        } else {
          // The preprocess's workspace rows (LSE already in log2 units, +inf for rows
          // without a visible key): one layout for dense and varlen calls.
          const int64_t ws = cuda::ws_row(args, batch, head, m0);
#pragma unroll
          for (int r = lane; r < kBlockM; r += 32) {
            const bool valid = m0 + r < len_q;
            s_lse[stage * kBlockM + r] = valid ? args.lse2[ws + r] : __builtin_huge_valf();
            s_delta[stage * kBlockM + r] = valid ? args.delta[ws + r] : 0.f;
          }
          sm90::mbar_arrive(bar_full(stage));  // releases this lane's LSE/delta writes
        }
        if (++m_index == m_blocks) {
          m_index = 0;
          ++head;
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
    const int key_row = wg * 64 + warp * 16 + g;  // this thread's keys in the block: + 0, + 8
    // A operand rows of S^T / dP^T: this warpgroup's 64 keys of each K/V panel.
    const uint32_t s_k_wg = s_k + wg * 64 * 128;
    const uint32_t s_v_wg = s_v + wg * 64 * 128;
    // B operand of dQ = dS K: this warpgroup's half of K's columns (a panel for
    // hd128; 32 columns = 64 bytes into the one panel for hd64, where the
    // hardware's XOR applies to the final address as for the k16 steps).
    // Split head dim: this CTA's half of the columns (Note [portattn hopper split head dim]);
    // hd192: this part's (Note [portattn hopper hd192 backward]). Always a whole 64-column panel.
    const int half = kHalves > 1 ? static_cast<int>(blockIdx.x) % kHalves : 0;
    const int col0 = Traits::kParts > 1 ? Traits::kColOffset : half * Traits::kOutDim;  // this CTA's first output column
    const uint32_t s_k_dq =
        s_k + (Traits::kDqByStep        ? (col0 / 64) * Traits::kPanelBytesKV
               : Traits::kDqCols == 64 ? (col0 / 64 + wg) * Traits::kPanelBytesKV
                                        : (col0 / 64) * Traits::kPanelBytesKV + wg * 64);
    // The dV / dK products' B operands (dO, Q) start at this CTA's first panel.
    const uint32_t half_panels_q = static_cast<uint32_t>(col0 / 64) * Traits::kPanelBytesQ;
    // The operands' descriptors (Note [portattn hopper backward descriptors]), all from
    // one base: K-major tiles (LBO unused, 16 by convention) and MN-major ones (LBO = one
    // panel), SBO 1024 and the 128B swizzle for every one of them.
    const uint64_t desc_base = sm90::make_smem_desc(base, 0, 1024);
    auto desc_at = [&](uint32_t offset, uint32_t lbo_bytes) { return sm90::smem_desc_at(desc_base, offset, lbo_bytes); };
    // This warpgroup's K / V rows and dQ's K columns, made warp-uniform where they are used
    // (once a product; see the Note for why not once).
    auto uniform = [&](uint32_t offset) { return __shfl_sync(0xffffffffu, offset, 0); };
    const uint32_t k_rows_offset = Traits::kOffK + wg * 64 * 128;
    const uint32_t v_rows_offset = Traits::kOffV + wg * 64 * 128;
    const uint32_t k_dq_cols_offset = s_k_dq - base;
    const int dq_col0 = col0 + (Traits::kDqByStep ? 0 : wg * Traits::kDqCols);  // this consumer's first dQ column
    // Whether this consumer computes step at_step's dQ, and the thread that writes its turn
    // (deterministic mode).
    auto computes_dq = [&](int at_step) { return !Traits::kDqByStep || (at_step & 1) == wg; };
    const bool dq_leader = tid == 0 && (Traits::kDqByStep || wg == 0);
    // Note [portattn hopper staging addresses]: this thread's parts of the dS^T and dQ staging
    // addresses, fixed for the kernel.
#if PORTATTN_HOPPER_BWD_DS_STMATRIX
    // dS^T by stmatrix: this lane gives row wg * 64 + warp * 16 + (lane & 7) + 8 ((lane >> 3) & 1)
    // of matrix lane / 8, whose 16-byte chunk 2 kk + (lane >> 4) the 128B swizzle XORs with the
    // row's low three bits, lane & 7.
    const uint32_t ds_lane =
        static_cast<uint32_t>(wg * 64 + warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * 128 +
        16 * static_cast<uint32_t>((lane & 7) ^ (lane >> 4));
#else
    // dS^T by 4-byte stores: rows key_row (+ 8); bits 4-6 hold the row's low bits g, which the
    // swizzle XORs with the chunk index.
    const uint32_t ds_lane_b32 = static_cast<uint32_t>(key_row) * 128 + 4 * q4 + 16 * g;
#endif
    const int dq_key = cuda::dq_chunk_key(g);  // the swizzle key of rows g, g + 8
    uint32_t dq_stage_off[4];
#pragma unroll
    for (int jl = 0; jl < 4; ++jl)
      dq_stage_off[jl] = static_cast<uint32_t>((warp * 16 + g) * Traits::kDqPitch + 4 * dq_col0 +
                                               16 * ((2 * jl + (q4 >> 1)) ^ dq_key) + 8 * (q4 & 1));
    // kWide: dQ^T's element (column dq_col0 + warp * 16 + g + 8 r, query 8 j + 2 q4 + h) goes to
    // row 8 j + 2 q4 + h of the staging tile, at dq_chunk_swizzle's offset of its byte 4 column:
    // the row's low three bits are 2 q4 + h whatever j, so the swizzle key is fixed per (thread, h).
    // + 8 r moves the column's chunk by 2 (bit 1 of the chunk is r: column bits 3-4 are 2 r + (g >> 2)
    // up to warp's), and h flips the key's bit 1 (row bit 0 is key bit 1), so all four offsets are
    // dqt_stage_off ^ 32 (r ^ h) + kDqPitch h (the XOR and the add touch different bits).
    const uint32_t dqt_stage_off = static_cast<uint32_t>(
        2 * q4 * Traits::kDqPitch + cuda::dq_chunk_swizzle(2 * q4, 4 * (dq_col0 + warp * 16 + g)));
    // kWide: dS by stmatrix.trans, lane l giving memory row l & 7 (query 8 ((l >> 3) >> 1) + (l & 7) of
    // the k16 block) of matrix l >> 3, whose 8 keys start at chunk 2 warp + ((l >> 3) & 1) of this
    // consumer's 64-key panel; the 128B swizzle XORs the chunk with the query's low bits, l & 7.
    const uint32_t dsw_lane = static_cast<uint32_t>(wg * Traits::kDsPanelBytes +
                                                    (8 * ((lane >> 3) >> 1) + (lane & 7)) * 128 +
                                                    16 * ((2 * warp + ((lane >> 3) & 1)) ^ (lane & 7)));
    const float scale_log2 = f.softmax_scale * softmax::kLog2e;
    // One dQ accumulator in both modes: the deterministic mode orders its adds
    // (Note [portattn hopper ordered dQ]) instead of adding into per-split slices.
    float* const dq_slice = args.dq_accum;
    const int m_blocks_max = (f.seqlen_q + kBlockM - 1) / kBlockM;  // rows of dq_order per head
    const bool gqa_atomic = !det && group > 1;

    int step = 0;
    uint32_t kv_round = 0;
    for (int n_block = n_first(); n_block < n_blocks; n_block += n_step) {
      const int n0 = n_block * kBlockN;
      int m_begin, m_blocks;
      m_range(n_block, m_begin, m_blocks);
      const int iters = heads * m_blocks;

      float dv[2][kOCols], dk[2][kOCols];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < kOCols; ++c) dv[r][c] = dk[r][c] = 0.f;

      // S^T = K Q^T and dP^T = V dO^T of step `at` (64 keys x 64 queries each), one wgmma
      // group each; S^T first waits for the step's Q/dO stage.
      float s[2][kSCols], dp[2][kSCols];
      // K / V in registers (Traits::kKvInRegs) where the 32 registers fit: next to the
      // whole-tile dQ of kDqByStep, softcap's and the ordered adds' live values made them spill.
      constexpr bool kKvRegs = Traits::kKvInRegs && !(Traits::kDqByStep && (kSoftcap || kOrderedDq));
      constexpr int kKvSteps = kKvRegs ? kHeadDim / 16 : 1;
      uint32_t ka[kKvSteps][4], va[kKvSteps][4];
      auto product_rs = [&](float (&acc)[2][kSCols], const uint32_t (&a)[kKvSteps][4], uint64_t desc_tile) {
        if constexpr (kKvRegs) {  // (hd64 only: N = 64)
          sm90::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kKvSteps; ++kk)
            sm90::wgmma_rs_kmajor_n64<Elem>(
                acc, a[kk], sm90::smem_desc_advance(desc_tile, (kk / 4) * Traits::kPanelBytesQ + (kk % 4) * 32),
                kk > 0 ? 1 : 0);
          sm90::wgmma_commit();
        }
      };
      auto issue_s = [&](int at) {
        sm90::mbar_wait(bar_full(at % kStages), (at / kStages) & 1u);
        const uint64_t desc_q = desc_at(Traits::kOffQ + (at % kStages) * Traits::kQBytes, 16);
        if constexpr (kKvRegs) product_rs(s, ka, desc_q);
        else product_ss<Traits, Elem>(s, desc_at(uniform(k_rows_offset), 16), desc_q);
      };
      auto issue_dp = [&](int at) {
        const uint64_t desc_do = desc_at(Traits::kOffDo + (at % kStages) * Traits::kQBytes, 16);
        if constexpr (kKvRegs) product_rs(dp, va, desc_do);
        else product_ss<Traits, Elem>(dp, desc_at(uniform(v_rows_offset), 16), desc_do);
      };
      // A step's dQ (64 queries x this consumer's kDqCols).
      float dq[2][kQCols];

      // Step at_step's dQ (in `dq`, complete): written into a staging buffer for warp 2's
      // bulk reduction (publish_dq then hands it over), or added from registers (Note
      // [portattn hopper bulk dQ]).
      auto stage_dq = [&](int at_step, int head, int m0) {
        // Deterministic mode: this key block's turn for query block m0, after every
        // later key block that reaches the query block has added (their count), before
        // any earlier one. The last key block reaching m_block: m_begin_of is
        // nondecreasing and this block reaches it, so a search over [n_block, n_blocks)
        // finds it (the last block without a right bound); every block between the two
        // reaches it too.
        auto dq_turn = [&]() {
          const int m_block = m0 / kBlockM;
          int lo = n_block, hi = n_blocks - 1;
          while (right_bound && lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (m_begin_of(mid) <= m_block) lo = mid; else hi = mid - 1;
          }
          return (right_bound ? lo : n_blocks - 1) - n_block;
        };
        auto dq_order_count = [&]() {
          return args.dq_order + (static_cast<int64_t>(batch) * args.heads + head - args.head0) * m_blocks_max +
                 m0 / kBlockM;
        };
        if constexpr (kBulkDq) {
          // Stage this consumer's columns; warp 2 of the producer reduces the
          // tile once both consumers arrived (Note [portattn hopper bulk dQ]).
          const int b = at_step % Traits::kDqStages;
          if (at_step >= Traits::kDqStages)  // the copy of step - kDqStages has read buffer b
            sm90::named_barrier_sync(Traits::kBarDqEmpty + b, Traits::kDqBarThreads);
          if constexpr (kOrderedDq) {
            if (dq_leader) {
              uint8_t* turn = base_ptr + Traits::kOffDqTurn + b * Traits::kDqTurnBytes;
              *reinterpret_cast<int**>(turn) = dq_order_count();
              *reinterpret_cast<int*>(turn + 8) = dq_turn();
            }
          }
          const uint32_t s_dq = base + Traits::kOffDq + b * Traits::kDqBytes;
          if constexpr (kWide) {
            // dQ^T transposed back into the tile's rows, one element a store.
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int j = 0; j < kQCols / 2; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                  cuda::st_shared_b32(s_dq + ((dqt_stage_off ^ static_cast<uint32_t>(32 * (r ^ h))) +
                                              static_cast<uint32_t>((8 * j + h) * Traits::kDqPitch)),
                                      __float_as_uint(dq[r][2 * j + h]));
          } else {
            // Rows warp * 16 + g (+ 8; rows past len_q are staged, never copied), at
            // dq_chunk_swizzle's offsets (Note [portattn hopper staging addresses]).
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int j = 0; j < kQCols / 2; ++j)
                sm90::st_shared_v2_f32(s_dq + dq_stage_off[j & 3] + r * 8 * Traits::kDqPitch + (j >> 2) * 128,
                                       dq[r][2 * j], dq[r][2 * j + 1]);
          }
        } else {
          float* g_dq = dq_slice + cuda::ws_row(args, batch, head, m0) * kHeadDim + dq_col0;
          int* order = nullptr;
          if constexpr (kOrderedDq) {
            order = dq_order_count();
            // Split head dim: both halves of every later key block add (disjoint columns) and count
            // up, so this half waits until all of theirs have, whatever this block's other half did.
            if (dq_leader) {
              if constexpr (kHalves > 1) sm90::wait_count_at_least(order, kHalves * dq_turn());
              else sm90::wait_count_equals(order, dq_turn());
            }
            sm90::named_barrier_sync(Traits::kBarDqOrder, 128 * Traits::kDqConsumers);
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = warp * 16 + g + 8 * r;
            if (m0 + row >= len_q) continue;
#pragma unroll
            for (int j = 0; j < kQCols / 2; ++j)
              cuda::accum_add2(g_dq + row * kHeadDim + 8 * j + 2 * q4, dq[r][2 * j], dq[r][2 * j + 1]);
          }
          if constexpr (kOrderedDq) {
            sm90::named_barrier_sync(Traits::kBarDqOrder, 128 * Traits::kDqConsumers);
            if (dq_leader) sm90::count_up_release(order);
          }
        }
      };
      auto publish_dq = [&](int at_step) {
        if constexpr (kBulkDq) {
          sm90::fence_proxy_async_smem();  // generic writes before the bulk copy's (async-proxy) read
          sm90::named_barrier_arrive(Traits::kBarDqFull + at_step % Traits::kDqStages, Traits::kDqBarThreads);
        }
      };

      if (iters > 0) sm90::mbar_wait(bar_kv_full, kv_round & 1u);
      if constexpr (kKvRegs) {
        // The A fragment of k16 step kk: rows key_row (+ 8), columns 16 kk + 2 q4 (+ 8).
#pragma unroll
        for (int kk = 0; kk < kKvSteps; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = 16 * kk + 8 * (e >> 1) + 2 * q4;
            const uint32_t at = (col / 64) * Traits::kPanelBytesKV + swizzle128(key_row + 8 * (e & 1), col % 64);
            ka[kk][e] = sm90::ld_shared_b32(s_k + at);
            va[kk][e] = sm90::ld_shared_b32(s_v + at);
          }
      }
      // Step it's query block and head, counted (it = (head - head_first) * m_blocks + m_index).
      int head = head_first, m_index = 0;
      for (int it = 0; it < iters; ++it, ++step) {
        const int stage = step % kStages;
        const int m0 = (m_begin + m_index) * kBlockM;
        const uint64_t desc_q_mn = desc_at(Traits::kOffQ + stage * Traits::kQBytes + half_panels_q, Traits::kPanelBytesQ);
        const uint64_t desc_do_mn = desc_at(Traits::kOffDo + stage * Traits::kQBytes + half_panels_q, Traits::kPanelBytesQ);
        const uint32_t s_ds = base + Traits::kOffDs + (step & 1) * Traits::kDsBytes;
        const uint64_t desc_ds = desc_at(Traits::kOffDs + (step & 1) * Traits::kDsBytes, Traits::kDsBytes);
        const float* lse2 = s_lse + stage * kBlockM;
        const float* delta = s_delta + stage * kBlockM;

        // ---- S^T and dP^T; pipelined, the last step's staged dQ is handed over under them ----
        PORTATTN_BWD_STAMP(it, 0);
        issue_s(step);
        if constexpr (Traits::kAhead >= 2) issue_dp(step);
        if (Traits::kAhead > 0 && it > 0 && computes_dq(step - 1)) publish_dq(step - 1);
        if constexpr (Traits::kAhead < 2) issue_dp(step);
        PORTATTN_BWD_STAMP(it, 2);
        // This thread's LSE columns, read while S^T runs (kLseEarly) or where P^T needs them.
        float lse_cols[kLseEarly ? kSCols : 1];
        if constexpr (kLseEarly) {
#pragma unroll
          for (int c = 0; c < kSCols; ++c) lse_cols[c] = lse2[(c / 2) * 8 + 2 * q4 + (c % 2)];
        }
        auto lse_of = [&](int c) {
          if constexpr (kLseEarly) return lse_cols[c];
          else return lse2[(c / 2) * 8 + 2 * q4 + (c % 2)];
        };
        sm90::wgmma_wait<1>();
        sm90::fence_operands(s);
        PORTATTN_BWD_STAMP(it, 3);

        // ---- P^T: masked only on blocks that straddle len_k or a window edge
        // (the right edge is tightest for the block's first query, the left for
        // its last). Rows past len_q or without any visible key have
        // lse2 = +inf, so their P^T is exactly 0 unmasked.
        const bool edge = n0 + kBlockN > len_k || (right_bound && n0 + kBlockN - 1 > m0 + diag + wr) ||
                          (left_bound && n0 < m0 + kBlockM - 1 + diag - wl);
        auto visible = [&](int key, int query) {
          return key < len_k && (!right_bound || key <= query + diag + wr) &&
                 (!left_bound || key >= query + diag - wl);
        };
        uint32_t pp[kMSteps][4], ds[kMSteps][4];
        if constexpr (kSoftcap) {
          // tanh first, in place (its branches then keep nothing else live), then
          // P^T packs straight into the dV operand while s keeps P^T * (1 - tanh^2),
          // the factor dS^T needs.
#pragma unroll
          for (int c = 0; c < kSCols; ++c)
#pragma unroll
            for (int r = 0; r < 2; ++r) s[r][c] = tanhf(s[r][c] * softcap_scale);
#pragma unroll
          for (int c = 0; c < kSCols; c += 2)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float prob[2];
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int col = (c / 2) * 8 + 2 * q4 + h;
                const float t = s[r][c + h];
                prob[h] = softmax::exp2_fast(f.softcap * t * softmax::kLog2e - lse_of(c + h));
                if (edge && !visible(n0 + key_row + 8 * r, m0 + col)) prob[h] = 0.f;
                s[r][c + h] = prob[h] * (1.f - t * t);
              }
              pp[c / 4][r + (c & 2)] = ptx::ElemTraits<Elem>::pack(prob[0], prob[1]);
            }
        } else {
          // The masked and the plain loop apart: with a per-element `if (edge)` in one loop
          // the compiler evaluates every element's mask test on every step and, where
          // registers are tight (dQ by step in the causal kernel), moves the tests'
          // predicates through registers (27 P2R and ~250 more LOP3 in cuobjdump's SASS;
          // the one loop against these two: archive:2026-11-24-1d55b4e/kbreak_ab.txt).
          if (edge) {
#pragma unroll
            for (int c = 0; c < kSCols; ++c) {
              const int col = (c / 2) * 8 + 2 * q4 + (c % 2);
              const float l = lse_of(c);
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const float prob = softmax::exp2_fast(s[r][c] * scale_log2 - l);
                s[r][c] = visible(n0 + key_row + 8 * r, m0 + col) ? prob : 0.f;
              }
            }
          } else {
#pragma unroll
            for (int c = 0; c < kSCols; ++c) {
              const float l = lse_of(c);
#pragma unroll
              for (int r = 0; r < 2; ++r) s[r][c] = softmax::exp2_fast(s[r][c] * scale_log2 - l);
            }
          }
          sm90::pack_a_fragment<Elem>(pp, s);
        }

        // ---- dV += P^T dO (runs while dS^T is computed) ----
        PORTATTN_BWD_STAMP(it, 4);
        accumulate_rs<Traits, Elem>(dv, pp, desc_do_mn);
        PORTATTN_BWD_STAMP(it, 5);
        sm90::wgmma_wait<1>();  // dP^T complete; dV may still run
        sm90::fence_operands(dp);
        PORTATTN_BWD_STAMP(it, 6);

        // kWide: P^T read back from its packed 16-bit copy (the dV operand), so the 40 fp32 of s are
        // free once packed: with them live the 80-query kernel spilled 76 bytes and ptxas serialised
        // its wgmma (C7512). dS^T is rounded to 16 bits for its products either way.
        auto p_of = [&](int r, int c) {
          if constexpr (kWide) {
            const uint32_t w = pp[c / 4][r + (c & 2)];
            if constexpr (std::is_same<Elem, __nv_bfloat16>::value) {
              return __uint_as_float((c & 1) ? (w & 0xffff0000u) : (w << 16));
            } else {
              const __half2 h = *reinterpret_cast<const __half2*>(&w);
              return (c & 1) ? __high2float(h) : __low2float(h);
            }
          } else {
            return s[r][c];
          }
        };
#pragma unroll
        for (int c = 0; c < kSCols; ++c) {
          const float d = delta[(c / 2) * 8 + 2 * q4 + (c % 2)];
#pragma unroll
          for (int r = 0; r < 2; ++r) dp[r][c] = p_of(r, c) * (dp[r][c] - d);
        }
        sm90::pack_a_fragment<Elem>(ds, dp);
        PORTATTN_BWD_STAMP(it, 7);

        // ---- dK += dS^T Q (here, under the dS^T stores and barrier; or after dQ) ----
        if constexpr (!kLateDk) accumulate_rs<Traits, Elem>(dk, ds, desc_q_mn);

        // ---- dS^T to shared memory, then both consumers' keys are visible ----
        // Element (key_row + 8 (e & 1), 16 kk + 8 (e >> 1) + 2 q4) of the swizzled tile is one XOR
        // with a constant away from the thread's base (Note [portattn hopper staging addresses]).
        // The stmatrix option: register e of every lane is 8x8 matrix e, whose row addresses lanes
        // 8e .. 8e + 7 give, one stmatrix.x4 per k16 block.
        if constexpr (kWide) {
          // dS (queries x keys): each 8 x 8 matrix of dS^T stored transposed.
#pragma unroll
          for (int kk = 0; kk < kMSteps; ++kk)
            sm90::stmatrix_x4_trans(s_ds + dsw_lane + static_cast<uint32_t>(kk * 16 * 128), ds[kk][0], ds[kk][1],
                                    ds[kk][2], ds[kk][3]);
        } else {
#if PORTATTN_HOPPER_BWD_DS_STMATRIX
          const uint32_t ds_row = s_ds + ds_lane;
#pragma unroll
          for (int kk = 0; kk < kMSteps; ++kk)
            sm90::stmatrix_x4(ds_row ^ static_cast<uint32_t>(32 * kk), ds[kk][0], ds[kk][1], ds[kk][2], ds[kk][3]);
#else
          const uint32_t ds_row = s_ds + ds_lane_b32;
#pragma unroll
          for (int kk = 0; kk < kMSteps; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              cuda::st_shared_b32((ds_row ^ static_cast<uint32_t>(16 * (2 * kk + (e >> 1)))) + (e & 1) * 8 * 128,
                                  ds[kk][e]);
#endif
        }
        sm90::fence_proxy_async_smem();
        // The consumer that computes this step's dQ waits for both halves of dS^T; the
        // other only contributes its half (Note [portattn hopper dQ by step]).
        const bool my_dq = computes_dq(step);
        PORTATTN_BWD_STAMP(it, 8);
        if (my_dq) sm90::named_barrier_sync(Traits::kBarDs + (step & 1), 128 * Traits::kConsumers);
        else sm90::named_barrier_arrive(Traits::kBarDs + (step & 1), 128 * Traits::kConsumers);
        PORTATTN_BWD_STAMP(it, 9);

        // ---- dQ (64 queries x kDqCols from dq_col0) = dS K over all 128 keys ----
        if (my_dq) {
          const uint32_t k_dq_offset = uniform(k_dq_cols_offset);
          sm90::wgmma_fence();
          if constexpr (kWide) {
            // dQ^T (this consumer's 64 columns x 80 queries) = K^T dS^T: A = K^T, MN-major (K's rows
            // are the keys); B = dS, K-major (its rows are the queries, the keys contiguous).
            const uint64_t desc_ds_k = desc_at(Traits::kOffDs + (step & 1) * Traits::kDsBytes, 16);
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk)
              sm90::wgmma_ss<Elem, 1, 0>(
                  dq, desc_at(k_dq_offset + kk * 16 * 128, Traits::kPanelBytesKV),
                  sm90::smem_desc_advance(desc_ds_k, (kk / 4) * Traits::kDsPanelBytes + (kk % 4) * 32), kk > 0 ? 1 : 0);
          } else {
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk)
              sm90::wgmma_ss<Elem, 1, 1>(dq, sm90::smem_desc_advance(desc_ds, kk * 16 * 128),
                                         desc_at(k_dq_offset + kk * 16 * 128, Traits::kPanelBytesKV), kk > 0 ? 1 : 0);
          }
          sm90::wgmma_commit();
        }
        if constexpr (kLateDk) {
          // Note [portattn hopper late dK]: dK queued behind dQ; dQ (and dV) complete at
          // wait<1>, staged while dK runs.
          accumulate_rs<Traits, Elem>(dk, ds, desc_q_mn);
          PORTATTN_BWD_STAMP(it, 10);
          if (my_dq) {
            sm90::wgmma_wait<1>();
            sm90::fence_operands(dq);
            PORTATTN_BWD_STAMP(it, 11);
            stage_dq(step, head, m0);
            PORTATTN_BWD_STAMP(it, 12);
            if constexpr (Traits::kAhead == 0) publish_dq(step);
          }
        }
        if constexpr (kEarlyRelease) {
          // dV and dK complete, dQ (the last group) may still run: the stage is free (Note
          // [portattn hopper one-stage release]).
          sm90::wgmma_wait<1>();
          sm90::fence_operands(dv);
          sm90::fence_operands(dk);
          sm90::fence_fragment(pp);
          sm90::fence_fragment(ds);
          __syncwarp();
          if (lane == 0) sm90::mbar_arrive(bar_empty(stage));
        }
        sm90::wgmma_wait<0>();
        sm90::fence_operands(dq);
        sm90::fence_operands(dv);
        sm90::fence_operands(dk);
        sm90::fence_fragment(pp);
        sm90::fence_fragment(ds);
        PORTATTN_BWD_STAMP(it, 13);
        // This warp no longer reads the stage (Q, dO, LSE, delta).
        if constexpr (!kEarlyRelease) {
          __syncwarp();
          if (lane == 0) sm90::mbar_arrive(bar_empty(stage));
        }

        if (!kLateDk && my_dq) {
          stage_dq(step, head, m0);
          if constexpr (Traits::kAhead == 0) publish_dq(step);
        }
        if (++m_index == m_blocks) {
          m_index = 0;
          ++head;
        }
      }
      if (Traits::kAhead > 0 && iters > 0 && computes_dq(step - 1)) publish_dq(step - 1);
      if (iters > 0) {
        ++kv_round;
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(bar_kv_empty);  // K and V of this block are done
      }

      // ---- epilogue: dK (scaled) and dV of this thread's two keys ----
      const int n_valid = min(kBlockN, len_k - n0);
      // Note [portattn hopper dK/dV store]: through the K and V buffers and TMA stores
      // where the block is this CTA's last (nothing refills K/V) and its rows are the
      // sequence's (varlen: a packed map would write the next sequence's rows).
      if (Traits::kTmaStoreDkv && !gqa_atomic && n_block + n_step >= n_blocks &&
          (f.cu_seqlens_k == nullptr || n_valid == kBlockN)) {
        sm90::named_barrier_sync(Traits::kBarEpilogue, 128 * Traits::kConsumers);  // K and V read by all
        // Key row wg * 64 + warp * 16 + g (+ 8): its row mod 8 is g, and the 128B swizzle
        // puts 16-byte chunk j of a 128-byte panel row at chunk j ^ g.
        const uint32_t row_offset = static_cast<uint32_t>(key_row) * 128 + q4 * 4;
        const uint32_t g16 = static_cast<uint32_t>(g) * 16;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int j = 0; j < kOCols / 2; ++j) {
            const uint32_t at = row_offset + r * 8 * 128 + (j / 8) * Traits::kPanelBytesKV +
                                ((static_cast<uint32_t>(j % 8) * 16) ^ g16);
            sm90::st_shared_b32(s_k + at, ptx::ElemTraits<Elem>::pack(dk[r][2 * j] * f.softmax_scale,
                                                                      dk[r][2 * j + 1] * f.softmax_scale));
            sm90::st_shared_b32(s_v + at, ptx::ElemTraits<Elem>::pack(dv[r][2 * j], dv[r][2 * j + 1]));
          }
        }
        sm90::fence_proxy_async_smem();  // the writes above, before the copy engine reads them
        sm90::named_barrier_sync(Traits::kBarStaged + wg, 128);
        if (tid == 0) {
          const int row = bounds.k_start + n0 + wg * 64;  // dense: rows past seqlen_k are clipped
#pragma unroll
          for (int p = 0; p < Traits::kOutDim / Traits::kPanel; ++p) {
            const int col = col0 + p * Traits::kPanel;  // staged in panels 0.. of K / V
            sm90::tma_store_4d(&tm_dk, s_k_wg + p * Traits::kPanelBytesKV, col, row, head_k, tma_batch);
            sm90::tma_store_4d(&tm_dv, s_v_wg + p * Traits::kPanelBytesKV, col, row, head_k, tma_batch);
          }
          sm90::bulk_commit_group();
          sm90::bulk_wait_group_read<0>();  // the buffers stay until the copy engine has read them
        }
        continue;
      }
      // GQA default mode: fp32 reductions into the (B, Sk_max, chunk KV heads, kHeadDim)
      // accumulators (rows padded to the longest sequence, as the convert kernel reads them;
      // kHeadDim = args.acc_head_dim, the pitch run_hopper_bwd laid them out with).
      const int64_t acc_stride = static_cast<int64_t>(args.heads_k) * kHeadDim;
      const int64_t acc_offset = (static_cast<int64_t>(batch) * f.seqlen_k + n0) * acc_stride +
                                 static_cast<int64_t>(head_k - args.head0 / group) * kHeadDim;
      Elem* g_dk = static_cast<Elem*>(p.dk) + batch * p.dk_strides.batch_stride +
                   static_cast<int64_t>(bounds.k_start + n0) * p.dk_strides.row_stride +
                   head_k * p.dk_strides.head_stride;
      Elem* g_dv = static_cast<Elem*>(p.dv) + batch * p.dv_strides.batch_stride +
                   static_cast<int64_t>(bounds.k_start + n0) * p.dv_strides.row_stride +
                   head_k * p.dv_strides.head_stride;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = key_row + 8 * r;
        if (row >= n_valid) continue;
#pragma unroll
        for (int j = 0; j < kOCols / 2; ++j) {
          const int col = col0 + 8 * j + 2 * q4;
          // Padded serving (96 on the hd128 kernel): columns at or past the call's head dim are
          // the padding's zeros and, for the direct stores, the next head's or row's elements.
          // Only the last 64-column panel can hold them (hopper_bwd_acc_head_dim: the head dim
          // is above kHeadDim - 64), so the test is compiled there only and hd64 has none
          // (with the split head dim, in every column of the halves).
          if ((kHalves > 1 || 8 * j + 8 > kHeadDim - 64) && kHeadDim > 64 && col >= f.headdim) continue;
          const float dk0 = dk[r][2 * j] * f.softmax_scale, dk1 = dk[r][2 * j + 1] * f.softmax_scale;
          if (gqa_atomic) {
            const int64_t at = acc_offset + row * acc_stride + col;
            cuda::accum_add2(args.dk_accum + at, dk0, dk1);
            cuda::accum_add2(args.dv_accum + at, dv[r][2 * j], dv[r][2 * j + 1]);
          } else {
            *reinterpret_cast<uint32_t*>(g_dk + row * p.dk_strides.row_stride + col) =
                ptx::ElemTraits<Elem>::pack(dk0, dk1);
            *reinterpret_cast<uint32_t*>(g_dv + row * p.dv_strides.row_stride + col) =
                ptx::ElemTraits<Elem>::pack(dv[r][2 * j], dv[r][2 * j + 1]);
          }
        }
      }
    }
  }
#endif
}

// kPart = kBothParts: hd192's two parts in one launch, by blockIdx.x's parity.
constexpr int kBothParts = -1;

// Whether hd192's kernel of this mask / softcap / mode runs both parts in one launch (Note
// [portattn hopper hd192 backward]). With both bodies in one function ptxas spilled 96-300 bytes in
// the softcap kernels and the deterministic window ones (nvcc 13.0, -Xptxas -v), 0 elsewhere;
// those keep one launch per part.
constexpr bool hd192_one_launch(bool window, bool softcap, bool ordered_dq) {
  return PORTATTN_HOPPER_BWD_HD192_ONE_LAUNCH == 2 ||
         (PORTATTN_HOPPER_BWD_HD192_ONE_LAUNCH == 1 && !softcap && !(ordered_dq && window));
}

template <int kHeadDim, typename Elem, int kMask, bool kSoftcap, bool kBulkDq, bool kOrderedDq, int kPart>
__global__ void __launch_bounds__(HopperBwdTraits<kHeadDim>::kThreads, 1)
    hopper_bwd_kernel(const __grid_constant__ CUtensorMap tm_q,
                      const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v,
                      const __grid_constant__ CUtensorMap tm_do, const __grid_constant__ CUtensorMap tm_dk,
                      const __grid_constant__ CUtensorMap tm_dv, const cuda::BwdArgs args,
                      const float softcap_scale) {
  if constexpr (kPart == kBothParts) {
    if (blockIdx.x % 2 == 0)
      hopper_bwd_body<kHeadDim, Elem, kMask, kSoftcap, kBulkDq, kOrderedDq, 0, true>(tm_q, tm_k, tm_v, tm_do, tm_dk,
                                                                                     tm_dv, args, softcap_scale);
    else
      hopper_bwd_body<kHeadDim, Elem, kMask, kSoftcap, kBulkDq, kOrderedDq, 1, true>(tm_q, tm_k, tm_v, tm_do, tm_dk,
                                                                                     tm_dv, args, softcap_scale);
  } else {
    hopper_bwd_body<kHeadDim, Elem, kMask, kSoftcap, kBulkDq, kOrderedDq, kPart, false>(tm_q, tm_k, tm_v, tm_do,
                                                                                         tm_dk, tm_dv, args,
                                                                                         softcap_scale);
  }
}

}  // namespace hopper
}  // namespace portattn
