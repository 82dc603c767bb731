// Which keys a query sees, which key blocks a query block must visit (and the
// reverse for the backward), and which tiles need a per-element mask: the
// masking rule of Note [portattn semantics] (params.h), written once for the
// sm80 forward and backward, the ROCm forward and backward and both vendors'
// decode kernels, host and device, CUDA and HIP. The Hopper forward and
// backward keep their own written-out copy on purpose: ported to these helpers
// they measure slower on an H100 (forward+backward 7-11% at hd 64 causal,
// forward 0-5%; archive:2026-11-24-c4f0d81/hopper_bwd_ab_block_range.md), from
// code generation, not from the ranges, which are the same (the brute-force
// test below covers the rule; the Hopper GPU tests cover those kernels). tests/test_block_range.py checks it on the CPU against a brute-force
// reading of the rule.
//
// Note [portattn visible keys]
// One sequence has len_q queries and len_k keys (seq_bounds.h); key j is on
// query i's diagonal when j == i + diag, diag = len_k - len_q (bottom-right
// alignment). A window side < 0 is unbounded. Query i sees key j iff
//     i < len_q  &&  j < len_k  &&  (wl < 0 || j >= i + diag - wl)  &&  (wr < 0 || j <= i + diag + wr)
// Both window edges move right by one key per query, so
//   - the keys rows q_first..q_last see together are one interval, from the
//     first row's left edge to the last row's right edge (key_range), and the
//     key blocks to visit are those that overlap it (key_blocks); the queries
//     that see keys k_first..k_last likewise (query_range, query_blocks);
//   - a tile is visible everywhere when its two tightest corners are: the right
//     edge is tightest for its first row, the left edge for its last
//     (tile_fully_visible).
// The range and tile helpers take the rows (or keys) the caller computes and do
// not test that side against its length: a forward tile's rows past len_q are
// computed but never stored, so the CUDA forward kernels pass their whole query
// block (ROCm clamps it to len_q), and the backward kernels pass key ranges
// already cut at len_k. They do test the other side: keys past len_k are
// padding and are never visible; query ranges stop at len_q.
#pragma once
#include <limits.h>
#include <stdint.h>

#include "seq_bounds.h"  // PORTATTN_HD; SeqBounds gives a rule its lengths

namespace portattn {

// [begin, end): rows, keys or blocks; empty when end <= begin.
struct IndexRange {
  int begin, end;
  PORTATTN_HD int size() const { return end > begin ? end - begin : 0; }
};

// The keys one query sees: lo <= j <= hi (lo is INT_MIN without a left window).
struct VisibleSpan {
  int lo, hi;
};

// Which window sides a kernel instantiation has (kernels compiled per mask kind
// pass it so that the compiler drops the tests of the absent sides).
enum MaskKind : int { kMaskKindNone = 0, kMaskKindCausal = 1, kMaskKindLocal = 2 };

struct MaskRule {
  int len_q, len_k;
  int diag;  // len_k - len_q
  int window_left, window_right;  // < 0: unbounded

  PORTATTN_HD static MaskRule of(int len_q, int len_k, int window_left, int window_right) {
    return MaskRule{len_q, len_k, len_k - len_q, window_left, window_right};
  }
  PORTATTN_HD static MaskRule of(const SeqBounds& seq, int window_left, int window_right) {
    return of(seq.len_q, seq.len_k, window_left, window_right);
  }
  // kMaskKindNone ignores both windows, kMaskKindCausal is the window (-1, 0),
  // kMaskKindLocal takes both as given.
  template <int kKind>
  PORTATTN_HD static MaskRule of_kind(int len_q, int len_k, int window_left, int window_right) {
    return of(len_q, len_k, kKind == kMaskKindLocal ? window_left : -1,
              kKind == kMaskKindNone ? -1 : (kKind == kMaskKindCausal ? 0 : window_right));
  }

  // The rule itself, for one (query, key) pair. Bitwise &: with && nvcc kept a
  // 16-bit bool per element of the sm80 backward (448 more SASS instructions).
  PORTATTN_HD bool visible(int i, int j) const {
    return (j < len_k) & (i < len_q) & (window_left < 0 || j >= i + diag - window_left) &
           (window_right < 0 || j <= i + diag + window_right);
  }

