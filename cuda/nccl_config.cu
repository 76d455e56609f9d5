// nccl_config.cu: ncclConfig_t initialised by the header's own NCCL_CONFIG_INITIALIZER.
//
// The config struct grows with every NCCL release; its "undefined" markers (INT_MIN, NULL)
// and its size/magic/version fields are only right when they come from the same header
// that bindgen read, so the initialiser lives on the C side.

#include <nccl.h>
#include <string.h>

#include "tpfuse.h"

extern "C" size_t tpfuse_nccl_config_init(void *config, size_t size) {
  ncclConfig_t initial = NCCL_CONFIG_INITIALIZER;
  if (config != NULL && size == sizeof(initial)) memcpy(config, &initial, sizeof(initial));
  return sizeof(initial);
}
