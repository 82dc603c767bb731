// portattn C ABI: the one boundary between Python and every compiled kernel.
//
// Both vendor backends (backends/cuda, backends/rocm) implement the same two
// entry points over these structs. Kernels see raw pointers, element strides
// and a stream handle only: no libtorch types cross this line, so one binary
// works with every torch version and the ROCm backend builds without torch.
//
// Conventions (Note [portattn semantics], mirrored in docs/ARCHITECTURE.md):
// - Layout (batch, seqlen, heads, headdim); strides are in elements, the last
//   dimension is contiguous. Varlen calls pack sequences along the seqlen axis
//   and pass cu_seqlens (int32, batch + 1 entries); their batch strides are 0.
// - Masking is one rule: key j is visible to query i when
//     i + seqlen_k - seqlen_q - window_left <= j   (if window_left  >= 0)
//     j <= i + seqlen_k - seqlen_q + window_right  (if window_right >= 0)
//   "causal" is window_right == 0 (bottom-right aligned, as flash-attn >= 2.1).
// - Scores: s = scale * q.k; if softcap > 0: s = softcap * tanh(s / softcap);
//   then ALiBi adds -slope * |i + seqlen_k - seqlen_q - j|; then the mask.
// - LSE is the natural-log log-sum-exp of the masked scores, fp32, layout
//   (batch, heads, seqlen_q) or (heads, total_q) for varlen. A row with no
//   visible key gets out = 0 and lse = -inf.
// - Dropout acts on the normalised probabilities; kept entries are scaled by
//   1 / (1 - p). The keep decision is philox.h's, so forward, backward and
//   the reference backend agree bit for bit on the mask.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum PortattnDtype { PORTATTN_FP16 = 0, PORTATTN_BF16 = 1 };

typedef struct PortattnTensor4 {
  // Strides (elements) of a (batch, seqlen, heads, headdim) tensor; the
  // headdim stride is 1 by contract and therefore absent.
  int64_t batch_stride;
  int64_t row_stride;
  int64_t head_stride;
} PortattnTensor4;

typedef struct PortattnFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // null: not wanted (inference calls); else written for every row

  PortattnTensor4 q_strides, k_strides, v_strides, out_strides;
  int64_t lse_batch_stride;  // lse[b * lse_batch_stride + h * lse_head_stride + i]
  int64_t lse_head_stride;

  int dtype;  // PortattnDtype
  int batch;
  int nheads;
  int nheads_k;  // nheads % nheads_k == 0 (GQA/MQA), checked in Python
  int headdim;   // multiple of 8, <= the backend's maximum
  int seqlen_q;  // max over the batch for varlen
  int seqlen_k;

  // Varlen: non-null cu_seqlens_q/k switch the kernel to packed sequences. Their
  // values (and seqused_k's) are device data no kernel trusts: seq_bounds.h.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_k;  // optional: keys actually used per sequence (kv cache)

  float softmax_scale;
  float softcap;     // 0 = off
  int window_left;   // -1 = unbounded
  int window_right;  // -1 = unbounded; 0 = causal

  const float* alibi_slopes;  // null = off; (nheads,) or (batch, nheads) fp32
  int64_t alibi_batch_stride; // 0 for (nheads,)

  float dropout_p;  // 0 = off
  uint64_t philox_seed;
  uint64_t philox_offset;

  void* stream;  // cudaStream_t / hipStream_t

  // Rows along the sequence axis of q (out, dq) and k/v (dk, dv): the packed
  // total over the batch for varlen, seqlen_q / seqlen_k per batch entry
  // otherwise; filled for every call (abi.py). Varlen kernels clamp each
  // sequence's rows to them on the device (seq_bounds.h), and the Hopper
  // kernels' tensor maps take them as the extent.
  int64_t total_q;
  int64_t total_k;

  // Dropout under CUDA-graph capture: null, or a device int64 pair [seed, offset] that the
  // kernels read instead of philox_seed / philox_offset above. Drawn on the device for each
  // call (portattn/rng.py), so every replay of a captured step gets a fresh mask.
  const int64_t* philox_state;

  // SMs a persistent grid leaves free for kernels running beside it (NCCL's in ring
  // attention): such a grid launches max(1, SMs - sm_margin) CTAs. >= 0, checked in Python
  // (FlashAttention-3's argument of the same name). The Hopper forward's persistent
  // schedules are the only grids sized by the SM count; the others (sm80+ forward and
  // backward, Hopper backward, merge) have one CTA per tile, which the hardware hands to
  // whichever SMs are free, and ignore it, as do the ROCm kernels (none is persistent).
  // The decode kernels take no params of this struct: their split count is planned in
  // Python (portattn/decode.py), which takes the margin off the SMs it plans for.
  int sm_margin;
} PortattnFwdParams;

