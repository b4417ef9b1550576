//! The storage stacks a database runs on: a block device (zdisk attached with `zdisk attach
//! --fuse`; a raw file behind qemu-nbd + nbdfuse + loop, the same transport; a raw file on a
//! loop device directly) with ext4 on it. Every piece is torn down when dropped, in reverse
//! order, also on errors and Ctrl-C.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use zdisk_bench::server::{qemu_nbd_raw, sparse_file, Server};
use zdisk_bench::sys::{self, progress, run};

/// Where the stacks live and which zdisk binary formats and attaches stores.
#[derive(Clone, Debug)]
pub struct Ctx {
    pub work: PathBuf,
    pub zdisk_bin: PathBuf,
    pub run_dir: PathBuf,
    /// Passed to the `zdisk serve` that `zdisk attach` starts (after `--`).
    pub serve_options: Vec<String>,
}

impl Ctx {
    pub fn zdisk(&self) -> Command {
        let mut c = Command::new(&self.zdisk_bin);
        c.env("ZDISK_RUN_DIR", &self.run_dir);
        c
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `zdisk attach --fuse`: zdisk serve (nbdkit + plugin), nbdfuse, loop (direct I/O).
    Zdisk,
    /// A raw file behind `qemu-nbd --cache=none --aio=native`, then nbdfuse + loop exactly as
    /// attach does it.
    RawNbd,
    /// A raw file on a loop device (direct I/O), no NBD.
    RawLoop,
}

#[derive(Debug, Deserialize)]
struct AttachState {
    uuid: String,
    started_serve_pid: Option<u32>,
    nbdfuse_pid: Option<u32>,
    fuse_dir: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
struct ServeState {
    #[serde(alias = "nbdkit_pid")]
    server_pid: u32,
}

/// An attached block device. Dropping it detaches it (and stops the servers it started).
pub struct Device {
    ctx: Ctx,
    pub transport: Transport,
    pub path: PathBuf,
    /// The zdisk store file or the raw image file.
    pub backing: PathBuf,
    pub dio: bool,
    /// The raw target's qemu-nbd; dropping it stops it.
    qemu: Option<Server>,
    fuse_dir: Option<PathBuf>,
    nbdfuse_pid: Option<u32>,
    serve_pid: Option<u32>,
    nbdkit_pid: Option<u32>,
    attached: bool,
}

impl Device {
    /// Formats a fresh zdisk store and attaches it. The store is preallocated: a database's
    /// every commit is a flush, and a flush onto blocks the host file system has not yet
    /// allocated waits for it (docs/format.md, "Backing allocation"); the raw image's blocks
    /// under the database files are allocated when the data set is copied in.
    pub fn zdisk_new(ctx: &Ctx, store: &Path, physical: u64, logical: u64, format_args: &[String]) -> Result<Device> {
        let mut c = ctx.zdisk();
        c.arg("format")
            .arg(store)
            .arg("--physical-size")
            .arg(physical.to_string())
            .arg("--logical-size")
            .arg(logical.to_string())
            .arg("--force")
            .arg("--preallocate")
            .args(format_args);
        run(&mut c).context("zdisk format")?;
        Device::zdisk_attach(ctx, store)
    }

    /// `zdisk attach --fuse STORE` (starts the server, recovering the store after a crash).
    pub fn zdisk_attach(ctx: &Ctx, store: &Path) -> Result<Device> {
        let mut attach = ctx.zdisk();
        attach.arg("attach").arg("--fuse").arg(store);
        if !ctx.serve_options.is_empty() {
            attach.arg("--").args(&ctx.serve_options);
        }
        let out = run(&mut attach).context("zdisk attach")?;
        let path = PathBuf::from(out.trim());
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let state: AttachState = read_json(&ctx.run_dir.join("attach").join(format!("{name}.json")))?;
        let serve: Option<ServeState> = read_json(&ctx.run_dir.join(format!("{}.serve.json", state.uuid))).ok();
        let dio = loop_dio(&path);
        Ok(Device {
            ctx: ctx.clone(),
            transport: Transport::Zdisk,
            path,
            backing: store.to_path_buf(),
            dio,
            qemu: None,
            fuse_dir: state.fuse_dir,
            nbdfuse_pid: state.nbdfuse_pid,
            serve_pid: state.started_serve_pid,
            nbdkit_pid: serve.map(|s| s.server_pid),
            attached: true,
        })
    }

