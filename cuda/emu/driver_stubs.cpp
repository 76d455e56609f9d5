// driver_stubs.cpp: every CUDA driver entry point cudarc resolves (driver_names.inc) as a weak
// symbol that logs its name and returns CUDA_ERROR_NOT_SUPPORTED; driver.cpp's strong
// definitions replace the ones the emulator implements. So a call the emulator does not
// cover fails loudly instead of succeeding silently or leaving cudarc without a symbol.
#include <cstdio>

namespace {
int not_supported(const char *name) {
  std::fprintf(stderr, "tpfuse emulator: %s is not emulated (CUDA_ERROR_NOT_SUPPORTED)\n", name);
  return 801;
}
} // namespace

#define TPFUSE_EMU_DRIVER_NAME(name)                                                            \
  extern "C" __attribute__((weak)) int name() { return not_supported(#name); }
#include "driver_names.inc"
