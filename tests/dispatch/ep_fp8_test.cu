// The FP8 dispatch on 1..N GPUs (Dispatcher::dispatch_fp8): each recipe against the reference's quantize_fp8 of each
// source row moved to the reference plan's rows, bit for bit, eager and in a captured graph; its argument checks.
#include <gtest/gtest.h>

#include "dispatch/ep_harness.h"

namespace moerail::test::ep_gpu {
namespace {

// FP8 dispatch, for each recipe: recv and recv_scales are the reference's quantize_fp8 of each source row, moved to
// the reference plan's rows, bit for bit (Block1x128: f32 scales; Mx1x32: E8M0 bytes; PerTensor: the given scale, no
// scales moved); pad rows zero bytes with the scale of a zero block; recv_probs as dispatch; rows past rows_used
// untouched; the bf16 ops that follow (combine, backward) use the FP8 dispatch's plan. Eager first, then one
// captured graph replayed with new routings and token counts. H = 640: five 128-column groups per row (20 scale
// bytes), so the staged row's scale part is padded.
constexpr float kTensorScale = 0.015625f;  // PerTensor: 2^-6, the same on every rank

// Bytes of one row of recv_scales (0: PerTensor, whose recv_scales is the [1] scale, read).
std::int64_t scale_row_bytes(Fp8Scaling sc, std::int64_t H) {
  return sc == Fp8Scaling::PerTensor ? 0 : H / fp8_scale_block_cols(sc) * std::int64_t(dtype_size(fp8_scale_dtype(sc)));
}

int compare_fp8(const Case& c, const Expected& e, const Step& st, Buffers& b, const DeviceTensor& recv8,
                const DeviceTensor& scales, std::int64_t capacity, Fp8Scaling sc, int me);

// As rank comm.rank(), with c.transport; graph: the steps after the first replay one captured graph. given: the rows
// are quantized first (quantize_fp8) and dispatched as e4m3 q with q_scales, moved as bytes; the result must be the
// same.
void run_fp8_steps_on(Communicator& comm, const Case& c, const std::vector<std::vector<std::int64_t>>& tokens,
                      std::uint64_t seed, Fp8Scaling sc, bool given, bool graph) {
  SCOPED_TRACE(std::string("recipe ") + std::string(fp8_scaling_name(sc)) + (given ? ", rows given in FP8" : ""));
  const int R = comm.size(), me = comm.rank();
  const MoeConfig cfg = config_of(c, R);
  Dispatcher d(cfg, comm, options_of(c));
  const std::int64_t capacity = d.capacity(), H = c.H;
  Buffers b(c, capacity);
  DeviceTensor recv8(DType::F8E4M3, {capacity, H});
  DeviceTensor scales = sc == Fp8Scaling::PerTensor
                            ? DeviceTensor(DType::F32, {1})
                            : DeviceTensor(fp8_scale_dtype(sc), {capacity, H / fp8_scale_block_cols(sc)});
  DeviceTensor q(DType::F8E4M3, {c.t_max, H});
  DeviceTensor q_scales(fp8_scale_dtype(sc), {c.t_max, sc == Fp8Scaling::PerTensor ? 1 : H / fp8_scale_block_cols(sc)});
  cudaStream_t stream;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  auto step = [&] {
    EpDispatchFp8Args a{b.x.view(), b.topk.view(), b.probs.view(), b.num_tokens.view(), recv8.view(), scales.view(),
                        b.recv_probs.view(), sc};
    if (given) {
      const bool per_tensor = sc == Fp8Scaling::PerTensor;
      quantize_fp8({sc, b.x.view(), b.num_tokens.view(), q.view(), per_tensor ? scales.view() : q_scales.view()},
                   stream);
      a.x = {};
      a.q = q.view();
      if (!per_tensor) a.q_scales = q_scales.view();
    }
    d.dispatch_fp8(a, stream);
    d.combine({c.mode, b.y.view(), b.out.view()}, stream);
  };
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const Step st = draw(c, R, capacity, seed + i, tokens[i], Routing::Random);
    b.upload(st, me);
    recv8.poison();
    if (sc == Fp8Scaling::PerTensor)
      scales.from_vector(std::vector<float>{kTensorScale});
    else
      scales.poison();
    if (i == 0 || !graph) {
      step();
    } else {
      if (!exec) {
        testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
        step();
        testing::cuda_ok(cudaStreamEndCapture(stream, &g), "capture");
        testing::cuda_ok(cudaGraphInstantiate(&exec, g, 0), "instantiate");
      }
      testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
    }
    testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
    EXPECT_NO_THROW(d.check(stream)) << "step " << i << ", rank " << me;
    const Expected e = reference(c, cfg, st, capacity, d.peer_rows());
    EXPECT_EQ(compare_fp8(c, e, st, b, recv8, scales, capacity, sc, me), 0)
        << "step " << i << ", tokens per rank " << ::testing::PrintToString(st.tokens);
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (g) cudaGraphDestroy(g);
  cudaStreamDestroy(stream);
}

int compare_fp8(const Case& c, const Expected& e, const Step& st, Buffers& b, const DeviceTensor& recv8,
                const DeviceTensor& scales, std::int64_t capacity, Fp8Scaling sc, int me) {
  const int R = int(e.plan.num_ranks);
  const std::int64_t H = c.H, SB = scale_row_bytes(sc, H);
  const std::int64_t cols = sc == Fp8Scaling::PerTensor ? 1 : H / fp8_scale_block_cols(sc);
  const DType sdt = fp8_scale_dtype(sc);
  int bad = 0;
  auto report = [&](const std::string& what) {
    if (++bad <= 8) ADD_FAILURE() << "rank " << me << ": " << what;
  };
  // expected rows: quantize every source rank's rows, then place them where the plan says
  HostTensor want(DType::F8E4M3, {capacity, H});
  std::vector<std::uint8_t> want_s(std::size_t(capacity * SB), 0xff);  // = poison: rows nobody writes
  std::memset(want.view().data(), 0xff, std::size_t(capacity * H));
  auto* wq = static_cast<std::uint8_t*>(want.view().data());
  for (int src = 0; src < R; ++src) {
    const std::int64_t T = st.tokens[std::size_t(src)], T1 = std::max<std::int64_t>(T, 1);
    HostTensor q(DType::F8E4M3, {T1, H});
    HostTensor qs = sc == Fp8Scaling::PerTensor ? HostTensor(DType::F32, {1}) : HostTensor(sdt, {T1, cols});
    if (sc == Fp8Scaling::PerTensor) qs.set_f(0, kTensorScale);
    if (T > 0)
      ref::quantize_fp8(sc, rows_of(st.x[std::size_t(src)], T), TensorView(q.view().data(), DType::F8E4M3, {T, H}),
                        sc == Fp8Scaling::PerTensor ? qs.view() : TensorView(qs.view().data(), sdt, {T, cols}));
    for (std::int64_t slot = 0; slot < T * c.K; ++slot) {
      if (e.plan.dest_rank[std::size_t(src)][std::size_t(slot)] != me) continue;
      const std::int64_t row = e.plan.dest_row[std::size_t(src)][std::size_t(slot)], t = slot / c.K;
      std::memcpy(wq + row * H, static_cast<const std::uint8_t*>(q.view().data()) + t * H, std::size_t(H));
      if (SB > 0)
        std::memcpy(want_s.data() + row * SB, static_cast<const std::uint8_t*>(qs.view().data()) + t * SB,
                    std::size_t(SB));
    }
  }
  const std::int64_t L = e.plan.local_experts;
  for (std::int64_t j = 0; j < L; ++j) {  // pad rows of this rank's segments
    const std::size_t eg = std::size_t(me * L + j);
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
  const std::int64_t rows_used = e.plan.rows_used[std::size_t(me)];
  for (std::int64_t row = 0; row < rows_used; ++row)
    if (std::memcmp(static_cast<const char*>(got_p.view().data()) + row * 4,
                    static_cast<const char*>(e.recv_probs[std::size_t(me)].view().data()) + row * 4, 4) != 0)
      report("recv_probs[" + std::to_string(row) + "] = " + std::to_string(got_p.f(row)) + ", expected " +
             std::to_string(e.recv_probs[std::size_t(me)].f(row)));
  // combine after the FP8 dispatch runs on its plan
  HostTensor out(DType::BF16, {c.t_max, c.H});
  b.out.download(out);
  const std::int64_t T = st.tokens[std::size_t(me)];
  for (std::int64_t i = 0; i < T * c.H; ++i) {
    const double bound = std::ldexp(e.out_abs[std::size_t(me)].f(i), -7) + 1e-6;
    if (!(std::fabs(out.f(i) - e.out[std::size_t(me)].f(i)) <= bound)) {
      report("out[" + std::to_string(i / c.H) + "," + std::to_string(i % c.H) + "] = " + std::to_string(out.f(i)) +
             ", expected " + std::to_string(e.out[std::size_t(me)].f(i)));
      break;
    }
  }
  return bad;
}

class EpFp8 : public Ep {
 protected:
  void run_fp8_steps(Case c, const std::vector<std::vector<std::int64_t>>& tokens, std::uint64_t seed, Fp8Scaling sc,
                     bool given = false) {
    c.transport = GetParam();
    run_fp8_steps_on(*g_comm, c, tokens, seed, sc, given, true);
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

// Rows the caller quantized (q and q_scales instead of x) land exactly as the rows quantized at the source.
TEST_P(EpFp8, GivenFp8RowsMovedAsBytesEagerAndGraph) {
  Case c;
  c.H = 640;
  c.A = 32;
  std::vector<std::vector<std::int64_t>> steps{tokens({64, 37}), tokens({0, 50}), tokens({5, 64}), tokens({31, 17})};
  for (Fp8Scaling sc : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32, Fp8Scaling::PerTensor})
    run_fp8_steps(c, steps, 850, sc, true);
  c.H = 4224;  // 33 scale words per row: more than one per lane
  c.E = 16;
  c.K = 8;
  c.t_max = 32;
  run_fp8_steps(c, {tokens({32, 20}), tokens({9, 32})}, 950, Fp8Scaling::Block1x128, true);
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

// The same over 2 to 4 in-process ranks (LoopbackGroup) on this GPU, both transports (the host API's staging of
// each recipe's rows and scale words for the peers a token goes to; on NVLink also one captured graph's replays).
TEST(EpFp8Loopback, EachRecipeQuantizedAtTheSourceOrGiven) {
  MOERAIL_REQUIRE_GPU();
  for (const Transport t : {Transport::HostApi, Transport::NvLink}) {
    for (int R = 2; R <= 4; ++R) {
      SCOPED_TRACE(std::to_string(R) + " in-process ranks, " + std::string(transport_name(t)));
      Case c;
      c.H = 640;
      c.A = 32;
      c.E = 12;
      c.transport = t;
      std::vector<std::vector<std::int64_t>> steps{{64, 37, 0, 5}, {0, 50, 64, 64}, {31, 17, 2, 0}};
      for (auto& n : steps) n.resize(std::size_t(R));
      run_ranks(R, [&](Communicator& comm) {
        for (Fp8Scaling sc : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32, Fp8Scaling::PerTensor}) {
          run_fp8_steps_on(comm, c, steps, 800, sc, false, t == Transport::NvLink);
          run_fp8_steps_on(comm, c, steps, 850, sc, true, t == Transport::NvLink);
        }
      });
    }
  }
}

// Hierarchical transfers (DispatchOptions::ranks_per_node): the staged e4m3 rows and their scale words cross
// between nodes once per (token, remote node) and are forwarded inside the node; the results as on the flat path.
TEST(EpFp8Loopback, EachRecipeThroughNodes) {
  MOERAIL_REQUIRE_GPU();
  for (const auto& [R, G] : {std::pair{4, 2}, std::pair{4, 1}, std::pair{6, 3}}) {
    SCOPED_TRACE(std::to_string(R) + " in-process ranks, " + std::to_string(G) + " per node");
    Case c;
    c.H = 640;
    c.A = 32;
    c.E = 12;
    c.transport = Transport::HostApi;
    c.ranks_per_node = G;
    std::vector<std::vector<std::int64_t>> steps{{64, 37, 0, 5, 20, 64}, {0, 50, 64, 64, 3, 1}};
    for (auto& n : steps) n.resize(std::size_t(R));
    run_ranks(R, [&](Communicator& comm) {
      for (Fp8Scaling sc : {Fp8Scaling::Block1x128, Fp8Scaling::Mx1x32, Fp8Scaling::PerTensor}) {
        run_fp8_steps_on(comm, c, steps, 860, sc, false, false);
        run_fp8_steps_on(comm, c, steps, 870, sc, true, false);
      }
    });
  }
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
  a = args(recv8, scales);
  DeviceTensor q(DType::F8E4M3, {c.t_max, c.H}), q_scales(DType::F32, {c.t_max, c.H / 128});
  a.q = q.view();
  a.q_scales = q_scales.view();
  refused(a, "both x and q", "x and q together");
  a.x = {};
  a.q_scales = {};
  refused(a, "q_scales has shape", "q without its scales");
  a.q_scales = q_scales.view();
  a.q = b.x.view();
  refused(a, "q has dtype", "a bf16 q");
  a.x = {};
  a.q = {};
  refused(a, "neither x nor q", "no source rows");
  DeviceTensor mx(kE8M0ScaleDType, {capacity + 4, c.H / 32});
  a = args(recv8, scales);
  a.recv_scales = TensorView(static_cast<char*>(mx.data()) + 1, kE8M0ScaleDType, {capacity, c.H / 32},
                             mx.view().device());
  a.scaling = Fp8Scaling::Mx1x32;
  refused(a, "4-byte aligned", "misaligned MXFP8 scales");
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Transports, EpFp8, ::testing::Values(Transport::NvLink, Transport::HostApi),
                         [](const auto& info) { return std::string(transport_name(info.param)); });

}  // namespace moerail::test::ep_gpu
