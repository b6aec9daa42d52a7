// Expert-parallel dispatch/combine on 1..N GPUs (include/moerail/dispatch.h) against the CPU reference over the same
// ranks. The program is its own launcher: run plainly, it spawns one worker process per GPU (MOERAIL_TEST_RANKS
// overrides the count; 1 runs in-process) and fails if any worker fails; each worker runs the same tests as one rank.
// Every rank draws the inputs of every rank from the same seed, so each can compute the whole reference and checks
// its own part: data movement bit-exact, sums within the rounding bound of docs/design.md, pad rows zero.
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
#include "common/multigpu.h"
#include "moerail/comm.h"
#include "moerail/dispatch.h"
#include "moerail/quant.h"
#include "moerail/reference/dispatch.h"
#include "moerail/reference/host.h"
#include "moerail/reference/layout.h"
#include "moerail/reference/quant.h"

namespace moerail {
namespace {

using ref::HostTensor;
using testing::DeviceTensor;

std::unique_ptr<Communicator> g_comm;  // this process's rank (set up in main)

struct Case {
  Transport transport = Transport::NvLink;
  std::int64_t H = 256, E = 8, K = 4, A = 16, t_max = 64;
  Capacity capacity = Capacity::worst_case();
  ProbMode mode = ProbMode::InActivation;
  int sms = 0;  // DispatchOptions::sms: few blocks make sources with more tokens than producer warps (two per chunk)
};

MoeConfig config_of(const Case& c, int R) {
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
  cfg.dtype = DType::BF16;
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

Step draw(const Case& c, int R, std::int64_t capacity, std::uint64_t seed, std::vector<std::int64_t> tokens,
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
    HostTensor x(DType::BF16, {c.t_max, c.H}), dout(DType::BF16, {c.t_max, c.H});
    ref::fill_normal(x, rng, 1.0);
    ref::fill_normal(dout, rng, 1.0);
    HostTensor y(DType::BF16, {capacity, c.H}), drecv(DType::BF16, {capacity, c.H}), drp(DType::F32, {capacity});
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
TensorView rows_of(const HostTensor& h, std::int64_t T) {
  const TensorView& v = h.view();
  return v.ndim() == 1 ? TensorView(v.data(), v.dtype(), {T}) : TensorView(v.data(), v.dtype(), {T, v.size(1)});
}

// The reference results of every op of one step, for every rank, plus absolute-value sums for the bounds.
struct Expected {
  ref::LayoutPlan plan;
  std::vector<HostTensor> recv, recv_probs, out, out_abs, dx, dx_abs, d_probs_disp, d_y, d_probs_comb, dot_abs;
};

Expected reference(const Case& c, const MoeConfig& cfg, const Step& s, std::int64_t capacity) {
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
  e.plan = ref::plan_layout(cfg, topk, capacity);
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
  make(e.recv, DType::BF16, capacity, c.H);
  for (int r = 0; r < R; ++r) {
    e.recv_probs.emplace_back(DType::F32, std::vector<std::int64_t>{capacity});
    e.recv_probs.back().fill_nan();
  }
  std::vector<TensorView> recv_probs_v;
  for (auto& h : e.recv_probs) recv_probs_v.push_back(h.view());
  ref::dispatch_forward(e.plan, {x, probs, views(e.recv, false), recv_probs_v});

  make(e.out, DType::BF16, c.t_max, c.H);
  make(e.out_abs, DType::F64, c.t_max, c.H);
  make(e.dx, DType::BF16, c.t_max, c.H);
  make(e.dx_abs, DType::F64, c.t_max, c.H);
  make(e.d_probs_disp, DType::F32, c.t_max, c.K);
  const std::vector<TensorView> out_v = views(e.out, true), dx_v = views(e.dx, true),
                                dpd_v = views(e.d_probs_disp, true);
  ref::CombineArgs ca{c.mode, y, probs, out_v};
  ca.reduction = ref::Reduction::PerRank;
  ref::combine_forward(e.plan, ca);
  ref::combine_forward(e.plan, ref::CombineArgs{c.mode, y_abs, probs_abs, views(e.out_abs, true)});

  ref::DispatchBackwardArgs db{d_recv, d_recv_probs, dx_v, dpd_v};
  db.reduction = ref::Reduction::PerRank;
  ref::dispatch_backward(e.plan, db);
  ref::dispatch_backward(e.plan, ref::DispatchBackwardArgs{d_recv_abs, {}, views(e.dx_abs, true), {}});

  make(e.d_y, DType::BF16, capacity, c.H);
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
      : topk(DType::I32, {c.t_max, c.K}), probs(DType::F32, {c.t_max, c.K}), x(DType::BF16, {c.t_max, c.H}),
        num_tokens(DType::I32, {1}), recv(DType::BF16, {capacity, c.H}), recv_probs(DType::F32, {capacity}),
        y(DType::BF16, {capacity, c.H}), out(DType::BF16, {c.t_max, c.H}), d_recv(DType::BF16, {capacity, c.H}),
        d_recv_probs(DType::F32, {capacity}), dx(DType::BF16, {c.t_max, c.H}), d_probs_disp(DType::F32, {c.t_max, c.K}),
        d_out(DType::BF16, {c.t_max, c.H}), d_y(DType::BF16, {capacity, c.H}), d_probs_comb(DType::F32, {c.t_max, c.K}) {}

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

std::uint16_t bits(const HostTensor& h, std::int64_t i) { return static_cast<const std::uint16_t*>(h.view().data())[i]; }

// Compares this rank's device results with the reference; returns the number of mismatches (details printed).
int compare(const Case& c, const Expected& e, Buffers& b, int me, std::int64_t T, std::int64_t capacity) {
  int bad = 0;
  auto report = [&](const std::string& what) {
    if (++bad <= 8) ADD_FAILURE() << "rank " << me << ": " << what;
  };
  const std::int64_t rows_used = e.plan.rows_used[std::size_t(me)];
  HostTensor recv(DType::BF16, {capacity, c.H}), recv_probs(DType::F32, {capacity}), d_y(DType::BF16, {capacity, c.H});
  b.recv.download(recv);
  b.recv_probs.download(recv_probs);
  b.d_y.download(d_y);
  const auto& er = e.recv[std::size_t(me)];
  const auto& edy = e.d_y[std::size_t(me)];
  for (std::int64_t row = 0; row < rows_used; ++row) {
    for (std::int64_t h = 0; h < c.H; ++h) {
      const std::int64_t i = row * c.H + h;
      if (bits(recv, i) != bits(er, i)) {
        report("recv[" + std::to_string(row) + "," + std::to_string(h) + "] = " + std::to_string(recv.f(i)) +
               ", expected " + std::to_string(er.f(i)));
        break;
      }
      // InActivation: d_y is a copy of d_out (bit-exact); InCombine: w * d_out rounded once (1 bf16 ulp)
      const double g = d_y.f(i), x = edy.f(i);
      const bool same = c.mode == ProbMode::InActivation ? bits(d_y, i) == bits(edy, i)
                                                         : std::fabs(g - x) <= std::ldexp(std::fabs(x), -7);
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
  HostTensor out(DType::BF16, {c.t_max, c.H}), dx(DType::BF16, {c.t_max, c.H});
  HostTensor dpd(DType::F32, {c.t_max, c.K}), dpc(DType::F32, {c.t_max, c.K});
  b.out.download(out);
  b.dx.download(dx);
  b.d_probs_disp.download(dpd);
  b.d_probs_comb.download(dpc);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t h = 0; h < c.H; ++h) {
      const std::int64_t i = t * c.H + h;
      // one bf16 rounding of a partial crossing the link plus the final one: 2^-7 of the sum of |terms|
      const double bo = std::ldexp(e.out_abs[std::size_t(me)].f(i), -7) + 1e-6;
      if (!(std::fabs(out.f(i) - e.out[std::size_t(me)].f(i)) <= bo)) {
        report("out[" + std::to_string(t) + "," + std::to_string(h) + "] = " + std::to_string(out.f(i)) +
               ", expected " + std::to_string(e.out[std::size_t(me)].f(i)));
        break;
      }
      const double bd = std::ldexp(e.dx_abs[std::size_t(me)].f(i), -7) + 1e-6;
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
void compare_layout(const Expected& e, const Dispatcher& d, int me, std::int64_t L) {
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

// check() after a step in which this rank dropped `lost` rows: an Error(CapacityOverflow) that names this rank and
// says `what`, or none when nothing was dropped here.
void expect_overflow_reported(Dispatcher& d, int me, std::int64_t lost, const std::string& what) {
  if (lost == 0) {
    EXPECT_NO_THROW(d.check(nullptr));
    return;
  }
  try {
    d.check(nullptr);
    ADD_FAILURE() << "rank " << me << " dropped " << lost << " rows but check() passed";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::CapacityOverflow);
    const std::string msg = err.what();
    EXPECT_NE(msg.find("rank " + std::to_string(me)), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
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
    const MoeConfig cfg = config_of(c, R());
    DispatchOptions opts;
    opts.transport = c.transport;
    opts.timeout_s = 30;
    opts.sms = c.sms;
    Dispatcher d(cfg, *g_comm, opts);
    const std::int64_t capacity = d.capacity();
    Buffers b(c, capacity);
    cudaStream_t stream;
    testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    cudaGraphExec_t exec = nullptr;
    cudaGraph_t g = nullptr;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const Step s = draw(c, R(), capacity, seed + i, tokens[i], routing);
      b.upload(s, me());
      if (!graph || i == 0) {
        b.run(d, c.mode, stream);  // the eager first step also connects NCCL's peers before any capture
      } else {
        if (!exec) {
          testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
          b.run(d, c.mode, stream);
          testing::cuda_ok(cudaStreamEndCapture(stream, &g), "capture");
          testing::cuda_ok(cudaGraphInstantiate(&exec, g, 0), "instantiate");
          b.upload(s, me());  // capture ran nothing: poison again, then replay
        }
        testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
      }
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream)) << "step " << i;
      const Expected e = reference(c, cfg, s, capacity);
      EXPECT_EQ(compare(c, e, b, me(), s.tokens[std::size_t(me())], capacity), 0)
          << "step " << i << (graph ? " (graph replay)" : "") << ", tokens per rank " << ::testing::PrintToString(s.tokens);
      compare_layout(e, d, me(), cfg.local_experts());
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  }

  std::vector<std::int64_t> tokens(std::initializer_list<std::int64_t> per_rank) const {
    std::vector<std::int64_t> v(per_rank);
    v.resize(std::size_t(R()), v.empty() ? 0 : v.back());
    return v;
  }
};

TEST_P(Ep, RandomRoutingUnevenTokens) {
  Case c;
  run_steps(c, {tokens({64, 37}), tokens({5, 64}), tokens({0, 50}), tokens({33, 0})}, Routing::Random, false, 100);
}

// Two blocks: 16 producer warps, so every warp handles several chunks, and sources of different sizes in one step.
TEST_P(Ep, FewBlocks) {
  Case c;
  c.sms = 2;
  run_steps(c, {tokens({64, 5}), tokens({16, 17}), tokens({0, 64}), tokens({1, 33})}, Routing::Random, false, 150);
  c.mode = ProbMode::InCombine;
  std::vector<std::vector<std::int64_t>> steps;
  for (int i = 0; i < 8; ++i) steps.push_back(tokens({(i * 11) % 65, (i * 23 + 9) % 65}));
  run_steps(c, steps, Routing::Random, true, 160);
}

// Fewer tokens than warps: idle warps take column ranges of a token's row (ep::LocalParts): the dispatch's local
// rows, the combine's and the dispatch backward's sums on the owner. H = 4104 is 513 vectors, so the ranges are
// uneven and the last ends mid-batch. 132 blocks give 4 ranges per token; 2 blocks give 2 to 4 at 5 and 8 tokens
// (by the rank count and the transport's warps per role) and one from 17 tokens on. A graph replay moves the token
// counts across those thresholds.
TEST_P(Ep, FewTokensSplitTheirRowsAcrossWarps) {
  Case c;
  c.H = 4104;
  c.K = 8;
  c.E = 16;
  c.t_max = 32;
  run_steps(c, {tokens({5, 32}), tokens({1, 0}), tokens({32, 8})}, Routing::Random, false, 800);
  c.sms = 2;
  run_steps(c, {tokens({5, 8}), tokens({8, 17}), tokens({0, 5})}, Routing::OneRank, false, 810);
  std::vector<std::vector<std::int64_t>> steps;
  for (int i = 0; i < 6; ++i) steps.push_back(tokens({(i * 7) % 33, (i * 5 + 3) % 33}));
  run_steps(c, steps, Routing::Random, true, 820);
}

// Every SM for the data kernels while a collective of another stream (a data-parallel all-reduce beside the
// backward) holds some of them on rank 0 and waits for rank 1, which launched its data kernels first and holds all
// of its SMs. Rank 0's blocks that cannot be resident wait for the all-reduce, which needs rank 1's all-reduce,
// which needs SMs on rank 1. Every wait on a peer pairs blocks of the same index (ep::RemoteWork), so only rank 1's
// partners of the missing blocks wait; the others finish and free SMs for rank 1's all-reduce. A design in which
// every block of rank 1 could wait for one of the missing blocks hangs here until the spin-wait timeout and fails
// the check. (At R = 2 the pairing held before RemoteWork spread chunks over blocks too; the test guards the
// all-SM default. Whether rank 0's blocks were in fact kept out is not checked: the all-reduce's CTAs, 96
// registers x 512+ threads, cannot share an SM with a data-kernel block of 512 threads x 95-128 registers.)
TEST_P(Ep, EverySmBesideACollectiveThatWaitsForThePeer) {
  if (R() < 2) GTEST_SKIP() << "needs two ranks";
  // HostApi's send/recv and the all-reduce would share one communicator in a different order on the two ranks
  // (NCCL needs one order); its kernels never wait on a peer's SMs anyway.
  if (GetParam() != Transport::NvLink) GTEST_SKIP() << "NvLink path only";
  Case c;
  c.H = 1024;
  c.t_max = 4096;  // 2048 two-token chunks per source: work for every producer warp of every block
  c.transport = GetParam();
  int sms = 0;
  testing::cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g_comm->device()), "attribute");
  c.sms = sms;
  const MoeConfig cfg = config_of(c, R());
  DispatchOptions opts;
  opts.transport = c.transport;
  opts.timeout_s = 10;
  opts.sms = c.sms;
  Dispatcher d(cfg, *g_comm, opts);
  const std::int64_t capacity = d.capacity();
  Buffers b(c, capacity);
  const Step s = draw(c, R(), capacity, 700, tokens({4096, 3000}), Routing::Random);
  b.upload(s, me());
  cudaStream_t stream, coll;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  testing::cuda_ok(cudaStreamCreateWithFlags(&coll, cudaStreamNonBlocking), "stream");
  b.run(d, c.mode, stream);  // a first step outside the scenario (the planner's count exchange, warm kernels)
  testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
  b.upload(s, me());
  const std::size_t n = std::size_t(64) << 20;  // 256 MB of f32: the all-reduce spans the whole scenario
  DeviceTensor grads(DType::F32, {std::int64_t(n)});
  testing::cuda_ok(cudaMemset(grads.data(), 0, n * 4), "memset");
  auto all_reduce = [&] {
    ASSERT_EQ(ncclAllReduce(grads.data(), grads.data(), n, ncclFloat, ncclSum,
                            static_cast<ncclComm_t>(g_comm->nccl_comm()), coll),
              ncclSuccess);
  };
  all_reduce();  // NCCL connects a collective's peers on its first call, on the host of both ranks: not in the scenario
  testing::cuda_ok(cudaStreamSynchronize(coll), "sync");
  const auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); };
  // Each kernel shape in turn is the one the collective meets: the whole step starts with the scatter kernel
  // (no shared memory), a combine alone is the gather kernel (192 KB of shared memory per block).
  auto scenario = [&](const char* what, const std::function<void()>& ops) {
    if (me() == 0) {
      all_reduce();  // resident and waiting for rank 1 before the data kernels arrive
      pause();
      ops();
    } else {
      ops();  // every SM, waiting for rank 0's data
      pause();
      all_reduce();
    }
    testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
    testing::cuda_ok(cudaStreamSynchronize(coll), "sync");
    EXPECT_NO_THROW(d.check(stream)) << what;
  };
  scenario("whole step", [&] { b.run(d, c.mode, stream); });
  scenario("combine", [&] { d.combine({c.mode, b.y.view(), b.out.view()}, stream); });
  const Expected e = reference(c, cfg, s, capacity);
  EXPECT_EQ(compare(c, e, b, me(), s.tokens[std::size_t(me())], capacity), 0);
  cudaStreamDestroy(coll);
  cudaStreamDestroy(stream);
}

TEST_P(Ep, NoAlignmentAndInCombineProbs) {
  Case c;
  c.A = 1;
  c.mode = ProbMode::InCombine;
  run_steps(c, {tokens({64, 64}), tokens({17, 3})}, Routing::Random, false, 200);
}

TEST_P(Ep, HiddenNotAMultipleOf64AndAlign128) {
  Case c;
  c.H = 136;
  c.A = 128;
  c.mode = ProbMode::InCombine;
  run_steps(c, {tokens({40, 64}), tokens({1, 1})}, Routing::Random, false, 300);
}

// Top-8 with 16 experts and wide rows: a token's summed rows (up to 8 on one rank) exceed one shared-memory landing
// wave of the gather (6 rows), so own rows fall into a second wave; H = 4224 makes rows longer than one gather batch
// (528 vectors, 128 per batch) and than one scatter batch (512 vectors). OneRank puts all 8 slots on one rank.
TEST_P(Ep, TopK8WideRowsAndManyRowsPerRank) {
  Case c;
  c.H = 4224;
  c.E = 16;
  c.K = 8;
  c.t_max = 32;
  run_steps(c, {tokens({32, 20}), tokens({7, 32})}, Routing::Random, false, 600);
  c.mode = ProbMode::InCombine;
  run_steps(c, {tokens({32, 32}), tokens({0, 17})}, Routing::OneRank, false, 610);
}

// More experts than the planner kernel's 256 threads: its prefix sums are carried over three tiles of experts, and
// at R > 1 a rank's first expert lies inside a later tile.
TEST_P(Ep, ManyExpertsPlannedInSeveralTiles) {
  Case c;
  c.E = 520;
  c.K = 8;
  run_steps(c, {tokens({64, 37}), tokens({0, 64}), tokens({3, 3})}, Routing::Random, false, 700);
}

TEST_P(Ep, AllTokensToOneExpert) {
  Case c;
  run_steps(c, {tokens({64, 64}), tokens({0, 64})}, Routing::OneExpert, false, 400);
}

TEST_P(Ep, GraphReplayWithNewRoutingsAndTokenCounts) {
  Case c;
  c.mode = ProbMode::InCombine;
  std::vector<std::vector<std::int64_t>> steps;
  for (int i = 0; i < 21; ++i) steps.push_back(tokens({(i * 13) % 65, (i * 29 + 7) % 65}));
  steps[3] = tokens({0, 0});
  steps[7] = tokens({64, 0});
  run_steps(c, steps, Routing::Random, true, 500);
}

// Several microbatches in flight, each with its own handle: k dispatches (and their combines) before any backward,
// the combines out of order, the backward passes in reverse and in shuffled order, eagerly and as one captured graph
// replayed with new inputs. Every output buffer, whole, is the same bytes as the same microbatch run alone (one step
// at a time over the default handle), which is checked against the reference.
TEST_P(Ep, MicrobatchesInFlightMatchOneAtATime) {
  constexpr int kMicro = 4;
  for (const ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
    Case c;
    c.mode = mode;
    c.transport = GetParam();
    const MoeConfig cfg = config_of(c, R());
    DispatchOptions opts;
    opts.transport = c.transport;
    opts.timeout_s = 30;
    Dispatcher d(cfg, *g_comm, opts);
    const std::int64_t capacity = d.capacity();
    std::vector<std::unique_ptr<Buffers>> mb;
    std::vector<DeviceTensor> memory;
    std::vector<DispatchHandle> handles;
    for (int i = 0; i < kMicro; ++i) {
      mb.push_back(std::make_unique<Buffers>(c, capacity));
      memory.emplace_back(DType::Bool, std::vector<std::int64_t>{std::int64_t(d.handle_bytes())});
      handles.push_back(d.make_handle(memory.back().view()));
    }
    cudaStream_t stream;
    testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    // the inputs of round `round`: microbatch i gets its own token counts and routing
    auto inputs = [&](int round) {
      std::vector<Step> steps;
      for (int i = 0; i < kMicro; ++i)
        steps.push_back(draw(c, R(), capacity, 1000 + 100 * std::uint64_t(round) + std::uint64_t(i),
                             tokens({(17 * i + 29 * round + 5) % 65, (23 * i + 11 * round) % 65}), Routing::Random));
      return steps;
    };
    // one at a time, checked against the reference: the bytes every other order must give
    auto alone = [&](const std::vector<Step>& steps) {
      std::vector<std::vector<std::vector<char>>> want;
      for (int i = 0; i < kMicro; ++i) {
        mb[std::size_t(i)]->upload(steps[std::size_t(i)], me());
        mb[std::size_t(i)]->run(d, mode, stream);
        testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
        EXPECT_NO_THROW(d.check(stream));
        const Expected e = reference(c, cfg, steps[std::size_t(i)], capacity);
        const std::int64_t T = steps[std::size_t(i)].tokens[std::size_t(me())];
        EXPECT_EQ(compare(c, e, *mb[std::size_t(i)], me(), T, capacity), 0) << "microbatch " << i << " alone";
        want.push_back(mb[std::size_t(i)]->outputs());
      }
      return want;
    };
    const std::vector<int> combine_order{1, 0, 3, 2};
    auto in_flight = [&](const std::vector<int>& backward_order) {
      for (int i = 0; i < kMicro; ++i) mb[std::size_t(i)]->dispatch(d, handles[std::size_t(i)], stream);
      for (int i : combine_order) mb[std::size_t(i)]->combine(d, mode, handles[std::size_t(i)], stream);
      for (int i : backward_order) mb[std::size_t(i)]->backward(d, mode, handles[std::size_t(i)], stream);
    };
    auto expect_same = [&](const std::vector<std::vector<std::vector<char>>>& want, const char* what) {
      for (int i = 0; i < kMicro; ++i) {
        const auto got = mb[std::size_t(i)]->outputs();
        for (std::size_t o = 0; o < got.size(); ++o)
          EXPECT_TRUE(got[o] == want[std::size_t(i)][o])
              << what << ": microbatch " << i << " output " << o << " differs from the microbatch alone";
      }
    };
    for (const auto& order : {std::vector<int>{3, 2, 1, 0}, std::vector<int>{2, 0, 3, 1}}) {
      const std::vector<Step> steps = inputs(order[0]);
      const auto want = alone(steps);
      for (int i = 0; i < kMicro; ++i) mb[std::size_t(i)]->upload(steps[std::size_t(i)], me());
      in_flight(order);
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream));
      expect_same(want, order[0] == 3 ? "backward in reverse" : "backward shuffled");
    }
    // one graph of all four in flight, replayed with new inputs
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
    in_flight({2, 0, 3, 1});
    testing::cuda_ok(cudaStreamEndCapture(stream, &g), "capture");
    testing::cuda_ok(cudaGraphInstantiate(&exec, g, 0), "instantiate");
    for (int round = 5; round < 8; ++round) {
      const std::vector<Step> steps = inputs(round);
      const auto want = alone(steps);
      for (int i = 0; i < kMicro; ++i) mb[std::size_t(i)]->upload(steps[std::size_t(i)], me());
      testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream));
      expect_same(want, "graph replay");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  }
}

