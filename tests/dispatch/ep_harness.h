// tests/dispatch/ep_harness.h — what the expert-parallel dispatch tests share: a case and the inputs of every rank
// drawn from one seed, the reference over all ranks, this rank's device buffers, the comparisons, and the Ep fixture
// (ep_test.cu, ep_handles_test.cu, ep_fp8_test.cu; main() and the communicator live in ep_test.cu).
#pragma once

#include <gtest/gtest.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/device_tensor.h"
#include "common/gpu.h"
#include "common/loopback.h"
#include "common/multigpu.h"
#include "moerail/comm.h"
#include "moerail/dispatch.h"
#include "moerail/quant.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "moerail/reference/quant.h"


namespace moerail::test::ep_gpu {

using ref::HostTensor;
using testing::DeviceTensor;

extern std::unique_ptr<Communicator> g_comm;  // this process's rank (set up in main, ep_test.cu)


struct Case {
  Transport transport = Transport::NvLink;
  std::int64_t H = 256, E = 8, K = 4, A = 16, t_max = 64;
  Capacity capacity = Capacity::worst_case();
  ProbMode mode = ProbMode::InActivation;
  int sms = 0;  // DispatchOptions::sms: few blocks make sources with more tokens than producer warps (two per chunk)
  DType dtype = DType::BF16;  // of the rows (x, recv, y, out and the gradients)
  int ranks_per_node = 0;     // DispatchOptions::ranks_per_node: hierarchical transfers (host API)
};

// The bound of one rounding to the case's dtype, twice (a partial crossing the link, then the result): 2^e of the
// sum of |terms|.
inline int rounding_exp(DType t) { return t == DType::F32 ? -22 : t == DType::F16 ? -10 : -7; }

// The Dispatcher options of a case: its transport and block count, bounded waits (a hung peer fails the test).
inline DispatchOptions options_of(const Case& c, double timeout_s = 30) {
  DispatchOptions o;
  o.transport = c.transport;
  o.timeout_s = timeout_s;
  o.sms = c.sms;
  o.ranks_per_node = c.ranks_per_node;
  return o;
}

inline MoeConfig config_of(const Case& c, int R) {
  MoeConfig cfg;
  cfg.hidden = c.H;
  cfg.ffn_hidden = 64;
  cfg.num_experts = c.E;
  cfg.topk = c.K;
  cfg.ep_size = R;
  cfg.align = c.A;
  cfg.max_tokens = c.t_max;
  cfg.capacity = c.capacity;
  cfg.prob_mode = c.mode;
  cfg.dtype = c.dtype;
  return cfg;
}

// How a step's routing is drawn.
enum class Routing { Random, OneExpert, OneRank };

// The inputs of one step for every rank (host), drawn from `seed`.
struct Step {
  std::vector<std::int64_t> tokens;
  std::vector<HostTensor> topk, probs, x, d_out;  // [T_max, ...] per rank (rows >= T unused)
  std::vector<HostTensor> y, d_recv, d_recv_probs;  // [capacity, ...] per rank
};

inline Step draw(const Case& c, int R, std::int64_t capacity, std::uint64_t seed, std::vector<std::int64_t> tokens,
          Routing routing) {
  ref::Rng rng(seed);
  Step s;
  s.tokens = tokens;
  for (int r = 0; r < R; ++r) {
    HostTensor idx(DType::I32, {c.t_max, c.K}), p(DType::F32, {c.t_max, c.K});
    for (std::int64_t t = 0; t < c.t_max; ++t) {
      std::vector<std::int64_t> chosen;
      for (std::int64_t k = 0; k < c.K; ++k) {
        std::int64_t e = -1;
        if (routing == Routing::OneExpert) {
          e = k == 0 ? 1 : -1;
        } else if (routing == Routing::OneRank) {
          e = (c.E - c.E / R) + k % (c.E / R);  // the last rank's experts
          if (std::find(chosen.begin(), chosen.end(), e) != chosen.end()) e = -1;
        } else if (rng.uniform() > 0.1) {
          do e = rng.below(c.E);
          while (std::find(chosen.begin(), chosen.end(), e) != chosen.end());
        }
        if (e >= 0) chosen.push_back(e);
        idx.set_i(t * c.K + k, e);
        p.set_f(t * c.K + k, rng.uniform(0.1, 1.0));
      }
    }
    HostTensor x(c.dtype, {c.t_max, c.H}), dout(c.dtype, {c.t_max, c.H});
    ref::fill_normal(x, rng, 1.0);
    ref::fill_normal(dout, rng, 1.0);
    HostTensor y(c.dtype, {capacity, c.H}), drecv(c.dtype, {capacity, c.H}), drp(DType::F32, {capacity});
    ref::fill_normal(y, rng, 1.0);
    ref::fill_normal(drecv, rng, 1.0);
    ref::fill_uniform(drp, rng, -1.0, 1.0);
    s.topk.push_back(std::move(idx));
    s.probs.push_back(std::move(p));
    s.x.push_back(std::move(x));
    s.d_out.push_back(std::move(dout));
    s.y.push_back(std::move(y));
    s.d_recv.push_back(std::move(drecv));
    s.d_recv_probs.push_back(std::move(drp));
  }
  return s;
}

// Views of the first T rows of a [T_max, ...] host tensor.
inline TensorView rows_of(const HostTensor& h, std::int64_t T) {
  const TensorView& v = h.view();
  return v.ndim() == 1 ? TensorView(v.data(), v.dtype(), {T}) : TensorView(v.data(), v.dtype(), {T, v.size(1)});
}

// The reference results of every op of one step, for every rank, plus absolute-value sums for the bounds.
struct Expected {
  ref::LayoutPlan plan;
  std::vector<HostTensor> recv, recv_probs, out, out_abs, dx, dx_abs, d_probs_disp, d_y, d_probs_comb, dot_abs;
};

// peer_rows: the Dispatcher's peer_rows() (the host-API transport's staging bound; -1 = none).
inline Expected reference(const Case& c, const MoeConfig& cfg, const Step& s, std::int64_t capacity,
                          std::int64_t peer_rows = -1) {
  const int R = int(cfg.ep_size);
  Expected e;
  std::vector<TensorView> topk, probs, x, d_out, y, y_abs, d_recv, d_recv_abs, d_recv_probs, probs_abs;
  std::vector<HostTensor> keep;
  auto abs_of = [&](const HostTensor& h, std::int64_t rows) {
    HostTensor a(DType::F64, {rows, h.view().ndim() > 1 ? h.view().size(1) : 1});
    for (std::int64_t i = 0; i < rows * (h.view().ndim() > 1 ? h.view().size(1) : 1); ++i) a.set_f(i, std::fabs(h.f(i)));
    keep.push_back(std::move(a));
    return keep.back().view();
  };
  keep.reserve(64);
  for (int r = 0; r < R; ++r) {
    const std::int64_t T = s.tokens[std::size_t(r)];
    topk.push_back(rows_of(s.topk[std::size_t(r)], T));
    probs.push_back(rows_of(s.probs[std::size_t(r)], T));
    x.push_back(rows_of(s.x[std::size_t(r)], T));
    d_out.push_back(rows_of(s.d_out[std::size_t(r)], T));
    y.push_back(s.y[std::size_t(r)].view());
    d_recv.push_back(s.d_recv[std::size_t(r)].view());
    d_recv_probs.push_back(s.d_recv_probs[std::size_t(r)].view());
  }
  for (int r = 0; r < R; ++r) {
    y_abs.push_back(abs_of(s.y[std::size_t(r)], capacity));
    d_recv_abs.push_back(abs_of(s.d_recv[std::size_t(r)], capacity));
    const TensorView pa = abs_of(s.probs[std::size_t(r)], c.t_max);
    probs_abs.push_back(TensorView(pa.data(), DType::F64, {s.tokens[std::size_t(r)], c.K}));
  }
  e.plan = ref::plan_layout(cfg, topk, capacity, peer_rows);
  auto make = [&](std::vector<HostTensor>& v, DType t, std::int64_t rows, std::int64_t cols) {
    for (int r = 0; r < R; ++r) {
      v.emplace_back(t, std::vector<std::int64_t>{rows, cols});
      v.back().fill_nan();
    }
  };
  auto views = [&](std::vector<HostTensor>& v, bool token_rows) {
    std::vector<TensorView> out;
    for (int r = 0; r < R; ++r) out.push_back(token_rows ? rows_of(v[std::size_t(r)], s.tokens[std::size_t(r)])
                                                         : v[std::size_t(r)].view());
    return out;
  };
  make(e.recv, c.dtype, capacity, c.H);
  for (int r = 0; r < R; ++r) {
    e.recv_probs.emplace_back(DType::F32, std::vector<std::int64_t>{capacity});
    e.recv_probs.back().fill_nan();
  }
  std::vector<TensorView> recv_probs_v;
  for (auto& h : e.recv_probs) recv_probs_v.push_back(h.view());
  ref::dispatch_forward(e.plan, {x, probs, views(e.recv, false), recv_probs_v});

  make(e.out, c.dtype, c.t_max, c.H);
  make(e.out_abs, DType::F64, c.t_max, c.H);
  make(e.dx, c.dtype, c.t_max, c.H);
  make(e.dx_abs, DType::F64, c.t_max, c.H);
  make(e.d_probs_disp, DType::F32, c.t_max, c.K);
  const std::vector<TensorView> out_v = views(e.out, true), dx_v = views(e.dx, true),
                                dpd_v = views(e.d_probs_disp, true);
  // the flat path's per-rank sums; through nodes (ranks_per_node), a remote node's one partial
  const bool nodes = c.ranks_per_node > 0 && c.ranks_per_node < R;
  const ref::Reduction reduction = nodes ? ref::Reduction::PerNode : ref::Reduction::PerRank;
  ref::CombineArgs ca{c.mode, y, probs, out_v};
  ca.reduction = reduction;
  ca.ranks_per_node = nodes ? c.ranks_per_node : 0;
  ref::combine_forward(e.plan, ca);
  ref::combine_forward(e.plan, ref::CombineArgs{c.mode, y_abs, probs_abs, views(e.out_abs, true)});

  ref::DispatchBackwardArgs db{d_recv, d_recv_probs, dx_v, dpd_v};
  db.reduction = reduction;
  db.ranks_per_node = ca.ranks_per_node;
  ref::dispatch_backward(e.plan, db);
  ref::dispatch_backward(e.plan, ref::DispatchBackwardArgs{d_recv_abs, {}, views(e.dx_abs, true), {}});

  make(e.d_y, c.dtype, capacity, c.H);
  make(e.d_probs_comb, DType::F32, c.t_max, c.K);
  make(e.dot_abs, DType::F64, c.t_max, c.K);
  ref::combine_backward(e.plan, {c.mode, d_out, y, probs, views(e.d_y, false), views(e.d_probs_comb, true)});
  std::vector<TensorView> d_out_abs;
  for (int r = 0; r < R; ++r) {
    const TensorView a = abs_of(s.d_out[std::size_t(r)], c.t_max);
    d_out_abs.push_back(TensorView(a.data(), DType::F64, {s.tokens[std::size_t(r)], c.H}));
  }
  std::vector<HostTensor> scratch;
  make(scratch, DType::F64, capacity, c.H);
  ref::combine_backward(e.plan, {ProbMode::InCombine, d_out_abs, y_abs, probs_abs, views(scratch, false),
                                 views(e.dot_abs, true)});
  return e;
}

// This rank's device buffers for one Case; inputs are re-uploaded per step (graph replays read the same addresses).
struct Buffers {
  DeviceTensor topk, probs, x, num_tokens, recv, recv_probs, y, out, d_recv, d_recv_probs, dx, d_probs_disp, d_out,
      d_y, d_probs_comb;
  Buffers(const Case& c, std::int64_t capacity)
      : topk(DType::I32, {c.t_max, c.K}), probs(DType::F32, {c.t_max, c.K}), x(c.dtype, {c.t_max, c.H}),
        num_tokens(DType::I32, {1}), recv(c.dtype, {capacity, c.H}), recv_probs(DType::F32, {capacity}),
        y(c.dtype, {capacity, c.H}), out(c.dtype, {c.t_max, c.H}), d_recv(c.dtype, {capacity, c.H}),
        d_recv_probs(DType::F32, {capacity}), dx(c.dtype, {c.t_max, c.H}), d_probs_disp(DType::F32, {c.t_max, c.K}),
        d_out(c.dtype, {c.t_max, c.H}), d_y(c.dtype, {capacity, c.H}), d_probs_comb(DType::F32, {c.t_max, c.K}) {}

