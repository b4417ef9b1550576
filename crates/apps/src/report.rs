//! The bench report: report.json (everything), summary.md and report.html (tables, and inline
//! SVG charts: TPS and p95 per thread count, CPU per transaction split by part). Written by
//! the harness's writer (`zdisk_bench::writer`), with `zdisk bench`'s tables and style.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use zdisk_bench::writer::{esc, html_start, html_table, md_table, write_report};

use crate::plan::{ConfigKey, Point, Report, Workload};

struct Table {
    title: String,
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn md(&self) -> String {
        let mut s = format!("### {}\n\n", self.title);
        md_table(&mut s, &self.headers, &self.rows);
        s
    }

    fn html(&self) -> String {
        let mut s = format!("<h3>{}</h3>\n", esc(&self.title));
        html_table(&mut s, &self.headers, &self.rows);
        s
    }
}

fn f(v: f64, d: usize) -> String {
    if v.is_finite() {
        format!("{v:.d$}")
    } else {
        "—".into()
    }
}

fn gib(b: u64) -> String {
    format!("{:.3}", b as f64 / (1u64 << 30) as f64)
}

/// Mean of the rounds for one (config, workload, threads).
#[derive(Default, Clone)]
struct Agg {
    n: f64,
    tps: f64,
    p95: f64,
    cpu_total: f64,
    cpu_db: f64,
    cpu_server: f64,
    cpu_transport: f64,
    cpu_client: f64,
    busy: f64,
    iowait: f64,
    wkib: f64,
    swkib: f64,
    bounds: Vec<String>,
}

type Key = (ConfigKey, Workload, u32);

fn aggregate(points: &[Point]) -> BTreeMap<Key, Agg> {
    let mut m: BTreeMap<Key, Agg> = BTreeMap::new();
    for p in points {
        let a = m.entry((p.config, p.workload, p.threads)).or_default();
        a.n += 1.0;
        a.tps += p.load.tps;
        a.p95 += p.load.p95_ms;
        a.cpu_total += p.cpu.total_ms_per_txn;
        a.cpu_db += p.cpu.db_ms_per_txn;
        a.cpu_server += p.cpu.server_ms_per_txn;
        a.cpu_transport += p.cpu.transport_ms_per_txn;
        a.cpu_client += p.cpu.client_ms_per_txn;
        a.busy += p.cpu.busy_pct;
        a.iowait += p.cpu.iowait_pct;
        a.wkib += p.device_write_kib_per_txn;
        a.swkib += p.server_write_kib_per_txn;
        a.bounds.push(p.bound.clone());
    }
    for a in m.values_mut() {
        let n = a.n;
        for v in [
            &mut a.tps,
            &mut a.p95,
            &mut a.cpu_total,
            &mut a.cpu_db,
            &mut a.cpu_server,
            &mut a.cpu_transport,
            &mut a.cpu_client,
            &mut a.busy,
            &mut a.iowait,
            &mut a.wkib,
            &mut a.swkib,
        ] {
            *v /= n;
        }
        a.bounds.dedup();
    }
    m
}

fn color(c: ConfigKey) -> &'static str {
    match c {
        ConfigKey::ZdiskNodw => "#1f77b4",
        ConfigKey::ZdiskDw => "#17becf",
        ConfigKey::RawDw => "#d62728",
        ConfigKey::RawNodw => "#ff9896",
        ConfigKey::RawZlib => "#9467bd",
        ConfigKey::LoopDw => "#7f7f7f",
    }
}

