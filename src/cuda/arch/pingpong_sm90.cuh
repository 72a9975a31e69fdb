#pragma once
// Two consumer warpgroups that issue their matrix products in turn (ping-pong), so that one's
// element-wise work (softmax, gradients) runs while the other's products hold the tensor cores,
// instead of both reaching the exp unit, then the tensor cores, at the same time. Consumer c
// takes its turn at named barrier kTurnConsumer0 + c and hands it over at the other's; consumer
// 0 goes first.
// Both consumers must take the same number of turns, and call finish() once they are done.
#include "cuda/arch/pipeline_sm90.cuh"
#include "cuda/arch/ptx_sm90.cuh"

namespace tileattn::cuda::sm90 {

struct PingPong {
  int consumer;  // 0 or 1

  __device__ __forceinline__ void start() const {
    if (consumer == 1) named_barrier_arrive(kTurnConsumer0, 256);
  }
  __device__ __forceinline__ void take() const { named_barrier_sync(kTurnConsumer0 + consumer, 256); }
  __device__ __forceinline__ void hand_over() const { named_barrier_arrive(kTurnConsumer1 - consumer, 256); }
  // Consumer 1's last hand-over, taken so that no arrival is left on the barrier at exit.
  __device__ __forceinline__ void finish() const {
    if (consumer == 0) named_barrier_sync(kTurnConsumer0, 256);
  }
};

}  // namespace tileattn::cuda::sm90
