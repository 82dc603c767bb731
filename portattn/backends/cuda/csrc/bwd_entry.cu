// C entry points of the backward pass in libportattn_cuda.so, plus the pieces
// of it that do not depend on the head dim (workspace layout, preprocess and
// convert kernels), compiled once here instead of once per variant.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "bwd_launch.cuh"

namespace portattn {
namespace cuda {

namespace {

// Deterministic mode: the number of CTAs the key-block splits aim for across
// (batch, KV head, head-dim half). About two waves on a 132-SM H100 and more
// on smaller parts; a function of the shape only, so a given call reduces in
// the same order on every GPU. Each split costs one fp32 copy of dQ.
constexpr int kDetTargetCtas = 256;
// About the smallest kBlockN: more splits than key blocks would only idle.
constexpr int kMinBlockN = 64;

// Chunking by KV heads (Note [portattn cuda backward]): a chunk's fp32 dQ
// accumulator stays at least this large, so only long launches are split
// (each chunk is then still thousands of CTAs) while a 32k-token, 16-head
// call keeps half the scratch of an unchunked one.
constexpr int64_t kMinChunkDqBytes = int64_t(128) << 20;
// Deterministic mode chunks only past this much dQ scratch: its splits were sized
// for the whole call (kDetTargetCtas), so a chunk of one or two KV heads would run
// a fraction of the GPU (measured 1.8-7.6x the default's time at 8k-16k tokens with
// the 128 MiB rule above, against 1.00-1.25x unchunked). The price is scratch: about
// kDetTargetCtas / (batch * nheads_k) fp32 copies of dQ, 2 GiB at B=1, H=16, 16k, hd128.
constexpr int64_t kMinChunkDetDqBytes = int64_t(4) << 30;

int64_t align_up(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// PORTATTN_SM80_BWD_WIDE (bwd_launch.cuh: bwd_wide_enabled): "0" runs bwd_kernel (head dims above
// 128 as two head-dim halves); unset or anything else, the full-head-dim kernel from head dim 64 up
// where its tile fits (the default: 1.08-1.25x the halves' forward+backward on an H200 at every
// budget, 1.05-1.12x bwd_kernel's at 64-128; docs/kernels-sm80.md).
constexpr const char* kWideEnv = "PORTATTN_SM80_BWD_WIDE";
std::atomic<int> g_wide{1};
std::once_flag g_wide_once;

int wide_now() {
  std::call_once(g_wide_once, [] {
    const char* text = getenv(kWideEnv);
    g_wide.store(text != nullptr && strcmp(text, "0") == 0 ? 0 : 1);
  });
  return g_wide.load();
}

int det_splits(const PortattnFwdParams& f) {
  // The CTAs of one split: head-dim halves over grid.z unless the wide kernel runs.
  const int64_t halves = f.headdim > 128 && !bwd_wide_enabled() ? 2 : 1;
  const int64_t ctas = static_cast<int64_t>(f.batch) * f.nheads_k * halves;
  int64_t splits = (kDetTargetCtas + ctas - 1) / ctas;
  const int64_t key_blocks = (f.seqlen_k + kMinBlockN - 1) / kMinBlockN;
  if (splits > key_blocks) splits = key_blocks;
  return static_cast<int>(splits < 1 ? 1 : splits);
}

}  // namespace

bool bwd_wide_enabled() { return wide_now() != 0; }

BwdWorkspace bwd_workspace_layout(const PortattnBwdParams& params, bool ordered_dq, int acc_head_dim) {
  const PortattnFwdParams& f = params.fwd;
  BwdWorkspace ws{};
  // Ordered dQ (the Hopper deterministic mode) adds into one accumulator in key-block
  // order; the sm80+ deterministic mode gives each split its own slice.
  const bool sliced = params.deterministic && !ordered_dq;
  ws.slices = sliced ? det_splits(f) : 1;
  const int group = f.nheads_k > 0 ? f.nheads / f.nheads_k : 1;
  // The sm80+ kernels' dQ is stored in 8-row blocks (Note [portattn sm80 blocked dQ]): each head's
  // rows start on a whole block.
  ws.ws_rows = ordered_dq ? f.seqlen_q : (f.seqlen_q + 7) / 8 * 8;
  const int64_t dq_per_kv_head = static_cast<int64_t>(ws.slices) * f.batch * group * ws.ws_rows *
                                 acc_head_dim * 4;
  ws.chunk_heads_k = f.nheads_k;
  const int64_t min_chunk_bytes = sliced ? kMinChunkDetDqBytes : kMinChunkDqBytes;
  while (ws.chunk_heads_k % 2 == 0 && dq_per_kv_head * (ws.chunk_heads_k / 2) >= min_chunk_bytes)
    ws.chunk_heads_k /= 2;
  const int64_t rows = static_cast<int64_t>(f.batch) * ws.chunk_heads_k * group * ws.ws_rows;
  ws.dq_slice = rows * acc_head_dim;
  ws.dkv_accum = !params.deterministic && f.nheads != f.nheads_k;
  const int64_t dkv =
      ws.dkv_accum ? static_cast<int64_t>(f.batch) * f.seqlen_k * ws.chunk_heads_k * acc_head_dim * 4 : 0;
  // The ordered mode's counts, one per kDqOrderRows-query block of each head.
  const int64_t order_counts = params.deterministic && ordered_dq
                                   ? static_cast<int64_t>(f.batch) * ws.chunk_heads_k * group *
                                         ((f.seqlen_q + kDqOrderRows - 1) / kDqOrderRows)
                                   : 0;
  ws.delta = 0;
  ws.lse2 = align_up(rows * 4);
  ws.dq_order = ws.lse2 + align_up(rows * 4);
  ws.dq = ws.dq_order + align_up(order_counts * 4);
  ws.dk = ws.dq + align_up(ws.slices * ws.dq_slice * 4);
  ws.dv = ws.dk + align_up(dkv);
  ws.total = ws.dv + align_up(dkv);
  return ws;
}

// Note [portattn backward zeroing] (bwd_kernel.cuh): the preprocess clears the accumulators
// where its grid has the CTAs for it; a call with few query rows and many keys (GQA's dK / dV
// accumulators are sized by the keys) would leave a few CTAs each a long serial run of stores,
// so past this many bytes a CTA (hd128 at 16k tokens: 8 KiB) a memset clears them instead, as
// it does a workspace that is not 16-byte aligned (the kernel's stores are 16 bytes wide).
constexpr int64_t kMaxZeroBytesPerPreprocessCta = 64 * 1024;

template <typename Elem>
cudaError_t launch_bwd_preprocess(const BwdArgs& args, cudaStream_t stream) {
  const PortattnFwdParams& f = args.p.fwd;
  const int lanes_log2 = bwd_preprocess_lanes_log2(f.headdim);
  const int rows_per_block = (256 / 32) << (5 - lanes_log2);
  const dim3 grid((f.seqlen_q + rows_per_block - 1) / rows_per_block, args.heads, f.batch);
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  BwdArgs launch_args = args;
  const bool aligned = reinterpret_cast<uintptr_t>(args.zero_begin) % 16 == 0 && args.zero_bytes % 16 == 0;
  if (args.zero_bytes > 0 && (ctas == 0 || !aligned || args.zero_bytes > ctas * kMaxZeroBytesPerPreprocessCta)) {
    const cudaError_t err = cudaMemsetAsync(args.zero_begin, 0, args.zero_bytes, stream);
    if (err != cudaSuccess) return err;
    launch_args.zero_bytes = 0;
  }
  if (ctas == 0) return cudaSuccess;
  bwd_preprocess<Elem><<<grid, 256, 0, stream>>>(launch_args, lanes_log2);
  return cudaGetLastError();
}

template <typename Elem>
cudaError_t launch_bwd_convert(const BwdArgs& args, int slices, bool dkv_accum, cudaStream_t stream) {
  const PortattnFwdParams& f = args.p.fwd;
  const int64_t chunks = f.headdim / 8;
  const int64_t dq_threads = static_cast<int64_t>(f.seqlen_q) * args.heads * chunks;
  if (dq_threads > 0) {
    bwd_convert_dq<Elem><<<dim3((dq_threads + 255) / 256, f.batch), 256, 0, stream>>>(args, slices);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t dkv_threads = static_cast<int64_t>(f.seqlen_k) * args.heads_k * chunks;
  if (dkv_accum && dkv_threads > 0) {
    bwd_convert_dkv<Elem><<<dim3((dkv_threads + 255) / 256, f.batch), 256, 0, stream>>>(args);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template cudaError_t launch_bwd_preprocess<__half>(const BwdArgs&, cudaStream_t);
template cudaError_t launch_bwd_preprocess<__nv_bfloat16>(const BwdArgs&, cudaStream_t);
template cudaError_t launch_bwd_convert<__half>(const BwdArgs&, int, bool, cudaStream_t);
template cudaError_t launch_bwd_convert<__nv_bfloat16>(const BwdArgs&, int, bool, cudaStream_t);

bool bwd_operands_aligned(const PortattnBwdParams& params) {
  const PortattnFwdParams& f = params.fwd;
  const void* pointers[] = {f.q, f.k, f.v, f.out, params.dout, params.dq, params.dk, params.dv};
  const PortattnTensor4* strides[] = {&f.q_strides,       &f.k_strides,       &f.v_strides,
                                      &f.out_strides,     &params.dout_strides, &params.dq_strides,
                                      &params.dk_strides, &params.dv_strides};
  for (int t = 0; t < 8; ++t)
    if (!aligned16(pointers[t]) || !strides_aligned(*strides[t])) return false;
  return true;
}

}  // namespace cuda
}  // namespace portattn

using namespace portattn::cuda;

extern "C" long long portattn_cuda_bwd_workspace_bytes(const PortattnBwdParams* params) {
  return bwd_workspace_layout(*params, /*ordered_dq=*/false, params->fwd.headdim).total;
}

// The Hopper backward's (its deterministic mode orders dQ: one slice and the counts), with
// the accumulator rows as wide as its kernel's (96 -> 128, 192 -> 256; hopper_bwd_acc_head_dim, the
// rule run_hopper_bwd checks and lays its workspace out with).
extern "C" long long portattn_cuda_hopper_bwd_workspace_bytes(const PortattnBwdParams* params) {
  return bwd_workspace_layout(*params, /*ordered_dq=*/true, hopper_bwd_acc_head_dim(params->fwd.headdim)).total;
}

// Smallest shared-memory budget (bytes) of the backward block shapes for a
// head dim (an instantiable one: 32, 64, ..., 256), or -1: what the support
// matrix compares with a device's opt-in limit.
extern "C" int portattn_cuda_bwd_smem_bytes(int head_dim) {
  int bytes = -1;
  with_instantiable_head_dim(head_dim, [&](auto hd) {
    bytes = min_smem_bytes(typename BwdConfigsFor<decltype(hd)::value>::type{});
  });
  return bytes;
}

// PORTATTN_SM80_BWD_WIDE at run time: 0 or 1 sets it for the calls that follow (and their
// workspace queries); any other value only reads it. Returns the setting now in effect.
extern "C" int portattn_cuda_sm80_bwd_wide(int mode) {
  wide_now();  // the environment's value first, so a later first read cannot undo the set
  if (mode == 0 || mode == 1) g_wide.store(mode);
  return g_wide.load();
}

namespace {
template <class... Cfgs>
BwdTileFacts facts_of_first_serving(int budget, bool extras, TileCandidates<Cfgs...> candidates) {
  return with_first_serving(budget, extras, candidates, [](auto config) { return bwd_tile_facts<decltype(config)>(); });
}

template <int kHeadDim>
BwdTileFacts bwd_tile_for(int budget, bool wide, bool extras) {
  if constexpr (BwdWideConfigsFor<kHeadDim>::kDefined) {
    if (bwd_wide_runs<kHeadDim>(wide, budget))
      return facts_of_first_serving(budget, extras, typename BwdWideConfigsFor<kHeadDim>::type{});
  }
  return facts_of_first_serving(budget, extras, typename BwdConfigsFor<kHeadDim>::type{});
}
}  // namespace

// The main kernel's tile a backward call at an instantiable head dim would run under a
// shared-memory budget (bytes), as run_bwd picks it: wide = 1 / 0 for PORTATTN_SM80_BWD_WIDE on
// / off, -1 for its current setting; extras != 0 for a call with softcap, ALiBi or dropout.
// out[0..6] = block N, block M, Q/dO stages, warps, kSmemBytes, head-dim CTAs over grid.z, 1 for
// the wide kernel. Returns 0, or -1 for a head dim
// without a backward shape. No CUDA call: the host tests read the selection on a CPU.
extern "C" int portattn_cuda_bwd_tile(int head_dim, int budget, int wide, int extras, int* out) {
  const bool on = wide < 0 ? bwd_wide_enabled() : wide != 0;
  BwdTileFacts t{};
  const bool known = with_instantiable_head_dim(head_dim, [&](auto hd) {
    t = bwd_tile_for<decltype(hd)::value>(budget, on, extras != 0);
  });
  if (!known) return -1;
  const int values[7] = {t.block_n, t.block_m, t.stages, t.warps, t.smem_bytes, t.dsplit, t.wide};
  for (int k = 0; k < 7; ++k) out[k] = values[k];
  return 0;
}

extern "C" int portattn_cuda_bwd(const PortattnBwdParams* params, char* message, int message_len) {
  const PortattnFwdParams& f = params->fwd;
  const Variant<BwdFn>* variant = find_variant(kBwdVariants, kNumBwdVariants, f.headdim, f.dtype);
  if (variant == nullptr) {
    char text[160];
    snprintf(text, sizeof(text), "portattn cuda: no backward kernel built for head_dim %d dtype %d",
             f.headdim, f.dtype);
    return fail(message, message_len, -1, text);
  }
  if (!bwd_operands_aligned(*params))
    return fail(message, message_len, -1,
                "portattn cuda backward: q, k, v, out, dout, dq, dk and dv need 16-byte "
                "aligned data pointers and strides that are multiples of 8 elements");
  set_error_detail("");
  const cudaError_t err = variant->run(*params);
  if (err != cudaSuccess) {
    char text[400];
    snprintf(text, sizeof(text), "portattn cuda backward: %s%s%s", cudaGetErrorString(err),
             last_error_detail()[0] ? ": " : "", last_error_detail());
    return fail(message, message_len, static_cast<int>(err), text);
  }
  return 0;
}
