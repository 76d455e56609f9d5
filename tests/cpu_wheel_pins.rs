//! The CUDA and NCCL wheels that build.rs tells a user to install are the ones
//! scripts/setup.sh installs: one set of pins, written twice (a shell script and the build
//! script's message), checked here.

fn pins(text: &str) -> Vec<String> {
    let mut pins: Vec<String> = text
        .split(|c: char| c.is_whitespace() || c == '"' || c == '\\')
        .filter_map(|w| w.find("nvidia-").map(|i| &w[i..]))
        .filter(|w| {
            w.split_once("==").is_some_and(|(_, v)| {
                !v.is_empty() && v.chars().all(|c| c.is_ascii_digit() || c == '.')
            })
        })
        .map(str::to_string)
        .collect();
    pins.sort();
    pins.dedup();
    pins
}

#[test]
fn build_script_and_setup_pin_the_same_wheels() {
    let root = env!("CARGO_MANIFEST_DIR");
    let build = std::fs::read_to_string(format!("{root}/build.rs")).unwrap();
    let setup = std::fs::read_to_string(format!("{root}/scripts/setup.sh")).unwrap();
    let from_build = pins(&build);
    assert_eq!(from_build.len(), 6, "{from_build:?}");
    assert_eq!(from_build, pins(&setup));
}
