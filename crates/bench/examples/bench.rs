//! Runs `zdisk bench` without the zdisk binary (for developing the bench itself):
//! `cargo run -p zdisk-bench --example bench -- --smoke --targets raw,memory`.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: zdisk_bench::BenchArgs,
}

fn main() -> anyhow::Result<()> {
    zdisk_bench::run(&Cli::parse().bench)
}
