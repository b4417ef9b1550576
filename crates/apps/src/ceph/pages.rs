//! summary.md and report.html of `zdisk ceph report`: the tables and text of the Ceph case
//! study's report, written with the harness's tables and page style (`zdisk_bench::writer`).

use std::fmt::Write as _;

use serde_json::Value;
use zdisk_bench::writer::{esc, html_start, html_table, md_table};

use super::Report;

/// A piece of the page, rendered as Markdown and as HTML.
enum Block {
    Heading(usize, String),
    Text(String),
    Table(Vec<String>, Vec<Vec<String>>),
}

fn f(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.decimals$}"),
        _ => "—".into(),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{:.0}%", v * 100.0))
}

fn x(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{v:.2}x"))
}

fn gib(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{:.2} GiB", v / (1u64 << 30) as f64))
}

fn met(yes: bool) -> String {
    if yes { "**met**" } else { "not met" }.into()
}

fn case_name(case: &str) -> String {
    match case {
        "zdisk" => "zdisk (Ceph compression off)",
        "zdisk-zstd1" => "zdisk zstd:1 (Ceph compression off)",
        "bluestore-zstd" => "raw + BlueStore zstd force",
        "bluestore-lz4" => "raw + BlueStore lz4 force",
        "raw" => "raw, no compression",
        other => other,
    }
    .into()
}

/// A field of meta.json's objects as text: strings as they are, numbers as JSON writes them.
fn text(v: &Value, key: &str) -> String {
    match v.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "—".into(),
        Some(other) => other.to_string(),
    }
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// The report's pages, section by section.
fn blocks(r: &Report) -> Vec<Block> {
    let mut b = intro(r);
    b.extend(per_case(r));
    b.extend(cpu_split(r));
    b.extend(comparisons(r));
    b.extend(every_round(r));
    b
}

/// What ran, and on which host.
fn intro(r: &Report) -> Vec<Block> {
    use Block::{Heading, Text};
    let (c, h) = (&r.config, &r.host);
    vec![
        Heading(1, "zdisk under Ceph: the SNIA case study side by side".into()),
        Text(format!(
            "{} BlueStore OSDs on one host, pool size 2, {} RBD images of {}, fio rbd engine, QD{} per image, \
             `buffer_compress_percentage={}`, {} round(s), the case order rotated each round. Each OSD device is {} \
             (what Ceph sees); a zdisk store has {} of physical space under it (logical = {} x physical). Raw devices \
             are sparse files behind qemu-nbd (O_DIRECT), attached through the same transport as zdisk.",
            text(c, "osds"),
            text(c, "images"),
            gib(num(c, "image_bytes")),
            text(c, "qd"),
            text(c, "buffer_compress_percentage"),
            text(c, "rounds"),
            gib(num(c, "osd_bytes")),
            gib(num(c, "zdisk_physical_bytes")),
            text(c, "zdisk_native_fraction"),
        )),
        Text(format!(
            "Host: {}, {} cores, kernel {}, Ceph {}, {}, zdisk {} ({}), backing filesystem {}. Load average at start {}, \
             at end {}. Wall time {} s.",
            text(h, "cpu"),
            text(h, "cores"),
            text(h, "kernel"),
            text(h, "ceph"),
            text(h, "fio"),
            text(h, "zdisk"),
            text(h, "git"),
            text(h, "backing_fs"),
            r.loadavg_start,
            r.loadavg_end,
            r.wall_s,
        )),
    ]
}

