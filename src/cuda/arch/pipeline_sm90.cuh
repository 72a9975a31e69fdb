#pragma once
// The Hopper pipeline vocabulary every sm90 kernel is written in:
//
//   SmemRegions   the block's dynamic shared memory as named regions, laid out once at compile
//                 time (the launch's byte count and the kernel's pointers come from one list)
//   StageRing     kStages buffers handed from a producer to its readers through a "full" and an
//                 "empty" mbarrier per buffer, with the stage/phase arithmetic in one place
//   WarpRoles     warpgroup 0 produces, the others consume; registers move from the producer to
//                 the consumers (setmaxnreg) within the launch's allocation
//   NamedBarrier  the named-barrier ids, one list, so that pieces a kernel combines never share one
#include <cstdint>

#include "cuda/arch/ptx_sm90.cuh"

namespace tileattn::cuda::sm90 {

// ---- shared memory ----------------------------------------------------------------------------

// Dynamic shared memory advanced to the next 1024-byte boundary, where the swizzle pattern starts
// (kernels ask for 1024 bytes more than their tiles take).
__device__ __forceinline__ unsigned char* swizzle_aligned(unsigned char* smem_raw) {
  return smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
}

// Regions of kSizes bytes each, in order, from a base aligned to the 1024-byte swizzle period of
// TMA's 128-byte swizzle. Sizes that are multiples of 1024 keep every later region so aligned.
template <int... kSizes>
struct SmemRegions {
  static constexpr int kCount = int(sizeof...(kSizes));
  static constexpr int offset(int region) {
    constexpr int sizes[] = {kSizes...};
    int at = 0;
    for (int r = 0; r < region; ++r) at += sizes[r];
    return at;
  }
  // What the launch asks for: the regions plus the slack the base may lose to alignment.
  static constexpr int kBytes = offset(kCount) + 1024;

  unsigned char* base;
  __device__ __forceinline__ explicit SmemRegions(unsigned char* raw) : base(swizzle_aligned(raw)) {}
  template <int kRegion, class T = unsigned char>
  __device__ __forceinline__ T* at() const {
    static_assert(kRegion < kCount, "SmemRegions: no such region");
    return reinterpret_cast<T*>(base + offset(kRegion));
  }
};

// ---- stage rings ------------------------------------------------------------------------------

// Item i of a stream lives in buffer i % kStages; its buffer's barriers are on their
// (i / kStages)-th use, so item i waits for phase (i / kStages) & 1. A fresh barrier reads as
// having completed the phase before 0: the producer's first pass (phase ^ 1) does not wait.
// The barriers are kBarrierBytes of shared memory: full[kStages], then empty[kStages].
template <int kStages>
struct StageRing {
  static constexpr int kBarrierBytes = 2 * kStages * int(sizeof(uint64_t));
  uint64_t* full;

  __device__ __forceinline__ static int slot(int i) { return i % kStages; }
  __device__ __forceinline__ static uint32_t phase(int i) { return uint32_t(i / kStages) & 1u; }
  __device__ __forceinline__ uint64_t* empty() const { return full + kStages; }
  // Where the next ring's barriers may start.
  __device__ __forceinline__ uint64_t* end() const { return full + 2 * kStages; }

  // By one thread, before the block's barrier_init_fence and __syncthreads: `fills` arrivals
  // complete a buffer (1 for a TMA thread, whose bytes complete the rest), `releases` free it.
  __device__ __forceinline__ void init(int fills, int releases) const {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(full + s, fills);
      barrier_init(empty() + s, releases);
    }
  }

  // Producer: wait until item i's buffer is free.
  __device__ __forceinline__ void acquire(int i) const { barrier_wait(empty() + slot(i), phase(i) ^ 1u); }
  // Producer by TMA: item i's buffer is complete once `bytes` have landed; the returned barrier
  // is the one the copies signal.
  __device__ __forceinline__ uint64_t* expect_bytes(int i, uint32_t bytes) const {
    uint64_t* bar = full + slot(i);
    barrier_arrive_expect_bytes(bar, bytes);
    return bar;
  }
  // acquire, then expect_bytes: a TMA producer's whole hand-shake for item i.
  __device__ __forceinline__ uint64_t* acquire_bytes(int i, uint32_t bytes) const {
    acquire(i);
    return expect_bytes(i, bytes);
  }
  // acquire_bytes for a producer whose loop computes item i's slot itself (i % kStages), as for
  // wait_slot: with the slot computed inside, the Hopper backward's producer formed its barrier
  // addresses differently, and with ALiBi the consumers' code changed too (SASS).
  __device__ __forceinline__ uint64_t* acquire_bytes_slot(int i, int s, uint32_t bytes) const {
    barrier_wait(empty() + s, phase(i) ^ 1u);
    barrier_arrive_expect_bytes(full + s, bytes);
    return full + s;
  }
  // Producer by thread stores: this thread's share of item i is written.
  __device__ __forceinline__ void publish(int i) const { barrier_arrive(full + slot(i)); }
  // Producer warp: one arrival once every lane's share is written (rings initialised with one
  // fill per warp). Stores that a TMA copy or wgmma reads next need fence_shared_to_async first.
  // `lane` is the caller's own lane index: reading the thread index again here let ptxas move
  // that read among a consumer's wgmma and serialise them (softmax_matmul fast: 15% slower).
  __device__ __forceinline__ void publish_warp(int i, int lane) const {
    __syncwarp();
    if (lane == 0) publish(i);
  }

