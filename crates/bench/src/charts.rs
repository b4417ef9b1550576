//! SVG charts for the HTML report, drawn with plotters' SVG backend and inlined in the page.

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::plan::{DataMode, TargetKind, WorkloadKind};
use crate::results::{fmt_int, Report};

const SIZE_PX: (u32, u32) = (720, 380);

struct Series {
    name: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    line: bool,
    marker_px: u32,
    /// Whether the series gets a legend entry (repeated segments of one metric do not).
    legend: bool,
}

fn target_color(t: TargetKind) -> RGBColor {
    let (r, g, b) = t.rgb();
    RGBColor(r, g, b)
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing chart: {e:?}")
}

/// Axis text: descriptions, tick label formatters and the wanted number of x ticks.
struct Axes<'a> {
    x_desc: &'a str,
    y_desc: &'a str,
    x_fmt: &'a dyn Fn(&f64) -> String,
    y_fmt: &'a dyn Fn(&f64) -> String,
    x_labels: usize,
}

fn plain(v: &f64) -> String {
    if v.abs() >= 1000.0 || (v.fract() == 0.0) {
        fmt_int(*v)
    } else {
        format!("{v:.1}")
    }
}

/// Log-axis labels: plotters puts a key point at every 1..9 x 10^k, far too dense to read;
/// only 1, 2 and 5 x 10^k get text.
fn log_label(v: &f64) -> String {
    if *v <= 0.0 {
        return String::new();
    }
    let lead = v / 10f64.powf(v.log10().floor());
    if [1.0, 2.0, 5.0, 10.0].iter().any(|d| (lead - d).abs() < 1e-6) {
        plain(v)
    } else {
        String::new()
    }
}

/// Queue depths are drawn on a log2 axis: positions are log2(QD), labels the QD itself.
fn qd_label(v: &f64) -> String {
    format!("{}", 2f64.powf(*v).round())
}

/// Draws `series` on axes `x`/`y` (linear or logarithmic) and returns the SVG text.
fn render<X, Y>(title: &str, axes: &Axes, series: &[Series], x: X, y: Y) -> Result<String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE_PX).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x, y)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(axes.x_desc)
            .y_desc(axes.y_desc)
            .x_label_formatter(axes.x_fmt)
            .y_label_formatter(axes.y_fmt)
            .x_labels(axes.x_labels)
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(err)?;
        for s in series {
            let color = s.color;
            let style = color.stroke_width(2);
            if s.line {
                let drawn = chart.draw_series(LineSeries::new(s.points.iter().copied(), style)).map_err(err)?;
                if s.legend {
                    drawn
                        .label(s.name.clone())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
                }
                if s.marker_px > 0 {
                    chart
                        .draw_series(s.points.iter().map(|&p| Circle::new(p, s.marker_px, color.filled())))
                        .map_err(err)?;
                }
            } else {
                let drawn = chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, s.marker_px.max(1), color.mix(0.6).filled())))
                    .map_err(err)?;
                if s.legend {
                    drawn.label(s.name.clone()).legend(move |(x, y)| Circle::new((x + 9, y), 3, color.filled()));
                }
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

fn bounds(series: &[Series]) -> Option<(f64, f64, f64, f64)> {
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    let mut any = false;
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            any = true;
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    any.then_some((x0, x1, y0, y1))
}

/// Linear range from zero (IOPS axes start at zero so ratios read honestly), with head-room
/// for the legend in the upper right.
fn lin_from_zero(max: f64) -> std::ops::Range<f64> {
    0.0..(max * 1.4).max(1.0)
}

/// Log range with the same legend head-room (0.6 decade).
fn log_range(min: f64, max: f64) -> std::ops::Range<f64> {
    (min * 0.7).max(0.1)..(max * 4.0).max(1.0)
}

/// IOPS (or p99 latency) versus queue depth, one line per target.
pub fn vs_qd(r: &Report, d: DataMode, w: WorkloadKind, latency: bool) -> Result<String> {
    let mut series = Vec::new();
    for &t in &r.config.targets {
        let points: Vec<(f64, f64)> = r
            .config
            .qds
            .iter()
            .filter_map(|&qd| r.result(d, w, t, qd))
            .filter_map(|res| {
                let y = if latency { res.p99_us? } else { res.iops };
                (y > 0.0).then_some(((res.qd as f64).log2(), y))
            })
            .collect();
        series.push(Series {
            name: t.title().to_string(),
            color: target_color(t),
            points,
            line: true,
            marker_px: 3,
            legend: true,
        });
    }
    let qd_max = (*r.config.qds.last().unwrap_or(&1) as f64).log2();
    let qd_min = (*r.config.qds.first().unwrap_or(&1) as f64).log2();
    let x: RangedCoordf64 = (qd_min - 0.2..qd_max.max(qd_min + 1.0) + 0.2).into();
    let span = (qd_max - qd_min).round() as usize + 1;
    let title =
        format!("{} — {} vs queue depth ({} data)", w.title(), if latency { "p99 latency" } else { "IOPS" }, d.key());
    let mut axes =
        Axes { x_desc: "queue depth", y_desc: "IOPS", x_fmt: &qd_label, y_fmt: &plain, x_labels: span.max(2) };
    let Some((_, _, y0, y1)) = bounds(&series) else {
        axes.y_desc = "no data";
        return render(&title, &axes, &series, x, 0.0..1.0);
    };
    if latency {
        axes.y_desc = "p99 completion latency (µs, log)";
        axes.y_fmt = &log_label;
        render(&title, &axes, &series, x, log_range(y0, y1).log_scale())
    } else {
        render(&title, &axes, &series, x, lin_from_zero(y1))
    }
}