/// Each case's means over rounds, with what the columns measure.
fn per_case(r: &Report) -> Vec<Block> {
    use Block::{Heading, Table, Text};
    vec![
        Heading(2, "Per case (mean over rounds)".into()),
        Table(
            strings(&[
                "case",
                "128K write MB/s",
                "128K read MB/s",
                "4K randwrite IOPS",
                "CPU s/GB written (named)",
                "CPU s/GB (host total)",
                "host CPU busy",
                "backing bytes / client byte",
                "host disk used",
                "space saved vs raw",
                "comp ratio",
            ]),
            r.cases
                .iter()
                .map(|m| {
                    let ratio = if m.zdisk_comp_ratio.is_some() {
                        format!("{} (zdisk)", f(m.zdisk_comp_ratio, 2))
                    } else if m.bluestore_comp_ratio.is_some() {
                        format!(
                            "{} allocated ({} compressor)",
                            f(m.bluestore_comp_ratio, 2),
                            f(m.bluestore_compressor_ratio, 2)
                        )
                    } else {
                        "—".into()
                    };
                    vec![
                        case_name(&m.case),
                        f(m.write_mb_s, 1),
                        f(m.read_mb_s, 1),
                        f(m.randwrite_iops, 0),
                        f(m.cpu_s_per_gb.named, 2),
                        f(m.cpu_s_per_gb.host, 2),
                        m.cpu_busy_pct.host.map_or_else(|| "—".into(), |v| format!("{v:.0}%")),
                        f(m.backing_bytes_per_client_byte, 2),
                        gib(m.host_disk_bytes),
                        pct(m.space_saving),
                        ratio,
                    ]
                })
                .collect(),
        ),
        Text(
            "Bandwidth is the client's (before 2x replication). \"named\" CPU is the Ceph daemons, the device servers \
             (zdisk serve or qemu-nbd), the transport (nbdfuse) and fio; \"host total\" is every busy tick of the \
             machine (/proc/stat) — it adds the kernel's loop and FUSE work and anything else running. Backing bytes \
             are what the device servers wrote to the disk (/proc/PID/io), both replicas included. Host disk used is \
             the allocated size of the OSD backing files after the write phase (BlueStore's RocksDB and metadata \
             included). Space saved is against the raw case of the same round. BlueStore's ratio is original / \
             allocated bytes of compressed blobs (what the disk holds) and, in brackets, original / compressor output."
                .into(),
        ),
    ]
}

/// Where the 128K write phase's CPU went, per case.
fn cpu_split(r: &Report) -> Vec<Block> {
    use Block::{Heading, Table};
    vec![
        Heading(2, "CPU split of the 128K write phase (seconds per GB written)".into()),
        Table(
            strings(&[
                "case",
                "OSD processes",
                "mon + mgr",
                "device servers",
                "transport (nbdfuse)",
                "fio (client)",
                "kernel + other",
                "host total",
            ]),
            r.cases
                .iter()
                .map(|m| {
                    let g = &m.cpu_s_per_gb;
                    vec![
                        case_name(&m.case),
                        f(g.osd, 2),
                        f(g.monmgr, 2),
                        f(g.server, 2),
                        f(g.transport, 2),
                        f(g.client, 2),
                        f(g.other, 2),
                        f(g.host, 2),
                    ]
                })
                .collect(),
        ),
    ]
}

