#include <cstdio>

#include "moerail/config.h"
#include "moerail/error.h"

int main() {
  moerail::MoeConfig c = moerail::preset_config("deepseek-v3");
  c.ep_size = 8;
  c.validate();
  std::printf("%s: %lld rows per rank\n", c.summary().c_str(), static_cast<long long>(c.rows_per_rank()));
  c.topk = 1000;
  try {
    c.validate();
  } catch (const moerail::Error& e) {
    return 0;  // the installed library reports the bad configuration
  }
  return 1;
}
