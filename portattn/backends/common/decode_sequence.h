// Where a decode call's sequence lives and which keys a workgroup/CTA covers:
// the device-side rules of Note [portattn decode] (params.h), written once
// for the vendor kernels. cu_seqlens values are clamped to the extents the
// params carry (flash-attn's contract); cache_seqlens, leftpad and batch_idx
// values outside the cache make the sequence empty instead (Note [portattn
// decode errors]: no read of another sequence's rows), and block-table page
// numbers are clamped to the pool here and checked by the kernels
// (first_bad_page_slot), so no content of those tensors can move a read or a
// write outside the tensors the call was given.
//
// Every decode kernel includes this header (cuda/csrc/decode_kernel.cuh; on ROCm
// rocm/csrc/decode_kernel.h and wmma_decode_kernel.h, through decode_common.h);
// tests/test_rocm_emulated.py checks it on the CPU and tests/gpu/test_cuda_decode.py
// on the GPU.
#pragma once
#include <stdint.h>

#include "block_range.h"
#include "params.h"
#include "seq_bounds.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PORTATTN_DECODE_HD __host__ __device__ __forceinline__
#else
#define PORTATTN_DECODE_HD inline
#endif

namespace portattn {
namespace decode {

PORTATTN_DECODE_HD int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }
PORTATTN_DECODE_HD int min_int(int a, int b) { return a < b ? a : b; }
PORTATTN_DECODE_HD int max_int(int a, int b) { return a > b ? a : b; }

// Note [portattn decode errors] (params.h): the first offending batch entry per argument.
#if defined(__CUDACC__) || defined(__HIPCC__)
__device__ __forceinline__
#else
inline
#endif
void record_error(int32_t* errors, int argument, int b, int value) {
  if (errors == nullptr) return;
#if defined(__CUDACC__) || defined(__HIPCC__)
  if (atomicCAS(errors + 2 * argument, 0, b + 1) == 0) errors[2 * argument + 1] = value;
#else  // the CPU emulation of the ROCm kernels (tests/rocm_emulation)
  int32_t expected = 0;
  if (__atomic_compare_exchange_n(errors + 2 * argument, &expected, b + 1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
    errors[2 * argument + 1] = value;
#endif
}

// One sequence's queries and keys. Packed (varlen) rows follow common/seq_bounds.h.
struct Sequence {
  int q_start;    // first packed row of q (varlen), else 0
  int seqlen_q;
  int seqlen_k;   // visible keys (0 for a contained sequence)
  int key_base;   // position of key 0: leftpad (caches) or packed row (varlen)
  int cache_row;  // contiguous cache: which batch entry of k (0 for packed keys)

  PORTATTN_DECODE_HD static Sequence of(const PortattnDecodeParams& p, int b) {
    Sequence s{0, p.seqlen_q, p.seqlen_k, 0, b};
    if (p.cu_seqlens_q != nullptr) packed_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, s.q_start, s.seqlen_q);
    if (p.cu_seqlens_k != nullptr && p.block_table != nullptr) {
      // Paged varlen (flash_attn_varlen_func with block_table): cu_seqlens_k gives the
      // lengths; every sequence starts at position 0 of its own pages.
      s.seqlen_k = clamp_int(p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b], 0, p.kv_capacity);
    } else if (p.cu_seqlens_k != nullptr) {
      packed_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k, s.key_base, s.seqlen_k);
      s.cache_row = 0;  // packed keys: batch stride 0
    } else if (p.cache_seqlens != nullptr || p.cache_leftpad != nullptr) {
      // Compared before adding: cache_seqlens + seqlen_new may overflow an int.
      const int filled = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.kv_capacity - p.seqlen_new;
      const int start = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
      if (filled < 0 || filled > p.kv_capacity - p.seqlen_new || start < 0 || start > filled + p.seqlen_new) {
        s.contain();  // metadata_error says which
      } else {
        s.key_base = start;
        s.seqlen_k = filled + p.seqlen_new - start;
      }
    } else {
      s.seqlen_k = min_int(p.seqlen_k, p.kv_capacity);
    }
    if (p.cu_seqlens_k == nullptr && p.cache_batch_idx != nullptr) {
      const int entry = p.cache_batch_idx[b];
      if (entry < 0 || entry >= p.cache_batches) {
        s.cache_row = 0;
        s.contain();
      } else {
        s.cache_row = entry;
      }
    }
    return s;
  }

  // Its masking rule (block_range.h).
  PORTATTN_DECODE_HD MaskRule rule(const PortattnDecodeParams& p) const {
    return MaskRule::of(seqlen_q, seqlen_k, p.window_left, p.window_right);
  }

