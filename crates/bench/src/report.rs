//! The report's headline numbers and the contents of its three output files (report.json,
//! summary.md, report.html), rendered from the run's records (`results`); `writer` writes
//! them, as it does `zdisk db bench`'s.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use crate::charts;
use crate::plan::{DataMode, TargetKind, WorkloadKind};
use crate::results::{fmt_int, DataSummary, JobResult, Report};
use crate::size::fmt_size;
use crate::writer::{esc, html_start, html_table, md_table, write_report};

fn geomean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp())
}

impl Report {
    pub fn result(&self, d: DataMode, w: WorkloadKind, t: TargetKind, qd: u32) -> Option<&JobResult> {
        self.results.iter().find(|r| r.data == d && r.workload == w && r.target == t && r.qd == qd && r.error.is_none())
    }

    /// Computes the per-data and top-level headline numbers.
    pub fn summarize(&mut self) {
        self.by_data.clear();
        for &d in &self.config.data {
            let mut ratios = Vec::new();
            for &w in &self.config.workloads {
                for &qd in &self.config.qds {
                    if let (Some(z), Some(r)) =
                        (self.result(d, w, TargetKind::Zdisk, qd), self.result(d, w, TargetKind::Raw, qd))
                    {
                        if z.iops > 0.0 && r.iops > 0.0 {
                            ratios.push(z.iops / r.iops);
                        }
                    }
                }
            }
            let comp_ratio = self
                .results
                .iter()
                .filter(|r| r.data == d && r.target == TargetKind::Zdisk)
                .filter_map(|r| r.cost.comp_ratio)
                .next_back();
            self.by_data.push(DataSummary {
                data: d,
                comp_ratio,
                perf_multiplier: geomean(&ratios),
                pairs: ratios.len(),
            });
        }
        let two = self.by_data.iter().find(|s| s.data == DataMode::Ratio2);
        self.comp_ratio = two.and_then(|s| s.comp_ratio);
        self.perf_multiplier = two.and_then(|s| s.perf_multiplier);
        self.headline_basis = match two {
            Some(s) => format!(
                "2:1 data: comp_ratio = zdisk stat after the 2:1 runs; perf_multiplier = geometric mean of zdisk/raw IOPS over {} (workload, QD) points, raw = qemu-nbd O_DIRECT",
                s.pairs
            ),
            None => "the 2:1 data mode was not run, so comp_ratio and perf_multiplier are null".into(),
        };
    }

    pub fn write_all(&self, out: &Path) -> Result<()> {
        write_report(out, self, || Ok((self.markdown(), self.html()?)))
    }

    fn targets_in_run(&self) -> Vec<TargetKind> {
        let mut t = self.config.targets.clone();
        t.sort();
        t
    }

    fn data_header(&self, d: DataMode) -> String {
        match d {
            DataMode::Real => {
                let c = self.corpus.as_ref();
                format!(
                    "real files from {} at rest ({} files, LZ4 4K ratio {:.2}); write workloads use fio buffer_compress_percentage={} to match",
                    c.map(|c| c.roots.join(", ")).unwrap_or_default(),
                    c.map(|c| c.files).unwrap_or(0),
                    c.map(|c| c.lz4_4k_ratio).unwrap_or(0.0),
                    c.map(|c| c.write_compress_pct).unwrap_or(0)
                )
            }
            _ => format!(
                "fio refill_buffers, buffer_compress_percentage={}, buffer_compress_chunk=4096",
                d.compress_pct().unwrap_or(0)
            ),
        }
    }

