// GPU tests of the grouped expert MLP's weight gradients beyond the plain call: accumulated into bf16 or fp32
// gradients (Megatron's main_grad), the weight converters, GEMMs on fewer SMs, chunked weight gradients, and the
// argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdlib>

#include "experts/mlp_harness.h"
#include "experts/setup.h"

namespace moerail::testing::mlp {
namespace {

std::vector<std::int64_t> shape_of(const TensorView& v) {
  std::vector<std::int64_t> s;
  for (int d = 0; d < v.ndim(); ++d) s.push_back(v.size(d));
  return s;
}

// The accumulating weight-gradient tests' case: shapes of several tiles and k-tiles, a partial last tile, empty
// experts and an expert of one row, both biases; random old gradients of `dtype`, and the reference's accumulation
// into them (RefOutputs in f32: old + f32(g)).
struct AccumulationCase {
  MoeConfig cfg = small_config(Activation::SwiGLU, 6, 384, 192);
  std::vector<std::int64_t> counts = {37, 0, 200, 1, 0, 64};
  std::int64_t rows = 330;
  HostInputs in;
  RefOutputs ref;
  std::vector<HostTensor> old;  // dw1, db1, dw2, db2 before the accumulating call
  static constexpr const char* kNames[] = {"dw1", "db1", "dw2", "db2"};

