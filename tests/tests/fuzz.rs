//! The differential fuzzer (docs/classification.md): a smoke of 200,000
//! generated frames under several generated profiles, and every regression
//! frame in `tests/fuzz-regressions/`. Root only; run serially.

use flowctl_tests::fuzz::run::{self, Options};
use std::path::{Path, PathBuf};

fn regressions_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-regressions")
}

/// 200,000 frames, a new profile every 25,000: every class must agree.
/// In the kernel matrix's VMs (TCG, 10-50x slower) 20,000, under 4 profiles.
fn fuzz_smoke_200k() {
    let out = std::env::temp_dir().join(flowctl_tests::unique("flowctl-fuzz-smoke"));
    let (frames, per_profile) =
        if flowctl_tests::need::in_vm() { (20_000, 5_000) } else { (200_000, 25_000) };
    let o = Options {
        frames,
        frames_per_profile: per_profile,
        seed: 13,
        out: out.clone(),
        max_failures: 20,
        ..Options::default()
    };
    let s = run::run(&o);
    let report = run::report(&s);
    print!("{report}");
    assert!(s.failures.is_empty(), "the kernel and the reference disagree on {} frames, {} distinct (the report above; cases in {})", s.disagreeing_frames, s.failures.len(), out.display());
    let _ = std::fs::remove_dir_all(&out);
}

/// Every `NAME.hex` in tests/fuzz-regressions/ under `NAME.toml`: the
/// reference gives the class the file names, and the kernel agrees.
fn fuzz_regression_frames() {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(regressions_dir())
        .expect("tests/fuzz-regressions")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "hex"))
        .collect();
    cases.sort();
    assert!(!cases.is_empty(), "no regression frames");
    let mut bad = vec![];
    for hex in &cases {
        let prof = hex.with_extension("toml");
        match run::replay(hex, &prof) {
            Ok(msg) => print!("{msg}"),
            Err(msg) => {
                print!("{msg}");
                bad.push(hex.file_name().unwrap().to_string_lossy().to_string());
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} regression frames disagree: {}",
        bad.len(),
        cases.len(),
        bad.join(", ")
    );
}

fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        fuzz_smoke_200k: [Root],
        fuzz_regression_frames: [Root],
    ]);
}