typedef struct PortattnBwdParams {
  PortattnFwdParams fwd;  // the forward call's inputs (out and lse as produced)

  const void* dout;
  PortattnTensor4 dout_strides;
  void* dq;
  void* dk;
  void* dv;
  PortattnTensor4 dq_strides, dk_strides, dv_strides;

  // Scratch owned by the caller (allocated in Python through torch so the
  // caching allocator serves it): sizes come from the backend's
  // bwd_workspace_bytes(), never computed twice.
  void* workspace;
  int64_t workspace_bytes;

  int deterministic;  // 1: bitwise reproducible dq (no fp32 atomics race)
} PortattnBwdParams;

// ---- decode: few query rows against a KV cache read in place ----------------
//
// Note [portattn fp8 kv cache]
// A KV cache may hold float8 e4m3 (OCP "fn": bias 7, no infinities, max 448) with a query of
// `dtype` (fp16/bf16). The key the attention sees is k_cache * k_descale[b, hk], the value
// v_cache * v_descale[b, hk], indexed by the query's batch entry b and the KV head hk (as
// FlashAttention-3). The decode kernels convert e4m3 to `dtype` exactly (both have more
// exponent and mantissa bits), run the same mma path, fold k_descale into the score scale
// and multiply the output by v_descale, so the descales never round. The append quantises
// new rows as e4m3(x / descale): round to nearest even, saturating to +-448.
enum PortattnCacheDtype { PORTATTN_CACHE_AS_QUERY = 0, PORTATTN_CACHE_FP8_E4M3 = 1 };

typedef struct PortattnKvDescale {
  int cache_dtype;         // PortattnCacheDtype
  const float* k_descale;  // null (1.0), or fp32 read at b * batch_stride + hk * head_stride
  const float* v_descale;
  int64_t k_descale_batch_stride, k_descale_head_stride;
  int64_t v_descale_batch_stride, v_descale_head_stride;
} PortattnKvDescale;

//
// Note [portattn decode]
// One CTA per (split, kv head x 16-row query tile, sequence). The query rows of
// one KV head's group are packed into the tile's rows (row = query * group +
// head-in-group), so each K/V byte is read once per step, not once per query
// head. The CTA's warps take different keys of each stage and merge their
// softmax states through shared memory at the end; the key range of a sequence
// is split over `num_splits` CTAs whose partial results (fp32, in the caller's
// workspace) a combine kernel merges by their LSE. With one split the CTA
// writes `out` directly. Every per-sequence value (lengths, offsets, page
// numbers) is read and clamped on the device: no host synchronisation, so a
// decode step can be captured in a CUDA graph, and no value of those tensors
// can make a kernel read or write outside the tensors it was given.
//
// Where sequence b's keys live (exactly one of three layouts):
// - contiguous cache: k[(batch_idx ? batch_idx[b] : b), leftpad + j]
// - paged cache:      k[block_table[b, p / page_size], p % page_size], p = leftpad + j
// - varlen (packed):  k[cu_seqlens_k[b] + j]; with a block table, paged as above
//   from position 0, cu_seqlens_k giving only the lengths
// Key count: cache_seqlens[b] + seqlen_new - leftpad (cache layouts, clamped to the
// capacity), cu_seqlens_k[b + 1] - cu_seqlens_k[b] (varlen), else seqlen_k.
typedef struct PortattnDecodeParams {
  const void* q;  // (batch, seqlen_q, nheads, headdim), or varlen (total_q, nheads, headdim)
  const void* k;  // see above; paged: (num_pages, page_size, nheads_k, headdim)
  const void* v;
  void* out;   // like q
  float* lse;  // null, or (batch, nheads, seqlen_q) / varlen (nheads, total_q)

  PortattnTensor4 q_strides, k_strides, v_strides, out_strides;  // k/v batch stride: per page when paged
  int64_t lse_batch_stride;
  int64_t lse_head_stride;

  int dtype;
  int batch;
  int nheads;
  int nheads_k;
  int headdim;
  int seqlen_q;  // max over the batch for varlen
  int seqlen_k;  // keys per sequence when no per-sequence count is given

  const int32_t* cu_seqlens_q;   // varlen queries, or null
  const int32_t* cu_seqlens_k;   // varlen keys, or null
  const int32_t* cache_seqlens;  // cache layouts: live keys before the append, or null (capacity)
  int seqlen_new;                // tokens appended at cache_seqlens[b] (already written)
  const int32_t* cache_leftpad;  // or null
  const int32_t* cache_batch_idx;  // contiguous cache only, or null
  const int32_t* block_table;    // paged cache only, or null
  int64_t block_table_batch_stride;
  int page_size;
  int num_pages;      // k's first extent when paged (page numbers are clamped to it)
  int cache_batches;  // k's first extent for a contiguous cache (batch_idx is clamped to it)
  int kv_capacity;    // key rows a sequence can hold: seqlen dim, or block_table width * page_size
  int64_t total_q;    // varlen: rows of q / k (offsets are clamped to them)
  int64_t total_k;

  float softmax_scale;
  float softcap;
  int window_left;
  int window_right;
  const float* alibi_slopes;
  int64_t alibi_batch_stride;

  int num_splits;        // >= 1; > 1 needs the workspace below
  float* o_partial;      // (num_splits, batch, nheads, seqlen_q, headdim) fp32
  float* lse_partial;    // (num_splits, batch, nheads, seqlen_q) fp32

  void* stream;

  // Containment of out-of-range cache metadata (Note [portattn decode errors]): null, or
  // portattn's per-device int32 buffer of PORTATTN_ERROR_SLOTS entries. Appended last so
  // that the fields before keep their offsets.
  int32_t* errors;

  // FP8 caches (Note [portattn fp8 kv cache]): cache_dtype PORTATTN_CACHE_FP8_E4M3 means k and
  // v hold e4m3 bytes (their strides count bytes) while q and out keep `dtype`.
  PortattnKvDescale kv;
} PortattnDecodeParams;