  void upload(const Step& s, int me) {
    topk.upload(s.topk[std::size_t(me)]);
    probs.upload(s.probs[std::size_t(me)]);
    x.upload(s.x[std::size_t(me)]);
    num_tokens.from_vector(std::vector<std::int32_t>{std::int32_t(s.tokens[std::size_t(me)])});
    y.upload(s.y[std::size_t(me)]);
    d_recv.upload(s.d_recv[std::size_t(me)]);
    d_recv_probs.upload(s.d_recv_probs[std::size_t(me)]);
    d_out.upload(s.d_out[std::size_t(me)]);
    for (DeviceTensor* t : {&recv, &recv_probs, &out, &dx, &d_probs_disp, &d_y, &d_probs_comb}) t->poison();
  }

  // The four ops of a step, in training order (the Dispatcher's default handle).
  void run(Dispatcher& d, ProbMode mode, cudaStream_t stream) {
    d.dispatch({x.view(), topk.view(), probs.view(), num_tokens.view(), recv.view(), recv_probs.view()}, stream);
    d.combine({mode, y.view(), out.view()}, stream);
    d.combine_backward({mode, d_out.view(), y.view(), d_y.view(), d_probs_comb.view()}, stream);
    d.dispatch_backward({d_recv.view(), d_recv_probs.view(), dx.view(), d_probs_disp.view()}, stream);
  }
  // The same ops over a handle of this microbatch's; rows >= 0: views of only the first `rows` rows of the
  // row-side buffers (recv, recv_probs, y, d_recv, d_recv_probs, d_y), as a planned dispatch may take.
  void dispatch(Dispatcher& d, DispatchHandle& h, cudaStream_t stream, std::int64_t rows = -1) {
    d.dispatch({x.view(), topk.view(), probs.view(), num_tokens.view(), cut(recv, rows), cut(recv_probs, rows)}, h,
               stream);
  }
  void combine(Dispatcher& d, ProbMode mode, const DispatchHandle& h, cudaStream_t stream, std::int64_t rows = -1) {
    d.combine({mode, cut(y, rows), out.view()}, h, stream);
  }
  void backward(Dispatcher& d, ProbMode mode, const DispatchHandle& h, cudaStream_t stream, std::int64_t rows = -1) {
    d.combine_backward({mode, d_out.view(), cut(y, rows), cut(d_y, rows), d_probs_comb.view()}, h, stream);
    d.dispatch_backward({cut(d_recv, rows), cut(d_recv_probs, rows), dx.view(), d_probs_disp.view()}, h, stream);
  }
  static TensorView cut(const DeviceTensor& t, std::int64_t rows) {
    const TensorView v = t.view();
    if (rows < 0) return v;
    return v.ndim() == 1 ? t.view_as({rows}) : t.view_as({rows, v.size(1)});
  }
  // Every output buffer, whole (rows nobody writes keep the poison), as bytes.
  std::vector<std::vector<char>> outputs() const {
    std::vector<std::vector<char>> v;
    for (const DeviceTensor* t : {&recv, &recv_probs, &out, &dx, &d_probs_disp, &d_y, &d_probs_comb}) {
      v.emplace_back(t->view().nbytes());
      testing::cuda_ok(cudaMemcpy(v.back().data(), t->data(), v.back().size(), cudaMemcpyDeviceToHost), "download");
    }
    return v;
  }
};

// Element i of a and b, bit for bit.
inline bool same_bits(const HostTensor& a, const HostTensor& b, std::int64_t i) {
  const std::size_t n = dtype_size(a.view().dtype());
  return std::memcmp(static_cast<const char*>(a.view().data()) + std::size_t(i) * n,
                     static_cast<const char*>(b.view().data()) + std::size_t(i) * n, n) == 0;
}

// Compares this rank's device results with the reference; returns the number of mismatches (details printed).
// One step of every op as rank `me` with s's inputs, eagerly on a stream of its own (in-process ranks on one GPU
// would share the legacy default stream), waited for.
inline void run_step_once(Dispatcher& d, const Case& c, Buffers& b, const Step& s, int me) {
  b.upload(s, me);
  cudaStream_t stream;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  b.run(d, c.mode, stream);
  testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
  cudaStreamDestroy(stream);
}

// The per-rank token counts of a test: `per_rank` padded with its last value (or 0) to R ranks, or cut to R.
inline std::vector<std::int64_t> tokens_of(int R, std::initializer_list<std::int64_t> per_rank) {
  std::vector<std::int64_t> v(per_rank);
  v.resize(std::size_t(R), v.empty() ? 0 : v.back());
  return v;
}

inline int compare(const Case& c, const Expected& e, Buffers& b, int me, std::int64_t T, std::int64_t capacity) {
  int bad = 0;
  auto report = [&](const std::string& what) {
    if (++bad <= 8) ADD_FAILURE() << "rank " << me << ": " << what;
  };
  const std::int64_t rows_used = e.plan.rows_used[std::size_t(me)];
  const int ex = rounding_exp(c.dtype);
  HostTensor recv(c.dtype, {capacity, c.H}), recv_probs(DType::F32, {capacity}), d_y(c.dtype, {capacity, c.H});
  b.recv.download(recv);
  b.recv_probs.download(recv_probs);
  b.d_y.download(d_y);
  const auto& er = e.recv[std::size_t(me)];
  const auto& edy = e.d_y[std::size_t(me)];
  for (std::int64_t row = 0; row < rows_used; ++row) {
    for (std::int64_t h = 0; h < c.H; ++h) {
      const std::int64_t i = row * c.H + h;
      if (!same_bits(recv, er, i)) {
        report("recv[" + std::to_string(row) + "," + std::to_string(h) + "] = " + std::to_string(recv.f(i)) +
               ", expected " + std::to_string(er.f(i)));
        break;
      }
      // InActivation: d_y is a copy of d_out (bit-exact); InCombine: w * d_out rounded once (1 ulp)
      const double g = d_y.f(i), x = edy.f(i);
      const bool same = c.mode == ProbMode::InActivation ? same_bits(d_y, edy, i)
                                                         : std::fabs(g - x) <= std::ldexp(std::fabs(x), ex);
      if (!same) {
        report("d_y[" + std::to_string(row) + "," + std::to_string(h) + "] = " + std::to_string(g) + ", expected " +
               std::to_string(x));
        break;
      }
    }
    if (std::memcmp(static_cast<const char*>(recv_probs.view().data()) + row * 4,
                    static_cast<const char*>(e.recv_probs[std::size_t(me)].view().data()) + row * 4, 4) != 0)
      report("recv_probs[" + std::to_string(row) + "] = " + std::to_string(recv_probs.f(row)) + ", expected " +
             std::to_string(e.recv_probs[std::size_t(me)].f(row)));
  }
  HostTensor out(c.dtype, {c.t_max, c.H}), dx(c.dtype, {c.t_max, c.H});
  HostTensor dpd(DType::F32, {c.t_max, c.K}), dpc(DType::F32, {c.t_max, c.K});
  b.out.download(out);
  b.dx.download(dx);
  b.d_probs_disp.download(dpd);
  b.d_probs_comb.download(dpc);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t h = 0; h < c.H; ++h) {
      const std::int64_t i = t * c.H + h;
      // one rounding of a partial crossing the link plus the final one
      const double bo = std::ldexp(e.out_abs[std::size_t(me)].f(i), ex) + 1e-6;
      if (!(std::fabs(out.f(i) - e.out[std::size_t(me)].f(i)) <= bo)) {
        report("out[" + std::to_string(t) + "," + std::to_string(h) + "] = " + std::to_string(out.f(i)) +
               ", expected " + std::to_string(e.out[std::size_t(me)].f(i)));
        break;
      }
      const double bd = std::ldexp(e.dx_abs[std::size_t(me)].f(i), ex) + 1e-6;
      if (!(std::fabs(dx.f(i) - e.dx[std::size_t(me)].f(i)) <= bd)) {
        report("dx[" + std::to_string(t) + "," + std::to_string(h) + "] = " + std::to_string(dx.f(i)) +
               ", expected " + std::to_string(e.dx[std::size_t(me)].f(i)));
        break;
      }
    }
    for (std::int64_t k = 0; k < c.K; ++k) {
      const std::int64_t i = t * c.K + k;
      if (dpd.f(i) != e.d_probs_disp[std::size_t(me)].f(i))
        report("dispatch d_probs[" + std::to_string(t) + "," + std::to_string(k) + "] = " + std::to_string(dpd.f(i)) +
               ", expected " + std::to_string(e.d_probs_disp[std::size_t(me)].f(i)));
      const double bound = 1e-4 * e.dot_abs[std::size_t(me)].f(i) + 1e-6;
      if (!(std::fabs(dpc.f(i) - e.d_probs_comb[std::size_t(me)].f(i)) <= bound))
        report("combine d_probs[" + std::to_string(t) + "," + std::to_string(k) + "] = " + std::to_string(dpc.f(i)) +
               ", expected " + std::to_string(e.d_probs_comb[std::size_t(me)].f(i)));
    }
  }
  return bad;
}

