#pragma once
// Consumer warpgroups that issue their matrix products in turn (ping-pong; round-robin for
// three), so that one's element-wise work (softmax, gradients) runs while another's products hold
// the tensor cores, instead of all reaching the exp unit, then the tensor cores, at the same time.
// Consumer c takes its turn at named barrier kTurnConsumer0 + c and hands it over at the next
// one's; consumer 0 goes first.
// Every consumer must take the same number of turns, and call finish() once it is done.
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"

namespace tileattn::cuda::sm90 {

template <int kConsumers>
struct PingPong {
  static_assert(kConsumers == 2 || kConsumers == 3, "PingPong: two or three consumers (barrier ids)");
  int consumer;

  __device__ __forceinline__ void start() const {
    if (consumer == kConsumers - 1) named_barrier_arrive(kTurnConsumer0, 256);
  }
  __device__ __forceinline__ void take() const { named_barrier_sync(kTurnConsumer0 + consumer, 256); }
  __device__ __forceinline__ void hand_over() const {
    named_barrier_arrive(kTurnConsumer0 + (consumer + 1) % kConsumers, 256);
  }
  // The last consumer's last hand-over, taken so that no arrival is left on the barrier at exit.
  __device__ __forceinline__ void finish() const {
    if (consumer == 0) named_barrier_sync(kTurnConsumer0, 256);
  }
};

}  // namespace tileattn::cuda::sm90
