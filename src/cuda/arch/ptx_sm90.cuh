#pragma once
// Hopper-only PTX the sm90 kernels are built from: mbarriers, the bulk tensor copy (TMA),
// wgmma's fences and shared-memory descriptors, and register reallocation between warpgroups.
// Everything here needs sm_90a; the kernels compile their bodies only under
// TILEATTN_SM90_ENABLED so that the sm_80 pass of a multi-architecture build sees none of it.
#include <cuda.h>

#include <cstdint>

#include "cuda/arch/ptx_sm80.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TILEATTN_SM90_ENABLED 1
#endif

namespace tileattn::cuda::sm90 {

// ---- mbarrier: phase-tracked arrival counters in shared memory --------------------------------

__device__ __forceinline__ void barrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals));
}
// Makes initialised barriers visible to the other threads and to the copy engine.
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
// Arrives and announces `bytes` that copies will complete on this barrier in the current phase.
__device__ __forceinline__ void barrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// Blocks until the phase with this parity has completed. A fresh barrier is in phase 0, so
// waiting for parity 1 returns at once: producers start with "every slot empty" for free.
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_address(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- TMA: bulk tensor copies global -> shared, completing on an mbarrier ----------------------

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// One box of a 4-d tensor map at coordinates (c0 innermost .. c3); elements outside the tensor
// arrive as zeros, and the barrier is credited with the whole box either way.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
          smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// ---- TMA: bulk tensor copies shared -> global, tracked in bulk groups of the issuing thread ---

// After ordinary st.shared of data that the async proxy (wgmma, a TMA store) will read, before
// the barrier that publishes it.
__device__ __forceinline__ void fence_shared_to_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// One box of a 4-d tensor map at coordinates (c0 innermost .. c3) from shared memory; elements
// outside the tensor are not written.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_address(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's committed stores have read their shared memory (the global writes may still
// be in flight; they complete before the grid does).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// Adds a contiguous run of `bytes` fp32 values (a multiple of 16, both addresses 16-byte aligned)
// from shared memory into global memory, element by element at the L2, as one bulk copy of this
// thread's bulk group: the summing costs the issuing SM one instruction, not one per element.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_address(src)), "r"(bytes)
               : "memory");
}

// Until this thread's committed bulk copies have completed, their global writes performed.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// ---- counts in global memory that blocks of one grid hand work over with ----------------------

// Orders this thread's async-proxy accesses to global memory (bulk copies and reductions) with its
// generic ones: after bulk_wait, before publishing their writes; after an acquire, before the
// bulk copies that must follow it.
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release_gpu(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// A contiguous run of `bytes` (a multiple of 16, both addresses 16-byte aligned), global -> shared.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_address(dst)),
               "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
}

// ---- clusters: CTAs that share loads (multicast) and signal each other's barriers -----------

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA in the cluster: barriers initialised before any peer signals them,
// and no CTA exits while a peer may still write to its shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}
// The cluster-window address of `p`'s offset in CTA `cta`'s shared memory. A CTA's window is
// contiguous, so offsets from one mapped address stay valid.
__device__ __forceinline__ uint32_t cluster_address(const void* p, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_address(p)), "r"(cta));
  return remote;
}
// Arrives on the barrier at a cluster-window address. Plain (CTA-scope) semantics: a
// cluster-scope release compiles to a GPU-wide memory barrier per arrival, and the callers only
// release stages whose reads have completed.
__device__ __forceinline__ void barrier_arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
// tma_load_4d into the same offset of every CTA in `cta_mask`, completing on each one's barrier
// at `bar`'s offset.
__device__ __forceinline__ void tma_load_4d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, uint16_t cta_mask,
                                                      int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, %4, %5, "
      "%6}], [%2], %7;\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "h"(cta_mask)
      : "memory");
}

// ---- wgmma ordering ---------------------------------------------------------------------------

// Before the first wgmma that reads registers (accumulators, A fragments) written by ordinary
// instructions.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Pins accumulator registers at this point of the program: the compiler may not move their
// reads or writes across an issue or a wait, which it cannot see through.
template <int kRows, int kCols>
__device__ __forceinline__ void fence_registers(float (&r)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+f"(r[i][j])::"memory");
}

// ---- shared-memory matrix descriptors (128-byte swizzle) --------------------------------------
//
// Every operand tile here is stored in panels of 128-byte rows (64 16-bit or 32 32-bit elements)
// with the 16-byte chunks of row r XOR-ed by r % 8 -- what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B -- and each panel starts on a 1024-byte boundary.
//   K-major (the contiguous dimension is K): 8-row groups are 1024 bytes apart; a k-step inside
//     the 128-byte row moves the start address; the next 64 K-columns are the next panel.
//   MN-major (the contiguous dimension is M or N): 8-row groups along K are 1024 bytes apart
//     (stride byte offset), panels along M/N are `panel_bytes` apart (leading byte offset).
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (uint64_t((stride_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ uint64_t k_major_descriptor(uint32_t address) { return smem_descriptor(address, 16, 1024); }
// The descriptor of a + bytes from that of a (either major order: only the start field moves) in
// one 32-bit add: bytes a multiple of 16 and a + bytes inside the 256 KiB that the 14-bit start
// field addresses, so that the add never carries out of it (a descriptor a step computed from an
// address took four uniform instructions).
__device__ __forceinline__ uint64_t descriptor_plus(uint64_t desc, uint32_t bytes) {
  return (desc & ~uint64_t(0xFFFFFFFFu)) | uint32_t(uint32_t(desc) + (bytes >> 4));
}
__device__ __forceinline__ uint64_t mn_major_descriptor(uint32_t address, uint32_t panel_bytes) {
  return smem_descriptor(address, panel_bytes, 1024);
}

// ---- named barriers (1..15; 0 is __syncthreads) for `threads` threads of the block ----------
// The ids in use are the NamedBarrier enum of pipeline_sm90.cuh.

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp's threads toward the barrier without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation between warpgroups (needs a register cap at kernel entry) ----------

template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace tileattn::cuda::sm90
