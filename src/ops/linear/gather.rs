//! A gathered output, rank-major `[W, m, n]` as the all-gather leaves it, rearranged into the
//! rows of `[m, cols]` with strided copies (no kernel).

use crate::device::{bind, cuda};
use crate::error::Result;
use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut};

/// `out[i, r·n .. r·n + widths[r]] = gathered[r, i, 0 .. widths[r]]` for every rank `r`
/// (`widths.len()` ranks) and row `i < m`: one `cuMemcpy2DAsync` per rank of nonzero width
/// (`m` rows of `widths[r]` elements, source pitch `n`, destination pitch `cols`), enqueued on
/// `stream`. With every width `n` and `cols = W·n` this is the column-parallel layout; the LM
/// head passes each rank's real columns, which drops the vocabulary's padding.
///
/// The caller checks that `gathered` holds `W·m·n` and `out` `m·cols` elements on the
/// stream's device, and that `r·n + widths[r] <= cols` and `widths[r] <= n` for every rank.
pub(super) fn rank_major_to_rows<T>(
    stream: &CudaStream,
    gathered: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    m: usize,
    n: usize,
    cols: usize,
    widths: &[usize],
) -> Result<()> {
    let size = std::mem::size_of::<T>();
    let (src, _src_guard) = gathered.device_ptr(stream);
    let (dst, _dst_guard) = out.device_ptr_mut(stream);
    bind(stream)?;
    for (r, &width) in widths.iter().enumerate() {
        if width == 0 || m == 0 {
            continue;
        }
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src + (r * m * n * size) as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: n * size,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst + (r * n * size) as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: cols * size,
            WidthInBytes: width * size,
            Height: m,
        };
        // SAFETY: by the caller's checks, every source row r·m·n + i·n .. + width lies in
        // `gathered` and every destination row i·cols + r·n .. + width in `out`; the guards
        // keep cudarc's stream ordering until the copies are enqueued.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) }
            .result()
            .map_err(cuda("rearranging the gathered output (cuMemcpy2DAsync)"))?;
    }
    Ok(())
}
