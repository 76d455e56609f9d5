//! `tpfuse selftest`: the checks this machine can run.

use std::process::ExitCode;
use tpfuse::comm::{nccl_info, UniqueId};

/// Runs what this machine can run; fails (exit 1) on any failed check.
pub fn run() -> ExitCode {
    let mut failed = 0;
    let mut passed = 0;
    let mut check = |name: &str, result: tpfuse::Result<()>| match result {
        Ok(()) => {
            passed += 1;
            println!("ok      {name}");
        }
        Err(e) => {
            failed += 1;
            println!("FAILED  {name}: {e}");
        }
    };
    check("NCCL loads", nccl_info().map(|_| ()));
    check("unique ids are distinct and round-trip", unique_ids());
    if tpfuse::device::driver_present() {
        check(
            "reduce_ranks matches the CPU reference",
            gpu::reduce_ranks(),
        );
        check("one-rank NCCL communicator", gpu::one_rank_comm());
    } else {
        println!("skipped GPU checks: no CUDA driver on this machine");
    }
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn unique_ids() -> tpfuse::Result<()> {
    let a = UniqueId::new()?;
    let b = UniqueId::new()?;
    if a == b {
        return Err(tpfuse::Error::Mismatch("two unique ids are equal".into()));
    }
    if UniqueId::from_hex(&a.to_hex())? != a || UniqueId::from_bytes(a.as_bytes())? != a {
        return Err(tpfuse::Error::Mismatch(
            "unique id round trip changed it".into(),
        ));
    }
    Ok(())
}

mod gpu {
    use half::bf16;
    use tpfuse::comm::{Comm, CommOptions};
    use tpfuse::reference::reduce_ranks_exact;
    use tpfuse::{Error, Result};

    fn cuda(context: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
        move |source| Error::Cuda { context, source }
    }

    pub fn reduce_ranks() -> Result<()> {
        let stream = tpfuse::device::open(0)?.default_stream();
        for &n in &[1usize, 7, 8, 1000, 65_537] {
            let host: Vec<Vec<bf16>> = (0..4)
                .map(|r| {
                    (0..n)
                        .map(|i| bf16::from_f32(((i * 7 + r * 13) % 97) as f32 * 0.37 - 17.0))
                        .collect()
                })
                .collect();
            let dev = host
                .iter()
                .map(|h| stream.clone_htod(h))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(cuda("upload"))?;
            let mut out = stream
                .clone_htod(&vec![bf16::NAN; n])
                .map_err(cuda("upload"))?;
            let refs: Vec<_> = dev.iter().collect();
            tpfuse::ops::reduce_ranks(&stream, &refs, &mut out)?;
            let got = stream.clone_dtoh(&out).map_err(cuda("download"))?;
            let slices: Vec<&[bf16]> = host.iter().map(Vec::as_slice).collect();
            let want = reduce_ranks_exact(&slices);
            if got
                .iter()
                .map(|x| x.to_bits())
                .ne(want.iter().map(|x| x.to_bits()))
            {
                return Err(Error::Mismatch(format!(
                    "reduce_ranks of 4 x {n} bf16 differs from the reference"
                )));
            }
        }
        Ok(())
    }

    pub fn one_rank_comm() -> Result<()> {
        let id = tpfuse::comm::UniqueId::new()?;
        let comm = Comm::init_rank_on_device(&id, 0, 1, 0, CommOptions::default())?;
        comm.sanity_check()
    }
}
