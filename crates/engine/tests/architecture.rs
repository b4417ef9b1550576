//! The rules of docs/architecture.md that the sources themselves can be checked against:
//!
//! - The engine's modules import one another one way ("Which modules may import which"): no
//!   circle of imports joins more than two files. A component that imports a module of the
//!   store's work (`impl Inner`: request, gc, writeout, …) pulls that module and everything
//!   it reaches into one circle with `state.rs` — which is how merging Space's admission into
//!   `space.rs` made a circle of seven files on 2026-11-29 — so this reads the sources and
//!   fails naming the circle. What counts as an import: a `crate::`, `super::` or `self::`
//!   path outside comments and before the file's first `#[cfg(test)]`, with one level of
//!   `{…}` groups; it points at the deepest module file the path names.
//! - `Inner` is a short composition of components ("The store as components": at most 12
//!   fields), and no function takes the log as a parameter (`&Log`, `&mut Log`): the log's
//!   logic lives on `Log` and `LogGuard`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path (`store::log`; `""` for lib.rs) → its source text.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            out.insert(parts.join("::"), std::fs::read_to_string(&path).unwrap());
        }
    }
    out
}

/// The code a file's imports are read from: up to its first `#[cfg(test)]`, comments out.
fn code(text: &str) -> String {
    let before_tests = text.split("#[cfg(test)]").next().unwrap_or("");
    before_tests
        .lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path starting at `crate::`, `super::` or `self::`, groups expanded one level:
/// `super::{a, b::C}` gives `super::a` and `super::b::C`.
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        for (at, _) in code.match_indices(start) {
            if at > 0 && is_ident(bytes[at - 1] as char) {
                continue;
            }
            let rest = &code[at..];
            let head_len = rest.find(|c: char| !(is_ident(c) || c == ':')).unwrap_or(rest.len());
            let head = rest[..head_len].trim_end_matches(':');
            if rest[head_len..].starts_with('{') {
                let group = &rest[head_len + 1..rest[head_len..].find('}').map_or(rest.len(), |e| head_len + e)];
                for item in group.split(',') {
                    let item: String = item.trim().chars().take_while(|&c| is_ident(c) || c == ':').collect();
                    if !item.is_empty() && item != "self" {
                        out.push(format!("{head}::{item}"));
                    }
                }
            }
            out.push(head.to_string());
        }
    }
    out
}

/// The module file a path from module `from` points at: the longest prefix that is one.
fn resolve(from: &str, path: &str, modules: &BTreeMap<String, String>) -> Option<String> {
    let mut parts: Vec<&str> = path.split("::").collect();
    let mut base: Vec<&str> = if from.is_empty() { Vec::new() } else { from.split("::").collect() };
    match parts[0] {
        "crate" => {
            base.clear();
            parts.remove(0);
        }
        _ => {
            while let Some(&first) = parts.first() {
                match first {
                    "super" => {
                        base.pop();
                    }
                    "self" => {}
                    _ => break,
                }
                parts.remove(0);
            }
        }
    }
    (0..=parts.len())
        .rev()
        .map(|i| base.iter().chain(&parts[..i]).copied().collect::<Vec<_>>().join("::"))
        .find(|m| modules.contains_key(m))
}

/// Tarjan's strongly connected components.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in &self.edges[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut circle = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    circle.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                circle.sort();
                self.found.push(circle);
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

fn import_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let mut edges = BTreeMap::new();
    for (name, text) in &modules {
        let mut targets = BTreeSet::new();
        for path in paths(&code(text)) {
            let Some(target) = resolve(name, &path, &modules) else { continue };
            // A module and its own submodules or parents are one file tree, not an import.
            let nested = target.starts_with(&format!("{name}::")) || name.starts_with(&format!("{target}::"));
            if target != *name && !target.is_empty() && !nested {
                targets.insert(target);
            }
        }
        edges.insert(name.clone(), targets);
    }
    edges
}

#[test]
fn no_circle_of_imports_joins_more_than_two_engine_files() {
    let edges = import_graph();
    let imports: usize = edges.values().map(BTreeSet::len).sum();
    let mut found = circles(&edges);
    found.sort_by_key(|c| std::cmp::Reverse(c.len()));
    println!("{} modules, {imports} imports, largest circle: {:?}", edges.len(), found[0]);
    // The reader must see real imports, or the check passes on nothing.
    assert!(edges.len() > 40 && imports > 200, "read {} modules and {imports} imports", edges.len());
    assert!(edges["store::log"].contains("store::capacity"), "the log's import of the space classes was not seen");
    for circle in &found {
        assert!(circle.len() <= 2, "a circle of {} files imports itself: {circle:?}", circle.len());
    }
}

#[test]
fn the_reader_finds_paths_in_groups_and_skips_comments() {
    let text = "use super::{log::Op, capacity};\n// use crate::sim::SimDisk;\nfn f() { crate::store::gc::run(); }\n";
    let found = paths(&code(text));
    for want in ["super::log::Op", "super::capacity", "crate::store::gc::run"] {
        assert!(found.iter().any(|p| p == want), "{want} not in {found:?}");
    }
    assert!(!found.iter().any(|p| p.contains("sim")), "a commented import was read: {found:?}");
    let mut edges = BTreeMap::new();
    edges.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    edges.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    edges.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    edges.insert("d".to_string(), BTreeSet::new());
    let found = circles(&edges);
    assert!(found.iter().any(|c| c.len() == 3), "a circle of three was missed: {found:?}");
}

fn engine_sources() -> BTreeMap<String, String> {
    modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn no_function_takes_the_log_as_a_parameter() {
    let mut found = Vec::new();
    for (name, text) in engine_sources() {
        for (n, line) in code(&text).lines().enumerate() {
            for pattern in [": &Log", ": &mut Log"] {
                for (at, _) in line.match_indices(pattern) {
                    let after = line[at + pattern.len()..].chars().next();
                    if !after.is_some_and(is_ident) {
                        found.push(format!("{name}:{}: {}", n + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(found.is_empty(), "functions that take the log as a parameter:\n{}", found.join("\n"));
    // The check must be able to see one.
    assert!(code("fn f(log: &Log) {}").contains(": &Log"));
}

#[test]
fn inner_is_a_short_composition() {
    let sources = engine_sources();
    let state = code(&sources["store::state"]);
    let start = state.find("pub(crate) struct Inner {").expect("Inner is declared in store/state.rs");
    let body = &state[start..start + state[start..].find("\n}").expect("Inner's closing brace")];
    let fields: Vec<&str> = body.lines().skip(1).map(str::trim).filter(|l| l.starts_with("pub ")).collect();
    println!("Inner's fields: {fields:?}");
    assert!(fields.len() >= 8, "the reader found {} fields: {fields:?}", fields.len());
    assert!(fields.len() <= 12, "Inner has {} fields (docs/architecture.md: at most 12): {fields:?}", fields.len());
}
