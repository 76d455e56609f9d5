//! NCCL without a GPU: it loads, reports its version, and makes distinct unique ids.

use std::collections::HashSet;
use tpfuse::comm::{nccl_info, UniqueId};

#[test]
fn nccl_loads_and_reports_a_supported_version() {
    let info = nccl_info().expect("NCCL loads (the test command installs it)");
    let (major, minor, _) = info.version;
    assert!(
        (major, minor) >= (2, 19),
        "NCCL {major}.{minor} is older than 2.19"
    );
    assert!(
        std::path::Path::new(&info.path).exists(),
        "loaded from a path that does not exist: {}",
        info.path
    );
    assert!(
        info.header_version.starts_with("2."),
        "{}",
        info.header_version
    );
}

#[test]
fn unique_ids_from_nccl_are_distinct_and_round_trip() {
    let ids: Vec<UniqueId> = (0..32).map(|_| UniqueId::new().unwrap()).collect();
    let distinct: HashSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len());
    for id in &ids {
        assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), *id);
        assert_eq!(UniqueId::from_bytes(id.as_bytes()).unwrap(), *id);
    }
}