/// A line chart with the thread counts as categories on x.
fn line_chart(title: &str, y_label: &str, xs: &[u32], series: &[(String, &str, Vec<Option<f64>>)]) -> String {
    let (w, h, l, r, t, b) = (720.0, 360.0, 70.0, 230.0, 36.0, 44.0);
    let ymax = series.iter().flat_map(|s| s.2.iter().flatten()).fold(0.0f64, |a, &v| a.max(v)).max(1e-9) * 1.1;
    let pw = w - l - r;
    let ph = h - t - b;
    let x_at = |i: usize| l + if xs.len() > 1 { pw * i as f64 / (xs.len() - 1) as f64 } else { pw / 2.0 };
    let y_at = |v: f64| t + ph * (1.0 - v / ymax);
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\
<rect width='100%' height='100%' fill='white'/><text x='{}' y='20' font-size='15' text-anchor='middle'>{}</text>",
        l + pw / 2.0,
        esc(title)
    );
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        let y = y_at(v);
        let _ = write!(s, "<line x1='{l}' y1='{y}' x2='{}' y2='{y}' stroke='#e6e6e6'/><text x='{}' y='{}' text-anchor='end'>{}</text>", l + pw, l - 6.0, y + 4.0, f(v, if ymax < 10.0 { 2 } else { 0 }));
    }
    for (i, x) in xs.iter().enumerate() {
        let _ = write!(s, "<text x='{}' y='{}' text-anchor='middle'>{x}</text>", x_at(i), t + ph + 18.0);
    }
    let _ = write!(
        s,
        "<text x='{}' y='{}' text-anchor='middle'>client threads</text><text x='14' y='{}' transform='rotate(-90 14 {})' text-anchor='middle'>{}</text>",
        l + pw / 2.0,
        h - 6.0,
        t + ph / 2.0,
        t + ph / 2.0,
        esc(y_label)
    );
    for (k, (name, col, ys)) in series.iter().enumerate() {
        let pts: Vec<String> =
            ys.iter().enumerate().filter_map(|(i, v)| v.map(|v| format!("{},{}", x_at(i), y_at(v)))).collect();
        let _ = write!(s, "<polyline fill='none' stroke='{col}' stroke-width='2' points='{}'/>", pts.join(" "));
        for p in &pts {
            let (x, y) = p.split_once(',').unwrap();
            let _ = write!(s, "<circle cx='{x}' cy='{y}' r='3' fill='{col}'/>");
        }
        let ly = t + 14.0 + 18.0 * k as f64;
        let _ = write!(
            s,
            "<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='{col}' stroke-width='3'/><text x='{}' y='{}'>{}</text>",
            w - r + 10.0,
            ly - 4.0,
            w - r + 28.0,
            ly - 4.0,
            w - r + 32.0,
            ly,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Horizontal stacked bars: CPU ms per transaction by part.
fn cpu_bars(title: &str, bars: &[(String, [f64; 4])]) -> String {
    let parts = [
        ("database", "#1f77b4"),
        ("storage server", "#ff7f0e"),
        ("transport+kernel", "#2ca02c"),
        ("load generator", "#bbbbbb"),
    ];
    let row_h = 26.0;
    let (l, r, t) = (250.0, 30.0, 50.0);
    let w = 760.0;
    let h = t + row_h * bars.len() as f64 + 40.0;
    let max = bars.iter().map(|b| b.1.iter().sum::<f64>()).fold(0.0f64, f64::max).max(1e-9) * 1.05;
    let pw = w - l - r;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\
<rect width='100%' height='100%' fill='white'/><text x='{}' y='18' font-size='15' text-anchor='middle'>{}</text>",
        w / 2.0,
        esc(title)
    );
    for (k, (name, col)) in parts.iter().enumerate() {
        let x = l + 130.0 * k as f64;
        let _ = write!(
            s,
            "<rect x='{x}' y='28' width='12' height='12' fill='{col}'/><text x='{}' y='38'>{name}</text>",
            x + 16.0
        );
    }
    for (i, (label, vals)) in bars.iter().enumerate() {
        let y = t + row_h * i as f64;
        let _ = write!(s, "<text x='{}' y='{}' text-anchor='end'>{}</text>", l - 6.0, y + 16.0, esc(label));
        let mut x = l;
        for (k, v) in vals.iter().enumerate() {
            let bw = pw * v / max;
            let _ = write!(
                s,
                "<rect x='{x}' y='{}' width='{bw}' height='{}' fill='{}'/>",
                y + 3.0,
                row_h - 6.0,
                parts[k].1
            );
            x += bw;
        }
        let _ = write!(s, "<text x='{}' y='{}'>{} ms</text>", x + 4.0, y + 16.0, f(vals.iter().sum(), 2));
    }
    s.push_str("</svg>\n");
    s
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        f64::NAN
    }
}