  AccumulationCase(DType dtype, std::uint64_t seed) {
    cfg.fc1_bias = cfg.fc2_bias = true;
    in = make_inputs(cfg, rows, seed);
    ref = run_reference(cfg, in, counts);
    Rng rng(seed + 1000);
    for (HostTensor* t : ref_grads()) {
      old.emplace_back(dtype, shape_of(t->view()));
      ref::fill_normal(old.back(), rng, 0.5);
      for (std::int64_t j = 0; j < t->numel(); ++j) t->set_f(j, old.back().f(j));
    }
    ref::ExpertsBackwardArgs ba = reference_backward_args(cfg, in, counts);
    ba.grads = {ref.dw1.view(), ref.db1.view(), ref.dw2.view(), ref.db2.view(), true};
    ref::experts_backward(cfg, ba);
  }
  std::array<HostTensor*, 4> ref_grads() { return {&ref.dw1, &ref.db1, &ref.dw2, &ref.db2}; }
};

// The weight gradients of `run` written (accumulate = false) or added: backward() with grads, or (delayed)
// backward() then backward_dw().
void weight_gradient_call(GroupedMlp& mlp, const GpuRun& run, bool delayed, bool accumulate, cudaStream_t stream) {
  if (delayed) {
    MlpBackwardDwArgs a = run.backward_dw_args();
    a.grads.accumulate = accumulate;
    mlp.backward(run.backward_args(false), stream);
    mlp.backward_dw(a, stream);
  } else {
    MlpBackwardArgs a = run.backward_args(true);
    a.grads.accumulate = accumulate;
    mlp.backward(a, stream);
  }
}

// `old` (dw1, db1, dw2, db2) into run's gradient tensors, and into the per-expert ones a per-expert run reads.
void upload_gradients(const GpuRun& run, const std::vector<HostTensor>& old, cudaStream_t stream) {
  const DeviceTensor* grads[] = {&run.dw1, &run.db1, &run.dw2, &run.db2};
  for (std::size_t i = 0; i < 4; ++i) grads[i]->upload(old[i]);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  if (run.per_expert) {
    split_grouped_weights(run.dw1.view(), run.v_dw1, stream);
    split_grouped_weights(run.db1.view(), run.v_db1, stream);
    split_grouped_weights(run.dw2.view(), run.v_dw2, stream);
    split_grouped_weights(run.db2.view(), run.v_db2, stream);
  }
}

std::array<const HostTensor*, 4> weight_gradients(const GpuOutputs& o) { return {&o.dw1, &o.db1, &o.dw2, &o.db2}; }

// Accumulated weight gradients (MlpGrads::accumulate): every element of dW1, dW2, db1 and db2 becomes
// bf16(old + g) bit for bit, g being what the same call writes without accumulating (so an expert without rows
// keeps its old gradients), and the reference's accumulation agrees. backward() with grads and the delayed
// backward_dw(), grouped and per-expert gradient tensors, the grouped weight gradients (contiguous GEMMs off) for
// the call that writes g.
TEST(ExpertsMlp, AccumulatedWeightGradients) {
  MOERAIL_REQUIRE_GPU();
  AccumulationCase k(DType::BF16, 77);
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const bool per_expert : {false, true})
    for (const bool delayed : {false, true}) {
      SCOPED_TRACE(std::string(per_expert ? "per-expert" : "grouped") + (delayed ? ", backward_dw" : ", backward"));
      MlpOptions mo;
      mo.rows_hint = k.rows;
      mo.contiguous_gemms = MlpContiguous::Off;  // g from the grouped weight gradients
      GroupedMlp mlp(k.cfg, mo);
      GpuRun run(k.cfg, k.in, k.counts, false, per_expert, stream);
      run.poison_outputs();
      mlp.forward(run.forward_args(), stream);
      weight_gradient_call(mlp, run, delayed, false, stream);
      const GpuOutputs fresh = run.results(stream);
      upload_gradients(run, k.old, stream);
      weight_gradient_call(mlp, run, delayed, true, stream);
      const GpuOutputs got = run.results(stream);
      for (std::size_t i = 0; i < 4; ++i) {
        HostTensor want(DType::BF16, shape_of(k.old[i].view()));
        for (std::int64_t j = 0; j < want.numel(); ++j)
          want.set_f(j, k.old[i].f(j) + weight_gradients(fresh)[i]->f(j));
        expect_same_bits(AccumulationCase::kNames[i], *weight_gradients(got)[i], want);
        expect_close_per_expert(AccumulationCase::kNames[i], *weight_gradients(got)[i], *k.ref_grads()[i],
                                k.cfg.local_experts());
      }
    }
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

// fp32 weight gradients (MlpGrads of f32 tensors: Megatron-LM's fp32 main_grad). Written, they are the GEMMs'
// fp32 sums: rounded to bf16, the bf16 gradients of the same call bit for bit. Accumulated, every element becomes
// old + g in fp32, bit for bit, and the reference's fp32 accumulation agrees. Grouped and per-expert tensors,
// backward() and backward_dw(), the case of AccumulatedWeightGradients. A mix of bf16 and fp32 gradients is
// refused, naming the tensor.
TEST(ExpertsMlp, Fp32WeightGradients) {
  MOERAIL_REQUIRE_GPU();
  AccumulationCase k(DType::F32, 78);
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  MlpOptions mo;
  mo.rows_hint = k.rows;
  GroupedMlp mlp(k.cfg, mo);
  // The bf16 gradients of the same inputs.
  GpuRun bf16_run(k.cfg, k.in, k.counts, false, false, stream);
  bf16_run.poison_outputs();
  mlp.forward(bf16_run.forward_args(), stream);
  weight_gradient_call(mlp, bf16_run, false, false, stream);
  const GpuOutputs bf16 = bf16_run.results(stream);

  for (const bool per_expert : {false, true})
    for (const bool delayed : {false, true}) {
      SCOPED_TRACE(std::string(per_expert ? "per-expert" : "grouped") + (delayed ? ", backward_dw" : ", backward"));
      GpuRun run(k.cfg, k.in, k.counts, false, per_expert, stream, DType::F32);
      run.poison_outputs();
      mlp.forward(run.forward_args(), stream);
      weight_gradient_call(mlp, run, delayed, false, stream);
      const GpuOutputs fresh = run.results(stream);
      for (std::size_t i = 0; i < 4; ++i) {
        const HostTensor& g = *weight_gradients(fresh)[i];
        ASSERT_EQ(g.dtype(), DType::F32) << AccumulationCase::kNames[i];
        HostTensor rounded(DType::BF16, shape_of(k.old[i].view()));
        for (std::int64_t j = 0; j < rounded.numel(); ++j) rounded.set_f(j, g.f(j));
        expect_same_bits(AccumulationCase::kNames[i], rounded, *weight_gradients(bf16)[i]);
      }
      upload_gradients(run, k.old, stream);
      weight_gradient_call(mlp, run, delayed, true, stream);
      const GpuOutputs got = run.results(stream);
      for (std::size_t i = 0; i < 4; ++i) {
        HostTensor want(DType::F32, shape_of(k.old[i].view()));
        for (std::int64_t j = 0; j < want.numel(); ++j)  // one fp32 add, rounded to nearest
          want.set_f(j, float(k.old[i].f(j)) + float(weight_gradients(fresh)[i]->f(j)));
        expect_same_bits(AccumulationCase::kNames[i], *weight_gradients(got)[i], want);
        expect_close_per_expert(AccumulationCase::kNames[i], *weight_gradients(got)[i], *k.ref_grads()[i],
                                k.cfg.local_experts());
      }
    }

  // No rows at all (an x of 0 rows): fp32 gradients of exact zeros over the poison.
  {
    GpuRun none(k.cfg, make_inputs(k.cfg, 0, 79), std::vector<std::int64_t>(k.counts.size(), 0), false, false,
                stream, DType::F32);
    none.poison_outputs();
    mlp.backward_dw(none.backward_dw_args(), stream);
    const GpuOutputs z = none.results(stream);
    for (std::size_t i = 0; i < 4; ++i) {
      const HostTensor& t = *weight_gradients(z)[i];
      for (std::int64_t j = 0; j < t.numel(); ++j)
        ASSERT_EQ(t.f(j), 0.0) << AccumulationCase::kNames[i] << " element " << j;
    }
  }

  // bf16 dW1 with fp32 dW2: refused, naming dW2.
  GpuRun mixed(k.cfg, k.in, k.counts, false, false, stream, DType::F32);
  mlp.forward(mixed.forward_args(), stream);
  MlpBackwardArgs a = mixed.backward_args(true);
  a.grads.dw1 = bf16_run.dw1.view();
  expect_error_mentions([&] { mlp.backward(a, stream); }, "grads.dw2");
  MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertsMlp, WeightConvertersRoundTrip) {
  MOERAIL_REQUIRE_GPU();
  const std::int64_t L = 5, R = 24, C = 40;
  Rng rng(7);
  HostTensor host(DType::BF16, {L, R, C});
  ref::fill_normal(host, rng, 1.0);
  DeviceTensor grouped(host), back(DType::BF16, {L, R, C});
  std::vector<DeviceTensor> parts;
  std::vector<TensorView> views;
  for (std::int64_t e = 0; e < L; ++e) parts.emplace_back(DType::BF16, std::vector<std::int64_t>{R, C});
  for (const DeviceTensor& p : parts) views.push_back(p.view());
  split_grouped_weights(grouped.view(), views, nullptr);
  stack_grouped_weights(views, back.view(), nullptr);
  MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
  const HostTensor out = back.download();
  EXPECT_EQ(std::memcmp(out.view().data(), host.view().data(), host.view().nbytes()), 0);
  const HostTensor third = parts[3].download();
  EXPECT_EQ(std::memcmp(third.view().data(), static_cast<const char*>(host.view().data()) + 3 * R * C * 2,
                        std::size_t(R * C * 2)),
            0);
  // A per-expert list of the wrong length is rejected, naming the argument.
  try {
    split_grouped_weights(grouped.view(), std::span<const TensorView>(views.data(), 4), nullptr);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("per-expert"), std::string::npos) << e.what();
  }
}

// MlpOptions::sms caps the persistent grids (here to 2 of 8 SMs' clusters: many tiles per CTA); the bits do not move.
TEST(ExpertsMlp, GemmsOnFewerSmsGiveTheSameBits) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::SwiGLU, 6, 384, 320);
  const std::vector<std::int64_t> counts = {256, 0, 100, 384, 1, 300};
  for (MlpContiguous contig : {MlpContiguous::Off, MlpContiguous::On}) {
    GpuOptions all, few;
    all.mlp.contiguous_gemms = few.mlp.contiguous_gemms = contig;
    few.mlp.sms = 8;
    const GpuOutputs a = run_case(cfg, counts, 1100, all);
    const GpuOutputs b = run_case(cfg, counts, 1100, few);
    expect_same_y_dx_dw(a, b);
  }
  MlpOptions bad;
  bad.sms = -1;
  expect_error_mentions([&] { GroupedMlp m(cfg, bad); }, "options.sms = -1");
}

