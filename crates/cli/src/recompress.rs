//! `zdisk recompress`: moves every fragment the write path stored in another codec (the LZ4
//! fallback) into the store's codec, or into `--codec`, to completion; with `--train`, trains
//! a zstd dictionary on the store's own blocks first and recompresses every compressed
//! fragment into it (a store that keeps a dictionary recompresses into it without `--train`
//! too) — a thin call into `Store::recompress` / `Store::recompress_with_new_dictionary`
//! (offline) or the server's control socket (served: `recompress` or `recompress-train`,
//! then `recompress-status` polled), plus a progress bar and the before/after numbers.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use zdisk_engine::{Codec, DictionaryOptions, ErrorKind, OpenOptions, Stats, Store};

use crate::runtime;
use crate::size::human_bytes;

#[derive(Debug, Clone, clap::Args)]
pub struct RecompressArgs {
    pub store: PathBuf,
    /// Recompress into this codec instead of the store's: lz4, zstd[:LEVEL] or
    /// deflate[:LEVEL]. A stronger level of the store's own codec (e.g. zstd:3 in a zstd:1
    /// store) takes that codec's fragments too; a fragment is replaced only if the new one
    /// is smaller.
    #[arg(long, value_parser = |s: &str| s.parse::<Codec>(), conflicts_with = "train")]
    pub codec: Option<Codec>,
    /// Train a zstd dictionary on a sample of the store's blocks (up to 4 MiB, picked across
    /// the store), then recompress every compressed fragment with it. Explicit, not the
    /// default: it marks the store as one zdisk versions without dictionaries refuse
    /// (docs/cli.md, docs/format.md "Dictionaries").
    #[arg(long)]
    pub train: bool,
    /// The zstd level fragments are recompressed at with the new dictionary, by this run
    /// and by GC from then on (docs/space.md, "Trained dictionaries": 6 stores 5–8% less on
    /// text, files and VM images than the default 3, for 2.7 times the CPU).
    #[arg(long, requires = "train", default_value_t = zdisk_engine::DICTIONARY_LEVEL_DEFAULT,
          value_parser = clap::value_parser!(i32).range(1..=19))]
    pub level: i32,
    /// Print the result as JSON (`segments`, `segments_cleaned`, `before` and `after`: the
    /// engine's statistics).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub key: crate::keys::KeyArgs,
}

/// What a run did, offline or served.
struct Outcome {
    segments: u64,
    segments_cleaned: u64,
    before: Stats,
    after: Stats,
    /// `--train`: the dictionary trained (the engine's `DictionaryReport` as JSON).
    dictionary: Option<serde_json::Value>,
}

fn dictionary_json(report: &zdisk_engine::DictionaryReport) -> serde_json::Value {
    serde_json::json!({
        "id": report.id,
        "size_bytes": report.size_bytes,
        "sample_blocks": report.sample_blocks,
        "training_ms": report.training_ms,
        "freed_ids": report.freed_ids,
    })
}

pub fn run(args: &RecompressArgs) -> Result<()> {
    let info = Store::info(&args.store).with_context(|| format!("reading {}", args.store.display()))?;
    let started = Instant::now();
    let mut progress = Progress::new(args);
    let options = OpenOptions { key: args.key.secret_unless_served(&args.store)?, ..OpenOptions::default() };
    let outcome = match Store::open(&args.store, &options) {
        Ok(store) => {
            let mut show = |done, total| progress.show(done, total);
            let report = if args.train {
                let options = DictionaryOptions { level: args.level, ..DictionaryOptions::default() };
                store.recompress_with_new_dictionary(&options, &mut show)
            } else {
                store.recompress(args.codec, &mut show)
            };
            progress.finish();
            let report = report.with_context(|| format!("recompressing {}", args.store.display()))?;
            store.close().with_context(|| format!("closing {}", args.store.display()))?;
            Outcome {
                segments: report.segments,
                segments_cleaned: report.segments_cleaned,
                before: report.before,
                after: report.after,
                dictionary: report.dictionary.as_ref().map(dictionary_json),
            }
        }
        Err(e) if e.kind() == ErrorKind::Locked => {
            let request = match (args.train, args.codec) {
                (true, _) => format!("recompress-train {}", args.level),
                (false, Some(codec)) => format!("recompress {codec}"),
                (false, None) => "recompress".to_string(),
            };
            let outcome = served(&runtime::control_socket(&info.uuid), &request, &mut progress);
            progress.finish();
            outcome?
        }
        Err(e) => return Err(e).with_context(|| format!("opening {}", args.store.display())),
    };
    print(args, &outcome, started.elapsed().as_secs_f64())
}