// plan() then dispatch(): the ops take buffers of exactly the planned rows (views of that many rows: the rows past
// them keep their poison) and give the bytes of a dispatch that plans itself, whose results the other cases check
// against the reference; the rows are the reference plan's. Misuse is refused: another op between plan() and the
// dispatch, other routing than the plan's, a buffer shorter than the plan.
TEST_P(Ep, PlannedDispatchTakesBuffersOfExactlyItsRows) {
  for (const ProbMode mode : {ProbMode::InActivation, ProbMode::InCombine}) {
    Case c;
    c.mode = mode;
    c.transport = GetParam();
    const MoeConfig cfg = config_of(c, R());
    DispatchOptions opts;
    opts.transport = c.transport;
    opts.timeout_s = 30;
    Dispatcher d(cfg, *g_comm, opts);
    const std::int64_t capacity = d.capacity();
    Buffers whole(c, capacity), exact(c, capacity);
    DeviceTensor mem(DType::Bool, {std::int64_t(d.handle_bytes())});
    DispatchHandle h = d.make_handle(mem.view());
    cudaStream_t stream;
    testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const std::vector<std::vector<std::int64_t>> steps{tokens({64, 37}), tokens({0, 50}), tokens({33, 0}),
                                                       tokens({64, 64})};
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Step s = draw(c, R(), capacity, 3000 + i, steps[i], Routing::Random);
      whole.upload(s, me());
      whole.dispatch(d, h, stream);
      whole.combine(d, mode, h, stream);
      whole.backward(d, mode, h, stream);
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_EQ(h.layout().capacity, capacity) << "a dispatch that plans itself takes capacity() rows";
      const auto want = whole.outputs();

      exact.upload(s, me());
      const std::int64_t rows = d.plan({exact.topk.view(), exact.probs.view(), exact.num_tokens.view()}, h, stream);
      const Expected e = reference(c, cfg, s, capacity);
      EXPECT_EQ(rows, e.plan.rows_used[std::size_t(me())]) << "step " << i;
      EXPECT_EQ(h.layout().capacity, rows);
      exact.dispatch(d, h, stream, rows);
      exact.combine(d, mode, h, stream, rows);
      exact.backward(d, mode, h, stream, rows);
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream));
      const auto got = exact.outputs();
      for (std::size_t o = 0; o < got.size(); ++o)
        EXPECT_TRUE(got[o] == want[o]) << "step " << i << ", output " << o << ": the planned dispatch over " << rows
                                       << " rows differs from the dispatch that plans itself";
    }

    auto refused = [&](const std::function<void()>& f, const std::string& needle, const char* what) {
      try {
        f();
        ADD_FAILURE() << what << " was accepted";
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << what << ": " << err.what();
      }
    };
    const EpPlanArgs routing{exact.topk.view(), exact.probs.view(), exact.num_tokens.view()};
    std::int64_t rows = d.plan(routing, h, stream);  // the last step's routing: rows on every rank
    ASSERT_GT(rows, 0);
    refused([&] { exact.dispatch(d, h, stream, rows - 1); }, "recv has", "a recv shorter than the plan");
    rows = d.plan(routing, h, stream);
    refused([&] { whole.dispatch(d, h, stream, rows); }, "not the array", "other routing than the plan's");
    rows = d.plan(routing, h, stream);
    DeviceTensor mem2(DType::Bool, {std::int64_t(d.handle_bytes())});
    DispatchHandle other = d.make_handle(mem2.view());
    whole.dispatch(d, other, stream);  // a dispatch of another microbatch (it plans itself)
    refused([&] { exact.dispatch(d, h, stream, rows); }, "plan it again", "another op between plan() and dispatch()");
    testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
    cudaStreamDestroy(stream);
  }
}