    /// A fresh sparse raw image of `size` bytes served by qemu-nbd, then nbdfuse + loop.
    pub fn raw_nbd(ctx: &Ctx, image: &Path, size: u64) -> Result<Device> {
        sparse_file(image, size)?;
        let name = image.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let socket = ctx.run_dir.join(format!("{name}.qemu.sock"));
        // All of nbdfuse's connections must be let in.
        let shared = crate::parallel_requests().max(16);
        let mut c = qemu_nbd_raw(image, &socket, shared);
        // Its own process group, as every process here: Ctrl-C reaches only the harness,
        // whose teardown stops it in order.
        c.process_group(0);
        let qemu = Server::spawn("qemu-nbd", c, &socket, &ctx.work.join(format!("{name}.qemu-nbd.log")))?;
        let uri = qemu.uri();
        let fuse_dir = ctx.run_dir.join(format!("fuse-{name}"));
        let mut dev = Device {
            ctx: ctx.clone(),
            transport: Transport::RawNbd,
            path: PathBuf::new(),
            backing: image.to_path_buf(),
            dio: false,
            qemu: Some(qemu),
            fuse_dir: None,
            nbdfuse_pid: None,
            serve_pid: None,
            nbdkit_pid: None,
            attached: false,
        };
        let pid = nbdfuse(&fuse_dir, &uri)?;
        dev.fuse_dir = Some(fuse_dir.clone());
        dev.nbdfuse_pid = Some(pid);
        dev.path = losetup_dio(&fuse_dir.join("nbd"))?;
        dev.dio = loop_dio(&dev.path);
        dev.attached = true;
        Ok(dev)
    }

    /// A fresh sparse raw image on a loop device with direct I/O.
    pub fn raw_loop(ctx: &Ctx, image: &Path, size: u64) -> Result<Device> {
        sparse_file(image, size)?;
        let path = losetup_dio(image)?;
        let dio = loop_dio(&path);
        Ok(Device {
            ctx: ctx.clone(),
            transport: Transport::RawLoop,
            path,
            backing: image.to_path_buf(),
            dio,
            qemu: None,
            fuse_dir: None,
            nbdfuse_pid: None,
            serve_pid: None,
            nbdkit_pid: None,
            attached: true,
        })
    }

    /// The storage server's pid (its CPU is the server's cost): zdisk serve (nbdkit is its
    /// child) or qemu-nbd.
    pub fn server_pid(&self) -> Option<u32> {
        self.serve_pid.or(self.qemu.as_ref().and_then(Server::pid))
    }

    /// Every process of the storage server: zdisk serve and its nbdkit, or qemu-nbd.
    pub fn server_pids(&self) -> Vec<u32> {
        [self.serve_pid, self.nbdkit_pid, self.qemu.as_ref().and_then(Server::pid)].into_iter().flatten().collect()
    }

    pub fn nbdfuse_pid(&self) -> Option<u32> {
        self.nbdfuse_pid
    }

    /// `zdisk stat --json` of the store (live while served).
    pub fn zdisk_stat(&self) -> Option<serde_json::Value> {
        if self.transport != Transport::Zdisk {
            return None;
        }
        sys::zdisk_stat(self.ctx.zdisk(), &self.backing).ok()
    }

    /// Power cut of the storage: SIGKILL of the server that holds the not-yet-durable writes.
    pub fn kill_server(&self) -> Result<()> {
        let pid = self.nbdkit_pid.or(self.qemu.as_ref().and_then(Server::pid)).context("no server to kill")?;
        sys::signal(pid, libc::SIGKILL);
        Ok(())
    }

    /// Tears the device down after its server died: loop, FUSE mount, nbdfuse, state files.
    /// Fails if the killed server is not gone within a minute (it holds the store's lock).
    pub fn detach_after_cut(mut self) -> Result<()> {
        self.attached = false;
        if let Some(pid) = self.nbdkit_pid {
            if !sys::wait_gone(pid, Duration::from_secs(60)) {
                bail!("nbdkit (pid {pid}) still alive 60 s after SIGKILL");
            }
        }
        if let Some(pid) = self.serve_pid {
            if !sys::wait_gone(pid, Duration::from_secs(10)) {
                sys::signal(pid, libc::SIGKILL);
            }
        }
        let _ = run(sys::cmd("losetup")?.arg("-d").arg(&self.path));
        if let Some(dir) = self.fuse_dir.take() {
            unmount_fuse(&dir, self.nbdfuse_pid.take());
        }
        if self.transport == Transport::Zdisk {
            let name = self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let _ = std::fs::remove_file(self.ctx.run_dir.join("attach").join(format!("{name}.json")));
        }
        Ok(())
    }

    pub fn detach(mut self) -> Result<()> {
        self.detach_inner()
    }

