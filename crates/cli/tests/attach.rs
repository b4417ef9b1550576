//! `zdisk attach`: the kernel's ext4 on the attached block device (nbdfuse + loop here),
//! across a server restart, and the options attach passes to the server it starts.
//!
//! Run: `cargo test -p zdisk --test attach` (builds the plugin too; see tests/common).
//! Needs nbdkit, nbdfuse, fuse3, util-linux and e2fsprogs, and loop devices; missing tools
//! skip locally and fail under CI=true.

mod common;

use std::path::Path;
use std::process::Command;

use common::{refused, require, run_ok, Scratch, Server};

const BASIC_TOOLS: &[&str] = &["nbdkit"];

fn files_with_hashes(root: &Path) -> Vec<String> {
    let out = run_ok(
        Command::new("sh")
            .arg("-c")
            .arg("cd \"$1\" && find . -type f -print0 | sort -z | xargs -0 sha256sum")
            .arg("sh")
            .arg(root),
    );
    out.lines().map(str::to_string).collect()
}

struct Mount(std::path::PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

struct Attached<'a>(&'a Scratch, Option<String>);
impl Attached<'_> {
    fn device(&self) -> &str {
        self.1.as_deref().unwrap()
    }
    fn detach(mut self) {
        let device = self.1.take().unwrap();
        self.0.zdisk_ok(&["detach", &device]);
    }
    /// Detach naming the store instead of the device.
    fn detach_store(mut self, store: &Path) {
        self.1.take().unwrap();
        self.0.zdisk_ok(&["detach", store.to_str().unwrap()]);
    }
}
impl Drop for Attached<'_> {
    fn drop(&mut self) {
        if let Some(device) = self.1.take() {
            let _ = self.0.zdisk().args(["detach", &device]).status();
        }
    }
}

/// The state file attach wrote for `device`.
fn attach_state(s: &Scratch, device: &str) -> serde_json::Value {
    let path = s.run_dir().join("attach").join(format!("{}.json", device.trim_start_matches("/dev/")));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// A process's command line, its arguments separated (and ended) by spaces.
fn cmdline(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap().replace('\0', " ")
}

fn attach<'a>(s: &'a Scratch, store: &Path) -> Attached<'a> {
    common::plugin();
    let out = s.zdisk_ok(&["attach", store.to_str().unwrap()]);
    let device = out.trim().to_string();
    assert!(device.starts_with("/dev/"), "attach printed {device:?}");
    Attached(s, Some(device))
}

#[test]
fn ext4_on_the_attached_device_survives_a_server_restart() {
    if !require(&["nbdkit", "nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "e2fsck", "mount", "umount"])
        || !common::require_block_devices()
    {
        return;
    }
    let s = Scratch::new("ext4");
    let store = s.format("fs.zdisk", "256M", "2x", &[]);
    let mnt = s.path("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let tree = common::real_tree().parent().unwrap().join("json");
    let tree = if tree.is_dir() { tree } else { common::real_tree() };

    let attached = attach(&s, &store);
    // nbdfuse opens several connections, and the server attach started runs one thread each
    // (the kernel client, where present, opens one connection to a server of default threads).
    let state = attach_state(&s, attached.device());
    let fuse = state["kind"] == "fuse-loop";
    let serve_cmdline = cmdline(state["started_serve_pid"].as_u64().expect("attach started the server"));
    assert_eq!(serve_cmdline.contains(" --threads 1 "), fuse, "the server's command line: {serve_cmdline}");
    if fuse {
        let nbdfuse_cmdline = cmdline(state["nbdfuse_pid"].as_u64().expect("attached through nbdfuse"));
        let connections = nbdfuse_cmdline.split(" -C ").nth(1).and_then(|rest| rest.split(' ').next());
        assert!(
            connections.and_then(|n| n.parse::<u32>().ok()).is_some_and(|n| n >= 8),
            "nbdfuse's command line: {nbdfuse_cmdline}"
        );
    }
    // A second attach of the same store prints the same device (it made a second one, with a
    // second nbdfuse mounted over the first one's directory; detaching either then hung).
    let again = s.zdisk_ok(&["attach", store.to_str().unwrap()]);
    assert_eq!(again.trim(), attached.device(), "a second attach made another device");
    run_ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(attached.device()));
    run_ok(Command::new("mount").arg(attached.device()).arg(&mnt));
    let mounted = Mount(mnt.clone());
    run_ok(Command::new("cp").arg("-a").arg(&tree).arg(mnt.join("a")));
    run_ok(Command::new("cp").arg("-a").arg(common::real_tree()).arg(mnt.join("b")));
    let hashes = files_with_hashes(&mnt);
    assert!(hashes.len() > 20, "copied too few files: {}", hashes.len());
    run_ok(Command::new("umount").arg(&mnt));
    std::mem::forget(mounted);
    run_ok(Command::new("e2fsck").arg("-fn").arg(attached.device()));
    attached.detach(); // stops the server attach started: flush + checkpoint

    let out = s.zdisk_ok(&["check", store.to_str().unwrap()]);
    assert!(out.contains("clean"), "{out}");

    // Restarted with options for the server attach starts (after `--`): its threads given
    // there are kept, and `--connections` reaches nbdfuse.
    let options = ["--write-behind", "1M", "--cache", "64M", "-t", "2"];
    let out = s.zdisk_ok(&[&["attach", store.to_str().unwrap(), "--connections", "3", "--"][..], &options].concat());
    let attached = Attached(&s, Some(out.trim().to_string()));
    let state = attach_state(&s, attached.device());
    let serve_cmdline = cmdline(state["started_serve_pid"].as_u64().expect("attach started the server"));
    assert!(serve_cmdline.ends_with(&format!(" {} ", options.join(" "))), "the server's command line: {serve_cmdline}");
    assert!(!serve_cmdline.contains("--threads"), "the server's command line: {serve_cmdline}");
    if let Some(pid) = state["nbdfuse_pid"].as_u64() {
        let nbdfuse_cmdline = cmdline(pid);
        assert!(nbdfuse_cmdline.contains(" -C 3 "), "nbdfuse's command line: {nbdfuse_cmdline}");
    }
    refused(&s, &["attach", store.to_str().unwrap(), "--", "--cache", "1G"], 1, "already attached");
    run_ok(Command::new("mount").arg(attached.device()).arg(&mnt));
    let mounted = Mount(mnt.clone());
    assert_eq!(files_with_hashes(&mnt), hashes, "files changed across the restart");
    drop(mounted);
    attached.detach_store(&store);
    refused(&s, &["detach", store.to_str().unwrap()], 1, "is not attached");
    let stat = s.stat_json(&store);
    assert!(stat["comp_ratio"].as_f64().unwrap() > 1.2, "{stat}");
}

/// A running server's options do not change: attach refuses options for a store that is
/// already served rather than attach with the running server's and drop them.
#[test]
fn attach_refuses_server_options_for_a_store_already_served() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("attach-served");
    let store = s.format("s.zdisk", "32M", "1x", &[]);
    let _server = Server::start(&s, &store, &[]);
    refused(&s, &["attach", store.to_str().unwrap(), "--", "--cache", "64M"], 1, "already being served");
}
