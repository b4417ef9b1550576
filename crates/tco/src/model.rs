//! The SNIA storage TCO model: validated [`Config`] in, one [`ColumnReport`] per column out.
//!
//! Invariants: every figure is computed at full `f64` precision; rounding happens only when
//! rendering. Every division is by a quantity [`Config::validate`] declared positive (capacity,
//! deployment term, effective-capacity factor), so every output is finite.
//! The formulas are written out in docs/tco.md; each line below names its appendix row.

use serde::Serialize;

use crate::config::{Column, Config, RackProfile};

/// 365-day years: the appendix's 5-year energy cost matches 43,800 h, with no leap days.
pub const HOURS_PER_YEAR: f64 = 8760.0;
pub const MONTHS_PER_YEAR: f64 = 12.0;
pub const GB_PER_TB: f64 = 1000.0;
pub const TB_PER_PB: f64 = 1000.0;
pub const WATTS_PER_KW: f64 = 1000.0;

/// The model's output for every column, in config order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub columns: Vec<ColumnReport>,
}

/// One column of the output table. Names follow the appendix rows, with units last.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ColumnReport {
    pub name: String,
    pub rack: String,

    // Rack and system totals ("Totals" block of the appendix).
    pub drives_per_rack: u64,
    pub drive_price_usd: f64,
    pub rack_capex_usd: f64,
    pub rack_watts: f64,
    pub rack_size_ru: u64,

    // Workload, as used.
    pub compression_ratio: f64,
    /// Stored bytes / logical bytes, the appendix's "Data Reduction Ratio" percentage.
    pub data_reduction_percent: f64,
    pub performance_multiplier: f64,
    pub effective_tb_per_raw_tb: f64,

    // CapEx.
    pub capacity_per_rack_tb: f64,
    pub effective_capacity_per_rack_tbe: f64,
    pub capex_storage_per_rack_usd: f64,
    pub capex_rack_usd: f64,
    pub capex_total_per_rack_usd: f64,
    pub capex_per_tb_raw_usd: f64,
    pub capex_per_tbe_usd: f64,
    pub capex_per_tbe_month_usd: f64,

    // OpEx, over the deployment term.
    pub power_storage_watts: f64,
    pub power_max_watts: f64,
    pub opex_storage_usd: f64,
    pub opex_rack_usd: f64,
    pub opex_drive_failures_usd: f64,
    pub opex_rackspace_cooling_usd: f64,
    pub opex_total_per_rack_usd: f64,
    pub opex_per_tb_raw_usd: f64,
    pub opex_per_tbe_usd: f64,
    pub opex_per_tbe_month_usd: f64,

    // Total cost of ownership.
    pub tco_per_tbe_usd: f64,
    pub tco_per_tbe_month_usd: f64,
    pub capacity_per_rack_pb: f64,
    pub effective_capacity_per_rack_pbe: f64,
}

/// Runs the model on every column. The config must have passed [`Config::validate`]
/// (every constructor of a [`Config`] in this crate does that).
pub fn compute(config: &Config) -> Report {
    let columns = config
        .columns
        .iter()
        .map(|column| {
            let rack =
                config.racks.get(&column.rack).expect("validate() checked that every column's rack profile exists");
            compute_column(column, rack)
        })
        .collect();
    Report { columns }
}

