#include "quant/ops/device_path.h"

#include <atomic>
#include <cstdlib>
#include <string>

namespace rfsdp::quant {

namespace {
std::atomic<bool> g_generic{[] {
  const char* env = std::getenv("RFSDP_DEVICE_GENERIC");
  return env && std::string(env) == "1";
}()};
}  // namespace

bool device_generic_path() { return g_generic.load(std::memory_order_relaxed); }
void use_device_generic_path(bool on) { g_generic.store(on, std::memory_order_relaxed); }

}  // namespace rfsdp::quant