  // Out-of-range metadata: no key read, out = 0 and lse = -inf (Note [portattn decode errors]).
  PORTATTN_DECODE_HD void contain() {
    seqlen_k = 0;
    key_base = 0;
  }
};

// Which argument (PortattnErrorArgument) of sequence b made Sequence::of contain it, with
// its value in *value; -1 when none. The same rule as Sequence::of, read again only by the
// one thread that reports (kept out of Sequence: two more live fields made the head-dim-256
// CUDA kernel spill, ptxas -v). Block-table entries are the kernels' scan (first_bad_page_slot).
PORTATTN_DECODE_HD int metadata_error(const PortattnDecodeParams& p, int b, int* value) {
  if (p.cu_seqlens_k != nullptr) return -1;
  if (p.cache_seqlens != nullptr || p.cache_leftpad != nullptr) {
    const int filled = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.kv_capacity - p.seqlen_new;
    if (filled < 0 || filled > p.kv_capacity - p.seqlen_new) {
      *value = filled;
      return PORTATTN_ERR_CACHE_SEQLENS;
    }
    const int start = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
    if (start < 0 || start > filled + p.seqlen_new) {
      *value = start;
      return PORTATTN_ERR_CACHE_LEFTPAD;
    }
  }
  if (p.cache_batch_idx != nullptr) {
    const int entry = p.cache_batch_idx[b];
    if (entry < 0 || entry >= p.cache_batches) {
      *value = entry;
      return PORTATTN_ERR_CACHE_BATCH_IDX;
    }
  }
  return -1;
}

PORTATTN_DECODE_HD int log2_if_power_of_two(int x) {
  if (x <= 0 || (x & (x - 1)) != 0) return -1;
  int shift = 0;
  while ((1 << shift) < x) ++shift;
  return shift;
}

// Where key row `pos` (a position in the sequence's layout) of one KV head lives: a
// page (or the contiguous cache's batch entry) and the row within it. K and V share
// it; their strides may differ (separate views of one cache). Paged: a block-table read
// per row (or per stage when one page holds it), so any page size works and a tile may
// span pages; the page number is clamped to the pool.
struct KeyRowAddress {
  const int32_t* pages;  // this sequence's block-table row, or null
  int page_size;
  int num_pages;
  int page_shift;  // log2(page_size) when a power of two, else -1 (a division per row)

  PORTATTN_DECODE_HD KeyRowAddress() : pages(nullptr), page_size(1), num_pages(1), page_shift(0) {}
  PORTATTN_DECODE_HD KeyRowAddress(const int32_t* pages_, int page_size_, int num_pages_)
      : pages(pages_), page_size(page_size_), num_pages(num_pages_),
        page_shift(pages_ != nullptr ? log2_if_power_of_two(page_size_) : -1) {}

  // Which block-table slot holds `pos`, and the page it names.
  PORTATTN_DECODE_HD int page_of_slot(int pos) const {
    return page_shift >= 0 ? pos >> page_shift : pos / page_size;
  }
  PORTATTN_DECODE_HD int page_of(int pos) const { return clamp_int(pages[page_of_slot(pos)], 0, num_pages - 1); }
  PORTATTN_DECODE_HD int row_in_page(int pos) const {
    return page_shift >= 0 ? pos & (page_size - 1) : pos % page_size;
  }
  PORTATTN_DECODE_HD static int64_t offset_of(const PortattnTensor4& st, int page_or_entry, int row) {
    return page_or_entry * st.batch_stride + static_cast<int64_t>(row) * st.row_stride;
  }
  // Element offset of key row `pos`: paged, or row `pos` of batch entry `cache_row`.
  PORTATTN_DECODE_HD int64_t offset(const PortattnTensor4& st, int cache_row, int pos) const {
    if (pages == nullptr) return offset_of(st, cache_row, pos);
    return offset_of(st, page_of(pos), row_in_page(pos));
  }
};

// The first block-table slot among slot0 + t, slot0 + t + count, ... (t in [0, count): the
// threads of a block share the scan) of the slots holding positions [key_base, key_base +
// seqlen_k) of the sequence whose block-table row is `pages`, whose page number lies outside
// [0, num_pages); -1 when none. Every block of the sequence scans all of its slots, so all
// its splits agree on containing it (Note [portattn decode errors]).
PORTATTN_DECODE_HD int first_bad_page_slot(const int32_t* pages, int page_size, int num_pages, int key_base,
                                           int seqlen_k, int t, int count) {
  if (seqlen_k <= 0) return -1;
  const int last = (key_base + seqlen_k - 1) / page_size;
#if defined(__CUDACC__) || defined(__HIPCC__)
#pragma unroll 1
#endif
  for (int slot = key_base / page_size + t; slot <= last; slot += count) {
    const int page = pages[slot];
    if (page < 0 || page >= num_pages) return slot;
  }
  return -1;
}

