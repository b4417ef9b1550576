//! Bad configurations: each is rejected with an error that names the offending field.

use zdisk_tco::{Config, PUBLISHED_DEFAULT_TOML};

/// The default with the first occurrence of `from` replaced by `to`.
fn edited(from: &str, to: &str) -> String {
    assert!(PUBLISHED_DEFAULT_TOML.contains(from), "test edit {from:?} matches nothing");
    PUBLISHED_DEFAULT_TOML.replacen(from, to, 1)
}

/// Parses `text`, expects an error, and checks the full message (with its causes) contains
/// every `needle`.
fn rejected(text: &str, needles: &[&str]) {
    let err = Config::from_toml_str(text).expect_err("config should be rejected");
    let message = format!("{err:#}");
    for needle in needles {
        assert!(message.contains(needle), "error does not mention {needle:?}:\n{message}");
    }
}

#[test]
fn missing_drive_field_is_named() {
    rejected(&edited("capacity_gb = 3840.0\n", ""), &["missing field `capacity_gb`", "[column.drive]"]);
}

#[test]
fn missing_rack_field_is_named() {
    rejected(&edited("pue = 1.0\n", ""), &["missing field `pue`"]);
}

#[test]
fn missing_workload_field_is_named() {
    rejected(&edited("duty_cycle_percent = 30.0\n", ""), &["missing field `duty_cycle_percent`"]);
}

#[test]
fn empty_config_names_the_first_missing_section() {
    rejected("", &["missing field `racks`"]);
}

#[test]
fn unknown_fields_are_named_at_every_level() {
    rejected(&format!("currency = \"EUR\"\n{PUBLISHED_DEFAULT_TOML}"), &["unknown field `currency`"]);
    rejected(&edited("pue = 1.0\n", "pue = 1.0\npue_summer = 1.2\n"), &["unknown field `pue_summer`"]);
    rejected(&edited("rack = \"baseline\"\n", "rack = \"baseline\"\nvendor = \"x\"\n"), &["unknown field `vendor`"]);
    // A misspelt unit suffix is the likely real-world case.
    rejected(&edited("idle_watts = 3.5", "idle_watt = 3.5"), &["unknown field `idle_watt`"]);
    rejected(
        &edited("compression_ratio = 2.2", "compression_ratio = 2.2\nzstd_level = 3"),
        &["unknown field `zstd_level`"],
    );
}

#[test]
fn wrong_types_quote_the_field() {
    rejected(
        &edited("capacity_gb = 3840.0", "capacity_gb = \"3840\""),
        &["capacity_gb = \"3840\"", "invalid type: string"],
    );
    rejected(&edited("servers_per_rack = 6", "servers_per_rack = 6.5"), &["servers_per_rack = 6.5", "expected u32"]);
    let drive_table = "[column.drive]\ncapacity_gb = 3840.0\nactive_watts = 15.0\nidle_watts = 3.5\n\
                       afr_percent = 0.44\nprice_usd_per_gb = 0.07\n";
    rejected(&edited(drive_table, "drive = 5\n"), &["drive = 5", "expected struct Drive"]);
}

#[test]
fn negative_counts_are_rejected_by_type() {
    rejected(
        &edited("drives_per_server = 12", "drives_per_server = -12"),
        &["drives_per_server = -12", "expected u32"],
    );
}

#[test]
fn impossible_values_name_the_field_path() {
    let cases = [
        ("capacity_gb = 3840.0", "capacity_gb = 0", "`column[0].drive.capacity_gb` must be > 0, got 0"),
        ("price_usd_per_gb = 0.07", "price_usd_per_gb = -0.07", "`column[0].drive.price_usd_per_gb` must be >= 0"),
        ("afr_percent = 0.44", "afr_percent = 140", "`column[0].drive.afr_percent` must be a percentage"),
        ("deployment_years = 5.0", "deployment_years = 0", "`column[0].workload.deployment_years` must be > 0"),
        ("encoding_overhead = 1.5", "encoding_overhead = 0.5", "`column[0].workload.encoding_overhead` must be >= 1"),
        (
            "performance_multiplier = 1.32",
            "performance_multiplier = 0",
            "`column[0].workload.performance_multiplier` must be > 0",
        ),
        (
            "capacity_utilization_percent = 90.0",
            "capacity_utilization_percent = 0",
            "`column[0].workload.capacity_utilization_percent`",
        ),
        ("duty_cycle_percent = 30.0", "duty_cycle_percent = 130", "`column[0].workload.duty_cycle_percent`"),
        ("compression_ratio = 2.2", "compression_ratio = -2", "`column[0].workload.compression_ratio` must be > 0"),
        (
            "compression_ratio = 2.2",
            "compression_ratio = nan",
            "`column[0].workload.compression_ratio` must be > 0, got NaN",
        ),
        ("server_usd = 11651.0", "server_usd = -1", "`racks.baseline.server_usd` must be >= 0"),
        ("pue = 1.0", "pue = 0.9", "`racks.baseline.pue` must be >= 1"),
        ("electricity_usd_per_kwh = 0.14", "electricity_usd_per_kwh = inf", "`racks.baseline.electricity_usd_per_kwh`"),
    ];
    for (from, to, needle) in cases {
        rejected(&edited(from, to), &[needle]);
    }
}

#[test]
fn a_rack_without_drives_is_rejected() {
    rejected(
        &edited("servers_per_rack = 6", "servers_per_rack = 0"),
        &["`racks.baseline.servers_per_rack`", "at least one drive"],
    );
}

#[test]
fn references_and_names_are_checked() {
    rejected(&edited("rack = \"csd\"", "rack = \"cds\""), &["`column[1].rack`", "\"cds\"", "not defined"]);
    rejected(&edited("name = \"Ceph CS SSD 3.84TB\"", "name = \"Ceph baseline\""), &["`column[1].name`", "used twice"]);
    rejected(&edited("name = \"Ceph baseline\"", "name = \" \""), &["`column[0].name` must not be empty"]);
    let racks_only = PUBLISHED_DEFAULT_TOML.split("[[column]]").next().unwrap();
    rejected(&format!("column = []\n{racks_only}"), &["`column` must list at least one"]);
}

#[test]
fn config_file_errors_name_the_file() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("tco-bad-config.toml");
    std::fs::write(&path, edited("pue = 1.0\n", "")).unwrap();
    let err = Config::from_file(&path).unwrap_err();
    let message = format!("{err:#}");
    assert!(message.contains("tco-bad-config.toml") && message.contains("`pue`"), "{message}");
    let err = Config::from_file(&dir.join("no-such-config.toml")).unwrap_err();
    assert!(format!("{err:#}").contains("no-such-config.toml"));
}
