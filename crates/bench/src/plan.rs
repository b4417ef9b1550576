//! What to run: targets, workloads, data modes, and the resolved plan for one invocation.

use serde::Serialize;

/// A block device served over NBD that the benchmark measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetKind {
    /// zdisk: `zdisk format` + `zdisk serve` (nbdkit + the zdisk plugin).
    Zdisk,
    /// The honest raw baseline: a raw file behind `qemu-nbd --cache=none --aio=native` (O_DIRECT).
    Raw,
    /// A second raw row: `nbdkit file cache=none` (NOT O_DIRECT in nbdkit 1.32: page cache).
    NbdkitFile,
    /// `nbdkit memory`: the transport ceiling (no disk at all).
    Memory,
}

impl TargetKind {
    pub const ALL: [TargetKind; 4] = [Self::Zdisk, Self::Raw, Self::NbdkitFile, Self::Memory];

    pub fn key(self) -> &'static str {
        match self {
            Self::Zdisk => "zdisk",
            Self::Raw => "raw",
            Self::NbdkitFile => "nbdkit-file",
            Self::Memory => "memory",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::Zdisk => "zdisk",
            Self::Raw => "raw (qemu-nbd, O_DIRECT)",
            Self::NbdkitFile => "raw (nbdkit file, page cache)",
            Self::Memory => "nbdkit memory (ceiling)",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Self::Zdisk => "zdisk format + zdisk serve --unix (nbdkit with the zdisk plugin) on a store file in the backing directory",
            Self::Raw => "raw file in the backing directory behind qemu-nbd -f raw --cache=none --aio=native (O_DIRECT): the honest raw baseline",
            Self::NbdkitFile => "raw file in the backing directory behind nbdkit file cache=none; in nbdkit 1.32 cache=none is NOT O_DIRECT (it drops pages after writing), so the page cache still helps this row",
            Self::Memory => "nbdkit memory: RAM behind the same NBD transport, the ceiling no disk-backed target can beat",
        }
    }

    /// SVG/HTML colour for this target's series, fixed so every chart reads the same.
    pub fn rgb(self) -> (u8, u8, u8) {
        match self {
            Self::Zdisk => (31, 119, 180),
            Self::Raw => (214, 39, 40),
            Self::NbdkitFile => (255, 127, 14),
            Self::Memory => (127, 127, 127),
        }
    }

    /// Whether the consistency test (a disk-wear test) means anything for this target.
    pub fn has_disk(self) -> bool {
        !matches!(self, Self::Memory)
    }
}

/// The reviewers' workloads (see SEEDS.md "How they test").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
pub enum WorkloadKind {
    #[value(name = "4k-randread")]
    #[serde(rename = "4k-randread")]
    RandRead4k,
    #[value(name = "4k-randwrite")]
    #[serde(rename = "4k-randwrite")]
    RandWrite4k,
    #[value(name = "8k-randread")]
    #[serde(rename = "8k-randread")]
    RandRead8k,
    #[value(name = "8k-randwrite")]
    #[serde(rename = "8k-randwrite")]
    RandWrite8k,
    #[value(name = "128k-seqread")]
    #[serde(rename = "128k-seqread")]
    SeqRead128k,
    #[value(name = "128k-seqwrite")]
    #[serde(rename = "128k-seqwrite")]
    SeqWrite128k,
    #[value(name = "4k-70-30")]
    #[serde(rename = "4k-70-30")]
    Mix4k7030,
    #[value(name = "email")]
    #[serde(rename = "email")]
    Email,
    #[value(name = "oltp")]
    #[serde(rename = "oltp")]
    Oltp,
    #[value(name = "web")]
    #[serde(rename = "web")]
    Web,
}

/// The Intel IOMeter "web server" profile (512 B .. 512 KiB, reads only) as fio bssplit.
pub const WEB_BSSPLIT: &str = "512/22:1k/15:2k/8:4k/23:8k/15:16k/2:32k/6:64k/7:128k/1:512k/1";

impl WorkloadKind {
    pub const ALL: [WorkloadKind; 10] = [
        Self::RandRead4k,
        Self::RandWrite4k,
        Self::RandRead8k,
        Self::RandWrite8k,
        Self::SeqRead128k,
        Self::SeqWrite128k,
        Self::Mix4k7030,
        Self::Email,
        Self::Oltp,
        Self::Web,
    ];