// Chunked weight gradients (MlpBackwardDwArgs::chunk_rows, MoeLayer's chunked step): each expert's rows split over
// C regions of one buffer, each region laid out by its own counts, NaN poison in every row no segment holds. Against
// the same rows back to back in one region (a reference-checked run of the contiguous kernels): bit for bit where
// every region's segments are whole 64-row k-tiles (the same products in the same k-tiles, the bias sums' rows in
// the same lanes), within the bf16 tolerance otherwise; experts without rows anywhere get exact zeros.
struct ChunkedWgradCase {
  std::vector<std::vector<std::int64_t>> counts;  // [C][L]
  std::int64_t region_rows;
  bool whole_k_tiles;
};

// One case of the chunked weight gradients: the rows back to back in one region (forward and backward, checked
// against the reference when `check_reference`), then the same rows moved into the case's regions and their weight
// gradients compared with the back-to-back run's. The GroupedMlp is built here, so MOERAIL_CONTIG_WALK applies.
void check_chunked_wgrad(const MoeConfig& cfg, const MlpOptions& mo, const ChunkedWgradCase& k, bool check_reference,
                         cudaStream_t stream) {
  const std::int64_t L = cfg.num_experts, H = cfg.hidden, F = cfg.ffn_hidden, F1 = cfg.fc1_out();
  GroupedMlp mlp(cfg, mo);
  {
    const std::int64_t C = std::int64_t(k.counts.size()), R = k.region_rows;
    std::vector<std::int64_t> totals(std::size_t(L), 0);
    for (const auto& region : k.counts)
      for (std::int64_t e = 0; e < L; ++e) totals[std::size_t(e)] += region[std::size_t(e)];
    const std::int64_t used = std::accumulate(totals.begin(), totals.end(), std::int64_t(0));

    // The rows back to back: forward, backward with the weight gradients (checked against the reference).
    const HostInputs in = make_inputs(cfg, used + 16, 99);
    GpuRun run(cfg, in, totals, false, false, stream);
    run.poison_outputs();
    mlp.forward(run.forward_args(), stream);
    mlp.backward(run.backward_args(true), stream);
    const GpuOutputs want = run.results(stream);
    if (check_reference) compare(cfg, want, run_reference(cfg, in, totals), totals);
    const HostTensor d_h1 = run.d_h1.download();

    // The same rows in C regions: row i of expert e's part in region c moves from (start of e) + (e's rows in
    // regions before c) + i to c R + (start of e in region c) + i.
    const std::int64_t rows = C * R + 8;
    HostTensor x(DType::BF16, {rows, H}), probs(DType::F32, {rows}), act(DType::BF16, {rows, F});
    HostTensor dy(DType::BF16, {rows, H}), dh1(DType::BF16, {rows, F1}), counts(DType::I32, {C, L});
    for (const HostTensor* t : {&x, &probs, &act, &dy, &dh1}) t->fill_nan();
    auto move_row = [](const HostTensor& from, std::int64_t src, const HostTensor& to, std::int64_t dst) {
      const std::int64_t bytes = from.view().nbytes() / from.view().size(0);
      std::memcpy(static_cast<char*>(to.view().data()) + dst * bytes,
                  static_cast<const char*>(from.view().data()) + src * bytes, std::size_t(bytes));
    };
    std::vector<std::int64_t> done(std::size_t(L), 0), expert_start(std::size_t(L), 0);
    for (std::size_t e = 1; e < std::size_t(L); ++e) expert_start[e] = expert_start[e - 1] + totals[e - 1];
    for (std::int64_t c = 0; c < C; ++c) {
      std::int64_t at = c * R;
      for (std::int64_t e = 0; e < L; ++e) {
        const std::int64_t n = k.counts[std::size_t(c)][std::size_t(e)];
        counts.set_i(c * L + e, n);
        for (std::int64_t i = 0; i < n; ++i) {
          const std::int64_t src = expert_start[std::size_t(e)] + done[std::size_t(e)] + i;
          move_row(in.x, src, x, at + i);
          move_row(in.probs, src, probs, at + i);
          move_row(want.act, src, act, at + i);
          move_row(in.dy, src, dy, at + i);
          move_row(d_h1, src, dh1, at + i);
        }
        done[std::size_t(e)] += n;
        at += n;
      }
      ASSERT_LE(at, (c + 1) * R) << "region " << c << " overflows its rows";
    }
    const DeviceTensor dx_(x), dprobs(probs), dact(act), ddy(dy), ddh1(dh1), dcounts(counts);
    const DeviceTensor dw1(DType::BF16, {L, F1, H}), dw2(DType::BF16, {L, H, F});
    const DeviceTensor db1(DType::BF16, {L, F1}), db2(DType::BF16, {L, H});
    MOERAIL_CUDA_CHECK(cudaDeviceSynchronize());
    MlpBackwardDwArgs a;
    a.x = dx_.view();
    a.probs = dprobs.view();
    a.counts = dcounts.view();
    a.act = dact.view();
    a.dy = ddy.view();
    a.d_h1 = ddh1.view();
    a.grads.dw1 = dw1.view();
    a.grads.dw2 = dw2.view();
    a.grads.db1 = db1.view();
    a.grads.db2 = db2.view();
    a.chunk_rows = R;
    mlp.backward_dw(a, stream);
    MOERAIL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const HostTensor got_dw1 = dw1.download(), got_dw2 = dw2.download();
    const HostTensor got_db1 = db1.download(), got_db2 = db2.download();
    if (k.whole_k_tiles) {
      expect_same_bits("dw1", want.dw1, got_dw1);
      expect_same_bits("dw2", want.dw2, got_dw2);
      expect_same_bits("db1", want.db1, got_db1);
      expect_same_bits("db2", want.db2, got_db2);
    } else {
      expect_close_per_expert("dw1", got_dw1, want.dw1, L);
      expect_close_per_expert("dw2", got_dw2, want.dw2, L);
      expect_close_per_expert("db1", got_db1, want.db1, L);
      expect_close_per_expert("db2", got_db2, want.db2, L);
    }
    for (std::int64_t e = 0; e < L; ++e) {
      if (totals[std::size_t(e)] != 0) continue;
      expect_zero("dw1", got_dw1, e * F1 * H, F1 * H);
      expect_zero("dw2", got_dw2, e * H * F, H * F);
      expect_zero("db1", got_db1, e * F1, F1);
      expect_zero("db2", got_db2, e * H, H);
    }

    // Bad chunking is named.
    MlpBackwardDwArgs bad = a;
    bad.counts = run.counts.view();  // [L]
    expect_error_mentions([&] { mlp.backward_dw(bad, stream); }, "counts must be [C, L]");
    bad = a;
    bad.chunk_rows = R + 8;  // C (R + 8) > rows
    expect_error_mentions([&] { mlp.backward_dw(bad, stream); }, "chunk_rows");
  }
}