// The layout the expert MLP reads: per local expert rows and segments, as the reference plans them.
inline void compare_layout(const Expected& e, const Dispatcher& d, int me, std::int64_t L) {
  const EpLayout& l = d.layout();
  std::vector<std::int32_t> tpe(static_cast<std::size_t>(L)), seg(static_cast<std::size_t>(L + 1)),
      rows(static_cast<std::size_t>(L));
  testing::cuda_ok(cudaMemcpy(tpe.data(), l.tokens_per_expert.data(), L * 4, cudaMemcpyDeviceToHost), "layout");
  testing::cuda_ok(cudaMemcpy(seg.data(), l.segment_offset.data(), (L + 1) * 4, cudaMemcpyDeviceToHost), "layout");
  testing::cuda_ok(cudaMemcpy(rows.data(), l.segment_rows.data(), L * 4, cudaMemcpyDeviceToHost), "layout");
  for (std::int64_t j = 0; j < L; ++j) {
    const std::size_t eg = std::size_t(me * L + j);
    EXPECT_EQ(tpe[std::size_t(j)], e.plan.tokens_per_expert[eg]) << "rank " << me << " local expert " << j;
    EXPECT_EQ(seg[std::size_t(j)], e.plan.segment_offset[eg]) << "rank " << me << " local expert " << j;
    EXPECT_EQ(rows[std::size_t(j)], e.plan.segment_rows[eg]) << "rank " << me << " local expert " << j;
  }
}

