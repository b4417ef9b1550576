//! `zdisk bench` (placeholder: being written).

#[derive(Debug, clap::Args)]
pub struct BenchArgs {}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("zdisk bench is not written yet")
}
