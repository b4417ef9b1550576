//! `zdisk`: format, serve, inspect, check, attach and benchmark zdisk stores.
//!
//! A thin front end: storage logic lives in `zdisk_engine`, NBD in nbdkit and the plugin.
//! Wrong use exits 2 with a one-line reason (clap's usage errors, and arguments a command
//! refuses: a size out of range, an option that needs another — `Usage`); `check` exits 3
//! when it finds damage; every other failure exits 1.

mod attach;
mod commands;
mod demo;
mod keys;
mod recompress;
mod runtime;
mod serve;
mod serve_native;
mod size;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "zdisk",
    version,
    about = "zdisk: a software compressing block device served over NBD",
    long_about = "zdisk turns a file or block device into a compressed, thin-provisioned, \
                  log-structured, crash-safe block store, and serves it over NBD through nbdkit.\n\n\
                  Sizes take K/M/G/T/P suffixes (binary: 1K = 1024). A logical size may also be \
                  written Nx: N times the native capacity, the bytes incompressible data can \
                  always fill and overwrite (the data area less reserves, metadata and the \
                  --over-provision spare area; `zdisk format` prints it). 1x is the default.\n\n\
                  Quick start:\n  \
                  zdisk format disk.zdisk --physical-size 10G --logical-size 3x\n  \
                  zdisk serve disk.zdisk --unix /tmp/zdisk.sock\n  \
                  zdisk stat disk.zdisk"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Create a store on a file (created at the physical size) or a block device.
    ///
    /// Refuses to overwrite an existing zdisk store or other data unless --force.
    Format(commands::FormatArgs),
    /// Serve a store over NBD with nbdkit, in the foreground.
    ///
    /// Prints the NBD URI on stdout once the server accepts connections. SIGINT/SIGTERM stop it
    /// cleanly: connections close, the store is flushed and checkpointed. A store that is
    /// already being served is refused.
    Serve(serve::ServeArgs),
    /// Show the capacity statistics and the engine's counters, served or not.
    ///
    /// The capacity-stat table (free_space physical_size logical_size comp_ratio
    /// provisioned_cap space_flag, in bytes), write amplification and every engine statistic.
    /// When the store is being served the numbers are the server's live ones.
    Stat(commands::StatArgs),
    /// Verify every record header, every block checksum and the space accounting.
    ///
    /// Progress goes to stderr. Exit 0 when clean, 3 with the list of problems otherwise.
    /// The store must not be being served.
    Check(commands::CheckArgs),
    /// Change the logical size (capacity multiplier) or the over-provisioning.
    ///
    /// Offline: grow or shrink (a shrink is refused while data is mapped past the new end).
    /// While served: grow only; clients see the new size when they reconnect.
    /// --over-provision moves the native capacity (offline only).
    Resize(commands::ResizeArgs),
    /// Move the blocks the write path stored with the LZ4 fallback into the store's codec.
    ///
    /// Offline or while served (through the server's control socket), to completion, with a
    /// progress bar; prints the stored bytes and comp_ratio before and after. --codec
    /// recompresses into another codec or a stronger level instead.
    Recompress(recompress::RecompressArgs),
    /// Print a block device backed by the store's server (starting one if needed).
    ///
    /// Uses the kernel NBD client where /dev/nbd* exists, otherwise nbdfuse plus a loop device.
    Attach(attach::AttachArgs),
    /// Undo `zdisk attach`: release the device and stop the server attach started.
    Detach(attach::DetachArgs),
    /// An encrypted store's key slots: list, add, remove, change (only the slots are
    /// rewritten, never data; the store must not be served).
    Key(keys::KeyCmdArgs),
    /// Format a scratch store, serve it, write real data through NBD, show the statistics.
    Demo(demo::DemoArgs),
    /// Benchmark zdisk against a raw baseline with fio.
    Bench(zdisk_bench::BenchArgs),
    /// Total-cost-of-ownership model for compressed storage.
    Tco(zdisk_tco::TcoArgs),
    /// Real databases on zdisk: MariaDB/PostgreSQL benchmarks and power-cut tests (docs/apps.md).
    Db(zdisk_apps::DbArgs),
    /// The Ceph case study on zdisk devices (scripts/ceph-demo.sh, docs/ceph.md): its report.
    Ceph(zdisk_apps::CephArgs),
    /// Print a size in bytes, read as every zdisk command reads sizes (for scripts).
    ///
    /// `zdisk size 1.5G` prints 1610612736: K, M, G, T, P are binary (1K = 1024), with an
    /// optional B, iB or i; a fraction must come to a whole number of bytes.
    Size(SizeArgs),
    /// Write the man pages and shell completions generated from this command line
    /// (scripts/install.sh installs them).
    #[command(hide = true)]
    GenerateAssets(GenerateAssetsArgs),
}