  // The keys query i sees (i itself is not tested against len_q): key j passes
  // iff lo <= j <= hi. The ROCm kernels write the same bounds as offsets from
  // each lane's first key in place (fwd_kernel.h, bwd_kernel.h): through this
  // helper their compiler spent 1-4 more registers.
  PORTATTN_HD VisibleSpan keys_of_query(int i) const {
    const int aligned = i + diag;
    const int hi = window_right >= 0 ? aligned + window_right : INT_MAX;
    return VisibleSpan{window_left >= 0 ? aligned - window_left : INT_MIN, hi < len_k - 1 ? hi : len_k - 1};
  }

  // The keys some row of q_first..q_last sees.
  PORTATTN_HD IndexRange key_range(int q_first, int q_last) const {
    IndexRange r{0, len_k};
    if (window_left >= 0 && q_first + diag - window_left > 0) r.begin = q_first + diag - window_left;
    if (window_right >= 0 && q_last + diag + window_right + 1 < len_k) r.end = q_last + diag + window_right + 1;
    return r;
  }

  // The queries that see some key of k_first..k_last.
  PORTATTN_HD IndexRange query_range(int k_first, int k_last) const {
    IndexRange r{0, len_q};
    if (window_right >= 0 && k_first - diag - window_right > 0) r.begin = k_first - diag - window_right;
    if (window_left >= 0 && k_last - diag + window_left + 1 < len_q) r.end = k_last - diag + window_left + 1;
    return r;
  }

  // Blocks of `block` indices that overlap `r` (r.begin >= 0); empty when r is.
  PORTATTN_HD static IndexRange blocks_of(IndexRange r, int block) {
    const int first = r.begin / block;
    return IndexRange{first, r.end > r.begin ? (r.end + block - 1) / block : first};
  }

  // The same blocks as blocks_of(key_range(...)) and blocks_of(query_range(...))
  // for q_first < len_q (k_first < len_k; a kernel returns before asking for a
  // tile without rows or keys), computed from the window edges' blocks. Which
  // form a kernel calls is the one its compiler does best with (ptxas -v, ISA):
  // key_blocks for the sm80 forward (clamping the keys before dividing made it
  // spill 28 bytes at 255 registers; the Hopper forward writes the same form out),
  // query_blocks for the form the Hopper backward writes out, blocks_of for the decode kernels and
  // the sm80 backward. Empty when end <= begin.
  PORTATTN_HD IndexRange key_blocks(int q_first, int q_last, int block_n) const {
    IndexRange r{0, (len_k + block_n - 1) / block_n};
    if (window_right >= 0) {
      const int last_key = q_last + diag + window_right;
      const int end = last_key < 0 ? 0 : last_key / block_n + 1;
      r.end = end < r.end ? end : r.end;
    }
    if (window_left >= 0) {
      const int first = (q_first + diag - window_left) / block_n;  // rounds towards 0: clamped here
      r.begin = first > 0 ? first : 0;
    }
    return r;
  }

  PORTATTN_HD IndexRange query_blocks(int k_first, int k_last, int block_m) const {
    IndexRange r{0, (len_q + block_m - 1) / block_m};
    if (window_right >= 0) {
      const int first = k_first - diag - window_right;
      r.begin = (first > 0 ? first : 0) / block_m;
    }
    if (window_left >= 0) {
      const int reach = k_last - diag + window_left + block_m;  // one block past the last row's
      const int end = (reach > 0 ? reach : 0) / block_m;
      r.end = end < r.end ? end : r.end;
    }
    return r;
  }

  // Whether every key of k_first..k_last exists and every row of q_first..q_last
  // (not tested against len_q) sees it: then the tile needs no per-element mask.
  PORTATTN_HD bool tile_fully_visible(int q_first, int q_last, int k_first, int k_last) const {
    return k_last < len_k && (window_right < 0 || k_last <= q_first + diag + window_right) &&
           (window_left < 0 || k_first >= q_last + diag - window_left);
  }
};

}  // namespace portattn
