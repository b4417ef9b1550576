//! The TCO model's inputs, as read from TOML.
//!
//! Invariants kept here:
//! - Parsing is serde + toml only: every field is required, unknown fields are rejected
//!   (`deny_unknown_fields`), and wrong types are toml's errors, which quote the offending line.
//! - After parsing, [`Config::validate`] checks what types cannot (signs, ranges, references)
//!   and names the failing field by its TOML path, e.g. `column[1].drive.capacity_gb`.
//! - A [`Config`] handed to the model has been validated, so the model may divide by every
//!   quantity that validation declared positive.

use std::collections::{BTreeMap, HashSet};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// The appendix's three columns, with comments; printed by `--print-default-config`.
pub const PUBLISHED_DEFAULT_TOML: &str = include_str!("published_default.toml");

/// A whole model: named rack profiles and the columns that use them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Rack and system attributes by profile name (`[racks.NAME]`).
    pub racks: BTreeMap<String, RackProfile>,
    /// The table's columns, in output order (`[[column]]`).
    #[serde(rename = "column")]
    pub columns: Vec<Column>,
}

/// "Rack and System Attributes" and "Fixed" of the appendix: one column of that block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RackProfile {
    /// Data-centre charge for rack space and cooling, per rack per month.
    pub datacenter_usd_per_rack_month: f64,
    pub rack_usd: f64,
    /// One server; utility servers cost the same as storage servers.
    pub server_usd: f64,
    pub jbod_usd: f64,
    /// One switch per rack.
    pub switch_usd: f64,
    pub server_watts: f64,
    pub jbod_watts: f64,
    pub switch_watts: f64,
    pub server_ru: u32,
    pub jbod_ru: u32,
    pub switch_ru: u32,
    pub drives_per_server: u32,
    pub drives_per_jbod: u32,
    /// Storage servers: the ones holding drives.
    pub servers_per_rack: u32,
    pub jbods_per_rack: u32,
    /// Servers without storage (monitors, gateways): cost, power and space, no capacity.
    pub utility_servers_per_rack: u32,
    pub electricity_usd_per_kwh: f64,
    /// Power usage effectiveness: facility watts per IT watt (>= 1).
    pub pue: f64,
    /// Cost of replacing one failed drive (not the drive's price).
    pub drive_replacement_usd: f64,
}

/// One column of the table: a drive, a workload, and the rack profile it sits in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Column {
    /// Unique; `--bench-column` selects a column by it.
    pub name: String,
    /// A key of [`Config::racks`].
    pub rack: String,
    pub drive: Drive,
    pub workload: Workload,
}

/// "Drive Attributes" of the appendix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drive {
    /// Raw capacity in decimal GB (1 TB = 1000 GB).
    pub capacity_gb: f64,
    pub active_watts: f64,
    pub idle_watts: f64,
    /// Annualised failure rate, percent of drives per year.
    pub afr_percent: f64,
    /// Average selling price per raw GB.
    pub price_usd_per_gb: f64,
}

/// "Workload" of the appendix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub deployment_years: f64,
    /// Raw bytes stored per protected byte: 2.0 for two replicas, 1.5 for 4+2 erasure coding.
    pub encoding_overhead: f64,
    /// How many times this column's hardware is needed to reach the throughput of the
    /// comparison; effective capacity is divided by it (the appendix puts 1.32 on the slower
    /// Ceph baseline).
    pub performance_multiplier: f64,
    pub capacity_utilization_percent: f64,
    /// Share of time the drives draw active rather than idle power.
    pub duty_cycle_percent: f64,
    /// Logical bytes per stored byte (zdisk's `comp_ratio`); the appendix's "Data Reduction
    /// Ratio" percentage is its reciprocal.
    pub compression_ratio: f64,
}

impl Config {
    /// The appendix's three columns.
    pub fn published_default() -> Config {
        Config::from_toml_str(PUBLISHED_DEFAULT_TOML).expect("the built-in published_default.toml is valid (tested)")
    }

    /// Parses and validates; errors name the failing field.
    pub fn from_toml_str(text: &str) -> anyhow::Result<Config> {
        let config: Config = toml::from_str(text).context("invalid TCO configuration")?;
        config.validate()?;
        Ok(config)
    }

    pub fn from_file(path: &std::path::Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read TCO configuration {}", path.display()))?;
        Config::from_toml_str(&text).with_context(|| format!("in TCO configuration {}", path.display()))
    }

    pub fn to_toml_string(&self) -> anyhow::Result<String> {
        toml::to_string(self).context("cannot serialise the TCO configuration")
    }

    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|column| column.name == name)
    }

    /// Checks what the types cannot. The error names the field by its TOML path.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.columns.is_empty() {
            bail!("config field `column` must list at least one [[column]]");
        }
        for (name, rack) in &self.racks {
            rack.validate(&format!("racks.{name}"))?;
        }
        let mut names = HashSet::new();
        for (index, column) in self.columns.iter().enumerate() {
            let path = format!("column[{index}]");
            if column.name.trim().is_empty() {
                bail!("config field `{path}.name` must not be empty");
            }
            if !names.insert(column.name.as_str()) {
                bail!("config field `{path}.name`: column name {:?} is used twice", column.name);
            }
            if !self.racks.contains_key(&column.rack) {
                let known: Vec<&str> = self.racks.keys().map(String::as_str).collect();
                bail!(
                    "config field `{path}.rack` names rack profile {:?}, which is not defined \
                     (defined: {known:?})",
                    column.rack
                );
            }
            column.drive.validate(&format!("{path}.drive"))?;
            column.workload.validate(&format!("{path}.workload"))?;
        }
        Ok(())
    }
}