// Handles are checked: an empty one, one of another Dispatcher, one no dispatch filled, too little memory.
TEST_P(Ep, HandlesAreChecked) {
  Case c;
  c.transport = GetParam();
  const MoeConfig cfg = config_of(c, R());
  DispatchOptions opts;
  opts.transport = c.transport;
  Dispatcher d(cfg, *g_comm, opts), other(cfg, *g_comm, opts);
  Buffers b(c, d.capacity());
  DeviceTensor mem(DType::Bool, {std::int64_t(d.handle_bytes())});
  auto refused = [&](const std::function<void()>& f, const std::string& needle, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << what << ": " << err.what();
    }
  };
  DispatchHandle empty;
  refused([&] { b.dispatch(d, empty, nullptr); }, "handle is empty", "an empty handle");
  DispatchHandle theirs = other.make_handle(mem.view());
  refused([&] { b.dispatch(d, theirs, nullptr); }, "another Dispatcher", "another Dispatcher's handle");
  DispatchHandle fresh = d.make_handle(mem.view());
  refused([&] { b.combine(d, c.mode, fresh, nullptr); }, "holds no dispatch", "a handle no dispatch filled");
  refused([&] { b.backward(d, c.mode, fresh, nullptr); }, "holds no dispatch", "a handle no dispatch filled");
  const TensorView small(mem.data(), DType::Bool, {std::int64_t(d.handle_bytes()) - 256}, mem.view().device());
  refused([&] { (void)d.make_handle(small); }, "handle_bytes()", "too little memory");
}