    pub fn key(self) -> &'static str {
        match self {
            Self::RandRead4k => "4k-randread",
            Self::RandWrite4k => "4k-randwrite",
            Self::RandRead8k => "8k-randread",
            Self::RandWrite8k => "8k-randwrite",
            Self::SeqRead128k => "128k-seqread",
            Self::SeqWrite128k => "128k-seqwrite",
            Self::Mix4k7030 => "4k-70-30",
            Self::Email => "email",
            Self::Oltp => "oltp",
            Self::Web => "web",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::RandRead4k => "4K random read",
            Self::RandWrite4k => "4K random write",
            Self::RandRead8k => "8K random read",
            Self::RandWrite8k => "8K random write",
            Self::SeqRead128k => "128K sequential read",
            Self::SeqWrite128k => "128K sequential write",
            Self::Mix4k7030 => "4K 70/30 random mix",
            Self::Email => "Email server 8K 50/50",
            Self::Oltp => "OLTP 8K 66/33",
            Self::Web => "Web server 512B-512K reads",
        }
    }

    /// fio `rw=`.
    pub fn fio_rw(self) -> &'static str {
        match self {
            Self::RandRead4k | Self::RandRead8k | Self::Web => "randread",
            Self::RandWrite4k | Self::RandWrite8k => "randwrite",
            Self::SeqRead128k => "read",
            Self::SeqWrite128k => "write",
            Self::Mix4k7030 | Self::Email | Self::Oltp => "randrw",
        }
    }

    /// fio `bs=` (None when a bssplit is used instead).
    pub fn fio_bs(self) -> Option<&'static str> {
        match self {
            Self::RandRead4k | Self::RandWrite4k | Self::Mix4k7030 => Some("4k"),
            Self::RandRead8k | Self::RandWrite8k | Self::Email | Self::Oltp => Some("8k"),
            Self::SeqRead128k | Self::SeqWrite128k => Some("128k"),
            Self::Web => None,
        }
    }

    pub fn fio_bssplit(self) -> Option<&'static str> {
        matches!(self, Self::Web).then_some(WEB_BSSPLIT)
    }

    /// fio `rwmixread=` for the mixed workloads.
    pub fn rwmixread_pct(self) -> Option<u32> {
        match self {
            Self::Mix4k7030 => Some(70),
            Self::Email => Some(50),
            Self::Oltp => Some(66),
            _ => None,
        }
    }

    /// Whether the workload writes (and therefore changes the drive's state while it runs).
    pub fn writes(self) -> bool {
        !matches!(self.fio_rw(), "randread" | "read")
    }

    /// Whether throughput (MB/s) is the number people quote rather than IOPS.
    pub fn is_bandwidth(self) -> bool {
        matches!(self, Self::SeqRead128k | Self::SeqWrite128k)
    }
}

/// What the bytes written look like, i.e. how compressible they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
pub enum DataMode {
    #[value(name = "incompressible", alias = "incomp", alias = "1:1")]
    #[serde(rename = "incompressible")]
    Incompressible,
    #[value(name = "2:1", alias = "2to1")]
    #[serde(rename = "2:1")]
    Ratio2,
    #[value(name = "4:1", alias = "4to1")]
    #[serde(rename = "4:1")]
    Ratio4,
    /// Real files from this machine (/usr/share, /usr/lib) at rest; see docs/bench.md.
    #[value(name = "real")]
    #[serde(rename = "real")]
    Real,
}

impl DataMode {
    pub const ALL: [DataMode; 4] = [Self::Incompressible, Self::Ratio2, Self::Ratio4, Self::Real];

    pub fn key(self) -> &'static str {
        match self {
            Self::Incompressible => "incompressible",
            Self::Ratio2 => "2:1",
            Self::Ratio4 => "4:1",
            Self::Real => "real",
        }
    }

    /// File-name-safe key.
    pub fn slug(self) -> &'static str {
        match self {
            Self::Incompressible => "incomp",
            Self::Ratio2 => "2to1",
            Self::Ratio4 => "4to1",
            Self::Real => "real",
        }
    }

    /// fio `buffer_compress_percentage` for synthetic data; the real mode is calibrated at run
    /// time from the corpus, so it has none here.
    pub fn compress_pct(self) -> Option<u32> {
        match self {
            Self::Incompressible => Some(0),
            Self::Ratio2 => Some(50),
            Self::Ratio4 => Some(75),
            Self::Real => None,
        }
    }
}
