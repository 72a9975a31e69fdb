#include "cuda/backward/launch_bwd_sm90.hpp"

#include <string>

#include "cuda/arch/tma_map.hpp"
#include "tileattn/error.hpp"

namespace tileattn::cuda {

bool make_bwd_sm90_maps(const AttentionProblem& pr, BwdSm90Params& params, int box_rows) {
  using sm90::attention_map_shape;
  return sm90::make_tile_map(&params.q, pr.dtype, pr.q.data,
                             attention_map_shape(pr, pr.q, pr.headdim_qk, pr.seqlen_q, pr.total_q, pr.heads_q,
                                                 box_rows)) &&
         sm90::make_tile_map(&params.k, pr.dtype, pr.k.data,
                             attention_map_shape(pr, pr.k, pr.headdim_qk, pr.seqlen_k, pr.total_k, pr.heads_kv,
                                                 box_rows)) &&
         sm90::make_tile_map(&params.v, pr.dtype, pr.v.data,
                             attention_map_shape(pr, pr.v, pr.headdim_v, pr.seqlen_k, pr.total_k, pr.heads_kv,
                                                 box_rows)) &&
         sm90::make_tile_map(&params.dout, pr.dtype, pr.dout.data,
                             attention_map_shape(pr, pr.dout, pr.headdim_v, pr.seqlen_q, pr.total_q, pr.heads_q,
                                                 box_rows));
}

bool bwd_sm90_has_work(const bwd::BwdParams& p) {
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return false;
  // Batch and query heads are grid dimensions y and z of the dQ passes (and batch of the dK/dV kernels).
  if (p.batch > 65535 || p.heads_q > 65535)
    throw Error(ErrorKind::unsupported, "CUDA backward: batch " + std::to_string(p.batch) + " and heads_q " +
                                            std::to_string(p.heads_q) + " must be <= 65535");
  return true;
}

}  // namespace tileattn::cuda