// Capacity::PerExpert too small for a skewed routing: each expert keeps its first rows (the reference's plan, bit for
// bit), the rank whose experts overflow says so with the counts, per expert, and names itself.
TEST_P(Ep, PerExpertCapacityOverflowIsReportedWithItsCounts) {
  Case c;
  c.capacity = Capacity::per_expert(0.5);
  c.transport = GetParam();
  const MoeConfig cfg = config_of(c, R());
  DispatchOptions opts;
  opts.transport = c.transport;
  opts.timeout_s = 30;
  Dispatcher d(cfg, *g_comm, opts);
  const std::int64_t capacity = d.capacity();
  ASSERT_EQ(capacity, cfg.local_experts() * cfg.expert_rows());
  const Step s = draw(c, R(), capacity, 650, tokens({64, 50}), Routing::OneRank);
  Buffers b(c, capacity);
  b.upload(s, me());
  b.run(d, c.mode, nullptr);
  testing::cuda_ok(cudaDeviceSynchronize(), "sync");
  const Expected e = reference(c, cfg, s, capacity);
  const std::int64_t lost = e.plan.overflow[std::size_t(me())], L = cfg.local_experts();
  std::int64_t fullest = 0;
  for (std::int64_t j = 0; j < L; ++j) fullest = std::max(fullest, e.plan.padded_per_expert[std::size_t(me() * L + j)]);
  expect_overflow_reported(d, me(), lost,
                           std::to_string(lost) + " routed rows did not fit: the fullest expert needed " +
                               std::to_string(fullest) + " rows, " + std::to_string(cfg.expert_rows()) +
                               " per expert available (capacity per-expert(0.5))");
  EXPECT_EQ(compare(c, e, b, me(), s.tokens[std::size_t(me())], capacity), 0);
  compare_layout(e, d, me(), cfg.local_experts());
  EXPECT_GT(e.plan.overflow[std::size_t(R() - 1)], 0) << "the test routing must overflow the last rank's experts";
}

