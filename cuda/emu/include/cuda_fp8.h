// cuda_fp8.h of the CPU emulator: nothing in tpfuse uses fp8; nccl.h includes this header.
#pragma once
