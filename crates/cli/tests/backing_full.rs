//! A backing file system that fills up under a sparse store (issue 47): format reserves
//! the room by default and refuses when it is not there; a store formatted `--sparse` whose
//! file system fills takes no more writes — clients get ENOSPC, `zdisk stat` says `failed`
//! with the reason, `serve` exits non-zero — and loses nothing a client flushed: once the
//! file system has room again, `check` is clean and every flushed block reads back.
//!
//! Needs root (it mounts a small tmpfs) and nbdkit; skips locally without them, fails
//! under CI=true.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::crash_model::pattern;
use common::nbd::NbdClient;
use common::*;

/// A tmpfs of `size` mounted in the scratch directory; unmounted on drop.
struct SmallFs {
    dir: PathBuf,
}

impl SmallFs {
    fn mount(s: &Scratch, size: &str) -> SmallFs {
        let dir = s.path("fs");
        std::fs::create_dir_all(&dir).unwrap();
        run_ok(Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(&dir));
        SmallFs { dir }
    }

    fn resize(&self, size: &str) {
        run_ok(Command::new("mount").args(["-o", &format!("remount,size={size}")]).arg(&self.dir));
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

fn may_mount() -> bool {
    if is_root() {
        return true;
    }
    assert!(!in_ci(), "CI needs root to mount the small file system");
    eprintln!("SKIP: needs root (mounts a tmpfs)");
    false
}

fn stat_json_of(s: &Scratch, store: &Path) -> serde_json::Value {
    s.stat_json(store)
}

#[test]
fn a_sparse_store_whose_file_system_fills_fails_loudly_and_loses_nothing_flushed() {
    if !require(&["nbdkit"]) || !may_mount() {
        return;
    }
    let s = Scratch::new("backing-full");
    let fs = SmallFs::mount(&s, "40m");
    let store = fs.dir.join("s.zdisk");
    let store_arg = store.to_str().unwrap();

    // Reserved by default: a store larger than the file system is refused, and no file is left.
    let (code, said) = fails(&s, &["format", store_arg, "--physical-size", "128M"]);
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("No space left") && said.contains("--sparse"), "{said}");
    assert!(!store.exists(), "a refused format left {}", store.display());
    // Sparse: formatted, with a warning that names the shortfall.
    let output = s
        .zdisk()
        .args(["format", store_arg, "--physical-size", "128M", "--sparse", "--codec", "lz4"])
        .output()
        .unwrap();
    assert_success(&output, "format --sparse");
    let warning = String::from_utf8_lossy(&output.stderr);
    assert!(warning.contains("warning") && warning.contains("sparse") && warning.contains("free"), "{warning}");

    // Incompressible megabytes, a flush after every fourth, until the file system is full.
    let server = Server::start_as_job(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    let chunk = 1usize << 20;
    let mut flushed = 0u64; // chunks acknowledged and flushed
    let mut written = 0u64;
    let refused = loop {
        assert!(written < 100, "the 40 MiB file system never filled");
        let error = c.write(written * chunk as u64, &pattern(7, written, 0, chunk), 0).unwrap();
        if error != 0 {
            break error;
        }
        written += 1;
        if written.is_multiple_of(4) {
            match c.flush().unwrap() {
                0 => flushed = written,
                error => break error,
            }
        }
    };
    assert_eq!(refused, libc::ENOSPC as u32, "the write or flush that found the file system full");
    assert!(flushed >= 8, "only {flushed} MiB flushed before the 40 MiB file system filled");
    // Failed: every later write gets ENOSPC, reads go on, stat says why.
    assert_eq!(c.write(0, &pattern(8, 0, 0, 4096), 0).unwrap(), libc::ENOSPC as u32, "a write after the failure");
    for i in 0..flushed {
        assert!(c.read_ok(i * chunk as u64, chunk) == pattern(7, i, 0, chunk), "MiB {i} reads back wrong while failed");
    }
    let live = stat_json_of(&s, &store);
    assert_eq!(live["source"], "live", "{live}");
    assert_eq!(live["state"], "failed", "{live}");
    assert!(live["state_reason"].as_str().unwrap().contains("No space left"), "{live}");
    assert_eq!(live["space_flag"], 2, "{live}");
    let text = s.zdisk_ok(&["stat", store_arg]);
    assert!(text.contains("state   failed: "), "{text}");
    c.disconnect();
    // The stop says the store failed, and exits non-zero.
    let (status, stderr) = server.stop_group_with(libc::SIGTERM);
    assert!(!status.success(), "serve exited {status} after the store failed: {stderr}");
    assert!(stderr.contains("failed while served"), "{stderr}");
    assert!(stderr.contains("warning") && stderr.contains("is sparse"), "serve did not warn at open: {stderr}");

    // With room again: check is clean, and everything flushed reads back.
    fs.resize("256m");
    let checked = s.zdisk().args(["check", store_arg]).stdout(Stdio::piped()).output().unwrap();
    assert_success(&checked, "check after the file system filled");
    let server = Server::start(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    for i in 0..flushed {
        assert!(c.read_ok(i * chunk as u64, chunk) == pattern(7, i, 0, chunk), "MiB {i} lost after the failure");
    }
    c.write_ok(0, &pattern(9, 0, 0, chunk));
    c.disconnect();
    assert_eq!(stat_json_of(&s, &store)["state"], "ok");
    server.stop();
}