TEST_P(Ep, PerExpertCapacityThatFits) {
  Case c;
  c.capacity = Capacity::per_expert(2.0);
  run_steps(c, {tokens({64, 37}), tokens({5, 64})}, Routing::Random, false, 670);
}

// Factor capacity too small for the routing: the overflowing rank says so, names itself, and nothing is written
// past the buffers (they are exactly capacity rows: a write beyond would fault or corrupt the guard check below).
TEST_P(Ep, CapacityOverflowIsReportedByTheOverflowingRank) {
  Case c;
  c.capacity = Capacity::of_factor(0.3);
  c.transport = GetParam();
  const MoeConfig cfg = config_of(c, R());
  DispatchOptions opts;
  opts.transport = c.transport;
  opts.timeout_s = 30;
  Dispatcher d(cfg, *g_comm, opts);
  const std::int64_t capacity = d.capacity();
  const Step s = draw(c, R(), capacity, 600, tokens({64, 64}), Routing::OneRank);
  Buffers b(c, capacity);
  b.upload(s, me());
  b.run(d, c.mode, nullptr);
  testing::cuda_ok(cudaDeviceSynchronize(), "sync");
  const Expected e = reference(c, cfg, s, capacity);
  const std::int64_t lost = e.plan.overflow[std::size_t(me())];
  expect_overflow_reported(d, me(), lost, std::to_string(lost) + " routed rows did not fit");
  EXPECT_EQ(compare(c, e, b, me(), 64, capacity), 0);
  EXPECT_GT(e.plan.overflow[std::size_t(R() - 1)], 0) << "the test routing must overflow the last rank";
}