    /// Summary rows: (cells) per workload x QD for one data mode.
    fn summary_rows(&self, d: DataMode) -> (Vec<String>, Vec<Vec<String>>) {
        let targets = self.targets_in_run();
        let has = |t| targets.contains(&t);
        let mut head = vec!["Workload".to_string(), "QD".to_string()];
        for t in &targets {
            head.push(format!("{} IOPS", t.title()));
        }
        let both = has(TargetKind::Zdisk) && has(TargetKind::Raw);
        if both {
            head.push("zdisk/raw".into());
        }
        for t in [TargetKind::Zdisk, TargetKind::Raw] {
            if has(t) {
                head.push(format!("{} p99 µs", t.key()));
            }
        }
        for t in [TargetKind::Zdisk, TargetKind::Raw] {
            if has(t) {
                head.push(format!("{} CPU s/GiB", t.key()));
            }
        }
        if has(TargetKind::Zdisk) {
            head.push("comp ratio".into());
            head.push("WA (job)".into());
        }
        let mut rows = Vec::new();
        for &w in &self.config.workloads {
            for &qd in &self.config.qds {
                let mut row = vec![w.title().to_string(), qd.to_string()];
                for &t in &targets {
                    row.push(match self.cell(d, w, t, qd) {
                        Some(r) if w.is_bandwidth() => {
                            format!("{} ({:.0} MB/s)", fmt_int(r.iops), r.mb_per_s)
                        }
                        Some(r) => fmt_int(r.iops),
                        None => "—".into(),
                    });
                }
                if both {
                    row.push(
                        match (self.result(d, w, TargetKind::Zdisk, qd), self.result(d, w, TargetKind::Raw, qd)) {
                            (Some(z), Some(r)) if r.iops > 0.0 => format!("{:.2}x", z.iops / r.iops),
                            _ => "—".into(),
                        },
                    );
                }
                for t in [TargetKind::Zdisk, TargetKind::Raw] {
                    if has(t) {
                        row.push(
                            self.result(d, w, t, qd).and_then(|r| r.p99_us).map(fmt_int).unwrap_or_else(|| "—".into()),
                        );
                    }
                }
                for t in [TargetKind::Zdisk, TargetKind::Raw] {
                    if has(t) {
                        row.push(
                            self.result(d, w, t, qd)
                                .and_then(|r| r.cost.server_cpu_s_per_gib)
                                .map(|v| format!("{v:.2}"))
                                .unwrap_or_else(|| "—".into()),
                        );
                    }
                }
                if has(TargetKind::Zdisk) {
                    let z = self.result(d, w, TargetKind::Zdisk, qd);
                    row.push(opt_fmt(z.and_then(|r| r.cost.comp_ratio), 2));
                    row.push(opt_fmt(z.and_then(|r| r.cost.job_write_amplification), 2));
                }
                rows.push(row);
            }
        }
        (head, rows)
    }

    /// A result cell; failed points show as "error".
    fn cell(&self, d: DataMode, w: WorkloadKind, t: TargetKind, qd: u32) -> Option<&JobResult> {
        self.result(d, w, t, qd)
    }

    fn precondition_rows(&self) -> (Vec<String>, Vec<Vec<String>>) {
        let head = ["Data", "Workload", "Target", "QD", "Rounds", "Verdict", "Window mean IOPS", "Range", "Slope rise"]
            .map(String::from)
            .to_vec();
        let rows = self
            .preconditioning
            .iter()
            .map(|p| {
                vec![
                    p.data.key().to_string(),
                    p.workload.title().to_string(),
                    p.target.title().to_string(),
                    p.qd.to_string(),
                    p.rounds_run.to_string(),
                    p.error.clone().map(|e| format!("error: {}", first_line(&e))).unwrap_or_else(|| p.verdict.clone()),
                    p.window.map(|w| fmt_int(w.mean)).unwrap_or_else(|| "—".into()),
                    p.window.map(|w| format!("{:.0}%", w.range_fraction * 100.0)).unwrap_or_else(|| "—".into()),
                    p.window.map(|w| format!("{:.0}%", w.slope_rise_fraction * 100.0)).unwrap_or_else(|| "—".into()),
                ]
            })
            .collect();
        (head, rows)
    }

    fn consistency_rows(&self) -> (Vec<String>, Vec<Vec<String>>) {
        let head = [
            "Data",
            "Target",
            "Spare area",
            "Mean IOPS",
            "Min IOPS",
            "Max IOPS",
            "CoV",
            "CPU s/GiB",
            "comp ratio",
            "WA (job)",
        ]
        .map(String::from)
        .to_vec();
        let rows = self
            .consistency
            .iter()
            .map(|c| {
                if let Some(e) = &c.error {
                    return vec![
                        c.data.key().into(),
                        c.target.title().into(),
                        format!("+{}%", c.spare_pct),
                        format!("error: {}", first_line(e)),
                        String::new(),
                        String::new(),
                        String::new(),
                        String::new(),
                        String::new(),
                        String::new(),
                    ];
                }
                vec![
                    c.data.key().to_string(),
                    c.target.title().to_string(),
                    format!("+{}%", c.spare_pct),
                    fmt_int(c.mean_iops),
                    fmt_int(c.min_iops),
                    fmt_int(c.max_iops),
                    format!("{:.2}", c.cov),
                    opt_fmt(c.cost.server_cpu_s_per_gib, 2),
                    opt_fmt(c.cost.comp_ratio, 2),
                    opt_fmt(c.cost.job_write_amplification, 2),
                ]
            })
            .collect();
        (head, rows)
    }