/// Served: the plugin runs the recompression in a thread of its own; this polls it.
fn served(socket: &std::path::Path, request: &str, progress: &mut Progress) -> Result<Outcome> {
    let reply = runtime::control_request(socket, request)?;
    if reply != "ok" {
        bail!("the server refused: {}", reply.strip_prefix("error ").unwrap_or(&reply));
    }
    loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let reply = runtime::control_request(socket, "recompress-status")?;
        let status: serde_json::Value = serde_json::from_str(&reply).context("bad reply from the server")?;
        progress.show(status["done"].as_u64().unwrap_or(0), status["total"].as_u64().unwrap_or(0));
        if status["running"] == true {
            continue;
        }
        if let Some(error) = status["error"].as_str() {
            bail!("recompressing while served: {error}");
        }
        let report = &status["report"];
        let stats =
            |key: &str| serde_json::from_value::<Stats>(report[key].clone()).context("bad reply from the server");
        return Ok(Outcome {
            segments: report["segments"].as_u64().unwrap_or(0),
            segments_cleaned: report["segments_cleaned"].as_u64().unwrap_or(0),
            before: stats("before")?,
            after: stats("after")?,
            dictionary: report.get("dictionary").filter(|d| !d.is_null()).cloned(),
        });
    }
}

/// On a terminal a bar with an ETA; otherwise (logs, CI) one line per 10%.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    store: String,
    last_decile: u64,
}

impl Progress {
    fn new(args: &RecompressArgs) -> Progress {
        let store = args.store.display().to_string();
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "recompressing {msg} [{bar:30}] {pos}/{len} segments ETA {eta}",
                )
                .expect("a valid progress template")
                .progress_chars("=> "),
            );
            bar.set_message(store.clone());
            bar
        });
        Progress { bar, store, last_decile: u64::MAX }
    }

    fn show(&mut self, done: u64, total: u64) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(total);
                bar.set_position(done);
            }
            None => {
                let percent = done.saturating_mul(100).checked_div(total).unwrap_or(100);
                if percent / 10 != self.last_decile {
                    self.last_decile = percent / 10;
                    eprintln!("recompressing {}: {percent}% ({done}/{total} segments)", self.store);
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn print(args: &RecompressArgs, outcome: &Outcome, seconds: f64) -> Result<()> {
    let (before, after) = (&outcome.before, &outcome.after);
    if args.json {
        let value = serde_json::json!({
            "store": args.store,
            "segments": outcome.segments,
            "segments_cleaned": outcome.segments_cleaned,
            "seconds": seconds,
            "before": before,
            "after": after,
            "dictionary": outcome.dictionary,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!(
        "{}: {} of {} segments recompressed in {seconds:.1} s",
        args.store.display(),
        outcome.segments_cleaned,
        outcome.segments
    );
    println!(
        "  stored bytes   {} -> {} ({} -> {} bytes)",
        human_bytes(before.physical_size),
        human_bytes(after.physical_size),
        before.physical_size,
        after.physical_size
    );
    if let Some(d) = &outcome.dictionary {
        println!(
            "  dictionary     id {} ({} bytes, trained on {} blocks in {} ms); freed {}",
            d["id"], d["size_bytes"], d["sample_blocks"], d["training_ms"], d["freed_ids"]
        );
    }
    println!("  comp_ratio     {:.3} -> {:.3}", before.comp_ratio, after.comp_ratio);
    println!(
        "  fragments      {} recompressed, {} saved, {:.2} s CPU",
        after.codec.recompressed_fragments.saturating_sub(before.codec.recompressed_fragments),
        human_bytes(after.codec.recompress_saved_bytes.saturating_sub(before.codec.recompress_saved_bytes)),
        after.codec.recompress_cpu_ns.saturating_sub(before.codec.recompress_cpu_ns) as f64 / 1e9
    );
    Ok(())
}