// An expert id outside [-1, E) on one rank: that slot is skipped everywhere and the rank's check() says so.
TEST_P(Ep, BadExpertIdIsReportedAndSkipped) {
  Case c;
  c.transport = GetParam();
  const MoeConfig cfg = config_of(c, R());
  DispatchOptions opts;
  opts.transport = c.transport;
  Dispatcher d(cfg, *g_comm, opts);
  const std::int64_t capacity = d.capacity();
  Step s = draw(c, R(), capacity, 700, tokens({64, 64}), Routing::Random);
  s.topk[0].set_i(5 * c.K + 1, 999);
  Buffers b(c, capacity);
  b.upload(s, me());
  b.run(d, c.mode, nullptr);
  testing::cuda_ok(cudaDeviceSynchronize(), "sync");
  if (me() == 0) {
    try {
      d.check(nullptr);
      ADD_FAILURE() << "check() passed with expert id 999";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), ErrorCode::BadRouting);
      EXPECT_NE(std::string(err.what()).find("topk_idx[5,1] = 999"), std::string::npos) << err.what();
    }
  } else {
    EXPECT_NO_THROW(d.check(nullptr));
  }
  s.topk[0].set_i(5 * c.K + 1, -1);  // the reference of a skipped slot
  const Expected e = reference(c, cfg, s, capacity);
  EXPECT_EQ(compare(c, e, b, me(), 64, capacity), 0);
}

// FP8 dispatch, for each recipe: recv and recv_scales are the reference's quantize_fp8 of each source row, moved to
// the reference plan's rows, bit for bit (Block1x128: f32 scales; Mx1x32: E8M0 bytes; PerTensor: the given scale, no
// scales moved); pad rows zero bytes with the scale of a zero block; recv_probs as dispatch; rows past rows_used
// untouched; the bf16 ops that follow (combine, backward) use the FP8 dispatch's plan. Eager first, then one
// captured graph replayed with new routings and token counts. H = 640: five 128-column groups per row (20 scale
// bytes), so the staged row's scale part is padded.
class EpFp8 : public Ep {
 protected:
  static constexpr float kTensorScale = 0.015625f;  // PerTensor: 2^-6, the same on every rank

  // Bytes of one row of recv_scales (0: PerTensor, whose recv_scales is the [1] scale, read).
  static std::int64_t scale_row_bytes(Fp8Scaling sc, std::int64_t H) {
    return sc == Fp8Scaling::PerTensor ? 0 : H / fp8_scale_block_cols(sc) * std::int64_t(dtype_size(fp8_scale_dtype(sc)));
  }