    fn fill_rows(&self) -> (Vec<String>, Vec<Vec<String>>) {
        let head = ["Data", "Target", "Phase", "Range", "Passes", "Tool", "MB/s", "CPU s/GiB", "comp ratio"]
            .map(String::from)
            .to_vec();
        let rows = self
            .fills
            .iter()
            .map(|f| {
                vec![
                    f.data.key().to_string(),
                    f.target.title().to_string(),
                    f.phase.clone(),
                    fmt_size(f.range_bytes),
                    f.passes.to_string(),
                    f.tool.clone(),
                    f.error
                        .clone()
                        .map(|e| format!("error: {}", first_line(&e)))
                        .unwrap_or_else(|| format!("{:.0}", f.mb_per_s)),
                    opt_fmt(f.cost.server_cpu_s_per_gib, 2),
                    opt_fmt(f.cost.comp_ratio, 2),
                ]
            })
            .collect();
        (head, rows)
    }

    fn headline_lines(&self) -> Vec<String> {
        let mut v = vec![format!(
            "comp_ratio (2:1 data): {} · perf_multiplier (zdisk/raw IOPS, geometric mean, 2:1 data): {}",
            opt_fmt(self.comp_ratio, 2),
            self.perf_multiplier.map(|p| format!("{p:.2}x")).unwrap_or_else(|| "n/a".into())
        )];
        for s in &self.by_data {
            v.push(format!(
                "{}: comp_ratio {}, zdisk/raw geometric mean {} over {} points",
                s.data.key(),
                opt_fmt(s.comp_ratio, 2),
                s.perf_multiplier.map(|p| format!("{p:.2}x")).unwrap_or_else(|| "n/a".into()),
                s.pairs
            ));
        }
        v
    }

    fn setup_line(&self) -> String {
        let c = &self.config;
        format!(
            "{:?} mode · {} targets (zdisk store physical {}) · QD {:?} · {:.1} s per point · preconditioning rounds {:.1} s, limit {} · consistency {:.0} s at QD{} · fill {}x 128K · host: {} CPUs ({}), kernel {}, {} · backing {} · load average {} at start, {} at end",
            c.mode,
            fmt_size(c.size_bytes),
            fmt_size(c.zdisk_physical_bytes),
            c.qds,
            c.runtime_ms as f64 / 1000.0,
            c.round_ms as f64 / 1000.0,
            c.max_rounds,
            c.consistency_ms as f64 / 1000.0,
            c.consistency_qd,
            c.fill_passes,
            self.host.cpus,
            self.host.cpu_model,
            self.host.kernel,
            self.host.fio,
            self.host.backing_fs,
            self.host.loadavg_start,
            self.host.loadavg_end
        )
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# zdisk bench report\n");
        let _ = writeln!(s, "Command: `{}`  ", self.command);
        let _ = writeln!(s, "Wall time: {:.0} s  ", self.wall_s);
        let _ = writeln!(s, "Setup: {}\n", self.setup_line());
        for l in self.headline_lines() {
            let _ = writeln!(s, "- {l}");
        }
        let _ = writeln!(s);
        for &d in &self.config.data {
            let _ = writeln!(s, "## Data {} — {}\n", d.key(), self.data_header(d));
            let (h, rows) = self.summary_rows(d);
            md_table(&mut s, &h, &rows);
        }
        if !self.preconditioning.is_empty() {
            let _ = writeln!(s, "## Preconditioning (SNIA steady state: 5-round window, range ≤ 20% and slope rise ≤ 10% of the mean)\n");
            let (h, rows) = self.precondition_rows();
            md_table(&mut s, &h, &rows);
        }
        if !self.consistency.is_empty() {
            let _ = writeln!(
                s,
                "## Performance consistency (4K random write QD{} over the whole range after the fill)\n",
                self.config.consistency_qd
            );
            let (h, rows) = self.consistency_rows();
            md_table(&mut s, &h, &rows);
        }
        if !self.fills.is_empty() {
            let _ = writeln!(s, "## Fills\n");
            let (h, rows) = self.fill_rows();
            md_table(&mut s, &h, &rows);
        }
        let _ = writeln!(s, "## Targets\n");
        for t in &self.targets {
            let _ = writeln!(s, "- **{}**: {}", t.title, t.description);
        }
        let _ = writeln!(s, "\n## Notes\n");
        for n in &self.notes {
            let _ = writeln!(s, "- {n}");
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\n## Errors\n");
            for e in &self.errors {
                let _ = writeln!(s, "- {}", e.replace('\n', " "));
            }
        }
        s
    }