fn compute_column(column: &Column, rack: &RackProfile) -> ColumnReport {
    let drive = &column.drive;
    let workload = &column.workload;
    let drives = rack.drives_per_rack();
    let drives_f = drives as f64;
    let servers_f = rack.all_servers_per_rack() as f64;
    let jbods_f = f64::from(rack.jbods_per_rack);

    // Totals: utility servers cost money, power and space but hold no drives.
    let rack_capex_usd = rack.rack_usd + servers_f * rack.server_usd + jbods_f * rack.jbod_usd + rack.switch_usd;
    let rack_watts = servers_f * rack.server_watts + jbods_f * rack.jbod_watts + rack.switch_watts;
    let rack_size_ru = rack.all_servers_per_rack() * u64::from(rack.server_ru)
        + u64::from(rack.jbods_per_rack) * u64::from(rack.jbod_ru)
        + u64::from(rack.switch_ru);

    let effective = workload.effective_per_raw();
    assert!(effective.is_finite() && effective > 0.0, "validated inputs give a positive factor");
    let capacity_per_rack_tb = drive.capacity_gb * drives_f / GB_PER_TB;
    assert!(capacity_per_rack_tb > 0.0, "validate() requires drives and capacity");
    let effective_capacity_per_rack_tbe = capacity_per_rack_tb * effective;
    let months = workload.deployment_years * MONTHS_PER_YEAR;
    let hours = workload.deployment_years * HOURS_PER_YEAR;

    // CapEx.
    let drive_price_usd = drive.capacity_gb * drive.price_usd_per_gb;
    let capex_storage_per_rack_usd = drive_price_usd * drives_f;
    let capex_rack_usd = rack_capex_usd;
    let capex_total_per_rack_usd = capex_storage_per_rack_usd + capex_rack_usd;
    let capex_per_tb_raw_usd = capex_total_per_rack_usd / capacity_per_rack_tb;
    let capex_per_tbe_usd = capex_total_per_rack_usd / effective_capacity_per_rack_tbe;

    // OpEx. Energy is billed at the facility meter, so IT watts are scaled by the PUE.
    let duty = workload.duty_cycle_percent / 100.0;
    let power_storage_watts = drives_f * (drive.active_watts * duty + drive.idle_watts * (1.0 - duty));
    // The rack's power budget must cover every drive active at once.
    let power_max_watts = rack_watts + drives_f * drive.active_watts;
    let usd_per_watt_term = hours / WATTS_PER_KW * rack.electricity_usd_per_kwh * rack.pue;
    let opex_storage_usd = power_storage_watts * usd_per_watt_term;
    let opex_rack_usd = rack_watts * usd_per_watt_term;
    let opex_drive_failures_usd =
        drives_f * (drive.afr_percent / 100.0) * workload.deployment_years * rack.drive_replacement_usd;
    let opex_rackspace_cooling_usd = rack.datacenter_usd_per_rack_month * months;
    let opex_total_per_rack_usd =
        opex_storage_usd + opex_rack_usd + opex_drive_failures_usd + opex_rackspace_cooling_usd;
    let opex_per_tb_raw_usd = opex_total_per_rack_usd / capacity_per_rack_tb;
    let opex_per_tbe_usd = opex_total_per_rack_usd / effective_capacity_per_rack_tbe;

    let tco_per_tbe_usd = capex_per_tbe_usd + opex_per_tbe_usd;

    ColumnReport {
        name: column.name.clone(),
        rack: column.rack.clone(),
        drives_per_rack: drives,
        drive_price_usd,
        rack_capex_usd,
        rack_watts,
        rack_size_ru,
        compression_ratio: workload.compression_ratio,
        data_reduction_percent: 100.0 / workload.compression_ratio,
        performance_multiplier: workload.performance_multiplier,
        effective_tb_per_raw_tb: effective,
        capacity_per_rack_tb,
        effective_capacity_per_rack_tbe,
        capex_storage_per_rack_usd,
        capex_rack_usd,
        capex_total_per_rack_usd,
        capex_per_tb_raw_usd,
        capex_per_tbe_usd,
        capex_per_tbe_month_usd: capex_per_tbe_usd / months,
        power_storage_watts,
        power_max_watts,
        opex_storage_usd,
        opex_rack_usd,
        opex_drive_failures_usd,
        opex_rackspace_cooling_usd,
        opex_total_per_rack_usd,
        opex_per_tb_raw_usd,
        opex_per_tbe_usd,
        opex_per_tbe_month_usd: opex_per_tbe_usd / months,
        tco_per_tbe_usd,
        tco_per_tbe_month_usd: tco_per_tbe_usd / months,
        capacity_per_rack_pb: capacity_per_rack_tb / TB_PER_PB,
        effective_capacity_per_rack_pbe: effective_capacity_per_rack_tbe / TB_PER_PB,
    }
}
