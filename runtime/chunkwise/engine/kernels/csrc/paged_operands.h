// The operands of a bf16 paged decode-attention call as raw pointers and strides: what cpu_ops.cpp's
// paged_attention passes its bf16 case (paged_attention_bf16.cpp) and what paged_attention_amx.cpp takes.
// query/out [tokens, H, D]; kv_cache [2, blocks, block_size, KV, D]; block_tables [rows, max blocks];
// token_rows, token_index, token_lens: per decode row, its table row, its token and its context length.
#pragma once

#include <ATen/core/TensorBase.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

namespace chunkwise_paged {

struct Bf16Operands {
  int64_t n;  // decode rows
  int heads, kv_heads;
  int64_t block_size;
  const uint16_t* q;
  uint16_t* o;
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  int64_t block_stride, slot_stride, head_stride;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* rows;
  const int64_t* index;
  const int64_t* lens;
  int64_t padded;  // the longest context, rounded up to 16 keys
  int64_t qs0, qs1, os0, os1;

  Bf16Operands(const at::TensorBase& out, const at::TensorBase& query, const at::TensorBase& kv_cache,
               const at::TensorBase& block_tables, const at::TensorBase& token_rows,
               const at::TensorBase& token_index, const at::TensorBase& token_lens)
      : n(token_index.size(0)),
        heads(static_cast<int>(query.size(1))),
        kv_heads(static_cast<int>(kv_cache.size(3))),
        block_size(kv_cache.size(2)),
        q(reinterpret_cast<const uint16_t*>(query.const_data_ptr<c10::BFloat16>())),
        o(reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>())),
        k_cache(reinterpret_cast<const uint16_t*>(kv_cache.const_data_ptr<c10::BFloat16>())),
        v_cache(k_cache + kv_cache.stride(0)),
        block_stride(kv_cache.stride(1)),
        slot_stride(kv_cache.stride(2)),
        head_stride(kv_cache.stride(3)),
        tables(block_tables.const_data_ptr<int64_t>()),
        table_stride(block_tables.stride(0)),
        rows(token_rows.const_data_ptr<int64_t>()),
        index(token_index.const_data_ptr<int64_t>()),
        lens(token_lens.const_data_ptr<int64_t>()),
        qs0(query.stride(0)),
        qs1(query.stride(1)),
        os0(out.stride(0)),
        os1(out.stride(1)) {
    int64_t longest = 1;
    for (int64_t i = 0; i < n; ++i) longest = std::max(longest, lens[i]);
    padded = (longest + 15) / 16 * 16;
  }
};

}  // namespace chunkwise_paged
