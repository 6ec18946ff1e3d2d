//! `cargo xtask bench`: see docs/benchmarks.md.
pub fn run() -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
