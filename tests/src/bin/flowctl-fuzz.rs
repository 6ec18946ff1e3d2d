//! The differential fuzzer's command line (docs/classification.md):
//!
//! ```text
//! flowctl-fuzz N [--seed S] [--out DIR] [--max-failures K] [--per-profile M] [--batch B] [--cpu C]
//! flowctl-fuzz --replay FILE.hex --profile FILE.toml
//! ```
//!
//! Runs N generated frames through the real XDP program (root), under a new
//! generated profile every M frames, and compares every frame's class and
//! counters with the reference classifier. Disagreements are written to DIR
//! (a hex file and the profile each) with a one-line reproduction command;
//! it exits 1 when there was any.

use flowctl_tests::fuzz::run::{self, Options};
use std::path::PathBuf;

fn usage() -> ! {
    eprintln!("usage: flowctl-fuzz N [--seed S] [--out DIR] [--max-failures K] [--per-profile M] [--batch B] [--cpu C]\n       flowctl-fuzz --replay FILE.hex --profile FILE.toml");
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut o = Options { frames: 0, ..Options::default() };
    let (mut replay, mut profile): (Option<PathBuf>, Option<PathBuf>) = (None, None);
    let mut frames = None;
    let mut per_profile = None;
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--seed" => o.seed = val().parse().unwrap_or_else(|_| usage()),
            "--out" => o.out = PathBuf::from(val()),
            "--max-failures" => o.max_failures = val().parse().unwrap_or_else(|_| usage()),
            "--per-profile" => per_profile = Some(val().parse().unwrap_or_else(|_| usage())),
            "--batch" => o.batch = val().parse().unwrap_or_else(|_| usage()),
            "--cpu" => o.cpu = val().parse().unwrap_or_else(|_| usage()),
            "--replay" => replay = Some(PathBuf::from(val())),
            "--profile" => profile = Some(PathBuf::from(val())),
            "-h" | "--help" => usage(),
            n => frames = Some(n.replace('_', "").parse::<u64>().unwrap_or_else(|_| usage())),
        }
    }
    if let Some(hex) = replay {
        let Some(profile) = profile else { usage() };
        match run::replay(&hex, &profile) {
            Ok(msg) => print!("{msg}"),
            Err(msg) => {
                print!("{msg}");
                std::process::exit(1);
            }
        }
        return;
    }
    o.frames = frames.unwrap_or_else(|| usage());
    // By default 25,000 frames per profile, and at most 100 profiles (a
    // load is ~0.25 s): 10M frames run under 100 profiles of 100,000.
    o.frames_per_profile = per_profile.unwrap_or(o.frames.div_ceil(100).max(25_000)).max(1);
    println!("flowctl-fuzz: {} frames, seed {}, a new profile every {} frames, batches of {}, CPU {}, failures to {}", o.frames, o.seed, o.frames_per_profile, o.batch, o.cpu, o.out.display());
    let s = run::run(&o);
    print!("{}", run::report(&s));
    if !s.failures.is_empty() {
        std::process::exit(1);
    }
}
