//! The human-readable table: one row per appendix row, one column per config column.
//! Money is shown to the cent everywhere (the appendix rounds some rows to whole dollars; the
//! extra digits let a reader check the arithmetic).

use crate::model::{ColumnReport, Report};

enum Line {
    Section(&'static str),
    Row(&'static str, fn(&ColumnReport) -> String),
}

const LINES: &[Line] = &[
    Line::Section("Rack and system (per rack)"),
    Line::Row("Drives per rack", |c| c.drives_per_rack.to_string()),
    Line::Row("Drive price (ASP, $)", |c| usd(c.drive_price_usd)),
    Line::Row("Cost, CapEx per rack ($)", |c| usd(c.rack_capex_usd)),
    Line::Row("Power per rack (W)", |c| format!("{:.1}", c.rack_watts)),
    Line::Row("Size per rack (RU)", |c| c.rack_size_ru.to_string()),
    Line::Section("Workload"),
    Line::Row("Compression ratio (logical:stored)", |c| format!("{:.2}:1", c.compression_ratio)),
    Line::Row("Data reduction ratio (stored/logical)", |c| format!("{:.2}%", c.data_reduction_percent)),
    Line::Row("Performance multiplier", |c| format!("{:.3}", c.performance_multiplier)),
    Line::Row("Effective TB per raw TB", |c| format!("{:.4}", c.effective_tb_per_raw_tb)),
    Line::Section("CapEx"),
    Line::Row("Capacity per rack (TB)", |c| format!("{:.2}", c.capacity_per_rack_tb)),
    Line::Row("CapEx storage (per rack)", |c| usd(c.capex_storage_per_rack_usd)),
    Line::Row("CapEx rack", |c| usd(c.capex_rack_usd)),
    Line::Row("CapEx total (per rack)", |c| usd(c.capex_total_per_rack_usd)),
    Line::Row("CapEx total per TB raw", |c| usd(c.capex_per_tb_raw_usd)),
    Line::Row("CapEx total per TBe (effective)", |c| usd(c.capex_per_tbe_usd)),
    Line::Row("CapEx per TBe per month of deployment", |c| usd(c.capex_per_tbe_month_usd)),
    Line::Section("OpEx (over the deployment term)"),
    Line::Row("Power storage (active/idle/duty, W)", |c| format!("{:.1}", c.power_storage_watts)),
    Line::Row("Power max (rack limit, W)", |c| format!("{:.1}", c.power_max_watts)),
    Line::Row("OpEx storage", |c| usd(c.opex_storage_usd)),
    Line::Row("OpEx rack", |c| usd(c.opex_rack_usd)),
    Line::Row("OpEx drive failures / replacement", |c| usd(c.opex_drive_failures_usd)),
    Line::Row("OpEx rackspace / cooling", |c| usd(c.opex_rackspace_cooling_usd)),
    Line::Row("OpEx total per rack", |c| usd(c.opex_total_per_rack_usd)),
    Line::Row("OpEx per TB raw", |c| usd(c.opex_per_tb_raw_usd)),
    Line::Row("OpEx per TBe (effective)", |c| usd(c.opex_per_tbe_usd)),
    Line::Row("OpEx per TBe per month", |c| usd(c.opex_per_tbe_month_usd)),
    Line::Section("Total cost of ownership"),
    Line::Row("TCO (OpEx + CapEx) per TBe", |c| usd(c.tco_per_tbe_usd)),
    Line::Row("TCO per TBe per month of deployment", |c| usd(c.tco_per_tbe_month_usd)),
    Line::Row("Capacity per rack (PB)", |c| format!("{:.3}", c.capacity_per_rack_pb)),
    Line::Row("Effective capacity per rack (PBe)", |c| format!("{:.3}", c.effective_capacity_per_rack_pbe)),
];

/// The aligned text table, ending in a newline.
pub fn render_table(report: &Report) -> String {
    let mut grid: Vec<Option<Vec<String>>> = Vec::with_capacity(LINES.len() + 1);
    let mut header = vec![String::new()];
    header.extend(report.columns.iter().map(|c| c.name.clone()));
    grid.push(Some(header));
    for line in LINES {
        grid.push(match line {
            Line::Section(_) => None,
            Line::Row(label, cell) => {
                let mut row = vec![label.to_string()];
                row.extend(report.columns.iter().map(cell));
                Some(row)
            }
        });
    }

    let cells = report.columns.len() + 1;
    let mut widths = vec![0usize; cells];
    for row in grid.iter().flatten() {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }

    let mut out = String::new();
    let mut sections = LINES.iter().filter_map(|line| match line {
        Line::Section(title) => Some(*title),
        Line::Row(..) => None,
    });
    for row in &grid {
        let Some(row) = row else {
            out.push_str(&format!("\n{}\n", sections.next().expect("one title per section")));
            continue;
        };
        // Labels left-aligned, figures right-aligned so decimal points line up.
        let mut text = format!("{:<width$}", row[0], width = widths[0]);
        for (cell, width) in row[1..].iter().zip(&widths[1..]) {
            text.push_str(&format!("  {cell:>width$}"));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
    out
}

/// `$1,234.57`: dollars with thousands separators, to the cent.
pub fn usd(amount_usd: f64) -> String {
    let cents = (amount_usd.abs() * 100.0).round();
    // Display only: f64 holds whole cents exactly far beyond any rack's budget.
    let whole = (cents / 100.0).trunc() as u64;
    let frac = (cents % 100.0) as u64;
    let digits = whole.to_string();
    let mut grouped = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(ch);
    }
    let sign = if amount_usd < 0.0 && cents > 0.0 { "-" } else { "" };
    format!("{sign}${grouped}.{frac:02}")
}

#[cfg(test)]
mod tests {
    use super::usd;

    #[test]
    fn usd_groups_thousands_and_rounds_to_the_cent() {
        assert_eq!(usd(0.0), "$0.00");
        assert_eq!(usd(9.418), "$9.42");
        assert_eq!(usd(999.999), "$1,000.00");
        assert_eq!(usd(114061.6), "$114,061.60");
        assert_eq!(usd(1234567.891), "$1,234,567.89");
        assert_eq!(usd(-5.5), "-$5.50");
    }
}