// The key stages [begin, end) one split of one query tile covers, and the
// tile's alignment facts. Packed row r is query r / group; which keys a query
// sees is Sequence::rule (block_range.h). The stages a tile can see are
// divided evenly over the splits (in stages of the kernel's key count), so an
// empty split is possible and yields lse -inf.
struct KeyRange {
  int diag;             // seqlen_k - seqlen_q
  int q_first, q_last;  // queries of the tile's first and last valid rows
  int begin, end;       // stages of this split

  // row0 < seqlen_q * group (the kernels return before asking for a tile without rows).
  PORTATTN_DECODE_HD static KeyRange of(const PortattnDecodeParams& p, const Sequence& seq, int row0, int tile_rows,
                                        int group, int stage_keys, int split) {
    KeyRange r;
    const int rows = seq.seqlen_q * group;
    const MaskRule rule = seq.rule(p);
    r.diag = rule.diag;
    r.q_first = row0 / group;
    r.q_last = min_int(row0 + tile_rows - 1, rows - 1) / group;
    const IndexRange stages = MaskRule::blocks_of(rule.key_range(r.q_first, r.q_last), stage_keys);
    const int per_split = (stages.size() + p.num_splits - 1) / p.num_splits;
    r.begin = min_int(stages.begin + split * per_split, stages.end);
    r.end = min_int(r.begin + per_split, stages.end);
    return r;
  }

  // Whether every (row, key) pair of the stage starting at key0 is visible. (The
  // rule is rebuilt from the params here: given the caller's copy instead, the
  // CUDA decode kernel took 25 more registers, ptxas -v.)
  PORTATTN_DECODE_HD bool all_visible(const PortattnDecodeParams& p, const Sequence& seq, int key0,
                                      int stage_keys) const {
    return seq.rule(p).tile_fully_visible(q_first, q_last, key0, key0 + stage_keys - 1);
  }
};

// Where query qi of sequence b and head `head` leaves its result: its row of out and
// its LSE (packed (varlen) out and lse have no batch stride), or with several splits
// its row of the fp32 partials. Shared because four writers must agree on these
// places (each vendor's decode kernel with one split, and its split combine) and
// the combine finds a partial again by inverting partial_row (PartialRow::of).
struct OutputRow {
  int b, head;
  int q_start;  // the sequence's first packed row of q (varlen), else 0
  int qi;       // query within the sequence

  PORTATTN_DECODE_HD int64_t out_offset(const PortattnDecodeParams& p) const {
    const int64_t o_batch = p.cu_seqlens_q != nullptr ? 0 : b * p.out_strides.batch_stride;
    return o_batch + static_cast<int64_t>(q_start + qi) * p.out_strides.row_stride +
           static_cast<int64_t>(head) * p.out_strides.head_stride;
  }
  PORTATTN_DECODE_HD int64_t lse_offset(const PortattnDecodeParams& p) const {
    return (p.cu_seqlens_q != nullptr ? 0 : b * p.lse_batch_stride) + head * p.lse_head_stride + q_start + qi;
  }
  // Row of o_partial / lse_partial: indexed by the query within its sequence, so
  // the combine needs no sequence lengths to find it.
  PORTATTN_DECODE_HD int64_t partial_row(const PortattnDecodeParams& p, int split) const {
    return ((static_cast<int64_t>(split) * p.batch + b) * p.nheads + head) * p.seqlen_q + qi;
  }
};

// What a split combine owns: split 0's partial row `row` (OutputRow::partial_row,
// inverted) as an output row. in_sequence is false for a query past the end of a
// packed sequence shorter than seqlen_q: the decode kernel wrote nothing there (it
// clamps with the same Sequence::of), so the combine skips it too.
struct PartialRow {
  OutputRow out;
  bool in_sequence;

  PORTATTN_DECODE_HD static PartialRow of(const PortattnDecodeParams& p, int64_t row) {
    PartialRow r;
    r.out.qi = static_cast<int>(row % p.seqlen_q);
    r.out.head = static_cast<int>((row / p.seqlen_q) % p.nheads);
    r.out.b = static_cast<int>(row / (static_cast<int64_t>(p.seqlen_q) * p.nheads));
    r.out.q_start = 0;
    r.in_sequence = true;
    if (p.cu_seqlens_q != nullptr) {
      const Sequence seq = Sequence::of(p, r.out.b);
      r.in_sequence = r.out.qi < seq.seqlen_q;
      r.out.q_start = seq.q_start;
    }
    return r;
  }
};

}  // namespace decode
}  // namespace portattn
