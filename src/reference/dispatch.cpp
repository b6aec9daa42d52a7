// CPU reference of dispatch and combine over R simulated ranks. Contract: include/moerail/reference/dispatch.h.
//
// Every op first checks all its arguments (spans, shapes, dtypes, devices, buffer sizes, probs finite) and only
// then writes. The data loops walk the source slots (rank s, token t, slot k) in order and follow the plan's
// dest_rank/dest_row; pad rows are found from the plan's segments. Values pass through double: moving a value
// between views of the same dtype is exact, and sums are accumulated in double in k order and rounded once.
#include "moerail/reference/dispatch.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moerail/error.h"
#include "moerail/reference/host.h"
#include "moerail/reference/quant.h"

namespace moerail::ref {
namespace {

// ---- argument checks ----------------------------------------------------------------------------------------

using Views = std::span<const TensorView>;

std::string rank_name(std::string_view what, std::int64_t r) { return detail::concat(what, " of rank ", r); }

// The plan's vectors have the sizes its scalars promise, every destination lies inside the buffers and every
// segment ends inside them (a plan made by plan_layout always passes; a hand-edited one cannot make us write out
// of bounds).
void check_plan(std::string_view op, const LayoutPlan& p) {
  const auto R = std::size_t(p.num_ranks), E = std::size_t(p.num_experts);
  bool ok = p.num_ranks > 0 && p.local_experts > 0 && p.num_experts == p.num_ranks * p.local_experts &&
            p.topk > 0 && p.align > 0 && p.capacity >= 0 && p.tokens.size() == R && p.rows_used.size() == R &&
            p.tokens_per_expert.size() == E && p.segment_offset.size() == E && p.segment_rows.size() == E &&
            p.dest_rank.size() == R && p.dest_row.size() == R;
  for (std::size_t s = 0; ok && s < R; ++s) {
    const auto slots = std::size_t(p.tokens[s] * p.topk);
    ok = p.tokens[s] >= 0 && p.dest_rank[s].size() == slots && p.dest_row[s].size() == slots;
    for (std::size_t i = 0; ok && i < slots; ++i) {
      const std::int64_t d = p.dest_rank[s][i], row = p.dest_row[s][i];
      ok = d < 0 ? row == -1 : d < p.num_ranks && row >= 0 && row < p.capacity;
    }
  }
  for (std::size_t e = 0; ok && e < E; ++e)
    ok = p.segment_offset[e] >= 0 && p.segment_rows[e] >= 0 && p.tokens_per_expert[e] >= 0 &&
         (p.segment_rows[e] == 0 || p.segment_offset[e] + p.segment_rows[e] <= p.capacity);
  if (!ok)
    fail(op, "the LayoutPlan is inconsistent (its vectors do not match num_ranks, num_experts, topk and tokens, or "
             "a destination or segment lies outside the capacity); pass a plan made by plan_layout");
}

void check_count(std::string_view op, std::string_view name, Views views, const LayoutPlan& p) {
  if (std::int64_t(views.size()) != p.num_ranks)
    fail(op, "got ", views.size(), " ", name, " views but the plan has ", p.num_ranks, " ranks (one view per rank)");
}

// Activation-type views (x, y, recv, ...) may be any floating dtype the reference reads and writes.
void check_floating(std::string_view op, const std::string& name, const TensorView& v) {
  check_dtype(op, name, v, {DType::F32, DType::BF16, DType::F16, DType::F64});
  check_device(op, name, v, Device::host());
}

// Probabilities and their gradients are f32 or f64.
void check_prob_dtype(std::string_view op, const std::string& name, const TensorView& v) {
  check_dtype(op, name, v, {DType::F32, DType::F64});
  check_device(op, name, v, Device::host());
}

// Hidden size H, taken from the first per-destination-rank buffer (which always has a row dimension).
std::int64_t hidden_of(std::string_view op, std::string_view name, Views buffers) {
  check_shape(op, rank_name(name, 0), buffers[0], {-1, -1});
  return buffers[0].size(1);
}

// Per destination rank: [>= capacity, H] buffers.
void check_buffers(std::string_view op, std::string_view name, Views views, const LayoutPlan& p, std::int64_t H) {
  check_count(op, name, views, p);
  for (std::int64_t d = 0; d < p.num_ranks; ++d) {
    const std::string n = rank_name(name, d);
    const TensorView& v = views[std::size_t(d)];
    check_shape(op, n, v, {-1, H});
    check_floating(op, n, v);
    if (v.size(0) < p.capacity)
      fail(op, n, " has ", v.size(0), " rows but the plan's capacity is ", p.capacity, " rows");
  }
}

// Per destination rank: [>= capacity] prob buffers.
void check_prob_buffers(std::string_view op, std::string_view name, Views views, const LayoutPlan& p) {
  check_count(op, name, views, p);
  for (std::int64_t d = 0; d < p.num_ranks; ++d) {
    const std::string n = rank_name(name, d);
    const TensorView& v = views[std::size_t(d)];
    check_shape(op, n, v, {-1});
    check_prob_dtype(op, n, v);
    if (v.size(0) < p.capacity)
      fail(op, n, " has ", v.size(0), " rows but the plan's capacity is ", p.capacity, " rows");
  }
}

// Per source rank: [T_s, H] token tensors.
void check_tokens(std::string_view op, std::string_view name, Views views, const LayoutPlan& p, std::int64_t H) {
  check_count(op, name, views, p);
  for (std::int64_t s = 0; s < p.num_ranks; ++s) {
    const std::string n = rank_name(name, s);
    check_shape(op, n, views[std::size_t(s)], {p.tokens[std::size_t(s)], H});
    check_floating(op, n, views[std::size_t(s)]);
  }
}

// Per source rank: [T_s, K] probs or prob gradients.
void check_slot_probs(std::string_view op, std::string_view name, Views views, const LayoutPlan& p) {
  check_count(op, name, views, p);
  for (std::int64_t s = 0; s < p.num_ranks; ++s) {
    const std::string n = rank_name(name, s);
    check_shape(op, n, views[std::size_t(s)], {p.tokens[std::size_t(s)], p.topk});
    check_prob_dtype(op, n, views[std::size_t(s)]);
  }
}

// Router probs are routing input: the prob of every slot that has a row (routed, not dropped) must be finite, or
// Error(BadRouting). Slots without a row are never read, so their probs may hold anything (as on the GPU, where
// only routed slots are checked).
void check_probs_finite(std::string_view op, Views probs, const LayoutPlan& p) {
  for (std::int64_t s = 0; s < p.num_ranks; ++s) {
    for (std::int64_t t = 0; t < p.tokens[std::size_t(s)]; ++t) {
      for (std::int64_t k = 0; k < p.topk; ++k) {
        if (p.dest_rank[std::size_t(s)][std::size_t(t * p.topk + k)] < 0) continue;
        const double v = load_float(probs[std::size_t(s)], t * p.topk + k);
        if (!std::isfinite(v))
          fail_with(ErrorCode::BadRouting, op, "rank ", s, " probs[", t, ",", k, "] = ", v,
                    " (expected a finite value)");
      }
    }
  }
}

// ---- row helpers --------------------------------------------------------------------------------------------

void copy_row(const TensorView& src, std::int64_t src_row, const TensorView& dst, std::int64_t dst_row,
              std::int64_t H, double scale = 1.0) {
  for (std::int64_t h = 0; h < H; ++h) store_float(dst, dst_row * H + h, scale * load_float(src, src_row * H + h));
}

void zero_row(const TensorView& dst, std::int64_t row, std::int64_t H) {
  for (std::int64_t h = 0; h < H; ++h) store_float(dst, row * H + h, 0.0);
}

// Calls pad(rank, row) for every pad row inside the buffers: the rows of each expert's segment after its routed
// rows, clipped to the segment's rows inside the buffer (segment_rows). A segment cut short by the capacity has
// no pad rows left, because its routed rows come first (at most expert_capacity of them under PerExpert).
template <typename Fn>
void for_each_pad_row(const LayoutPlan& p, Fn pad) {
  for (std::int64_t e = 0; e < p.num_experts; ++e) {
    const std::int64_t routed = p.tokens_per_expert[std::size_t(e)];
    const std::int64_t kept = p.expert_capacity > 0 ? std::min(routed, p.expert_capacity) : routed;
    const std::int64_t first = p.segment_offset[std::size_t(e)] + kept;
    const std::int64_t end = p.segment_offset[std::size_t(e)] + p.segment_rows[std::size_t(e)];
    for (std::int64_t row = first; row < end; ++row) pad(p.rank_of_expert(e), row);
  }
}

// Calls slot(s, t, k, d, row) for every slot that has a row (routed and not dropped), in (s, t, k) order.
template <typename Fn>
void for_each_routed_slot(const LayoutPlan& p, Fn slot) {
  for (std::int64_t s = 0; s < p.num_ranks; ++s) {
    for (std::int64_t t = 0; t < p.tokens[std::size_t(s)]; ++t) {
      for (std::int64_t k = 0; k < p.topk; ++k) {
        const auto i = std::size_t(t * p.topk + k);
        const std::int64_t d = p.dest_rank[std::size_t(s)][i];
        if (d >= 0) slot(s, t, k, d, std::int64_t(p.dest_row[std::size_t(s)][i]));
      }
    }
  }
}

// The (rank, row) of slot (s, t, k), rank -1 when unrouted or dropped.
struct Dest {
  std::int64_t rank, row;
};
Dest dest_of(const LayoutPlan& p, std::int64_t s, std::int64_t t, std::int64_t k) {
  const auto i = std::size_t(t * p.topk + k);
  return {p.dest_rank[std::size_t(s)][i], p.dest_row[std::size_t(s)][i]};
}

// The value v as stored in (then read back from) an element of dtype t: what crossing a link in t does to it.
double round_as(DType t, double v) {
  alignas(8) unsigned char cell[8] = {};
  const TensorView one(cell, t, {1});
  store_float(one, 0, v);
  return load_float(one, 0);
}

// The weighted sum over the slots of token t of source s: acc[h] = sum w_k * rows[row_k][h] in the given order.
// weight(k) returns w of slot k; rows(d) the buffer of destination rank d.
// group: ranks per partial (PerRank 1, PerNode ranks_per_node).
template <typename Weight, typename Rows>
void reduce_token(const LayoutPlan& p, Reduction order, std::int64_t group, DType out_dtype, std::int64_t s,
                  std::int64_t t, std::int64_t H, Weight weight, Rows rows, std::vector<double>& acc,
                  std::vector<double>& part) {
  std::fill(acc.begin(), acc.end(), 0.0);
  if (order == Reduction::SlotOrder) {
    for (std::int64_t k = 0; k < p.topk; ++k) {
      const Dest src = dest_of(p, s, t, k);
      if (src.rank < 0) continue;
      const double w = weight(k);
      const TensorView& y = rows(src.rank);
      for (std::int64_t h = 0; h < H; ++h) acc[std::size_t(h)] += w * load_float(y, src.row * H + h);
    }
    return;
  }
  // the partial of the slots on ranks [lo, hi), k order, added to acc (rounded once unless `own`)
  auto add_partial = [&](std::int64_t lo, std::int64_t hi, bool own) {
    bool any = false;
    std::fill(part.begin(), part.end(), 0.0);
    for (std::int64_t k = 0; k < p.topk; ++k) {
      const Dest src = dest_of(p, s, t, k);
      if (src.rank < lo || src.rank >= hi) continue;
      any = true;
      const double w = weight(k);
      const TensorView& y = rows(src.rank);
      for (std::int64_t h = 0; h < H; ++h) part[std::size_t(h)] += w * load_float(y, src.row * H + h);
    }
    if (!any) return;
    for (std::int64_t h = 0; h < H; ++h)
      acc[std::size_t(h)] += own ? part[std::size_t(h)] : round_as(out_dtype, part[std::size_t(h)]);
  };
  for (std::int64_t g = 0; g < p.num_ranks / group; ++g) {  // the partial of each rank (PerRank) or node (PerNode)
    if (g == s / group && group > 1) {  // PerNode, t's own node: its ranks' partials, as PerRank
      for (std::int64_t r = g * group; r < (g + 1) * group; ++r) add_partial(r, r + 1, r == s);
      continue;
    }
    add_partial(g * group, (g + 1) * group, g == s / group);
  }
}

// ranks_per_node, checked to group the plan's ranks into nodes.
std::int64_t checked_ranks_per_node(std::string_view op, const LayoutPlan& p, std::int64_t ranks_per_node) {
  if (ranks_per_node < 1 || p.num_ranks % ranks_per_node != 0)
    fail(op, "ranks_per_node = ", ranks_per_node, " must be >= 1 and divide the ", p.num_ranks, " ranks");
  return ranks_per_node;
}

// Ranks per partial of `order`: 1 for SlotOrder and PerRank, ranks_per_node (checked) for PerNode.
std::int64_t partial_group(std::string_view op, const LayoutPlan& p, Reduction order, std::int64_t ranks_per_node) {
  return order == Reduction::PerNode ? checked_ranks_per_node(op, p, ranks_per_node) : 1;
}

}  // namespace

// ---- dispatch -----------------------------------------------------------------------------------------------

namespace {

// What dispatch_forward and its hierarchical form check before writing: H, and whether probs move.
struct DispatchShape {
  std::int64_t H;
  bool with_probs;
};
DispatchShape check_dispatch(std::string_view op, const LayoutPlan& plan, const DispatchArgs& args) {
  check_plan(op, plan);
  check_count(op, "recv", args.recv, plan);
  const std::int64_t H = hidden_of(op, "recv", args.recv);
  check_buffers(op, "recv", args.recv, plan, H);
  check_tokens(op, "x", args.x, plan, H);
  const bool with_probs = !args.probs.empty() || !args.recv_probs.empty();
  if (with_probs) {
    if (args.probs.empty() || args.recv_probs.empty())
      fail(op, "probs and recv_probs must be given together (got ", args.probs.size(), " probs and ",
           args.recv_probs.size(), " recv_probs views)");
    check_slot_probs(op, "probs", args.probs, plan);
    check_prob_buffers(op, "recv_probs", args.recv_probs, plan);
    check_probs_finite(op, args.probs, plan);
  }
  return {H, with_probs};
}

// The pad rows of every segment: zero rows, prob 0.
void zero_pad_rows(const LayoutPlan& plan, const DispatchArgs& args, const DispatchShape& shape) {
  for_each_pad_row(plan, [&](std::int64_t d, std::int64_t row) {
    zero_row(args.recv[std::size_t(d)], row, shape.H);
    if (shape.with_probs) store_float(args.recv_probs[std::size_t(d)], row, 0.0);
  });
}

}  // namespace

void dispatch_forward(const LayoutPlan& plan, const DispatchArgs& args) {
  const auto [H, with_probs] = check_dispatch("dispatch_forward", plan, args);
  zero_pad_rows(plan, args, {H, with_probs});
  for_each_routed_slot(plan, [&](std::int64_t s, std::int64_t t, std::int64_t k, std::int64_t d, std::int64_t row) {
    copy_row(args.x[std::size_t(s)], t, args.recv[std::size_t(d)], row, H);
    if (with_probs)
      store_float(args.recv_probs[std::size_t(d)], row, load_float(args.probs[std::size_t(s)], t * plan.topk + k));
  });
}

// ---- byte rows and FP8 ---------------------------------------------------------------------------------------

namespace {

// Per source rank [T_r, W] host views of dtype `dtype`.
void check_source_rows(std::string_view op, std::string_view name, Views x, const LayoutPlan& p, std::int64_t W,
                       DType dtype) {
  check_count(op, name, x, p);
  for (std::int64_t s = 0; s < p.num_ranks; ++s) {
    const std::string n = rank_name(name, s);
    check_shape(op, n, x[std::size_t(s)], {p.tokens[std::size_t(s)], W});
    check_dtype(op, n, x[std::size_t(s)], {dtype});
    check_device(op, n, x[std::size_t(s)], Device::host());
  }
}

// Per destination rank [>= capacity, W] host views of dtype `dtype`.
void check_dest_rows(std::string_view op, std::string_view name, Views recv, const LayoutPlan& p, std::int64_t W,
                     DType dtype) {
  check_count(op, name, recv, p);
  for (std::int64_t d = 0; d < p.num_ranks; ++d) {
    const std::string n = rank_name(name, d);
    const TensorView& v = recv[std::size_t(d)];
    check_shape(op, n, v, {-1, W});
    check_dtype(op, n, v, {dtype});
    check_device(op, n, v, Device::host());
    if (v.size(0) < p.capacity)
      fail(op, n, " has ", v.size(0), " rows but the plan's capacity is ", p.capacity, " rows");
  }
}

// The data loops of dispatch_rows_forward, on checked arguments.
void move_byte_rows(const LayoutPlan& p, Views x, Views recv, std::int64_t W, std::uint64_t pad_bits) {
  if (W == 0) return;
  const std::size_t es = dtype_size(recv[0].dtype()), row = std::size_t(W) * es;
  std::vector<unsigned char> pad(row);
  for (std::size_t i = 0; i < row; ++i) pad[i] = static_cast<unsigned char>(pad_bits >> (8 * (i % es)));
  auto at = [&](const TensorView& v, std::int64_t r) {
    return static_cast<unsigned char*>(v.data()) + std::size_t(r) * row;
  };
  for_each_pad_row(p, [&](std::int64_t d, std::int64_t r) {
    std::memcpy(at(recv[std::size_t(d)], r), pad.data(), row);
  });
  for_each_routed_slot(p, [&](std::int64_t s, std::int64_t t, std::int64_t, std::int64_t d, std::int64_t r) {
    std::memcpy(at(recv[std::size_t(d)], r), at(x[std::size_t(s)], t), row);
  });
}

}  // namespace

void dispatch_rows_forward(const LayoutPlan& plan, const DispatchRowsArgs& args) {
  constexpr std::string_view op = "dispatch_rows_forward";
  check_plan(op, plan);
  check_count(op, "recv", args.recv, plan);
  check_shape(op, rank_name("recv", 0), args.recv[0], {-1, -1});
  const std::int64_t W = args.recv[0].size(1);
  const DType dtype = args.recv[0].dtype();
  check_dest_rows(op, "recv", args.recv, plan, W, dtype);
  check_source_rows(op, "x", args.x, plan, W, dtype);
  move_byte_rows(plan, args.x, args.recv, W, args.pad_bits);
}

void dispatch_fp8_forward(const LayoutPlan& plan, const DispatchFp8Args& args) {
  constexpr std::string_view op = "dispatch_fp8_forward";
  check_plan(op, plan);
  const Fp8Scaling scaling = args.scaling;
  if (scaling != Fp8Scaling::PerTensor && scaling != Fp8Scaling::Block1x128 && scaling != Fp8Scaling::Mx1x32)
    fail(op, "scaling = ", int(scaling), " is not one of {PerTensor, Block1x128, Mx1x32}");
  if (args.x.empty() == args.q.empty())
    fail(op, "got ", args.x.size(), " x views and ", args.q.size(),
         " q views (expected exactly one of them: x to quantize, or q already quantized)");
  const bool quantize = !args.x.empty();
  const std::int64_t block = fp8_scale_block_cols(scaling);
  check_count(op, "recv", args.recv, plan);
  check_shape(op, rank_name("recv", 0), args.recv[0], {-1, -1});
  const std::int64_t H = args.recv[0].size(1), nb = block > 0 ? H / block : 0;
  if (block > 0 && H % block != 0)
    fail(op, "recv of rank 0 has ", H, " columns but ", fp8_scaling_name(scaling), " scaling needs a multiple of ",
         block, " (H % ", block, " == 0)");
  const DType sdt = fp8_scale_dtype(scaling);
  check_dest_rows(op, "recv", args.recv, plan, H, DType::F8E4M3);
  if (block > 0)
    check_dest_rows(op, "recv_scales", args.recv_scales, plan, nb, sdt);
  else if (!args.recv_scales.empty())
    fail(op, "recv_scales are given but per-tensor scaling has no per-row scales (its scale is shared)");
  if (quantize) {
    check_count(op, "x", args.x, plan);
    for (std::int64_t s = 0; s < plan.num_ranks; ++s) {
      const std::string n = rank_name("x", s);
      check_shape(op, n, args.x[std::size_t(s)], {plan.tokens[std::size_t(s)], H});
      check_dtype(op, n, args.x[std::size_t(s)], {DType::BF16, DType::F32});
      check_device(op, n, args.x[std::size_t(s)], Device::host());
    }
    if (!args.q_scales.empty()) fail(op, "q_scales are given with x (expected them only with q)");
    if (scaling == Fp8Scaling::PerTensor) {
      check_shape(op, "tensor_scale", args.tensor_scale, {1});
      check_dtype(op, "tensor_scale", args.tensor_scale, {DType::F32});
      check_device(op, "tensor_scale", args.tensor_scale, Device::host());
      const float v = args.tensor_scale.as<const float>()[0];
      if (!(std::isfinite(v) && v > 0.0f)) fail(op, "tensor_scale = ", v, " but a finite scale > 0 was expected");
    }
  } else {
    check_source_rows(op, "q", args.q, plan, H, DType::F8E4M3);
    if (block > 0)
      check_source_rows(op, "q_scales", args.q_scales, plan, nb, sdt);
    else if (!args.q_scales.empty())
      fail(op, "q_scales are given but per-tensor scaling has no per-row scales");
  }
  const bool with_probs = !args.probs.empty() || !args.recv_probs.empty();
  if (with_probs) {
    if (args.probs.empty() || args.recv_probs.empty())
      fail(op, "probs and recv_probs must be given together (got ", args.probs.size(), " probs and ",
           args.recv_probs.size(), " recv_probs views)");
    check_slot_probs(op, "probs", args.probs, plan);
    check_prob_buffers(op, "recv_probs", args.recv_probs, plan);
    check_probs_finite(op, args.probs, plan);
  }

  // Quantize each source rank's rows (or take them as given).
  std::vector<HostTensor> q_own, s_own;
  std::vector<TensorView> q_views, s_views;
  for (std::int64_t s = 0; s < plan.num_ranks; ++s) {
    if (!quantize) {
      q_views.push_back(args.q[std::size_t(s)]);
      if (block > 0) s_views.push_back(args.q_scales[std::size_t(s)]);
      continue;
    }
    const std::int64_t T = plan.tokens[std::size_t(s)];
    q_own.emplace_back(DType::F8E4M3, std::vector<std::int64_t>{T, H});
    if (block > 0) {
      s_own.emplace_back(sdt, std::vector<std::int64_t>{T, nb});
      quantize_fp8(scaling, args.x[std::size_t(s)], q_own.back(), s_own.back());
    } else {
      quantize_fp8(scaling, args.x[std::size_t(s)], q_own.back(), args.tensor_scale);
    }
  }
  for (const HostTensor& t : q_own) q_views.push_back(t.view());
  for (const HostTensor& t : s_own) s_views.push_back(t.view());

  move_byte_rows(plan, q_views, args.recv, H, 0);
  if (block > 0) {
    const std::uint64_t one = scaling == Fp8Scaling::Mx1x32 ? 127u : std::bit_cast<std::uint32_t>(1.0f);
    move_byte_rows(plan, s_views, args.recv_scales, nb, one);
  }
  if (with_probs) {
    for_each_pad_row(plan, [&](std::int64_t d, std::int64_t row) {
      store_float(args.recv_probs[std::size_t(d)], row, 0.0);
    });
    for_each_routed_slot(plan, [&](std::int64_t s, std::int64_t t, std::int64_t k, std::int64_t d, std::int64_t row) {
      store_float(args.recv_probs[std::size_t(d)], row, load_float(args.probs[std::size_t(s)], t * plan.topk + k));
    });
  }
}

void dispatch_backward(const LayoutPlan& plan, const DispatchBackwardArgs& args) {
  constexpr std::string_view op = "dispatch_backward";
  check_plan(op, plan);
  check_count(op, "d_recv", args.d_recv, plan);
  const std::int64_t H = hidden_of(op, "d_recv", args.d_recv);
  check_buffers(op, "d_recv", args.d_recv, plan, H);
  check_tokens(op, "dx", args.dx, plan, H);
  const bool with_probs = !args.d_probs.empty() || !args.d_recv_probs.empty();
  if (with_probs) {
    if (args.d_probs.empty() || args.d_recv_probs.empty())
      fail(op, "d_recv_probs and d_probs must be given together (got ", args.d_recv_probs.size(),
           " d_recv_probs and ", args.d_probs.size(), " d_probs views)");
    check_prob_buffers(op, "d_recv_probs", args.d_recv_probs, plan);
    check_slot_probs(op, "d_probs", args.d_probs, plan);
  }

  const std::int64_t group = partial_group(op, plan, args.reduction, args.ranks_per_node);
  const std::int64_t K = plan.topk;
  std::vector<double> acc(static_cast<std::size_t>(H)), part(static_cast<std::size_t>(H));
  for (std::int64_t s = 0; s < plan.num_ranks; ++s) {
    const TensorView& dx = args.dx[std::size_t(s)];
    for (std::int64_t t = 0; t < plan.tokens[std::size_t(s)]; ++t) {
      reduce_token(
          plan, args.reduction, group, dx.dtype(), s, t, H, [](std::int64_t) { return 1.0; },
          [&](std::int64_t d) -> const TensorView& { return args.d_recv[std::size_t(d)]; }, acc, part);
      for (std::int64_t k = 0; k < K; ++k) {
        const Dest dst = dest_of(plan, s, t, k);
        if (with_probs) {
          const double g = dst.rank >= 0 ? load_float(args.d_recv_probs[std::size_t(dst.rank)], dst.row) : 0.0;
          store_float(args.d_probs[std::size_t(s)], t * K + k, g);
        }
      }
      for (std::int64_t h = 0; h < H; ++h) store_float(dx, t * H + h, acc[std::size_t(h)]);
    }
  }
}

// ---- combine ------------------------------------------------------------------------------------------------

namespace {

// What combine_forward and its hierarchical form check before writing; returns H.
std::int64_t check_combine(std::string_view op, const LayoutPlan& plan, const CombineArgs& args) {
  check_plan(op, plan);
  check_count(op, "y", args.y, plan);
  const std::int64_t H = hidden_of(op, "y", args.y);
  check_buffers(op, "y", args.y, plan, H);
  check_tokens(op, "out", args.out, plan, H);
  if (args.mode == ProbMode::InCombine && args.probs.empty()) fail(op, "ProbMode::InCombine needs probs (got none)");
  if (!args.probs.empty()) {  // not read in InActivation mode, but checked when given
    check_slot_probs(op, "probs", args.probs, plan);
    check_probs_finite(op, args.probs, plan);
  }
  return H;
}

}  // namespace

void combine_forward(const LayoutPlan& plan, const CombineArgs& args) {
  constexpr std::string_view op = "combine_forward";
  const std::int64_t H = check_combine(op, plan, args);
  const bool weighted = args.mode == ProbMode::InCombine;

  const std::int64_t group = partial_group(op, plan, args.reduction, args.ranks_per_node);
  const std::int64_t K = plan.topk;
  std::vector<double> acc(static_cast<std::size_t>(H)), part(static_cast<std::size_t>(H));
  for (std::int64_t s = 0; s < plan.num_ranks; ++s) {
    for (std::int64_t t = 0; t < plan.tokens[std::size_t(s)]; ++t) {
      reduce_token(
          plan, args.reduction, group, args.out[std::size_t(s)].dtype(), s, t, H,
          [&](std::int64_t k) { return weighted ? load_float(args.probs[std::size_t(s)], t * K + k) : 1.0; },
          [&](std::int64_t d) -> const TensorView& { return args.y[std::size_t(d)]; }, acc, part);
      for (std::int64_t h = 0; h < H; ++h) store_float(args.out[std::size_t(s)], t * H + h, acc[std::size_t(h)]);
    }
  }
}

void combine_backward(const LayoutPlan& plan, const CombineBackwardArgs& args) {
  constexpr std::string_view op = "combine_backward";
  check_plan(op, plan);
  check_count(op, "d_y", args.d_y, plan);
  const std::int64_t H = hidden_of(op, "d_y", args.d_y);
  check_buffers(op, "d_y", args.d_y, plan, H);
  check_tokens(op, "d_out", args.d_out, plan, H);
  const bool weighted = args.mode == ProbMode::InCombine;
  if (weighted && args.probs.empty()) fail(op, "ProbMode::InCombine needs probs (got none)");
  if (weighted && !args.d_probs.empty() && args.y.empty())
    fail(op, "d_probs under ProbMode::InCombine needs the forward input y (got none)");
  if (!args.y.empty()) check_buffers(op, "y", args.y, plan, H);  // checked when given
  if (!args.probs.empty()) {
    check_slot_probs(op, "probs", args.probs, plan);
    check_probs_finite(op, args.probs, plan);
  }
  if (!args.d_probs.empty()) check_slot_probs(op, "d_probs", args.d_probs, plan);

  // d_y: pad rows get 0, each routed row w * d_out of its token.
  for_each_pad_row(plan, [&](std::int64_t d, std::int64_t row) { zero_row(args.d_y[std::size_t(d)], row, H); });
  for_each_routed_slot(plan, [&](std::int64_t s, std::int64_t t, std::int64_t k, std::int64_t d, std::int64_t row) {
    const double w = weighted ? load_float(args.probs[std::size_t(s)], t * plan.topk + k) : 1.0;
    copy_row(args.d_out[std::size_t(s)], t, args.d_y[std::size_t(d)], row, H, w);
  });

  // d_probs[t,k] = <y[row(t,k)], d_out[t]> under InCombine; 0 for unrouted or dropped slots and under InActivation.
  if (args.d_probs.empty()) return;
  const std::int64_t K = plan.topk;
  for (std::int64_t s = 0; s < plan.num_ranks; ++s) {
    const TensorView& d_out = args.d_out[std::size_t(s)];
    for (std::int64_t t = 0; t < plan.tokens[std::size_t(s)]; ++t) {
      for (std::int64_t k = 0; k < K; ++k) {
        const Dest src = dest_of(plan, s, t, k);
        double dot = 0.0;
        if (weighted && src.rank >= 0) {
          const TensorView& y = args.y[std::size_t(src.rank)];
          for (std::int64_t h = 0; h < H; ++h) dot += load_float(y, src.row * H + h) * load_float(d_out, t * H + h);
        }
        store_float(args.d_probs[std::size_t(s)], t * K + k, dot);
      }
    }
  }
}

// ---- rows over the network and over NVLink ------------------------------------------------------------------

NodeTraffic node_traffic(const LayoutPlan& plan, std::int64_t ranks_per_node) {
  constexpr std::string_view op = "node_traffic";
  check_plan(op, plan);
  const std::int64_t R = plan.num_ranks, G = checked_ranks_per_node(op, plan, ranks_per_node);
  NodeTraffic out;
  for (auto* v : {&out.flat_network, &out.flat_nvlink, &out.hier_network, &out.hier_nvlink})
    v->assign(std::size_t(R), 0);
  std::vector<char> to_rank(static_cast<std::size_t>(R)), to_node(static_cast<std::size_t>(R / G));
  for (std::int64_t s = 0; s < R; ++s) {
    for (std::int64_t t = 0; t < plan.tokens[std::size_t(s)]; ++t) {
      std::fill(to_rank.begin(), to_rank.end(), 0);
      std::fill(to_node.begin(), to_node.end(), 0);
      for (std::int64_t k = 0; k < plan.topk; ++k) {
        const Dest d = dest_of(plan, s, t, k);
        if (d.rank < 0) continue;
        to_rank[std::size_t(d.rank)] = 1;
        to_node[std::size_t(d.rank / G)] = 1;
      }
      for (std::int64_t d = 0; d < R; ++d) {  // flat: one row per destination rank but the source
        if (!to_rank[std::size_t(d)] || d == s) continue;
        (d / G == s / G ? out.flat_nvlink : out.flat_network)[std::size_t(s)] += 1;
      }
      for (std::int64_t n = 0; n < R / G; ++n) {
        if (!to_node[std::size_t(n)]) continue;
        if (n == s / G) {  // the source's node: as flat
          for (std::int64_t d = n * G; d < (n + 1) * G; ++d)
            if (to_rank[std::size_t(d)] && d != s) out.hier_nvlink[std::size_t(s)] += 1;
          continue;
        }
        out.hier_network[std::size_t(s)] += 1;
        const std::int64_t forwarder = n * G + s % G;  // the rank of node n with the source's local index
        for (std::int64_t d = n * G; d < (n + 1) * G; ++d)
          if (to_rank[std::size_t(d)] && d != forwarder) out.hier_nvlink[std::size_t(forwarder)] += 1;
      }
    }
  }
  return out;
}

// ---- the hierarchical dispatch: plan and data path -------------------------------------------------------------

namespace {

// hier is the plan's (its ranks and grouping), and each rank's staging buffer [>= its staged rows, H] of `dtype` (the
// dtype of the view named `like`).
void check_staging(std::string_view op, const LayoutPlan& plan, const HierarchicalPlan& hier,
                   std::span<const TensorView> staging, std::int64_t H, DType dtype, std::string_view like) {
  const std::int64_t R = plan.num_ranks;
  checked_ranks_per_node(op, plan, hier.ranks_per_node);
  if (std::int64_t(hier.staged.size()) != R)
    fail(op, "hier is a plan of ", hier.staged.size(), " ranks, the layout plan has ", R, " ranks");
  check_count(op, "staging", staging, plan);
  for (std::int64_t f = 0; f < R; ++f) {
    const TensorView& v = staging[std::size_t(f)];
    const auto rows = std::int64_t(hier.staged[std::size_t(f)].size());
    if (v.ndim() != 2 || v.size(0) < rows || v.size(1) != H || v.dtype() != dtype)
      fail(op, "staging of rank ", f, " must be [>= ", rows, ", ", H, "] of ", like, "'s dtype");
  }
}

}  // namespace

HierarchicalPlan plan_hierarchical(const LayoutPlan& plan, std::int64_t ranks_per_node) {
  constexpr std::string_view op = "plan_hierarchical";
  check_plan(op, plan);
  const std::int64_t R = plan.num_ranks, G = checked_ranks_per_node(op, plan, ranks_per_node);
  HierarchicalPlan h;
  h.ranks_per_node = G;
  h.staged.resize(std::size_t(R));
  std::vector<char> to_node(static_cast<std::size_t>(R / G));
  for (std::int64_t s = 0; s < R; ++s) {
    for (std::int64_t t = 0; t < plan.tokens[std::size_t(s)]; ++t) {
      std::fill(to_node.begin(), to_node.end(), 0);
      for (std::int64_t k = 0; k < plan.topk; ++k)
        if (const Dest d = dest_of(plan, s, t, k); d.rank >= 0) to_node[std::size_t(d.rank / G)] = 1;
      for (std::int64_t n = 0; n < R / G; ++n)
        if (to_node[std::size_t(n)] && n != s / G) h.staged[std::size_t(n * G + s % G)].emplace_back(s, t);
    }
  }
  return h;
}

void dispatch_forward_hierarchical(const LayoutPlan& plan, const HierarchicalPlan& hier, const DispatchArgs& args,
                                   std::span<const TensorView> staging) {
  constexpr std::string_view op = "dispatch_forward_hierarchical";
  const auto [H, with_probs] = check_dispatch(op, plan, args);
  const std::int64_t R = plan.num_ranks, G = hier.ranks_per_node;
  check_staging(op, plan, hier, staging, H, args.x[0].dtype(), "x");
  zero_pad_rows(plan, args, {H, with_probs});
  // Network hop: every staged row from its source.
  for (std::int64_t f = 0; f < R; ++f) {
    const auto& rows = hier.staged[std::size_t(f)];
    for (std::size_t i = 0; i < rows.size(); ++i)
      copy_row(args.x[std::size_t(rows[i].first)], rows[i].second, staging[std::size_t(f)], std::int64_t(i), H);
  }
  auto staged_index = [&](std::int64_t f, std::int64_t s, std::int64_t t) {
    const auto& rows = hier.staged[std::size_t(f)];
    const auto it = std::lower_bound(rows.begin(), rows.end(), std::make_pair(s, t));
    if (it == rows.end() || *it != std::make_pair(s, t))
      fail(op, "hier does not stage token ", t, " of rank ", s, " at rank ", f, " (not this plan's)");
    return std::int64_t(it - rows.begin());
  };
  // NVLink hops: in the source's node from x, in a remote node from the forwarder's staging row.
  for_each_routed_slot(plan, [&](std::int64_t s, std::int64_t t, std::int64_t k, std::int64_t d, std::int64_t row) {
    if (d / G == s / G) {
      copy_row(args.x[std::size_t(s)], t, args.recv[std::size_t(d)], row, H);
    } else {
      const std::int64_t f = (d / G) * G + s % G;
      copy_row(staging[std::size_t(f)], staged_index(f, s, t), args.recv[std::size_t(d)], row, H);
    }
    if (with_probs)
      store_float(args.recv_probs[std::size_t(d)], row, load_float(args.probs[std::size_t(s)], t * plan.topk + k));
  });
}

void combine_forward_hierarchical(const LayoutPlan& plan, const HierarchicalPlan& hier, const CombineArgs& args,
                                  std::span<const TensorView> staging) {
  constexpr std::string_view op = "combine_forward_hierarchical";
  const std::int64_t H = check_combine(op, plan, args);
  const std::int64_t R = plan.num_ranks, G = hier.ranks_per_node;
  const bool weighted = args.mode == ProbMode::InCombine;
  check_staging(op, plan, hier, staging, H, args.out[0].dtype(), "out");

  const std::int64_t K = plan.topk;
  auto weight = [&](std::int64_t s, std::int64_t t, std::int64_t k) {
    return weighted ? load_float(args.probs[std::size_t(s)], t * K + k) : 1.0;
  };
  // The sum of token t of source s over its slots on ranks [lo, hi), k order, in double; false when it has none.
  std::vector<double> part(static_cast<std::size_t>(H)), acc(static_cast<std::size_t>(H));
  auto range_sum = [&](std::int64_t s, std::int64_t t, std::int64_t lo, std::int64_t hi) {
    std::fill(part.begin(), part.end(), 0.0);
    bool any = false;
    for (std::int64_t k = 0; k < K; ++k) {
      const Dest d = dest_of(plan, s, t, k);
      if (d.rank < lo || d.rank >= hi) continue;
      any = true;
      const double w = weight(s, t, k);
      for (std::int64_t h = 0; h < H; ++h) part[std::size_t(h)] += w * load_float(args.y[std::size_t(d.rank)], d.row * H + h);
    }
    return any;
  };
  // At each forwarder: the partial of its node for each staged row, stored in the staging row's dtype.
  for (std::int64_t f = 0; f < R; ++f) {
    const auto& rows = hier.staged[std::size_t(f)];
    for (std::size_t i = 0; i < rows.size(); ++i) {
      range_sum(rows[i].first, rows[i].second, f / G * G, (f / G + 1) * G);
      for (std::int64_t h = 0; h < H; ++h)
        store_float(staging[std::size_t(f)], std::int64_t(i) * H + h, part[std::size_t(h)]);
    }
  }
  // At each source: the partials in node order; of its own node, each rank's partial (its own unrounded, the
  // others' rounded once, as they cross NVLink); of the others, the staging rows.
  const DType out_dtype = args.out[0].dtype();
  for (std::int64_t s = 0; s < R; ++s) {
    for (std::int64_t t = 0; t < plan.tokens[std::size_t(s)]; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t n = 0; n < R / G; ++n) {
        if (n == s / G) {
          for (std::int64_t r = n * G; r < (n + 1) * G; ++r) {
            if (!range_sum(s, t, r, r + 1)) continue;
            for (std::int64_t h = 0; h < H; ++h)
              acc[std::size_t(h)] += r == s ? part[std::size_t(h)] : round_as(out_dtype, part[std::size_t(h)]);
          }
          continue;
        }
        const std::int64_t f = n * G + s % G;
        const auto& rows = hier.staged[std::size_t(f)];
        const auto it = std::lower_bound(rows.begin(), rows.end(), std::make_pair(s, t));
        if (it == rows.end() || *it != std::make_pair(s, t)) continue;  // no slot of t on node n
        const auto i = std::int64_t(it - rows.begin());
        for (std::int64_t h = 0; h < H; ++h) acc[std::size_t(h)] += load_float(staging[std::size_t(f)], i * H + h);
      }
      for (std::int64_t h = 0; h < H; ++h) store_float(args.out[std::size_t(s)], t * H + h, acc[std::size_t(h)]);
    }
  }
}

}  // namespace moerail::ref
