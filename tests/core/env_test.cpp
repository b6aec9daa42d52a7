#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "core/env.h"
#include "moerail/error.h"

namespace moerail {
namespace {

// MOERAIL_CONTIG_WALK: the three values, unset = auto, and anything else refused with a message naming it.
TEST(Env, ContigWalk) {
  unsetenv("MOERAIL_CONTIG_WALK");
  EXPECT_EQ(env::contig_walk(), env::ContigWalk::Auto);
  const std::pair<const char*, env::ContigWalk> values[] = {
      {"auto", env::ContigWalk::Auto}, {"dynamic", env::ContigWalk::Dynamic}, {"static", env::ContigWalk::Static}};
  for (const auto& [text, walk] : values) {
    setenv("MOERAIL_CONTIG_WALK", text, 1);
    EXPECT_EQ(env::contig_walk(), walk) << text;
  }
  setenv("MOERAIL_CONTIG_WALK", "Static", 1);
  try {
    (void)env::contig_walk();
    ADD_FAILURE() << "MOERAIL_CONTIG_WALK=Static was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("MOERAIL_CONTIG_WALK = 'Static'"), std::string::npos) << e.what();
  }
  unsetenv("MOERAIL_CONTIG_WALK");
}

}  // namespace
}  // namespace moerail