// check() after a step in which this rank dropped `lost` rows for capacity and `peer_lost` slots of its own tokens
// past the host-API transport's peer_rows: an Error(CapacityOverflow) that names this rank and says `what` (when
// lost > 0) and how many slots were not sent (when peer_lost > 0), or none when nothing was dropped here.
inline void expect_overflow_reported(Dispatcher& d, int me, std::int64_t lost, const std::string& what,
                                     std::int64_t peer_lost = 0) {
  if (lost == 0 && peer_lost == 0) {
    EXPECT_NO_THROW(d.check(nullptr)) << "rank " << me;
    return;
  }
  try {
    d.check(nullptr);
    ADD_FAILURE() << "rank " << me << " dropped " << lost << " rows and " << peer_lost
                  << " slots past peer_rows but check() passed";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::CapacityOverflow);
    const std::string msg = err.what();
    EXPECT_NE(msg.find("rank " + std::to_string(me)), std::string::npos) << msg;
    if (lost > 0) EXPECT_NE(msg.find(what), std::string::npos) << msg;
    else EXPECT_EQ(msg.find("did not fit"), std::string::npos) << msg;
    const std::string peer = std::to_string(peer_lost) + " routed slot" + (peer_lost == 1 ? "" : "s") +
                             " of this rank's tokens were not sent: more than " + std::to_string(d.peer_rows());
    if (peer_lost > 0) EXPECT_NE(msg.find(peer), std::string::npos) << msg;
    else EXPECT_EQ(msg.find("were not sent"), std::string::npos) << msg;
  }
}