#[derive(Debug, clap::Args)]
struct SizeArgs {
    /// The size: NUMBER[K|M|G|T|P][B|iB|i], e.g. 4096, 64K, 1.5G.
    #[arg(allow_hyphen_values = true)]
    size: String,
}

/// `zdisk size`: the workspace's size parser for scripts (scripts/ceph-demo.sh reads its
/// --osd-size and --image-size through it).
fn print_size(args: &SizeArgs) -> anyhow::Result<()> {
    let bytes = zdisk_bench::size::parse_bytes(&args.size).map_err(Usage)?;
    println!("{bytes}");
    Ok(())
}

#[derive(Debug, clap::Args)]
struct GenerateAssetsArgs {
    /// Directory to write into: man1/*.1 and completions/ (bash, zsh, fish).
    out: std::path::PathBuf,
}

/// Man pages (zdisk.1 and one per command, `zdisk-format.1`, ...) and bash, zsh and fish
/// completions, from clap's own definition of the command line.
fn generate_assets(args: &GenerateAssetsArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    use clap::CommandFactory;
    let man = args.out.join("man1");
    let completions = args.out.join("completions");
    for dir in [&man, &completions] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let command = Cli::command();
    clap_mangen::generate_to(command.clone(), &man).context("writing the man pages")?;
    for shell in [clap_complete::Shell::Bash, clap_complete::Shell::Zsh, clap_complete::Shell::Fish] {
        clap_complete::generate_to(shell, &mut command.clone(), "zdisk", &completions)
            .with_context(|| format!("writing the {shell} completion"))?;
    }
    println!("wrote {} and {}", man.display(), completions.display());
    Ok(())
}

fn main() {
    // SAFETY: restoring the default SIGPIPE action before any thread starts, so that
    // `zdisk stat | head` ends quietly like other Unix tools instead of panicking on EPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // What the engine reports outside a request's result (see the plugin's after_fork).
    let filter = tracing_subscriber::EnvFilter::try_from_env("ZDISK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .with_target(false)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Cmd::Format(args) => commands::format(args).map(|()| 0),
        Cmd::Serve(args) => serve::run(args).map(|()| 0),
        Cmd::Stat(args) => commands::stat(args).map(|()| 0),
        Cmd::Check(args) => commands::check(args),
        Cmd::Resize(args) => commands::resize(args).map(|()| 0),
        Cmd::Recompress(args) => recompress::run(args).map(|()| 0),
        Cmd::Attach(args) => attach::attach(args).map(|()| 0),
        Cmd::Detach(args) => attach::detach(args).map(|()| 0),
        Cmd::Key(args) => keys::run(args).map(|()| 0),
        Cmd::Demo(args) => demo::run(args).map(|()| 0),
        Cmd::Bench(args) => zdisk_bench::run(args).map(|()| 0),
        Cmd::Tco(args) => zdisk_tco::run(args).map(|()| 0),
        Cmd::Db(args) => zdisk_apps::run(args).map(|()| 0),
        Cmd::Ceph(args) => zdisk_apps::ceph::run(args).map(|()| 0),
        Cmd::Size(args) => print_size(args).map(|()| 0),
        Cmd::GenerateAssets(args) => generate_assets(args).map(|()| 0),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            eprintln!("zdisk: error: {error:#}");
            let usage = error.chain().any(|cause| cause.downcast_ref::<Usage>().is_some());
            std::process::exit(if usage { 2 } else { 1 });
        }
    }
}

/// Wrong use of a command that clap's parser cannot see: exits 2, as clap's own usage
/// errors do.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// An engine error that refuses the arguments themselves (`InvalidArgument`: a size out of
/// range, a directory for a store) as a `Usage` error; others as they are.
pub fn usage_if_invalid(error: zdisk_engine::Error) -> anyhow::Error {
    match error.kind() {
        zdisk_engine::ErrorKind::InvalidArgument => Usage(error.to_string()).into(),
        _ => error.into(),
    }
}
