// all_reduce_packets.cuh: the one-shot all-reduce by packets (all_reduce_packets.cu), as the
// all-reduce's dispatcher (all_reduce.cu) chooses and launches it.
#pragma once

#include "backend.cuh"
#include "tpfuse.h"

namespace tpfuse {

// Host: whether the one-shot all-reduce of rows x hidden elements of `element_bytes` goes by
// packets on group `g`: the group offers packets (g.packet_bytes, equal on every rank), the
// message is whole 16-byte vectors, its packets from every rank (8 bytes for every 4 of data)
// fit half the packet area, and, with RMSNorm, a block holds a row in registers (two
// segments at most). It depends only on what every rank agrees on, so every rank decides the
// same.
bool one_shot_by_packets(const tpfuse_group_args &g, size_t element_bytes, size_t rows, size_t hidden, bool norm);

// Host: launches it on `grid` blocks (the same on every rank). The pointers and sizes are
// checked by the dispatcher.
template <typename T>
int launch_one_shot_packets(const tpfuse_peers &peers, const tpfuse_group_args &g, int grid, const T *input,
                            const T *bias, T *residual, const T *gamma, float eps, T *out, size_t rows,
                            size_t hidden, cudaStream_t stream);

} // namespace tpfuse