/// Per-interval IOPS while preconditioning: the descent to steady state, one line per target.
pub fn descent(r: &Report, d: DataMode, w: WorkloadKind) -> Result<Option<String>> {
    let mut series = Vec::new();
    for p in r.preconditioning.iter().filter(|p| p.data == d && p.workload == w) {
        let step = p.interval_ms as f64 / 1000.0;
        series.push(Series {
            name: format!("{} ({})", p.target.title(), if p.steady_state_reached { "steady" } else { "not steady" }),
            color: target_color(p.target),
            points: p.iops_per_interval.iter().enumerate().map(|(i, &v)| ((i + 1) as f64 * step, v)).collect(),
            line: true,
            marker_px: 0,
            legend: true,
        });
    }
    let Some((x0, x1, _, y1)) = bounds(&series) else {
        return Ok(None);
    };
    let x: RangedCoordf64 = (x0.min(0.0)..x1.max(x0 + 1.0)).into();
    let title =
        format!("{} — preconditioning at QD{} ({} data)", w.title(), r.config.qds.last().unwrap_or(&1), d.key());
    let axes = Axes { x_desc: "seconds", y_desc: "IOPS per interval", x_fmt: &plain, y_fmt: &plain, x_labels: 10 };
    render(&title, &axes, &series, x, lin_from_zero(y1)).map(Some)
}

/// Per-interval IOPS of the consistency test, a scatter per target and spare-area setting.
pub fn consistency(r: &Report, d: DataMode) -> Result<Option<String>> {
    let mut series = Vec::new();
    for c in r.consistency.iter().filter(|c| c.data == d && c.error.is_none()) {
        let step = c.interval_ms as f64 / 1000.0;
        let base = target_color(c.target);
        // The spare-area run uses a lighter shade of the target's colour.
        let color = if c.spare_pct > 0 { RGBColor(base.0 / 2 + 110, base.1 / 2 + 110, base.2 / 2 + 110) } else { base };
        series.push(Series {
            name: format!("{} +{}% spare", c.target.title(), c.spare_pct),
            color,
            points: c
                .iops_per_interval
                .iter()
                .enumerate()
                .filter(|(_, &v)| v > 0.0)
                .map(|(i, &v)| ((i + 1) as f64 * step, v))
                .collect(),
            line: false,
            marker_px: 2,
            legend: true,
        });
    }
    let Some((_, x1, y0, y1)) = bounds(&series) else {
        return Ok(None);
    };
    let title = format!("Consistency: 4K random write QD{} after fill ({} data)", r.config.consistency_qd, d.key());
    let x: RangedCoordf64 = (0.0..x1 * 1.05).into();
    let axes =
        Axes { x_desc: "seconds", y_desc: "IOPS per interval (log)", x_fmt: &plain, y_fmt: &log_label, x_labels: 10 };
    // Four legend rows: a little more head-room than the other charts.
    render(&title, &axes, &series, x, log_range(y0.max(1.0), y1 * 1.5).log_scale()).map(Some)
}

/// zdisk's comp_ratio and write amplification over the whole run (one line per store format).
pub fn timeline(r: &Report) -> Result<Option<String>> {
    let mut series = Vec::new();
    let mut gens: Vec<u32> = r.zdisk_timeline.iter().map(|s| s.format_gen).collect();
    gens.dedup();
    for (i, g) in gens.iter().enumerate() {
        // Before the first write of a fresh store the ratio and WA are 0/0, not data.
        let samples: Vec<_> =
            r.zdisk_timeline.iter().filter(|s| s.format_gen == *g && s.host_write_bytes != Some(0.0)).collect();
        // Only the first segment gets a legend entry: every segment is the same two metrics.
        let legend = i == 0;
        let ratio: Vec<(f64, f64)> = samples.iter().filter_map(|s| Some((s.t_s, s.comp_ratio?))).collect();
        let wa: Vec<(f64, f64)> = samples.iter().filter_map(|s| Some((s.t_s, s.write_amplification?))).collect();
        series.push(Series {
            name: "comp_ratio".into(),
            color: RGBColor(31, 119, 180),
            points: ratio,
            line: true,
            marker_px: 2,
            legend,
        });
        series.push(Series {
            name: "write amplification".into(),
            color: RGBColor(44, 160, 44),
            points: wa,
            line: true,
            marker_px: 2,
            legend,
        });
    }
    let Some((x0, x1, _, y1)) = bounds(&series) else {
        return Ok(None);
    };
    let x: RangedCoordf64 = (x0.min(0.0)..x1.max(x0 + 1.0)).into();
    let two_dp = |v: &f64| format!("{v:.2}");
    let axes = Axes { x_desc: "seconds since start", y_desc: "ratio", x_fmt: &plain, y_fmt: &two_dp, x_labels: 10 };
    render(
        "zdisk comp_ratio and write amplification (cumulative since each format) over the run",
        &axes,
        &series,
        x,
        lin_from_zero(y1),
    )
    .map(Some)
}
