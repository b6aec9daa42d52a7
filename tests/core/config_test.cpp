#include <gtest/gtest.h>

#include "moerail/config.h"
#include "moerail/error.h"

namespace moerail {
namespace {

TEST(Config, DefaultsAndPresetsValidate) {
  MoeConfig{}.validate();
  for (const char* name : {"small", "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"}) preset_config(name).validate();
}

TEST(Config, ReportsEveryProblemAtOnce) {
  MoeConfig c;
  c.num_experts = 10;
  c.ep_size = 4;   // 10 % 4 != 0
  c.topk = 11;     // K > E
  c.align = 24;    // not a power of two
  c.hidden = 0;    // not positive
  try {
    c.validate();
    FAIL() << "validate() accepted a bad configuration";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(msg.find("hidden = 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("topk = 11 but num_experts = 10"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not a multiple of ep_size = 4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("align = 24"), std::string::npos) << msg;
  }
}

TEST(Config, RejectsBadRouterAndLayoutOptions) {
  auto rejects = [](auto mutate, const char* needle) {
    MoeConfig c;
    mutate(c);
    try {
      c.validate();
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  rejects([](MoeConfig& c) { c.router.num_groups = 3; }, "does not divide num_experts");
  rejects([](MoeConfig& c) { c.router.num_groups = 4; c.router.group_topk = 5; }, "group_topk");
  rejects([](MoeConfig& c) { c.router.use_expert_bias = true; }, "use_expert_bias");
  rejects([](MoeConfig& c) { c.glu_layout = GluLayout::Interleaved; c.glu_block = 7; }, "glu_block = 7");
  rejects([](MoeConfig& c) { c.capacity = Capacity::of_factor(0); }, "capacity factor");
  rejects([](MoeConfig& c) { c.capacity = Capacity::per_expert(-1); }, "capacity factor = -1");
  rejects([](MoeConfig& c) { c.max_tokens = -1; }, "max_tokens = -1");
  rejects([](MoeConfig& c) { c.ffn_hidden = 0; }, "ffn_hidden = 0");
}

TEST(Config, RowsPerRankFollowsTheCapacityPolicy) {
  MoeConfig c;
  c.num_experts = 16; c.ep_size = 4; c.topk = 8; c.max_tokens = 100; c.align = 16;
  // WorstCase: R * T_max * min(K, L) + L * (A - 1) = 4*100*4 + 4*15
  EXPECT_EQ(c.rows_per_rank(), 4 * 100 * 4 + 4 * 15);
  c.capacity = Capacity::of_factor(1.5);  // ceil(1.5 * 100 * 8) + 60
  EXPECT_EQ(c.rows_per_rank(), 1200 + 60);
  EXPECT_EQ(c.expert_rows(), 0);  // no per-expert bound
  // PerExpert: ceil(c * R * T_max * K / E) rounded up to A, L of them: ceil(1.25 * 4*100*8 / 16) = 250 -> 256
  c.capacity = Capacity::per_expert(1.25);
  EXPECT_EQ(c.expert_rows(), 256);
  EXPECT_EQ(c.rows_per_rank(), 4 * 256);
  EXPECT_EQ(c.capacity.str(), "per-expert(1.25)");
  c.capacity = Capacity::per_expert(0.001);  // never below one aligned block
  EXPECT_EQ(c.expert_rows(), 16);
}

TEST(Config, PeerRowsFollowTheCapacityPolicy) {
  MoeConfig c;
  c.num_experts = 16; c.ep_size = 4; c.topk = 2; c.max_tokens = 1000;
  EXPECT_EQ(c.peer_rows(), 1000);  // WorstCase: T_max
  // a given other rank holds L = 4 of the 16 experts: p = 1 - C(12, 2) / C(16, 2) = 1 - 66/120 = 0.45
  c.capacity = Capacity::of_factor(1.25);
  EXPECT_EQ(c.peer_rows(), 563);  // ceil(1.25 * 1000 * 0.45)
  c.capacity = Capacity::per_expert(0.25);  // L * ceil(c * T_max * K / E) = 4 * ceil(31.25)
  EXPECT_EQ(c.peer_rows(), 128);
  c.capacity = Capacity::per_expert(2.0);  // 4 * 250: never above T_max
  EXPECT_EQ(c.peer_rows(), 1000);
  c.capacity = Capacity::of_factor(3.0);  // never above T_max
  EXPECT_EQ(c.peer_rows(), 1000);
  c.capacity = Capacity::of_factor(1e-9);  // never below one token
  EXPECT_EQ(c.peer_rows(), 1);
  c.topk = 13;  // more slots than the other ranks' experts: every token reaches every rank
  c.capacity = Capacity::of_factor(0.5);
  EXPECT_EQ(c.peer_rows(), 500);
  c.ep_size = 1;  // no peers
  EXPECT_EQ(c.peer_rows(), 1000);
}

TEST(Config, UnknownPresetNamesTheKnownOnes) {
  try {
    preset_config("gpt5");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("deepseek-v3"), std::string::npos);
  }
}

}  // namespace
}  // namespace moerail
