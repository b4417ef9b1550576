//! Byte sizes as people type them, the one parser of the workspace: `zdisk format`, `serve`
//! and the other store commands (through the CLI's `Size` and `LogicalSize`), `zdisk bench
//! --size` and `zdisk db bench --buffer-pool`/`--log-file-size`/`--fs-size` all read sizes
//! here, so a size one command takes every other takes too. It lives in the benchmark
//! harness because that is the one crate the CLI and `zdisk db` (apps) both depend on that
//! does not bring the engine with it.
//!
//! The rules (`parse_bytes`):
//! - `NUMBER[UNIT]`, white space around either part allowed: `4096`, `64K`, `256 M`, `1.5G`.
//! - UNIT is `K`, `M`, `G`, `T` or `P` — binary (powers of 1024), any case — optionally
//!   followed by `B`, `iB` or `i` (`64KB`, `64KiB`, `64Ki` are all 65536); `B` alone means
//!   bytes. There are no decimal (power of 1000) units: `1GB` is 2^30 bytes, as zdisk always
//!   read it (unlike `dd`, where GB is 10^9).
//! - NUMBER is a decimal integer (exact up to `u64::MAX`), or a decimal fraction (exponent
//!   notation too: `1e3`) when the product is a whole number of bytes (`1.5G` yes, `1.3` or
//!   `0.1K` no: which byte would be meant?).
//! - Not negative, not past `u64::MAX`. Zero is a size (`--write-behind 0`); a place where
//!   zero means nothing sensible takes `parse_nonzero_bytes`.
//!
//! Errors are strings naming the input and what is wrong with it, for clap to print.

const EXPECTED: &str =
    "expected a number with an optional unit K, M, G, T or P (binary: 64K = 65536), e.g. 4096, 64M, 1.5G";

/// The shift of a unit letter (`k` → 10, …); the text is already lower case.
fn unit_shift(letter: char) -> Option<u32> {
    match letter {
        'k' => Some(10),
        'm' => Some(20),
        'g' => Some(30),
        't' => Some(40),
        'p' => Some(50),
        _ => None,
    }
}

/// Parses a byte count by the rules above.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let s = text.trim();
    if s.starts_with('-') {
        return Err(format!("bad size {text:?}: a size is not negative"));
    }
    let lower = s.to_ascii_lowercase();
    // The unit's tail (`ib`, `i` or `b`), then its letter. Only `b` may stand without a
    // letter (`4096b` is bytes); `4096i` names no unit.
    let (rest, letter_required) = if let Some(rest) = lower.strip_suffix("ib") {
        (rest, true)
    } else if let Some(rest) = lower.strip_suffix('i') {
        (rest, true)
    } else {
        (lower.strip_suffix('b').unwrap_or(&lower), false)
    };
    let (number, shift) = match rest.chars().last().and_then(unit_shift) {
        Some(shift) => (&rest[..rest.len() - 1], shift),
        None if letter_required => return Err(format!("bad size {text:?}: {EXPECTED}")),
        None => (rest, 0),
    };
    let number = number.trim();
    if number.is_empty() {
        return Err(format!("bad size {text:?}: {EXPECTED}"));
    }
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(1u64 << shift).ok_or_else(|| format!("size {text:?} is too large"));
    }
    let value: f64 = number.parse().map_err(|_| format!("bad size {text:?}: {EXPECTED}"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("bad size {text:?}: {EXPECTED}"));
    }
    let bytes = value * (1u64 << shift) as f64;
    if bytes >= u64::MAX as f64 {
        return Err(format!("size {text:?} is too large"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!("size {text:?} is not a whole number of bytes ({bytes} bytes)"));
    }
    Ok(bytes as u64)
}

/// `parse_bytes`, refusing zero: for sizes of things that must exist (a target, a buffer pool).
pub fn parse_nonzero_bytes(text: &str) -> Result<u64, String> {
    match parse_bytes(text)? {
        0 => Err(format!("bad size {text:?}: must be larger than zero")),
        bytes => Ok(bytes),
    }
}

/// Human-readable binary size for messages and reports: whole units without decimals
/// (`1 GiB`), others with two (`1.50 GiB`).
pub fn fmt_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, unit) in UNITS {
        if bytes >= unit {
            let v = bytes as f64 / unit as f64;
            return if (v - v.round()).abs() < 1e-9 {
                format!("{} {name}", v.round())
            } else {
                format!("{v:.2} {name}")
            };
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_units_in_every_spelling() {
        for (text, bytes) in [
            ("4096", 4096),
            ("4096b", 4096),
            ("4096B", 4096),
            ("64K", 64 << 10),
            ("64k", 64 << 10),
            ("64KB", 64 << 10),
            ("64KiB", 64 << 10),
            ("64Ki", 64 << 10),
            ("256m", 256 << 20),
            ("64MiB", 64 << 20),
            ("64mb", 64 << 20),
            ("1GiB", 1 << 30),
            ("1.5G", 3 << 29),
            ("1.5g", 3 << 29),
            ("0.5K", 512),
            ("1e3", 1000),
            ("2T", 2 << 40),
            ("1P", 1 << 50),
            (" 256 M ", 256 << 20),
            ("+64M", 64 << 20),
            ("0", 0),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(parse_bytes(text), Ok(bytes), "{text:?}");
        }
    }

    #[test]
    fn bad_sizes_are_refused_with_the_reason() {
        for (bad, reason) in [
            ("", "expected a number"),
            ("G", "expected a number"),
            ("KiB", "expected a number"),
            ("12Q", "expected a number"),
            ("4096i", "expected a number"),
            ("4096ib", "expected a number"),
            ("abc", "expected a number"),
            ("1..5G", "expected a number"),
            ("nan", "expected a number"),
            ("inf", "expected a number"),
            ("-1G", "not negative"),
            ("1.3", "not a whole number of bytes"),
            ("0.1K", "not a whole number of bytes"),
            ("99999999999999T", "too large"),
            ("18446744073709551616", "too large"),
            ("1e30", "too large"),
        ] {
            let err = parse_bytes(bad).expect_err(bad);
            assert!(err.contains(reason), "{bad:?}: {err}");
            assert!(err.contains(&format!("{bad:?}")), "the error names the input: {err}");
        }
    }

    #[test]
    fn nonzero_sizes_refuse_zero_only() {
        assert_eq!(parse_nonzero_bytes("4G"), Ok(4 << 30));
        assert_eq!(parse_nonzero_bytes("1"), Ok(1));
        assert!(parse_nonzero_bytes("0").unwrap_err().contains("larger than zero"));
        assert!(parse_nonzero_bytes("0K").unwrap_err().contains("larger than zero"));
        assert!(parse_nonzero_bytes("x").unwrap_err().contains("expected a number"));
    }

    #[test]
    fn sizes_print_in_the_largest_whole_unit() {
        assert_eq!(fmt_size(1 << 30), "1 GiB");
        assert_eq!(fmt_size(3 << 29), "1.50 GiB");
        assert_eq!(fmt_size(512), "512 B");
    }
}