// Runs `steps` steps as rank comm.rank() (eagerly, or captured once and replayed) and checks each against the
// reference.
inline void run_steps_on(Communicator& comm, const Case& c, const std::vector<std::vector<std::int64_t>>& tokens,
                       Routing routing, bool graph, std::uint64_t seed) {
  const int R = comm.size(), me = comm.rank();
  const MoeConfig cfg = config_of(c, R);
  Dispatcher d(cfg, comm, options_of(c));
  const std::int64_t capacity = d.capacity();
  Buffers b(c, capacity);
  cudaStream_t stream;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaGraphExec_t exec = nullptr;
  cudaGraph_t g = nullptr;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const Step s = draw(c, R, capacity, seed + i, tokens[i], routing);
    b.upload(s, me);
    if (!graph || i == 0) {
      b.run(d, c.mode, stream);  // the eager first step also connects NCCL's peers before any capture
    } else {
      if (!exec) {
        // thread-local: in-process ranks (LoopbackGroup) capture on their threads while the others work
        testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
        b.run(d, c.mode, stream);
        testing::cuda_ok(cudaStreamEndCapture(stream, &g), "capture");
        testing::cuda_ok(cudaGraphInstantiate(&exec, g, 0), "instantiate");
        b.upload(s, me);  // capture ran nothing: poison again, then replay
      }
      testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
    }
    testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
    EXPECT_NO_THROW(d.check(stream)) << "step " << i << ", rank " << me;
    const Expected e = reference(c, cfg, s, capacity, d.peer_rows());
    EXPECT_EQ(compare(c, e, b, me, s.tokens[std::size_t(me)], capacity), 0)
        << "step " << i << (graph ? " (graph replay)" : "") << ", tokens per rank " << ::testing::PrintToString(s.tokens);
    compare_layout(e, d, me, cfg.local_experts());
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (g) cudaGraphDestroy(g);
  cudaStreamDestroy(stream);
}