// Appends new keys/values to a cache (rotating the keys) and writes rotated
// queries, before a decode call on the same stream: one writer per element.
// Rotary positions follow flash-attn 2: key i of sequence b sits at cache row
// cache_seqlens[b] + i and is rotated at that index (which counts leftpad);
// queries are rotated at cache_seqlens[b] (+ i when q_position_per_token:
// causal or local attention). Rows past the capacity are not written.
typedef struct PortattnAppendParams {
  const void* k_new;  // (batch, seqlen_new, nheads_k, headdim) or null
  const void* v_new;
  PortattnTensor4 k_new_strides, v_new_strides;
  void* k_cache;
  void* v_cache;
  PortattnTensor4 k_cache_strides, v_cache_strides;
  const void* q;  // (batch, seqlen_q, nheads, headdim) or null (no query rotation)
  void* q_out;    // rotated queries, like q
  PortattnTensor4 q_strides, q_out_strides;

  int dtype;
  int batch;
  int seqlen_new;
  int seqlen_q;
  int nheads;
  int nheads_k;
  int headdim;

  const int32_t* cache_seqlens;  // (batch,)
  const int32_t* cache_batch_idx;
  const int32_t* block_table;
  int64_t block_table_batch_stride;
  int page_size;
  int num_pages;
  int cache_batches;
  int kv_capacity;

  const void* rotary_cos;  // (seqlen_ro, rotary_dim / 2) or null
  const void* rotary_sin;
  int64_t rotary_row_stride;  // elements between positions (cos and sin share it)
  int rotary_dtype;           // PortattnDtype, or 2 for float32
  int rotary_dim;             // even, <= headdim; 0 = no rotation
  int seqlen_ro;
  int rotary_interleaved;
  int q_position_per_token;

  void* stream;
  int32_t* errors;  // as PortattnDecodeParams.errors
  PortattnKvDescale kv;  // an FP8 cache: k_new / v_new (of `dtype`) are quantised into it
} PortattnAppendParams;

// Note [portattn decode errors]
// A sequence whose cache_seqlens, cache_leftpad, cache_batch_idx or block_table entries
// point outside the cache (cache_seqlens outside [0, kv_capacity - seqlen_new], leftpad
// outside [0, cache_seqlens + seqlen_new], batch_idx outside [0, cache_batches), a page
// number outside [0, num_pages) among the pages its keys occupy) is contained rather than
// clamped into another sequence's rows: the append writes none of its rows, the decode reads
// none of its keys and writes out = 0, lse = -inf for its rows. The first offending batch
// entry per argument is recorded (one compare-and-swap per offending block) in `errors`:
// errors[2 a] = batch entry + 1 (0: none), errors[2 a + 1] = the value it held, for
// argument a below; portattn.check_errors() reads and clears it (portattn/errors.py).
// No device assert: it would kill the CUDA context every request of a server shares.
enum PortattnErrorArgument {
  PORTATTN_ERR_CACHE_SEQLENS = 0,
  PORTATTN_ERR_CACHE_LEFTPAD = 1,
  PORTATTN_ERR_CACHE_BATCH_IDX = 2,
  PORTATTN_ERR_BLOCK_TABLE = 3,
  PORTATTN_ERROR_SLOTS = 8
};

#ifdef __cplusplus
}
#endif