impl RackProfile {
    /// Drives that hold capacity: in storage servers and JBODs, not in utility servers.
    pub fn drives_per_rack(&self) -> u64 {
        u64::from(self.drives_per_server) * u64::from(self.servers_per_rack)
            + u64::from(self.drives_per_jbod) * u64::from(self.jbods_per_rack)
    }

    pub fn all_servers_per_rack(&self) -> u64 {
        u64::from(self.servers_per_rack) + u64::from(self.utility_servers_per_rack)
    }

    fn validate(&self, path: &str) -> anyhow::Result<()> {
        use Rule::*;
        check(path, "datacenter_usd_per_rack_month", self.datacenter_usd_per_rack_month, NonNegative)?;
        check(path, "rack_usd", self.rack_usd, NonNegative)?;
        check(path, "server_usd", self.server_usd, NonNegative)?;
        check(path, "jbod_usd", self.jbod_usd, NonNegative)?;
        check(path, "switch_usd", self.switch_usd, NonNegative)?;
        check(path, "server_watts", self.server_watts, NonNegative)?;
        check(path, "jbod_watts", self.jbod_watts, NonNegative)?;
        check(path, "switch_watts", self.switch_watts, NonNegative)?;
        check(path, "electricity_usd_per_kwh", self.electricity_usd_per_kwh, NonNegative)?;
        check(path, "pue", self.pue, AtLeast(1.0))?;
        check(path, "drive_replacement_usd", self.drive_replacement_usd, NonNegative)?;
        // Capacity divides every per-TB figure, so a rack without drives is an input error.
        if self.drives_per_rack() == 0 {
            bail!(
                "config fields `{path}.drives_per_server` x `{path}.servers_per_rack` + \
                 `{path}.drives_per_jbod` x `{path}.jbods_per_rack` must give at least one drive \
                 per rack, got 0"
            );
        }
        Ok(())
    }
}

impl Drive {
    fn validate(&self, path: &str) -> anyhow::Result<()> {
        use Rule::*;
        check(path, "capacity_gb", self.capacity_gb, Positive)?;
        check(path, "active_watts", self.active_watts, NonNegative)?;
        check(path, "idle_watts", self.idle_watts, NonNegative)?;
        check(path, "afr_percent", self.afr_percent, Percent)?;
        check(path, "price_usd_per_gb", self.price_usd_per_gb, NonNegative)
    }
}

impl Workload {
    fn validate(&self, path: &str) -> anyhow::Result<()> {
        use Rule::*;
        check(path, "deployment_years", self.deployment_years, Positive)?;
        // Below 1 the encoding would create capacity out of nothing.
        check(path, "encoding_overhead", self.encoding_overhead, AtLeast(1.0))?;
        check(path, "performance_multiplier", self.performance_multiplier, Positive)?;
        check(path, "capacity_utilization_percent", self.capacity_utilization_percent, PositivePercent)?;
        check(path, "duty_cycle_percent", self.duty_cycle_percent, Percent)?;
        check(path, "compression_ratio", self.compression_ratio, Positive)
    }

    /// Effective TB per raw TB: usable share, data reduction, protection overhead and the
    /// extra hardware a slower column needs for the same throughput.
    pub fn effective_per_raw(&self) -> f64 {
        (self.capacity_utilization_percent / 100.0) * self.compression_ratio
            / self.encoding_overhead
            / self.performance_multiplier
    }
}

#[derive(Clone, Copy)]
enum Rule {
    Positive,
    NonNegative,
    AtLeast(f64),
    /// [0, 100]
    Percent,
    /// (0, 100]
    PositivePercent,
}

fn check(path: &str, field: &str, value: f64, rule: Rule) -> anyhow::Result<()> {
    // TOML accepts `nan` and `inf`; neither is a price or a count.
    let ok = value.is_finite()
        && match rule {
            Rule::Positive => value > 0.0,
            Rule::NonNegative => value >= 0.0,
            Rule::AtLeast(min) => value >= min,
            Rule::Percent => (0.0..=100.0).contains(&value),
            Rule::PositivePercent => value > 0.0 && value <= 100.0,
        };
    if ok {
        return Ok(());
    }
    let want = match rule {
        Rule::Positive => "> 0".to_string(),
        Rule::NonNegative => ">= 0".to_string(),
        Rule::AtLeast(min) => format!(">= {min}"),
        Rule::Percent => "a percentage in [0, 100]".to_string(),
        Rule::PositivePercent => "a percentage in (0, 100]".to_string(),
    };
    bail!("config field `{path}.{field}` must be {want}, got {value}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_default_parses_and_round_trips_through_toml() {
        let config = Config::published_default();
        assert_eq!(config.columns.len(), 3);
        let again = Config::from_toml_str(&config.to_toml_string().unwrap()).unwrap();
        assert_eq!(config, again);
    }

    #[test]
    fn check_rejects_nan_even_where_anything_goes() {
        let err = check("x", "y", f64::NAN, Rule::NonNegative).unwrap_err();
        assert!(err.to_string().contains("`x.y`"), "{err}");
    }

    #[test]
    fn effective_per_raw_of_the_published_columns() {
        let config = Config::published_default();
        let factors: Vec<f64> = config.columns.iter().map(|c| c.workload.effective_per_raw()).collect();
        // 0.9 x 2.2 / 1.5 / 1.32 = 1 ; 0.9 x 2 / 1.5 / 1 = 1.2
        assert!((factors[0] - 1.0).abs() < 1e-12);
        assert!((factors[1] - 1.2).abs() < 1e-12);
        assert!((factors[2] - 1.2).abs() < 1e-12);
    }
}