// Every token to the last rank's experts under a capacity too small for them (c.capacity: Factor or PerExpert), one
// step as rank comm.rank(): the results are the reference plan's, bit for bit (each expert keeps its first rows;
// on the host-API transport each source first keeps its first peer_rows() tokens for a peer), and each rank's
// check() reports what it dropped: the last rank the rows that did not fit, with the counts (per expert under
// PerExpert), a source the slots it did not send.
inline void check_skewed_overflow(Communicator& comm, const Case& c, std::uint64_t seed) {
  const int R = comm.size(), me = comm.rank();
  const MoeConfig cfg = config_of(c, R);
  Dispatcher d(cfg, comm, options_of(c));
  const std::int64_t capacity = d.capacity();
  const bool per_expert = c.capacity.kind == Capacity::Kind::PerExpert;
  if (per_expert) ASSERT_EQ(capacity, cfg.local_experts() * cfg.expert_rows());
  std::vector<std::int64_t> tokens(std::size_t(R), c.t_max);
  tokens[0] = c.t_max - 14;
  const Step s = draw(c, R, capacity, seed, tokens, Routing::OneRank);
  Buffers b(c, capacity);
  run_step_once(d, c, b, s, me);
  const Expected e = reference(c, cfg, s, capacity, d.peer_rows());
  const std::int64_t lost = e.plan.overflow[std::size_t(me)], L = cfg.local_experts();
  std::string what = std::to_string(lost) + " routed rows did not fit";
  if (per_expert) {
    std::int64_t fullest = 0;
    for (std::int64_t j = 0; j < L; ++j)
      fullest = std::max(fullest, e.plan.padded_per_expert[std::size_t(me * L + j)]);
    what += ": the fullest expert needed " + std::to_string(fullest) + " rows, " + std::to_string(cfg.expert_rows()) +
            " per expert available (capacity " + c.capacity.str() + ")";
  }
  expect_overflow_reported(d, me, lost, what, e.plan.peer_dropped[std::size_t(me)]);
  EXPECT_EQ(compare(c, e, b, me, s.tokens[std::size_t(me)], capacity), 0) << "rank " << me;
  compare_layout(e, d, me, cfg.local_experts());
  EXPECT_GT(e.plan.overflow[std::size_t(R - 1)], 0) << "the test routing must overflow the last rank";
}

