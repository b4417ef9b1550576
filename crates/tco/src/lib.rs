//! `zdisk tco` (placeholder: being written).

#[derive(Debug, clap::Args)]
pub struct TcoArgs {}

pub fn run(args: &TcoArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("zdisk tco is not written yet")
}