    pub fn html(&self) -> Result<String> {
        let mut s = String::new();
        s.push_str(&html_start("zdisk bench report"));
        s.push_str("<h1>zdisk bench report</h1>\n");
        let _ = writeln!(
            s,
            "<p class=\"meta\"><code>{}</code><br>wall time {:.0} s<br>{}</p>",
            esc(&self.command),
            self.wall_s,
            esc(&self.setup_line())
        );
        s.push_str("<div class=\"headline\">");
        for (i, l) in self.headline_lines().iter().enumerate() {
            if i == 0 {
                let _ = write!(s, "<p class=\"big\">{}</p>", esc(l));
            } else {
                let _ = write!(s, "<p>{}</p>", esc(l));
            }
        }
        s.push_str("</div>\n<nav>");
        for &d in &self.config.data {
            let _ = write!(s, "<a href=\"#data-{}\">data {}</a> ", d.slug(), esc(d.key()));
        }
        s.push_str("<a href=\"#precondition\">preconditioning</a> <a href=\"#consistency\">consistency</a> <a href=\"#timeline\">ratio &amp; WA over time</a> <a href=\"#notes\">notes</a></nav>\n");

        for &d in &self.config.data {
            let _ = writeln!(
                s,
                "<h2 id=\"data-{}\">Data {} <small>{}</small></h2>",
                d.slug(),
                esc(d.key()),
                esc(&self.data_header(d))
            );
            let (h, rows) = self.summary_rows(d);
            html_table(&mut s, &h, &rows);
            for &w in &self.config.workloads {
                let _ = writeln!(s, "<h3>{} — {}</h3><div class=\"charts\">", esc(w.title()), esc(d.key()));
                if self.config.qds.len() > 1 {
                    s.push_str(&charts::vs_qd(self, d, w, false)?);
                    s.push_str(&charts::vs_qd(self, d, w, true)?);
                } else {
                    let _ = write!(s, "<p class=\"note\">one queue depth measured; no curve to draw</p>");
                }
                if let Some(svg) = charts::descent(self, d, w)? {
                    s.push_str(&svg);
                }
                s.push_str("</div>\n");
            }
        }

        s.push_str("<h2 id=\"precondition\">Preconditioning</h2>\n<p>Each workload runs at the largest queue depth in rounds until the SNIA PTS steady-state criterion holds over the last 5 rounds (max−min ≤ 20% of the mean, least-squares rise over the window ≤ 10% of the mean) or the round limit is hit.</p>\n");
        let (h, rows) = self.precondition_rows();
        html_table(&mut s, &h, &rows);

        s.push_str("<h2 id=\"consistency\">Performance consistency</h2>\n<p>After the fill, 4K random writes at QD32 across the whole range, IOPS every interval; default and with 25% extra spare area.</p>\n");
        let (h, rows) = self.consistency_rows();
        html_table(&mut s, &h, &rows);
        s.push_str("<div class=\"charts\">");
        for &d in &self.config.data {
            if let Some(svg) = charts::consistency(self, d)? {
                s.push_str(&svg);
            }
        }
        s.push_str("</div>\n");

        s.push_str("<h2 id=\"timeline\">zdisk compression ratio and write amplification over time</h2>\n<div class=\"charts\">");
        match charts::timeline(self)? {
            Some(svg) => s.push_str(&svg),
            None => s.push_str("<p class=\"note\">no zdisk statistics were collected (zdisk not in the run, or `zdisk stat` failed)</p>"),
        }
        s.push_str("</div>\n<h2>Fills</h2>\n");
        let (h, rows) = self.fill_rows();
        html_table(&mut s, &h, &rows);

        s.push_str("<h2 id=\"notes\">Targets and notes</h2>\n<ul>");
        for t in &self.targets {
            let _ = write!(s, "<li><b>{}</b>: {}</li>", esc(t.title), esc(t.description));
        }
        for n in &self.notes {
            let _ = write!(s, "<li>{}</li>", esc(n));
        }
        s.push_str("</ul>\n");
        if !self.errors.is_empty() {
            s.push_str("<h2>Errors</h2><ul class=\"errors\">");
            for e in &self.errors {
                let _ = write!(s, "<li><pre>{}</pre></li>", esc(e));
            }
            s.push_str("</ul>");
        }
        s.push_str("<p class=\"meta\">All numbers, per-interval logs and the full zdisk statistics are in report.json; fio's own JSON for every job is under fio/.</p>\n</body></html>\n");
        Ok(s)
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

fn opt_fmt(v: Option<f64>, decimals: usize) -> String {
    v.map(|x| format!("{x:.decimals$}")).unwrap_or_else(|| "—".into())
}