  void run_fp8_steps(Case c, const std::vector<std::vector<std::int64_t>>& tokens, std::uint64_t seed, Fp8Scaling sc) {
    SCOPED_TRACE(std::string("recipe ") + std::string(fp8_scaling_name(sc)));
    c.transport = GetParam();
    const MoeConfig cfg = config_of(c, R());
    DispatchOptions opts;
    opts.transport = c.transport;
    opts.timeout_s = 30;
    Dispatcher d(cfg, *g_comm, opts);
    const std::int64_t capacity = d.capacity(), H = c.H;
    Buffers b(c, capacity);
    DeviceTensor recv8(DType::F8E4M3, {capacity, H});
    DeviceTensor scales = sc == Fp8Scaling::PerTensor
                              ? DeviceTensor(DType::F32, {1})
                              : DeviceTensor(fp8_scale_dtype(sc), {capacity, H / fp8_scale_block_cols(sc)});
    cudaStream_t stream;
    testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    auto step = [&] {
      d.dispatch_fp8({b.x.view(), b.topk.view(), b.probs.view(), b.num_tokens.view(), recv8.view(), scales.view(),
                      b.recv_probs.view(), sc},
                     stream);
      d.combine({c.mode, b.y.view(), b.out.view()}, stream);
    };
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const Step st = draw(c, R(), capacity, seed + i, tokens[i], Routing::Random);
      b.upload(st, me());
      recv8.poison();
      if (sc == Fp8Scaling::PerTensor)
        scales.from_vector(std::vector<float>{kTensorScale});
      else
        scales.poison();
      if (i == 0) {
        step();
      } else {
        if (!exec) {
          testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
          step();
          testing::cuda_ok(cudaStreamEndCapture(stream, &g), "capture");
          testing::cuda_ok(cudaGraphInstantiate(&exec, g, 0), "instantiate");
        }
        testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
      }
      testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
      EXPECT_NO_THROW(d.check(stream)) << "step " << i;
      const Expected e = reference(c, cfg, st, capacity);
      EXPECT_EQ(compare_fp8(c, e, st, b, recv8, scales, capacity, sc), 0)
          << "step " << i << ", tokens per rank " << ::testing::PrintToString(st.tokens);
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  }

  int compare_fp8(const Case& c, const Expected& e, const Step& st, Buffers& b, const DeviceTensor& recv8,
                  const DeviceTensor& scales, std::int64_t capacity, Fp8Scaling sc) {
    const std::int64_t H = c.H, SB = scale_row_bytes(sc, H);
    const std::int64_t cols = sc == Fp8Scaling::PerTensor ? 1 : H / fp8_scale_block_cols(sc);
    const DType sdt = fp8_scale_dtype(sc);
    int bad = 0;
    auto report = [&](const std::string& what) {
      if (++bad <= 8) ADD_FAILURE() << "rank " << me() << ": " << what;
    };
    // expected rows: quantize every source rank's rows, then place them where the plan says
    HostTensor want(DType::F8E4M3, {capacity, H});
    std::vector<std::uint8_t> want_s(std::size_t(capacity * SB), 0xff);  // = poison: rows nobody writes
    std::memset(want.view().data(), 0xff, std::size_t(capacity * H));
    auto* wq = static_cast<std::uint8_t*>(want.view().data());
    for (int src = 0; src < R(); ++src) {
      const std::int64_t T = st.tokens[std::size_t(src)], T1 = std::max<std::int64_t>(T, 1);
      HostTensor q(DType::F8E4M3, {T1, H});
      HostTensor qs = sc == Fp8Scaling::PerTensor ? HostTensor(DType::F32, {1}) : HostTensor(sdt, {T1, cols});
      if (sc == Fp8Scaling::PerTensor) qs.set_f(0, kTensorScale);
      if (T > 0)
        ref::quantize_fp8(sc, rows_of(st.x[std::size_t(src)], T), TensorView(q.view().data(), DType::F8E4M3, {T, H}),
                          sc == Fp8Scaling::PerTensor ? qs.view() : TensorView(qs.view().data(), sdt, {T, cols}));
      for (std::int64_t slot = 0; slot < T * c.K; ++slot) {
        if (e.plan.dest_rank[std::size_t(src)][std::size_t(slot)] != me()) continue;
        const std::int64_t row = e.plan.dest_row[std::size_t(src)][std::size_t(slot)], t = slot / c.K;
        std::memcpy(wq + row * H, static_cast<const std::uint8_t*>(q.view().data()) + t * H, std::size_t(H));
        if (SB > 0)
          std::memcpy(want_s.data() + row * SB, static_cast<const std::uint8_t*>(qs.view().data()) + t * SB,
                      std::size_t(SB));
      }
    }
    const std::int64_t L = e.plan.local_experts;
    for (std::int64_t j = 0; j < L; ++j) {  // pad rows of this rank's segments
      const std::size_t eg = std::size_t(me() * L + j);
      const std::int64_t first = e.plan.segment_offset[eg] + e.plan.tokens_per_expert[eg];
      const std::int64_t end = std::min(e.plan.segment_offset[eg] + e.plan.padded_per_expert[eg], capacity);
      for (std::int64_t row = first; row < end; ++row) {
        std::memset(wq + row * H, 0, std::size_t(H));
        if (sc == Fp8Scaling::Block1x128)
          for (std::int64_t k = 0; k < cols; ++k) {
            const float one = 1.0f;
            std::memcpy(want_s.data() + row * SB + k * 4, &one, 4);
          }
        else if (sc == Fp8Scaling::Mx1x32)
          std::memset(want_s.data() + row * SB, 127, std::size_t(SB));  // E8M0 2^0
      }
    }
    if (sc == Fp8Scaling::PerTensor) {  // the given scale is read, never written
      std::vector<float> given = scales.to_vector<float>(1);
      if (given[0] != kTensorScale) report("the per-tensor scale changed to " + std::to_string(given[0]));
    }
    HostTensor got(DType::F8E4M3, {capacity, H}), got_p(DType::F32, {capacity});
    recv8.download(got);
    b.recv_probs.download(got_p);
    std::vector<std::uint8_t> got_s(std::size_t(capacity * SB));
    if (SB > 0)
      testing::cuda_ok(cudaMemcpy(got_s.data(), scales.data(), got_s.size(), cudaMemcpyDeviceToHost), "download");
    const auto* gq = static_cast<const std::uint8_t*>(got.view().data());
    for (std::int64_t row = 0; row < capacity; ++row) {
      for (std::int64_t h = 0; h < H; ++h)
        if (gq[row * H + h] != wq[row * H + h]) {
          report("recv[" + std::to_string(row) + "," + std::to_string(h) + "] = " + std::to_string(gq[row * H + h]) +
                 ", expected " + std::to_string(wq[row * H + h]));
          break;
        }
      for (std::int64_t k = 0; k < SB; ++k)
        if (got_s[std::size_t(row * SB + k)] != want_s[std::size_t(row * SB + k)]) {
          report("recv_scales row " + std::to_string(row) + " byte " + std::to_string(k) + " = " +
                 std::to_string(got_s[std::size_t(row * SB + k)]) + ", expected " +
                 std::to_string(want_s[std::size_t(row * SB + k)]));
          break;
        }
    }
    const std::int64_t rows_used = e.plan.rows_used[std::size_t(me())];
    for (std::int64_t row = 0; row < rows_used; ++row)
      if (std::memcmp(static_cast<const char*>(got_p.view().data()) + row * 4,
                      static_cast<const char*>(e.recv_probs[std::size_t(me())].view().data()) + row * 4, 4) != 0)
        report("recv_probs[" + std::to_string(row) + "] = " + std::to_string(got_p.f(row)) + ", expected " +
               std::to_string(e.recv_probs[std::size_t(me())].f(row)));
    // combine after the FP8 dispatch runs on its plan
    HostTensor out(DType::BF16, {c.t_max, c.H});
    b.out.download(out);
    const std::int64_t T = st.tokens[std::size_t(me())];
    for (std::int64_t i = 0; i < T * c.H; ++i) {
      const double bound = std::ldexp(e.out_abs[std::size_t(me())].f(i), -7) + 1e-6;
      if (!(std::fabs(out.f(i) - e.out[std::size_t(me())].f(i)) <= bound)) {
        report("out[" + std::to_string(i / c.H) + "," + std::to_string(i % c.H) + "] = " + std::to_string(out.f(i)) +
               ", expected " + std::to_string(e.out[std::size_t(me())].f(i)));
        break;
      }
    }
    return bad;
  }
};

