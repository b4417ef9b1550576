//! A bandwidth cap on the storage servers' disk (`zdisk db bench --disk-mbps`): a cgroup
//! v1 `blkio` group whose throttle limits the reads and writes its processes issue to the
//! disk under the work directory.
//!
//! Why: on a virtual disk the databases here wait on the latency of a chain of page reads
//! and fsyncs, not on bandwidth, so writing fewer bytes cannot show. The whitepaper's drives
//! were bandwidth-bound. Capping both NBD targets' servers at the same rate gives the
//! comparison where bytes are the limit, side by side, on the same disk. The cap counts
//! bytes only (a flush is not a byte), and only what the servers issue: the database itself
//! writes to a loop device, which the rule does not name.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

const BLKIO_ROOT: &str = "/sys/fs/cgroup/blkio";

/// A throttled blkio group. Dropping it moves its processes back to the root group and
/// removes it.
pub struct DiskThrottle {
    dir: PathBuf,
    /// The whole disk the rule names, as `major:minor`.
    pub device: String,
    pub bytes_per_s: u64,
}

impl DiskThrottle {
    /// Creates a group that caps reads and writes to the disk holding `dir` at `mbps`
    /// megabytes (10^6 bytes) a second each way.
    pub fn new(dir: &Path, mbps: u32) -> Result<DiskThrottle> {
        let root = Path::new(BLKIO_ROOT);
        if !root.join("blkio.throttle.write_bps_device").exists() {
            bail!(
                "--disk-mbps needs the cgroup v1 blkio controller at {BLKIO_ROOT} (this machine has none); \
                 on a cgroup v2 machine, put the storage servers in a group with io.max set by hand"
            );
        }
        let device = whole_disk_of(dir)?;
        let bytes_per_s = u64::from(mbps) * 1_000_000;
        let group = root.join(format!("zdisk-db-{}", std::process::id()));
        std::fs::create_dir_all(&group).with_context(|| format!("creating {}", group.display()))?;
        let throttle = DiskThrottle { dir: group, device, bytes_per_s };
        for file in ["blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"] {
            let rule = format!("{} {bytes_per_s}", throttle.device);
            std::fs::write(throttle.dir.join(file), &rule)
                .with_context(|| format!("writing '{rule}' to {}", throttle.dir.join(file).display()))?;
        }
        Ok(throttle)
    }

    /// Puts process `pid` (all its threads) under the cap.
    pub fn add(&self, pid: u32) -> Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving pid {pid} into {}", self.dir.display()))
    }

    /// Bytes the group's processes read and wrote to the capped disk so far.
    pub fn io_bytes(&self) -> (u64, u64) {
        let text = std::fs::read_to_string(self.dir.join("blkio.throttle.io_service_bytes")).unwrap_or_default();
        let field = |op: &str| {
            text.lines()
                .filter_map(|l| {
                    let mut it = l.split_whitespace();
                    (it.next() == Some(self.device.as_str()) && it.next() == Some(op)).then(|| it.next())?
                })
                .filter_map(|v| v.parse::<u64>().ok())
                .sum::<u64>()
        };
        (field("Read"), field("Write"))
    }
}

impl Drop for DiskThrottle {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.split_whitespace() {
            let _ = std::fs::write(Path::new(BLKIO_ROOT).join("cgroup.procs"), pid);
        }
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!("zdisk db: could not remove {}: {e}", self.dir.display());
        }
    }
}

/// `major:minor` of the whole disk under `dir`'s file system (throttle rules name disks, not
/// partitions).
fn whole_disk_of(dir: &Path) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir).with_context(|| format!("stat {}", dir.display()))?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    if !sys.exists() {
        bail!(
            "{} is on device {major}:{minor}, which is not a block device (tmpfs?): nothing to throttle",
            dir.display()
        );
    }
    if sys.join("partition").exists() {
        let parent = std::fs::read_to_string(sys.join("../dev")).context("the partition's disk")?;
        return Ok(parent.trim().to_string());
    }
    Ok(format!("{major}:{minor}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_under_a_directory_is_named_as_major_colon_minor() {
        // /sys exists on any Linux test machine; the root file system may be on a disk or
        // not (an overlay in a container), and both answers must be well formed.
        match whole_disk_of(Path::new("/")) {
            Ok(dev) => {
                let (major, minor) = dev.split_once(':').expect("major:minor");
                assert!(major.parse::<u32>().is_ok() && minor.parse::<u32>().is_ok(), "{dev}");
            }
            Err(e) => assert!(e.to_string().contains("not a block device"), "{e:#}"),
        }
    }
}
