//! The report writer of both harnesses: `zdisk bench` and `zdisk db bench` each write a
//! report directory of the same three files — report.json (every record, for tools),
//! summary.md and report.html (for people) — with the same tables, escaping and page style.
//! What goes in them (headlines, which tables, charts) is each harness's own; how a table or
//! a page is written, and that the three files are written together, is here.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

/// Writes `report.json` (the records, pretty-printed) into `out`, creating it, and then
/// `summary.md` and `report.html` as `pages` renders them (Markdown, HTML): the records are on
/// disk before anything is rendered, so a report that fails to render still holds its data.
pub fn write_report<R: Serialize>(
    out: &Path,
    records: &R,
    pages: impl FnOnce() -> Result<(String, String)>,
) -> Result<()> {
    fs::create_dir_all(out).with_context(|| format!("creating report directory {}", out.display()))?;
    let json = serde_json::to_string_pretty(records)?;
    fs::write(out.join("report.json"), json).context("writing report.json")?;
    let (markdown, html) = pages()?;
    fs::write(out.join("summary.md"), markdown).context("writing summary.md")?;
    fs::write(out.join("report.html"), html).context("writing report.html")?;
    Ok(())
}

/// Text made safe for HTML element content and attribute values.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A Markdown table: the first column (a label) left-aligned, the others (numbers) right; a
/// `|` inside a cell would end it, so it is written `/`.
pub fn md_table(s: &mut String, head: &[String], rows: &[Vec<String>]) {
    let _ = writeln!(s, "| {} |", head.join(" | "));
    let _ = writeln!(
        s,
        "|{}|",
        head.iter().enumerate().map(|(i, _)| if i == 0 { "---" } else { "---:" }).collect::<Vec<_>>().join("|")
    );
    for r in rows {
        let _ = writeln!(s, "| {} |", r.iter().map(|c| c.replace('|', "/")).collect::<Vec<_>>().join(" | "));
    }
    let _ = writeln!(s);
}

/// An HTML table (`CSS` styles it); a table without rows says so instead of showing an empty
/// header.
pub fn html_table(s: &mut String, head: &[String], rows: &[Vec<String>]) {
    if rows.is_empty() {
        s.push_str("<p class=\"note\">none in this run</p>\n");
        return;
    }
    s.push_str("<table><thead><tr>");
    for h in head {
        let _ = write!(s, "<th>{}</th>", esc(h));
    }
    s.push_str("</tr></thead><tbody>\n");
    for r in rows {
        s.push_str("<tr>");
        for c in r {
            let _ = write!(s, "<td>{}</td>", esc(c));
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</tbody></table>\n");
}

/// The start of a report page, through `<body>`: the title and the shared style.
pub fn html_start(title: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n<style>\n{CSS}</style></head><body>\n",
        esc(title)
    )
}

/// The report pages' style: numbers right-aligned in tables, charts side by side.
pub const CSS: &str = "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1500px;padding:0 1em;color:#222}
h1{margin-bottom:.2em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}h2 small{font-weight:normal;color:#666;font-size:.6em}
table{border-collapse:collapse;font-size:.85em;margin:1em 0}th,td{border:1px solid #ddd;padding:3px 7px;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}tr:nth-child(even){background:#fafafa}
.meta{color:#555;font-size:.85em}.headline{background:#eef5fb;border-left:4px solid #1f77b4;padding:.5em 1em}.big{font-size:1.2em;font-weight:bold}
.charts{display:flex;flex-wrap:wrap;gap:8px}.charts svg{border:1px solid #eee}.note{color:#777}nav a{margin-right:1em}pre{white-space:pre-wrap}";

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn markdown_tables_align_numbers_and_keep_pipes_out_of_cells() {
        let mut s = String::new();
        md_table(&mut s, &strings(&["target", "IOPS"]), &[strings(&["a|b", "12"])]);
        assert_eq!(s, "| target | IOPS |\n|---|---:|\n| a/b | 12 |\n\n");
    }

    #[test]
    fn html_tables_escape_cells_and_say_when_empty() {
        let mut s = String::new();
        html_table(&mut s, &strings(&["<h>"]), &[strings(&["a&\"b\""])]);
        assert_eq!(
            s,
            "<table><thead><tr><th>&lt;h&gt;</th></tr></thead><tbody>\n<tr><td>a&amp;&quot;b&quot;</td></tr>\n</tbody></table>\n"
        );
        let mut empty = String::new();
        html_table(&mut empty, &strings(&["h"]), &[]);
        assert!(empty.contains("none in this run"), "{empty}");
    }

    #[test]
    fn a_report_is_three_files() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("report");
        write_report(&out, &serde_json::json!({"a": 1}), || Ok(("# md\n".into(), "<html></html>\n".into()))).unwrap();
        let json: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
        assert_eq!(json["a"], 1);
        assert_eq!(fs::read_to_string(out.join("summary.md")).unwrap(), "# md\n");
        assert_eq!(fs::read_to_string(out.join("report.html")).unwrap(), "<html></html>\n");
        assert!(html_start("a<b").contains("<title>a&lt;b</title>"));
    }

    #[test]
    fn the_records_are_written_when_the_pages_fail() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_report(dir.path(), &[1, 2], || anyhow::bail!("no chart")).unwrap_err();
        assert!(err.to_string().contains("no chart"));
        assert!(dir.path().join("report.json").exists());
        assert!(!dir.path().join("summary.md").exists());
    }
}