/// The goals (from the whitepaper's direction), as ratios from this one run.
fn goals_table(r: &Report, agg: &BTreeMap<Key, Agg>, threads: &[u32]) -> Table {
    let mut goal_rows = Vec::new();
    for &w in &r.settings.workloads {
        for &t in threads {
            let get = |c: ConfigKey| agg.get(&(c, w, t)).cloned();
            let (Some(z), Some(raw)) = (get(ConfigKey::ZdiskNodw), get(ConfigKey::RawDw)) else { continue };
            let zlib = get(ConfigKey::RawZlib);
            let lp = get(ConfigKey::LoopDw);
            goal_rows.push(vec![
                w.key().to_string(),
                t.to_string(),
                f(ratio(z.tps, raw.tps), 2),
                raw.bounds.join("/"),
                f(100.0 * (ratio(z.cpu_total, raw.cpu_total) - 1.0), 1),
                f(
                    100.0
                        * (ratio(
                            z.cpu_db + z.cpu_server + z.cpu_transport,
                            raw.cpu_db + raw.cpu_server + raw.cpu_transport,
                        ) - 1.0),
                    1,
                ),
                zlib.map(|x| f(ratio(z.tps, x.tps), 2)).unwrap_or("—".into()),
                lp.map(|x| f(100.0 * (1.0 - ratio(raw.tps, x.tps)), 1)).unwrap_or("—".into()),
            ]);
        }
    }
    Table {
        title: "zdisk (guard off) against raw (guard on): the issue's goals".into(),
        headers: vec![
            "workload".into(),
            "threads".into(),
            "TPS zdisk-nodw / raw-dw (goal ≥ 1.3 where raw is I/O-bound)".into(),
            "raw-dw bound".into(),
            "CPU/txn added by zdisk, all machine % (goal ≤ 10 where CPU-bound)".into(),
            "CPU/txn added, db+server+transport %".into(),
            "TPS zdisk-nodw / raw-zlib (goal ≥ 2)".into(),
            "transport share of raw TPS % (1 − raw-dw/loop-dw)".into(),
        ],
        rows: goal_rows,
    }
}

/// Per workload: a table of TPS (p95) per thread count and configuration, and its charts
/// (TPS, p95, and the CPU split at the most threads).
fn workload_tables(r: &Report, agg: &BTreeMap<Key, Agg>, tables: &mut Vec<Table>, charts: &mut Vec<String>) {
    let db: crate::db::Db = r.settings.db;
    let threads = &r.settings.threads;
    let configs = &r.settings.configs;
    for &w in &r.settings.workloads {
        let mut rows = Vec::new();
        for &t in threads {
            let mut row = vec![t.to_string()];
            for &c in configs {
                row.push(
                    agg.get(&(c, w, t)).map(|a| format!("{} ({} ms)", f(a.tps, 1), f(a.p95, 1))).unwrap_or("—".into()),
                );
            }
            rows.push(row);
        }
        let mut headers = vec!["threads".to_string()];
        headers.extend(configs.iter().map(|c| c.label(db)));
        tables.push(Table { title: format!("{}: TPS (p95 latency)", w.key()), headers, rows });
        let series_tps: Vec<(String, &str, Vec<Option<f64>>)> = configs
            .iter()
            .map(|&c| {
                (c.key().to_string(), color(c), threads.iter().map(|&t| agg.get(&(c, w, t)).map(|a| a.tps)).collect())
            })
            .collect();
        charts.push(line_chart(
            &format!("{} {}: transactions per second", db.name(), w.key()),
            "TPS",
            threads,
            &series_tps,
        ));
        let series_p95: Vec<(String, &str, Vec<Option<f64>>)> = configs
            .iter()
            .map(|&c| {
                (c.key().to_string(), color(c), threads.iter().map(|&t| agg.get(&(c, w, t)).map(|a| a.p95)).collect())
            })
            .collect();
        charts.push(line_chart(&format!("{} {}: p95 latency", db.name(), w.key()), "p95 ms", threads, &series_p95));
        let tmax = *threads.iter().max().unwrap_or(&1);
        let bars: Vec<(String, [f64; 4])> = configs
            .iter()
            .filter_map(|&c| {
                agg.get(&(c, w, tmax))
                    .map(|a| (c.key().to_string(), [a.cpu_db, a.cpu_server, a.cpu_transport, a.cpu_client]))
            })
            .collect();
        if !bars.is_empty() {
            charts
                .push(cpu_bars(&format!("{} {} at {tmax} threads: CPU ms per transaction", db.name(), w.key()), &bars));
        }
    }
}

