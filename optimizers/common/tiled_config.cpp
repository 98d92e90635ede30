#include "optimizers/common/tiled_config.h"

#include <stdexcept>
#include <utility>

namespace rfsdp {

void check_tiled_config(const char* who, const TiledConfig& c) {
  for (const auto& [name, v] :
       {std::pair<const char*, int64_t>{"max_preconditioner_dim", c.max_preconditioner_dim},
        {"precondition_frequency", c.precondition_frequency}}) {
    if (v < 1) {
      throw std::invalid_argument(std::string(who) + ": " + name + " must be a positive integer, got " +
                                  std::to_string(v));
    }
  }
  if (c.factor_dtype != at::kFloat && c.factor_dtype != at::kBFloat16) {
    throw std::invalid_argument(std::string(who) + ": factor_dtype must be torch.float32 or torch.bfloat16");
  }
  c.basis.check(who);
}

}  // namespace rfsdp
