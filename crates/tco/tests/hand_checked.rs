//! A small configuration whose every output was worked out by hand (arithmetic in comments),
//! exercising the parts the published table leaves at zero or one: JBODs, rack cost, PUE,
//! a performance multiplier on a compressed column, and a term other than five years.

use zdisk_tco::{compute, Config};

const SMALL: &str = r#"
[racks.small]
datacenter_usd_per_rack_month = 100
rack_usd = 1000
server_usd = 5000
jbod_usd = 2000
switch_usd = 500
server_watts = 200
jbod_watts = 100
switch_watts = 50
server_ru = 2
jbod_ru = 4
switch_ru = 1
drives_per_server = 4
drives_per_jbod = 10
servers_per_rack = 2
jbods_per_rack = 1
utility_servers_per_rack = 1
electricity_usd_per_kwh = 0.10
pue = 1.5
drive_replacement_usd = 50

[[column]]
name = "small"
rack = "small"
drive = { capacity_gb = 1000, active_watts = 10, idle_watts = 2, afr_percent = 2, price_usd_per_gb = 0.05 }
workload = { deployment_years = 2, encoding_overhead = 2, performance_multiplier = 1.25, capacity_utilization_percent = 80, duty_cycle_percent = 50, compression_ratio = 2.5 }
"#;

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-9 * want.abs().max(1.0)
}

#[test]
fn small_configuration_matches_hand_arithmetic() {
    let report = compute(&Config::from_toml_str(SMALL).unwrap());
    let c = &report.columns[0];
    let checks = [
        // drives = 4 per server x 2 servers + 10 per JBOD x 1 JBOD = 18
        ("drives_per_rack", c.drives_per_rack as f64, 18.0),
        // 1000 GB x $0.05 = $50
        ("drive_price_usd", c.drive_price_usd, 50.0),
        // rack 1000 + (2 + 1 utility) servers x 5000 + 1 JBOD x 2000 + switch 500 = 18,500
        ("rack_capex_usd", c.rack_capex_usd, 18_500.0),
        // 3 servers x 200 + 1 JBOD x 100 + switch 50 = 750 W
        ("rack_watts", c.rack_watts, 750.0),
        // 3 x 2 RU + 1 x 4 RU + 1 RU = 11
        ("rack_size_ru", c.rack_size_ru as f64, 11.0),
        // 0.80 x 2.5 / 2 / 1.25 = 0.8 effective TB per raw TB
        ("effective_tb_per_raw_tb", c.effective_tb_per_raw_tb, 0.8),
        ("data_reduction_percent", c.data_reduction_percent, 40.0),
        // 18 x 1000 GB = 18 TB raw; x 0.8 = 14.4 TBe
        ("capacity_per_rack_tb", c.capacity_per_rack_tb, 18.0),
        ("effective_capacity_per_rack_tbe", c.effective_capacity_per_rack_tbe, 14.4),
        // 18 x $50 = $900; + 18,500 = 19,400
        ("capex_storage_per_rack_usd", c.capex_storage_per_rack_usd, 900.0),
        ("capex_rack_usd", c.capex_rack_usd, 18_500.0),
        ("capex_total_per_rack_usd", c.capex_total_per_rack_usd, 19_400.0),
        // 19,400 / 18 ; 19,400 / 14.4 ; / 24 months
        ("capex_per_tb_raw_usd", c.capex_per_tb_raw_usd, 19_400.0 / 18.0),
        ("capex_per_tbe_usd", c.capex_per_tbe_usd, 19_400.0 / 14.4),
        ("capex_per_tbe_month_usd", c.capex_per_tbe_month_usd, 19_400.0 / 14.4 / 24.0),
        // 18 x (10 W x 0.5 + 2 W x 0.5) = 108 W ; 750 + 18 x 10 = 930 W
        ("power_storage_watts", c.power_storage_watts, 108.0),
        ("power_max_watts", c.power_max_watts, 930.0),
        // 2 years x 8760 h = 17,520 h; per watt: 17.52 kWh x $0.10 x PUE 1.5 = $2.628
        // storage 108 x 2.628 = 283.824 ; rack 750 x 2.628 = 1971
        ("opex_storage_usd", c.opex_storage_usd, 283.824),
        ("opex_rack_usd", c.opex_rack_usd, 1971.0),
        // 18 drives x 2 %/year x 2 years x $50 = $36
        ("opex_drive_failures_usd", c.opex_drive_failures_usd, 36.0),
        // $100 x 24 months = $2,400
        ("opex_rackspace_cooling_usd", c.opex_rackspace_cooling_usd, 2400.0),
        // 283.824 + 1971 + 36 + 2400 = 4690.824
        ("opex_total_per_rack_usd", c.opex_total_per_rack_usd, 4690.824),
        ("opex_per_tb_raw_usd", c.opex_per_tb_raw_usd, 4690.824 / 18.0),
        ("opex_per_tbe_usd", c.opex_per_tbe_usd, 4690.824 / 14.4),
        ("opex_per_tbe_month_usd", c.opex_per_tbe_month_usd, 4690.824 / 14.4 / 24.0),
        // (19,400 + 4690.824) / 14.4 = 1672.9738...; / 24 = 69.7072...
        ("tco_per_tbe_usd", c.tco_per_tbe_usd, 24_090.824 / 14.4),
        ("tco_per_tbe_month_usd", c.tco_per_tbe_month_usd, 24_090.824 / 14.4 / 24.0),
        ("capacity_per_rack_pb", c.capacity_per_rack_pb, 0.018),
        ("effective_capacity_per_rack_pbe", c.effective_capacity_per_rack_pbe, 0.0144),
    ];
    for (name, got, want) in checks {
        assert!(close(got, want), "{name}: got {got}, want {want}");
    }
    assert_eq!(zdisk_tco::usd(c.tco_per_tbe_usd), "$1,672.97");
    assert_eq!(zdisk_tco::usd(c.tco_per_tbe_month_usd), "$69.71");
}