  // Reader: wait until item i is in its buffer.
  __device__ __forceinline__ void wait(int i) const { barrier_wait(full + slot(i), phase(i)); }
  // wait(i) for a reader whose loop computes item i's slot itself (i % kStages, the same number).
  // With the slot computed inside wait(i) (or any function), nvcc formed the Hopper backward
  // kernels' stage buffer addresses differently and their consumers' hot loops changed (SASS).
  __device__ __forceinline__ void wait_slot(int i, int s) const { barrier_wait(full + s, phase(i)); }
  // Reader: this thread is done with item i's buffer.
  __device__ __forceinline__ void release(int i) const { barrier_arrive(empty() + slot(i)); }
  // Reader warp: one arrival once every lane is done (rings initialised with one release per
  // warp); `lane` as for publish_warp.
  __device__ __forceinline__ void release_warp(int i, int lane) const {
    __syncwarp();
    if (lane == 0) release(i);
  }
};

// ---- warp roles -------------------------------------------------------------------------------

// Warpgroup 0 is the producer, warpgroups 1..kConsumers the consumers. setmaxnreg moves registers
// only inside the block's launch allocation (65536 / threads, rounded down to 8, per thread):
// asking for more leaves the consumers' increase waiting forever, hence the check.
//
// A kernel makes one WarpRoles after its barriers are set up and branches with
// `if (roles.warpgroup == 0) { enter_producer(); ...; return; }`, the consumers' code following.
// ptxas then lays the consumers' loop out first. Other spellings of the same test (a member
// function, the thread index read again) made it put the producer first, and the fp32 forward ran
// 5% slower at head dim 128 for that alone (H100, same call: 3.39-3.43 ms against 3.23-3.27).
// warp() and lane() are read where the kernel needs them: computed before the branch, they changed
// the 16-bit forward's consumer code throughout (SASS), computed in the consumer they did not.
template <int kConsumers_, int kProducerRegisters, int kConsumerRegisters>
struct WarpRoles {
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (kConsumers + 1) * (65536 / kThreads / 8 * 8),
                "WarpRoles: the register split exceeds the launch allocation");

  int warpgroup;  // 0: the producer
  // Read through a shuffle so that the compiler knows it is the same across the warp: the roles'
  // branches are then uniform, and values formed from it and from loop counters (shared-memory
  // descriptors, stage indices) may live in uniform registers, as wgmma wants its descriptors.
  __device__ __forceinline__ WarpRoles() : warpgroup(__shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0)) {}

  __device__ __forceinline__ int consumer() const { return warpgroup - 1; }
  // Warp within the warpgroup, lane within the warp.
  __device__ __forceinline__ static int warp() { return (int(threadIdx.x) / 32) % 4; }
  __device__ __forceinline__ static int lane() { return int(threadIdx.x) % 32; }

  // Every thread of the warpgroup, on entering its role.
  __device__ __forceinline__ static void enter_producer() { registers_decrease<kProducerRegisters>(); }
  __device__ __forceinline__ static void enter_consumer() { registers_increase<kConsumerRegisters>(); }
};

// ---- named barriers ---------------------------------------------------------------------------

// Ids for named_barrier_sync/arrive (0 is __syncthreads'). The ids of pieces one kernel combines
// are distinct; kernels that never run together may reuse an id under another name.
enum NamedBarrier : int {
  // The 16-bit forward: the consumers' turns (pingpong_sm90.cuh), 1 + consumer, and each
  // consumer's staged output store (tile_store_sm90.cuh), 4 + consumer (up to three consumers).
  kTurnConsumer0 = 1,
  kStoreConsumer0 = 4,
  // The fp32 forward: the producer warpgroup has read a raw V stage (the next V load may
  // overwrite it), and each consumer's Q rows are rounded to TF32, 2 + consumer.
  kFp32VStageRead = 1,
  kFp32QRoundedConsumer0 = 2,
  kFp32QRoundedConsumer1 = 3,
  // The Hopper backward (backward/*_sm90.cuh). Fused dQ: consumer c's part of a dQ tile is
  // written (it arrives, the dQ warp waits), 1 + c; that part's shared memory is read (the dQ warp
  // arrives), 3 + c; with two dQ warps, dQ warp w may wait for the tile's parts (the other has
  // waited for the step before's), 5 + w. Wide head dims: the step's P^T and dS^T are written;
  // the whole dQ tile is written (the consumers arrive, the dQ warp waits); both consumers'
  // products of the step are done (the tile may go over the stage).
  kBwdDqPartFull0 = 1,
  kBwdDqPartEmpty0 = 3,
  kBwdDqTurn0 = 5,
  kBwdPdsReady = 1,
  kBwdDqFull = 2,
  kBwdStepDone = 3,
  // fp32's exact backward: the splitting warps have read a stage's raw tile (it may be split over
  // itself); each consumer's rows are read (their lo parts may go over them), 2 + consumer; each
  // consumer's dS tiles are free, written, read by dQ's product, its dQ part written, 4 + consumer.
  kBwdExactRawRead = 1,
  kBwdExactRowsSplit0 = 2,
  kBwdExactDs0 = 4,
};

}  // namespace tileattn::cuda::sm90