/// zdisk's same-round ratios, the goals, and the seed's published result.
fn comparisons(r: &Report) -> Vec<Block> {
    use Block::{Heading, Table};
    vec![
        Heading(2, "zdisk against the others (same-round ratios, geometric mean over rounds)".into()),
        Table(
            strings(&[
                "zdisk case",
                "versus",
                "write bandwidth",
                "read bandwidth",
                "4K randwrite IOPS",
                "CPU per GB (named)",
                "CPU per GB (host)",
                "space saving",
            ]),
            r.ratios
                .iter()
                .map(|q| {
                    vec![
                        case_name(&q.zdisk),
                        case_name(&q.versus),
                        x(q.write_bw.mean),
                        x(q.read_bw.mean),
                        x(q.randwrite_iops.mean),
                        x(q.cpu_per_gb_named.mean),
                        x(q.cpu_per_gb_host.mean),
                        x(q.space_saving.mean),
                    ]
                })
                .collect(),
        ),
        Heading(2, "Goals (issue 19) against BlueStore zstd force".into()),
        Table(
            strings(&["zdisk case", "write bandwidth ≥ 1.2x", "CPU per GB ≤ 0.75x", "space saving ≥ 0.85x of zstd's"]),
            r.goals
                .iter()
                .map(|g| {
                    vec![
                        case_name(&g.zdisk),
                        format!(
                            "{}: {} ({} of the goal)",
                            x(g.write_bw.value),
                            met(g.write_bw.met),
                            pct(g.write_bw.fraction_of_goal)
                        ),
                        format!(
                            "{} named, {} host: {}",
                            x(g.cpu_per_gb.value),
                            x(g.cpu_per_gb.value_host_total),
                            met(g.cpu_per_gb.met)
                        ),
                        format!("{}: {}", x(g.space_saving.value), met(g.space_saving.met)),
                    ]
                })
                .collect(),
        ),
        Heading(2, "The seed's result (SNIA, 12 x CSD 3000, one node, 40 RBD images, QD128)".into()),
        Table(
            strings(&["case", "write GB/s", "read GB/s", "CPU", "compression ratio"]),
            vec![
                strings(&["BlueStore zstd force", "6.3", "21.1", "93% (write)", "2.285"]),
                strings(&["drive compression, Ceph off", "8.3 (1.32x)", "22.5", "66.5% (write)", "~2"]),
            ],
        ),
    ]
}

/// Every round's numbers, and the command.
fn every_round(r: &Report) -> Vec<Block> {
    use Block::{Heading, Table, Text};
    vec![
        Heading(2, "Every round".into()),
        Table(
            strings(&[
                "round",
                "case",
                "write MB/s",
                "read MB/s",
                "randwrite IOPS",
                "CPU s/GB named",
                "CPU s/GB host",
                "space saved",
                "load average (before write, after randwrite)",
            ]),
            r.per_round
                .iter()
                .map(|m| {
                    vec![
                        m.round.to_string(),
                        case_name(&m.case),
                        f(m.write_mb_s, 1),
                        f(m.read_mb_s, 1),
                        f(m.randwrite_iops, 0),
                        f(m.cpu_s_per_gb.named, 2),
                        f(m.cpu_s_per_gb.host, 2),
                        pct(m.space_saving),
                        m.loadavg.iter().map(|l| l.as_deref().unwrap_or("—")).collect::<Vec<_>>().join(" / "),
                    ]
                })
                .collect(),
        ),
        Text(format!("Command: `{}`", r.command)),
    ]
}

/// Markdown inline text as HTML: escaped, `code` and **bold** marked up.
pub(super) fn inline_html(s: &str) -> String {
    let mut out = String::new();
    for (i, part) in esc(s).split('`').enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<code>{part}</code>");
        } else {
            for (j, piece) in part.split("**").enumerate() {
                if j % 2 == 1 {
                    let _ = write!(out, "<b>{piece}</b>");
                } else {
                    out.push_str(piece);
                }
            }
        }
    }
    out
}

/// summary.md and report.html.
pub(super) fn render(r: &Report) -> (String, String) {
    let mut md = String::new();
    let mut html = html_start("zdisk under Ceph");
    for block in blocks(r) {
        match block {
            Block::Heading(level, title) => {
                let _ = writeln!(md, "{} {title}\n", "#".repeat(level));
                let _ = writeln!(html, "<h{level}>{}</h{level}>", esc(&title));
            }
            Block::Text(t) => {
                let _ = writeln!(md, "{t}\n");
                let _ = writeln!(html, "<p>{}</p>", inline_html(&t));
            }
            Block::Table(head, rows) => {
                md_table(&mut md, &head, &rows);
                let plain: Vec<Vec<String>> =
                    rows.iter().map(|row| row.iter().map(|c| c.replace("**", "")).collect()).collect();
                html_table(&mut html, &head, &plain);
            }
        }
    }
    html.push_str("</body></html>\n");
    (md, html)
}
