//! NVML discovery on a real machine (feature `gpu-tests`; ignored without it).

use tpfuse::topology::{assess, discover, Discovery};

#[test]
#[cfg_attr(not(feature = "gpu-tests"), ignore = "needs a CUDA GPU")]
fn nvml_sees_every_cuda_device_and_the_policy_answers() {
    let topo = match discover() {
        Discovery::Found(t) => t,
        other => panic!("NVML discovery on a GPU machine: {other:?}"),
    };
    let count = tpfuse::device::device_count().expect("CUDA driver") as u32;
    assert_eq!(
        topo.cuda_ordinals(),
        (0..count).collect::<Vec<_>>(),
        "every CUDA ordinal maps to one NVML GPU:\n{}",
        topo.to_json()
    );
    for g in &topo.gpus {
        assert!(g.memory_bytes > 0 && !g.uuid.is_empty(), "{g:?}");
        assert!(g.compute_capability.major >= 7, "{g:?}");
    }
    let n = topo.gpus.len();
    assert_eq!(topo.pairs.len(), n * (n - 1) / 2);
    let verdict = assess(&topo, &topo.cuda_ordinals());
    assert!(verdict.single_host);
    println!("{}", tpfuse::topology::render(&topo));
}