TEST_P(EpFp8, QuantizedAtTheSourceBitExactEagerAndGraph) {
  Case c;
  c.H = 640;
  c.A = 32;
  std::vector<std::vector<std::int64_t>> steps{tokens({64, 37}), tokens({0, 50}), tokens({64, 0}), tokens({5, 64}),
                                               tokens({0, 0}), tokens({31, 17})};
  for (Fp8Scaling sc : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32, Fp8Scaling::PerTensor})
    run_fp8_steps(c, steps, 800, sc);
}

// Wide rows: 33 scale words per row (more than one per lane), 264 e4m3 vectors (three quantize batches).
TEST_P(EpFp8, WideRowsTopK8) {
  Case c;
  c.H = 4224;
  c.E = 16;
  c.K = 8;
  c.t_max = 32;
  for (Fp8Scaling sc : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32})
    run_fp8_steps(c, {tokens({32, 20}), tokens({9, 32})}, 900, sc);
}

TEST_P(EpFp8, RefusesWrongArguments) {
  Case c;
  c.transport = GetParam();
  const MoeConfig cfg = config_of(c, R());  // H = 256
  DispatchOptions opts;
  opts.transport = c.transport;
  Dispatcher d(cfg, *g_comm, opts);
  const std::int64_t capacity = d.capacity();
  Buffers b(c, capacity);
  DeviceTensor recv8(DType::F8E4M3, {capacity, c.H}), scales(DType::F32, {capacity, c.H / 128});
  DeviceTensor short_scales(DType::F32, {capacity - 1, c.H / 128});
  auto args = [&](const DeviceTensor& r, const DeviceTensor& sc) {
    return EpDispatchFp8Args{b.x.view(), b.topk.view(), b.probs.view(), b.num_tokens.view(), r.view(), sc.view(),
                             b.recv_probs.view()};
  };
  try {
    d.dispatch_fp8(args(b.recv, scales), nullptr);  // bf16 recv
    ADD_FAILURE() << "a bf16 recv was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("recv"), std::string::npos) << err.what();
  }
  try {
    d.dispatch_fp8(args(recv8, short_scales), nullptr);
    ADD_FAILURE() << "recv_scales with too few rows was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("recv_scales"), std::string::npos) << err.what();
  }
  auto refused = [&](EpDispatchFp8Args a, const std::string& needle, const char* what) {
    try {
      d.dispatch_fp8(a, nullptr);
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << what << ": " << err.what();
    }
  };
  EpDispatchFp8Args a = args(recv8, scales);
  a.scaling = static_cast<Fp8Scaling>(7);
  refused(a, "scaling = 7", "an unknown recipe");
  a.scaling = Fp8Scaling::Mx1x32;  // f32 [capacity, H/128] where E8M0 bytes [capacity, H/32] are needed
  refused(a, "recv_scales", "f32 scales for MXFP8");
  DeviceTensor tensor_scale(DType::F32, {2});
  a = args(recv8, tensor_scale);
  a.scaling = Fp8Scaling::PerTensor;
  refused(a, "recv_scales", "a per-tensor scale of shape [2]");
  DeviceTensor mx(kE8M0ScaleDType, {capacity + 4, c.H / 32});
  a = args(recv8, scales);
  a.recv_scales = TensorView(static_cast<char*>(mx.data()) + 1, kE8M0ScaleDType, {capacity, c.H / 32},
                             mx.view().device());
  a.scaling = Fp8Scaling::Mx1x32;
  refused(a, "4-byte aligned", "misaligned MXFP8 scales");
}

INSTANTIATE_TEST_SUITE_P(Transports, EpFp8, ::testing::Values(Transport::NvLink, Transport::HostApi),
                         [](const auto& info) { return std::string(transport_name(info.param)); });

INSTANTIATE_TEST_SUITE_P(Transports, Ep, ::testing::Values(Transport::NvLink, Transport::HostApi),
                         [](const auto& info) { return std::string(transport_name(info.param)); });

}  // namespace
}  // namespace moerail

int main(int argc, char** argv) { return moerail::testing::multigpu_main(argc, argv, "ep_test", moerail::g_comm); }
