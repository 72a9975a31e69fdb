#pragma once
// Appending to a key/value cache on the CPU (problem.hpp's k_new, v_new and rotary fields).
#include <cstddef>
#include <vector>

#include "tileattn/problem.hpp"

namespace tileattn::cpu {

// Writes k_new and v_new into the cache (the new keys rotated when the problem has rotary) and
// returns the problem the attention then reads: with rotary, q is its rotated copy, held in
// `rotated_q` as (batch, seqlen_q, heads_q, headdim_qk); without, the problem unchanged.
AttentionProblem append_kv(const AttentionProblem& p, std::vector<std::byte>& rotated_q);

}  // namespace tileattn::cpu