// In-process ranks (LoopbackGroup, moerail/comm.h): the host-API path of R ranks on this process's GPU.
inline int this_device() { return g_comm ? g_comm->device() : 0; }
inline void run_ranks(int R, const std::function<void(Communicator&)>& body, double timeout_s = 60.0) {
  testing::run_ranks(R, this_device(), body, timeout_s);
}

class Ep : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    MOERAIL_REQUIRE_GPU();
    if (!g_comm) GTEST_SKIP() << "no communicator";
    if (GetParam() == Transport::NvLink && !g_comm->nvlink_ok())
      GTEST_SKIP() << "NVLink path refused: " << g_comm->nvlink_refusal();
  }
  int R() const { return g_comm->size(); }
  int me() const { return g_comm->rank(); }

  // Runs `steps` steps (eagerly, or captured once and replayed) and checks each against the reference.
  void run_steps(Case c, const std::vector<std::vector<std::int64_t>>& tokens, Routing routing, bool graph,
                 std::uint64_t seed) {
    c.transport = GetParam();
    run_steps_on(*g_comm, c, tokens, routing, graph, seed);
  }

  std::vector<std::int64_t> tokens(std::initializer_list<std::int64_t> per_rank) const {
    return tokens_of(R(), per_rank);
  }
};

}  // namespace moerail::test::ep_gpu