/// CPU and I/O per transaction, for every point.
fn cpu_table(agg: &BTreeMap<Key, Agg>) -> Table {
    let mut rows = Vec::new();
    for ((c, w, t), a) in agg {
        rows.push(vec![
            c.key().into(),
            w.key().into(),
            t.to_string(),
            f(a.cpu_total, 2),
            f(a.cpu_db, 2),
            f(a.cpu_server, 2),
            f(a.cpu_transport, 2),
            f(a.cpu_client, 2),
            f(a.busy, 0),
            f(a.iowait, 0),
            a.bounds.join("/"),
            f(a.wkib, 1),
            f(a.swkib, 1),
        ]);
    }
    Table {
        title: "CPU and I/O per transaction".into(),
        headers: [
            "target",
            "workload",
            "threads",
            "CPU ms/txn (machine)",
            "database",
            "storage server",
            "transport + kernel",
            "load generator",
            "busy %",
            "iowait %",
            "bound",
            "KiB written to the device /txn",
            "KiB the server wrote to its disk /txn",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    }
}

/// Storage used per stack and phase, and the compression of the final database files; their
/// headline lines.
fn capacity_tables(r: &Report, tables: &mut Vec<Table>, headline: &mut Vec<String>) {
    let mut cap_rows = Vec::new();
    for c in &r.capacity {
        let z = c.zdisk.as_ref();
        cap_rows.push(vec![
            c.stack.clone(),
            c.phase.clone(),
            gib(c.db_files_bytes),
            gib(c.db_files_allocated_bytes),
            gib(c.fs_used_bytes),
            gib(c.backing_used_bytes),
            z.and_then(|z| z["comp_ratio"].as_f64()).map(|v| f(v, 2)).unwrap_or("—".into()),
            c.zdisk_data_comp_ratio.map(|v| f(v, 2)).unwrap_or("—".into()),
            r.capacity
                .iter()
                .find(|x| x.stack == "raw" && x.phase == c.phase)
                .map(|raw| f(ratio(raw.backing_used_bytes as f64, c.backing_used_bytes as f64), 2))
                .unwrap_or("—".into()),
        ]);
    }
    tables.push(Table {
        title: "Storage used (GiB)".into(),
        headers: [
            "stack",
            "when",
            "database files (logical)",
            "database files allocated",
            "ext4 used",
            "on the host disk (raw: image allocated; zdisk: physical_size)",
            "zdisk comp_ratio (whole device)",
            "zdisk ratio of the data written after mkfs",
            "raw's host bytes / this stack's",
        ]
        .map(String::from)
        .to_vec(),
        rows: cap_rows,
    });
    if let Some(z) = r.capacity.iter().rev().find(|c| c.stack == "zdisk").and_then(|c| c.zdisk.as_ref()) {
        headline.push(format!(
            "zdisk comp_ratio at the end: {} (codec of the benchmarked store, whole device)",
            f(z["comp_ratio"].as_f64().unwrap_or(0.0), 2)
        ));
    }
    if let Some(c) = r.capacity.iter().rev().find(|c| c.stack == "zdisk") {
        if let Some(v) = c.zdisk_data_comp_ratio {
            headline.push(format!("zdisk ratio over the data written after mkfs: {}", f(v, 2)));
        }
        if let Some(raw) = r.capacity.iter().rev().find(|x| x.stack == "raw") {
            headline.push(format!(
                "host disk used: raw image {} GiB, zdisk {} GiB ({}x less)",
                gib(raw.backing_used_bytes),
                gib(c.backing_used_bytes),
                f(ratio(raw.backing_used_bytes as f64, c.backing_used_bytes as f64), 2)
            ));
        }
    }
    if let (Some(raw), Some(zl)) =
        (r.capacity.iter().rev().find(|c| c.stack == "raw"), r.capacity.iter().rev().find(|c| c.stack == "raw-zlib"))
    {
        headline.push(format!(
            "InnoDB zlib compression: database files {} GiB vs {} GiB uncompressed ({}:1)",
            gib(zl.db_files_bytes),
            gib(raw.db_files_bytes),
            f(ratio(raw.db_files_bytes as f64, zl.db_files_bytes as f64), 2)
        ));
    }
    let mut codec_rows: Vec<Vec<String>> = r
        .codec_ratios
        .iter()
        .map(|c| {
            vec![
                format!("zdisk --codec {} (database files; whole device {})", c.codec, f(c.comp_ratio, 2)),
                f(c.data_comp_ratio, 2),
                gib(c.logical_size),
                gib(c.physical_size),
            ]
        })
        .collect();
    if let Some(o) = &r.offline {
        for (name, v) in [
            ("offline LZ4, 4 KiB blocks", o.lz4),
            ("offline zstd -1, 4 KiB blocks", o.zstd1),
            ("offline DEFLATE -6, 4 KiB blocks", o.deflate6),
        ] {
            codec_rows.push(vec![name.into(), f(v, 2), gib((o.blocks - o.zero_blocks) * 4096), "—".into()]);
        }
    }
    for c in &r.codec_ratios {
        headline.push(format!("ratio of the database files with --codec {}: {}", c.codec, f(c.data_comp_ratio, 2)));
    }
    tables.push(Table {
        title: "Compression of the final database files".into(),
        headers: ["how", "ratio", "logical GiB", "physical GiB"].map(String::from).to_vec(),
        rows: codec_rows,
    });
}

/// Writes report.json, summary.md and report.html into `out`.
pub fn write(out: &Path, r: &Report) -> Result<()> {
    write_report(out, r, || {
        let agg = aggregate(&r.points);
        let mut tables: Vec<Table> = Vec::new();
        let mut charts: Vec<String> = Vec::new();
        let mut headline: Vec<String> = Vec::new();

        tables.push(goals_table(r, &agg, &r.settings.threads));
        workload_tables(r, &agg, &mut tables, &mut charts);
        tables.push(cpu_table(&agg));

        capacity_tables(r, &mut tables, &mut headline);
        Ok(pages(r, &headline, &tables, &charts))
    })
}

/// summary.md and report.html: the introduction, the headline, the tables and the charts.
fn pages(r: &Report, headline: &[String], tables: &[Table], charts: &[String]) -> (String, String) {
    let db: crate::db::Db = r.settings.db;
    let guard = db.torn_page_guard();
    let intro = format!(
        "zdisk db bench {} — preset {:?}; {} tables x {} rows (modified schema: two text columns of real text){}; \
buffer pool {} MiB; {} threads; {} s per point after {} s warm-up; {} round(s); sysbench --rand-type={}.\n\n\
Host: {} CPUs ({}), kernel {}; load average at start {}, at end {}. Wall time {:.0} s.\n\n\
Targets: zdisk = `zdisk attach --fuse` (zdisk serve + nbdfuse + loop, direct I/O); raw = the same disk as a sparse raw \
file behind qemu-nbd --cache=none + nbdfuse + loop (the same transport); loop = the raw file on a loop device, no NBD. \
`{guard}` off on raw is UNSAFE (no atomic page writes) and shown for reference only. \
Ratios come from one run on a noisy 2-core VM: compare columns, not absolute numbers.{}\n",
        db.name(),
        r.settings.preset,
        r.settings.tables,
        r.settings.table_size,
        if r.settings.workloads.contains(&Workload::Pgbench) {
            format!(", pgbench scale {}", r.settings.pgbench_scale)
        } else {
            String::new()
        },
        r.settings.buffer_pool >> 20,
        r.settings.threads.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","),
        r.settings.time_s,
        r.settings.warmup_s,
        r.settings.rounds,
        r.settings.rand_type,
        r.host["cpus"],
        r.host["cpu_model"].as_str().unwrap_or(""),
        r.host["kernel"].as_str().unwrap_or(""),
        r.host["loadavg_start"].as_str().unwrap_or(""),
        r.host["loadavg_end"].as_str().unwrap_or(""),
        r.wall_s,
        match r.settings.disk_mbps {
            Some(mbps) => format!(
                "\n\n**Bandwidth-bound run**: the storage servers (zdisk serve, qemu-nbd) were capped at {mbps} MB/s \
each way to the disk (`--disk-mbps`, cgroup blkio), the same cap for both: the comparison where bytes, not the \
latency of each request, are the limit."
            ),
            None => String::new(),
        } + &if r.settings.serve_options.is_empty() {
            String::new()
        } else {
            format!("\n\nzdisk's servers ran with `{}` (`--serve-options`).", r.settings.serve_options.join(" "))
        }
    );

    let mut md = format!("# zdisk db bench: {}\n\n{intro}\n", db.name());
    for h in headline {
        let _ = writeln!(md, "- {h}");
    }
    md.push('\n');
    for t in tables {
        md.push_str(&t.md());
    }
    if !r.notes.is_empty() || !r.errors.is_empty() {
        md.push_str("### Notes and errors\n\n");
        for n in r.notes.iter().chain(r.errors.iter()) {
            let _ = writeln!(md, "- {n}");
        }
    }

    let mut html = html_start(&format!("zdisk db bench {}", db.name()));
    let _ = write!(html, "<h1>zdisk db bench: {}</h1><p>{}</p><ul>", db.name(), esc(&intro).replace("\n\n", "</p><p>"));
    for h in headline {
        let _ = write!(html, "<li>{}</li>", esc(h));
    }
    html.push_str("</ul>");
    html.push_str(&tables[0].html());
    html.push_str("<h2>Charts</h2><div class=\"charts\">");
    for c in charts {
        html.push_str(c);
    }
    html.push_str("</div>\n");
    for t in &tables[1..] {
        html.push_str(&t.html());
    }
    for n in r.notes.iter().chain(r.errors.iter()) {
        let _ = write!(html, "<p><b>Note:</b> {}</p>", esc(n));
    }
    html.push_str("</body></html>\n");
    (md, html)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::Db;

    #[test]
    fn charts_are_svg_and_escape_text() {
        let s = line_chart("a<b", "TPS", &[4, 16], &[("x".into(), "#000", vec![Some(1.0), None])]);
        assert!(s.starts_with("<svg") && s.contains("a&lt;b") && s.trim_end().ends_with("</svg>"));
        let b = cpu_bars("cpu", &[("zdisk".into(), [1.0, 0.5, 0.25, 0.1])]);
        assert!(b.contains("1.85 ms"), "{b}");
        assert_eq!(Db::Mysql.torn_page_guard(), "innodb_doublewrite");
    }
}