TEST(ExpertsMlp, ChunkedWeightGradients) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::SwiGLU, 6, 384, 320);  // M = 384, 640: odd m tiles in clusters of 2
  cfg.fc1_bias = cfg.fc2_bias = true;
  cfg.prob_mode = ProbMode::InActivation;  // db2 weighs the rows by their probs
  MlpOptions mo;
  mo.contiguous_gemms = MlpContiguous::On;
  mo.rows_hint = 1024;
  const std::vector<ChunkedWgradCase> cases = {
      {{{64, 0, 128, 64, 0, 192}, {128, 0, 64, 0, 0, 64}}, 512, true},
      {{{64, 0, 0, 0, 0, 0}, {0, 0, 64, 0, 0, 0}, {0, 0, 0, 0, 0, 128}}, 200, true},  // one region per expert
      {{{37, 0, 100, 1, 0, 5}, {0, 0, 65, 128, 0, 3}, {200, 0, 0, 7, 0, 64}}, 320, false},
  };
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const ChunkedWgradCase& k : cases) {
    SCOPED_TRACE(::testing::PrintToString(k.counts));
    check_chunked_wgrad(cfg, mo, k, true, stream);
  }
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

// The chunked weight gradient with many tiles per CTA, under both walks: 64 experts in three regions, dW1 [512,
// 512] and dW2 [512, 256] per expert (512 and 256 work units for ~66 resident clusters), so each consumer
// warpgroup computes several tiles, each over the expert's segments region after region and starting where its
// partner's tile ended in the pipeline. Every region's segments are whole 64-row k-tiles (some empty, some experts
// in one region only), so both walks must give the bits of the rows back to back in one region.
TEST(ExpertsMlp, ChunkedWeightGradientsWithManyTilesPerCta) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig cfg = small_config(Activation::SwiGLU, 64, 512, 256);
  cfg.fc1_bias = cfg.fc2_bias = true;  // the bias gradients' row sums over the regions too
  cfg.prob_mode = ProbMode::InActivation;
  MlpOptions mo;
  mo.contiguous_gemms = MlpContiguous::On;
  mo.rows_hint = 20480;  // the three regions' rows: the contiguous kernels take every call
  // ~6400 rows in each region
  ChunkedWgradCase k{std::vector<std::vector<std::int64_t>>(3, std::vector<std::int64_t>(64)), 6656, true};
  const std::int64_t lengths[] = {0, 64, 128, 192, 64, 0, 256};
  for (std::size_t c = 0; c < 3; ++c)
    for (std::size_t e = 0; e < 64; ++e) k.counts[c][e] = lengths[(e * 3 + c * 5 + e / 7) % 7];
  cudaStream_t stream = nullptr;
  MOERAIL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const char* walk : {"dynamic", "static"}) {
    SCOPED_TRACE(walk);
    const ScopedWalk scoped(walk);
    check_chunked_wgrad(cfg, mo, k, false, stream);
  }
  MOERAIL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertsMlp, ArgumentErrorsNameTheArgument) {
  MOERAIL_REQUIRE_GPU();
  MoeConfig bad = small_config(Activation::SwiGLU, 4, 100, 128);  // H = 100: not a multiple of 8
  expect_error_mentions([&] { GroupedMlp m(bad); }, "cfg.hidden = 100");
  MoeConfig bad_f = small_config(Activation::SwiGLU, 4, 128, 20);
  expect_error_mentions([&] { GroupedMlp m(bad_f); }, "cfg.ffn_hidden = 20");

  MoeConfig cfg = small_config(Activation::SwiGLU, 4);
  GroupedMlp mlp(cfg);
  const HostInputs in = make_inputs(cfg, 64, 3);
  GpuRun run(cfg, in, {16, 16, 16, 16}, false, false, nullptr);
  MlpForwardArgs a = run.forward_args();
  a.counts = TensorView(run.counts.data(), DType::I32, {3}, Device::cuda(cuda::current_device()));
  expect_error_mentions([&] { mlp.forward(a, nullptr); }, "counts");
  a = run.forward_args();
  a.probs = TensorView();
  expect_error_mentions([&] { mlp.forward(a, nullptr); }, "probs is absent");
  a = run.forward_args();
  a.h1 = run.act.view();  // [rows, F] instead of [rows, 2F]
  expect_error_mentions([&] { mlp.forward(a, nullptr); }, "h1 has shape");
  MlpBackwardArgs b = run.backward_args(true);
  b.workspace = TensorView(run.workspace.data(), DType::BF16, {8}, Device::cuda(cuda::current_device()));
  expect_error_mentions([&] { mlp.backward(b, nullptr); }, "workspace has");
}

}  // namespace
}  // namespace moerail::testing::mlp
