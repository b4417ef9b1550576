//! `zdisk recompress`: moves every fragment the write path stored in another codec (the LZ4
//! fallback) into the store's codec, or into `--codec`, offline, to completion — a thin call
//! into `Store::recompress` plus a progress bar and the before/after numbers.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use zdisk_engine::{Codec, ErrorKind, OpenOptions, Store};

use crate::size::human_bytes;

#[derive(Debug, Clone, clap::Args)]
pub struct RecompressArgs {
    pub store: PathBuf,
    /// Recompress into this codec instead of the store's: lz4, zstd[:LEVEL] or
    /// deflate[:LEVEL]. A stronger level of the store's own codec (e.g. zstd:3 in a zstd:1
    /// store) takes that codec's fragments too; a fragment is replaced only if the new one
    /// is smaller.
    #[arg(long, value_parser = |s: &str| s.parse::<Codec>())]
    pub codec: Option<Codec>,
    /// Print the result as JSON (`segments`, `segments_cleaned`, `before` and `after`: the
    /// engine's statistics).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &RecompressArgs) -> Result<()> {
    Store::info(&args.store).with_context(|| format!("reading {}", args.store.display()))?;
    let store = match Store::open(&args.store, &OpenOptions::default()) {
        Ok(store) => store,
        Err(e) if e.kind() == ErrorKind::Locked => {
            bail!("{} is being served: stop the server before recompressing it", args.store.display())
        }
        Err(e) => return Err(e).with_context(|| format!("opening {}", args.store.display())),
    };
    let started = Instant::now();
    // On a terminal a bar with an ETA; otherwise (logs, CI) one line per 10%.
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("recompressing {msg} [{bar:30}] {pos}/{len} segments ETA {eta}")
                .expect("a valid progress template")
                .progress_chars("=> "),
        );
        bar.set_message(args.store.display().to_string());
        bar
    });
    let mut last_decile = u64::MAX;
    let mut progress = |done: u64, total: u64| match &bar {
        Some(bar) => {
            bar.set_length(total);
            bar.set_position(done);
        }
        None => {
            let percent = done.saturating_mul(100).checked_div(total).unwrap_or(100);
            if percent / 10 != last_decile {
                last_decile = percent / 10;
                eprintln!("recompressing {}: {percent}% ({done}/{total} segments)", args.store.display());
            }
        }
    };
    let report = store.recompress(args.codec, &mut progress);
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let report = report.with_context(|| format!("recompressing {}", args.store.display()))?;
    store.close().with_context(|| format!("closing {}", args.store.display()))?;
    let (before, after) = (&report.before, &report.after);
    if args.json {
        let value = serde_json::json!({
            "store": args.store,
            "segments": report.segments,
            "segments_cleaned": report.segments_cleaned,
            "seconds": started.elapsed().as_secs_f64(),
            "before": before,
            "after": after,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!(
        "{}: {} of {} segments recompressed in {:.1} s",
        args.store.display(),
        report.segments_cleaned,
        report.segments,
        started.elapsed().as_secs_f64()
    );
    println!(
        "  stored bytes   {} -> {} ({} -> {} bytes)",
        human_bytes(before.physical_size),
        human_bytes(after.physical_size),
        before.physical_size,
        after.physical_size
    );
    println!("  comp_ratio     {:.3} -> {:.3}", before.comp_ratio, after.comp_ratio);
    println!(
        "  fragments      {} recompressed, {} saved, {:.2} s CPU",
        after.codec.recompressed_fragments,
        human_bytes(after.codec.recompress_saved_bytes),
        after.codec.recompress_cpu_ns as f64 / 1e9
    );
    Ok(())
}