    fn detach_inner(&mut self) -> Result<()> {
        if !self.attached {
            return Ok(());
        }
        self.attached = false;
        match self.transport {
            Transport::Zdisk => {
                run(self.ctx.zdisk().arg("detach").arg(&self.path)).context("zdisk detach")?;
            }
            Transport::RawNbd | Transport::RawLoop => {
                let r = run(sys::cmd("losetup")?.arg("-d").arg(&self.path));
                if let Some(dir) = self.fuse_dir.take() {
                    unmount_fuse(&dir, self.nbdfuse_pid.take());
                }
                // SIGTERM, SIGKILL after a grace period (the guard's rule).
                let stopped = self.qemu.take().map_or(Ok(()), |mut q| q.stop());
                r?;
                stopped?;
            }
        }
        Ok(())
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Err(e) = self.detach_inner() {
            progress(&format!("teardown: {e:#}"));
        }
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Whether the loop device does direct I/O on its backing file (losetup's DIO column).
pub fn loop_dio(device: &Path) -> bool {
    let name = device.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    sys::read_u64(Path::new(&format!("/sys/block/{name}/loop/dio"))) == Some(1)
}

fn losetup_dio(file: &Path) -> Result<PathBuf> {
    let out = run(sys::cmd("losetup")?.arg("--direct-io=on").arg("-f").arg("--show").arg(file))
        .with_context(|| format!("losetup --direct-io=on {}", file.display()))?;
    Ok(PathBuf::from(out.trim()))
}

/// nbdfuse MOUNT/nbd URI, as `zdisk attach` runs it; returns nbdfuse's pid once mounted.
fn nbdfuse(dir: &Path, uri: &str) -> Result<u32> {
    std::fs::create_dir_all(dir)?;
    let pid_file = dir.with_extension("pid");
    let _ = std::fs::remove_file(&pid_file);
    let mut c = sys::cmd("nbdfuse")?;
    // As many connections as `zdisk attach` opens for zdisk's target.
    c.arg("-C").arg(crate::parallel_requests().to_string());
    c.arg("-P").arg(&pid_file).arg(dir.join("nbd")).arg(uri);
    c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    let mut child = sys::spawn(&mut c)?;
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("nbdfuse exited ({status})");
        }
        if std::fs::read_to_string(&pid_file).map(|s| !s.trim().is_empty()).unwrap_or(false) {
            break;
        }
        if Instant::now() > end {
            let _ = child.kill();
            bail!("nbdfuse did not mount within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = child.id();
    // nbdfuse stays in the foreground of its own process group; we reap it by pid later.
    std::mem::forget(child);
    Ok(pid)
}

/// Unmounts an nbdfuse mount of this harness's, lazily and killing nbdfuse if it will not go.
fn unmount_fuse(dir: &Path, pid: Option<u32>) {
    let fusermount = sys::path_of("fusermount3").unwrap_or_else(|_| "fusermount3".into());
    for problem in sys::unmount_fuse(&fusermount, dir, pid, sys::WhenStuck::Force) {
        progress(&format!("teardown: {problem}"));
    }
}

/// ext4 mounted on a device; unmounted when dropped.
pub struct Mount {
    pub dir: PathBuf,
    mounted: bool,
}

pub fn mkfs_ext4(device: &Path) -> Result<()> {
    // Inode tables and the journal are written now, not by a background thread during the run.
    run(sys::cmd("mkfs.ext4")?.args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"]).arg(device))
        .context("mkfs.ext4")?;
    Ok(())
}

impl Mount {
    pub fn new(device: &Path, dir: &Path, options: &str) -> Result<Mount> {
        std::fs::create_dir_all(dir)?;
        run(sys::cmd("mount")?.arg("-t").arg("ext4").arg("-o").arg(options).arg(device).arg(dir))
            .with_context(|| format!("mounting {} on {}", device.display(), dir.display()))?;
        Ok(Mount { dir: dir.to_path_buf(), mounted: true })
    }

    pub fn unmount(mut self) -> Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<()> {
        if !self.mounted {
            return Ok(());
        }
        self.mounted = false;
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            match run(sys::cmd("umount")?.arg(&self.dir)) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > end => {
                    let _ = run(sys::cmd("umount")?.arg("-l").arg(&self.dir));
                    return Err(e.context("umount (lazily unmounted instead)"));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(300)),
            }
        }
    }

    /// After a power cut the device returns errors, but with every process that used the
    /// filesystem gone (the caller's job) it unmounts. If it stays busy it is unmounted lazily
    /// (so the teardown goes on) and that is an error naming who holds it.
    pub fn unmount_after_cut(mut self) -> Result<()> {
        self.mounted = false;
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            match run(sys::cmd("umount")?.arg(&self.dir)) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > end => {
                    let users = sys::users_of(&std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone()));
                    let _ = run(sys::cmd("umount")?.arg("-l").arg(&self.dir));
                    return Err(e.context(format!(
                        "unmounting {} after the power cut (lazily unmounted instead; processes using it: {users:?})",
                        self.dir.display()
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            progress(&format!("teardown: {e:#}"));
        }
    }
}

/// `cp -a SRC/. DST/` (a database directory copied file by file onto a target).
pub fn copy_tree(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst)?;
    let mut from = src.as_os_str().to_owned();
    from.push("/.");
    run(sys::cmd("cp")?.arg("-a").arg(from).arg(dst)).context("copying the database files")?;
    run(&mut sys::cmd("sync")?)?;
    Ok(())
}
