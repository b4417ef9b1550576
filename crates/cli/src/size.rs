//! Sizes on the command line: `4096`, `64K`, `256M`, `1.5G`, `2T` — the workspace's one
//! byte parser, `zdisk_bench::size::parse_bytes`, whose module states the rules — for
//! logical sizes also `Nx` = N × the native capacity (what incompressible data can always
//! fill: the engine's `native_capacity_of_physical`), and percentages for over-provisioning.

use std::fmt;
use std::str::FromStr;

use zdisk_bench::size::parse_bytes;

/// A byte count parsed from `NUMBER[K|M|G|T|P][B|iB]` (`parse_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Size, String> {
        parse_bytes(s).map(Size)
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&human_bytes(self.0))
    }
}

/// A logical size: absolute, or a multiple of the native capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LogicalSize {
    Bytes(u64),
    Times(f64),
}

impl FromStr for LogicalSize {
    type Err = String;
    fn from_str(s: &str) -> Result<LogicalSize, String> {
        let t = s.trim();
        if let Some(factor) = t.strip_suffix('x').or_else(|| t.strip_suffix('X')) {
            let factor: f64 =
                factor.trim().parse().map_err(|_| format!("bad multiplier {s:?}: expected e.g. 3x or 2.5x"))?;
            if !factor.is_finite() || factor <= 0.0 || factor > 1024.0 {
                return Err(format!("multiplier {s:?} must be in (0, 1024]"));
            }
            return Ok(LogicalSize::Times(factor));
        }
        parse_bytes(t).map(LogicalSize::Bytes)
    }
}

/// An over-provisioning share: `PCT` or `PCT%`, e.g. `7`, `12.5%`; kept as parts per million.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverProvision(pub u32);

impl FromStr for OverProvision {
    type Err = String;
    fn from_str(s: &str) -> Result<OverProvision, String> {
        let t = s.trim();
        let number = t.strip_suffix('%').unwrap_or(t).trim();
        let percent: f64 = number.parse().map_err(|_| format!("bad percentage {s:?}: expected e.g. 7 or 12.5%"))?;
        zdisk_engine::over_provision_ppm_from_percent(percent).map(OverProvision)
    }
}

impl fmt::Display for OverProvision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", self.0 as f64 / 10_000.0)
    }
}

/// The logical block (4 KiB): logical sizes are multiples of it.
pub const BLOCK_BYTES: u64 = 4096;

impl LogicalSize {
    /// Resolves against the native capacity; `Nx` rounds down to a whole 4 KiB block.
    pub fn resolve(self, native_bytes: u64) -> u64 {
        match self {
            LogicalSize::Bytes(bytes) => bytes,
            LogicalSize::Times(factor) => {
                let bytes = (native_bytes as f64 * factor) as u64;
                bytes / BLOCK_BYTES * BLOCK_BYTES
            }
        }
    }
}

/// `1.50 GiB` style, exact bytes for small values.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!("4096".parse::<Size>().unwrap().0, 4096);
        assert_eq!("64K".parse::<Size>().unwrap().0, 64 << 10);
        assert_eq!("256m".parse::<Size>().unwrap().0, 256 << 20);
        assert_eq!("1GiB".parse::<Size>().unwrap().0, 1 << 30);
        assert_eq!("1.5G".parse::<Size>().unwrap().0, 3 << 29);
        assert_eq!("2T".parse::<Size>().unwrap().0, 2 << 40);
    }

    #[test]
    fn bad_sizes_are_refused() {
        for bad in ["", "G", "12Q", "-1G", "1.3", "abc", "99999999999999T"] {
            assert!(bad.parse::<Size>().is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn logical_size_takes_a_multiplier() {
        assert_eq!("3x".parse::<LogicalSize>().unwrap().resolve(1 << 30), 3 << 30);
        assert_eq!("1.5x".parse::<LogicalSize>().unwrap().resolve(1 << 30), 3 << 29);
        assert_eq!("10G".parse::<LogicalSize>().unwrap().resolve(1 << 30), 10 << 30);
        assert_eq!("1.0001x".parse::<LogicalSize>().unwrap().resolve(1 << 20) % 4096, 0);
        assert!("0x".parse::<LogicalSize>().is_err());
        assert!("ax".parse::<LogicalSize>().is_err());
    }

    #[test]
    fn over_provisioning_is_a_percentage() {
        assert_eq!("7".parse::<OverProvision>().unwrap().0, 70_000);
        assert_eq!("12.5%".parse::<OverProvision>().unwrap().0, 125_000);
        assert_eq!("28%".parse::<OverProvision>().unwrap().to_string(), "28%");
        for bad in ["", "x", "0.1", "90", "-5", "nan"] {
            assert!(bad.parse::<OverProvision>().is_err(), "{bad:?} should be refused");
        }
    }
}
